"""The toy's runs with and without offload that the offload tiers' tests compare: the configs, the
float64 first gradient norm, the assertions on a run."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy
from numerics import EPS, max_rel_error, rounding_scale

import jzero

BATCH = 32


STEPS = 3


def config(stage, bf16=False, **zero):
    # pad_shards false: the NVMe tier never pads, so the runs in memory it is compared with,
    # bit for bit, keep the same layout (a leaf 8 does not divide stays whole in both).
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, "pad_shards": False, **zero}
    return {
        "train_batch_size": BATCH,
        "gradient_clipping": 0.5,
        "bf16": {"enabled": bf16},
        "zero_optimization": zero,
    }


def host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


F64 = jnp.float64


def train(cfg, steps=STEPS, dtype=jnp.float32):
    """(losses, params, optimizer state on the host, engine, grad norms); float64 parameters and
    batches (under ``jax.enable_x64``) with ``dtype=F64``."""
    with jax.enable_x64(dtype == F64):
        tx = optax.adamw(1e-2, weight_decay=1e-2)
        e = jzero.initialize(toy.make_params(dtype=dtype), toy.loss_fn, tx, cfg)
        metrics = [e.train_step(b) for b in toy.make_batches(steps, BATCH, dtype=dtype)]
        losses = [float(m["loss"]) for m in metrics]
        norms = [float(m["grad_norm"]) for m in metrics]
        return losses, host(e.params), host(e.opt_state), e, norms


@functools.cache
def reference(stage, bf16=False, dtype=jnp.float32):
    losses, params, opt, e, norms = train(config(stage, bf16), dtype=dtype)
    e.close()
    return losses, params, opt, norms


@functools.cache
def first_grad_norm():
    """The float64 global norm of the toy's gradient on the first batch, without jzero: every
    run's first grad_norm (clipping and Adam hide a gradient's scale from the losses)."""
    return toy.first_grad_norm(BATCH)


def assert_first_norm(norms, dtype):
    """The first step's grad_norm against the float64 gradient's: within 1e-10 in float64;
    in float32 or bf16 within 16 unit roundoffs (the toy rounds each gradient's path about 16
    times, tests/step/test_parity.py). A gradient x2 is 100% off."""
    rel = 1e-10 if dtype == F64 else 16 * EPS[np.dtype(dtype).name]
    assert norms[0] == pytest.approx(first_grad_norm(), rel=rel, abs=0)


def assert_same_run(run, ref):
    losses, params, opt = run[:3]
    assert losses == ref[0]
    assert run[4] == ref[3]
    for a, b in zip(params, ref[1], strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(opt, ref[2], strict=True):
        np.testing.assert_array_equal(a, b)
    assert_first_norm(run[4], params[0].dtype)


PSI = sum(x.size for x in jax.tree.leaves(toy.make_params()))


# -- the NVMe tier -------------------------------------------------------------------------------
def nvme(path, **extra):
    return {"device": "nvme", "nvme_path": str(path), **extra}


def assert_close_run(run, ref, ref64=None):
    """The run on the NVMe tier against the run in memory. In float64: equal up to float64
    rounding (1e-10 losses and norms, 1e-9 of each leaf's scale). With bf16 (``ref64``: the
    same stage in float64): the NVMe tier's update programs round a last float32 bit
    differently (nvme_bits_child.py) and a bf16 copy of a master on a rounding boundary then
    flips, so each run is as far from the float64 run as bf16 rounding takes this training
    (rounding_scale, per leaf), and the two at most twice that from each other."""
    if ref64 is None:
        assert run[1][0].dtype == np.float64
        np.testing.assert_allclose(run[0], ref[0], rtol=1e-10, atol=0)
        np.testing.assert_allclose(run[4], ref[3], rtol=1e-10, atol=0)
        assert max_rel_error(run[1] + run[2], ref[1] + ref[2]) < 1e-9
    else:
        np.testing.assert_allclose(
            run[0], ref[0], rtol=0, atol=2 * rounding_scale(ref[0], ref64[0])
        )
        for a, b, truth in zip(run[1] + run[2], ref[1] + ref[2], ref64[1] + ref64[2], strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=2 * rounding_scale(b, truth))
    assert_first_norm(run[4], run[1][0].dtype)


def flip_last_byte(path):
    """Corrupts a store file where an array's data is: its last byte."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 0xFF]))
