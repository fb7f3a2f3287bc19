"""Every leaf sharded at any device count: padded shards.

On 6 (and, in a child process, 12) devices only the toy's embedding (12 rows) divides evenly:
its layer stacks (4 layers, or 64 rows beside the layer at stage 3), its head (64 rows) and its
5-row leaves rest padded with zeros. The runs must still be
the single-device optax loop (float64, 1e-10), the bytes per device ZeRO's formula up to the
padding (from the live arrays and from the compiled step), and checkpoints and exports must hold
the logical shapes, moving between 8, 6, 12 and 1 device bit for bit.
"""

import functools
import math
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy
from numerics import max_rel_error
from repo import SUPPORT

import jzero
from jzero.distributed import CompileCounter
from jzero.plan import model_state_bytes
from jzero.step import logical_view

BATCH = 48  # 6 x 8 rows, 12 x 4
STEPS = 4
CLIP = 0.5


def tx():
    return optax.adamw(1e-2, weight_decay=1e-2)


@functools.cache
def reference():
    return toy.reference_float64(tx, BATCH, steps=STEPS, clip=CLIP)


def config(stage, **zero):
    return {
        "train_batch_size": BATCH,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }


def engine_at(n, cfg, params=None):
    mesh = jzero.make_mesh(cfg.get("mesh", n), devices=jax.devices()[:n])
    params = toy.make_params(dtype=jnp.float64) if params is None else params
    return jzero.initialize(params, toy.loss_fn, tx(), cfg, options=jzero.InitOptions(mesh=mesh))


def assert_trains_like_optax(engine):
    _, batches, ref_losses, ref_norms, ref_params = reference()
    metrics = [engine.train_step(b) for b in batches]
    np.testing.assert_allclose([float(m["loss"]) for m in metrics], ref_losses, rtol=1e-10)
    np.testing.assert_allclose([float(m["grad_norm"]) for m in metrics], ref_norms, rtol=1e-10)
    final = jax.device_get(engine.params)
    assert jax.tree.map(np.shape, final) == jax.tree.map(np.shape, ref_params)  # logical
    assert max_rel_error(final, ref_params) < 1e-9


def per_device(tree):
    """Bytes device 0 holds of ``tree`` (live arrays)."""
    total = 0
    for x in jax.tree.leaves(tree):
        total += sum(s.data.nbytes for s in x.addressable_shards if s.device == jax.devices()[0])
    return total


def zero_share(leaf, n, itemsize=8):
    """Bytes of ``leaf`` one of ``n`` devices holds under ZeRO: ``1/n`` of it, its sharded
    dimension rounded up to a multiple of ``n`` (the padding)."""
    rows = -(-leaf.shape[leaf.state_dim] // n)
    return itemsize * rows * math.prod(leaf.shape) // leaf.shape[leaf.state_dim]


# Stage 2 on 6 devices trains in test_the_streamed_offloaded_update_pads_and_cuts_each_group
# (its padded gradients reduce-scattered like stage 1's, its state at rest stage 1's).
@pytest.mark.parametrize("stage", [1, 3])
def test_every_leaf_is_sharded_on_6_devices_and_trains_like_optax(stage, tmp_path):
    with jax.enable_x64(True):
        engine = engine_at(6, config(stage))
        batch = reference()[1][0]
        compiled = engine.lower(batch).compile()  # fits the layout (stage 3) first
        plan = engine.plan
        leaves = plan.leaves
        assert all(leaf.state_dim is not None for leaf in leaves)
        padded = {leaf.path for leaf in leaves if leaf.padding}
        assert padded == {"blocks.b", "blocks.w", "head.b", "head.w", "odd"}  # not embed
        assert all((leaf.param_dim is not None) == (stage == 3) for leaf in leaves)
        # ZeRO's bytes up to the padding: Adam's two moments (and, at stage 3, the params)
        # are one padded share per leaf; the step count is the only whole leaf.
        share = sum(zero_share(leaf, 6) for leaf in leaves)
        count = 4
        assert per_device(engine.state.opt_state) == 2 * share + count
        params_bytes = share if stage == 3 else 8 * sum(math.prod(x.shape) for x in leaves)
        assert per_device(engine.state.params) == params_bytes
        assert model_state_bytes(plan)["opt_state"] == 2 * share + count
        # The compiled step's arguments are those arrays, the scalars and 1/6 of the batch.
        scalars = sum(
            np.dtype(x.dtype).itemsize * x.size
            for x in jax.tree.leaves((engine.state.step, engine.state.loss_scale))
        )
        batch_bytes = sum(x.nbytes for x in jax.tree.leaves(batch)) // 6
        expected = params_bytes + 2 * share + count + scalars + batch_bytes
        assert compiled.memory_analysis().argument_size_in_bytes == expected
        assert_trains_like_optax(engine)  # reads engine.params
        if stage == 3:
            assert_export_is_the_single_device_parameters(engine, tmp_path)


def assert_export_is_the_single_device_parameters(engine, tmp_path):
    """The export of the padded run (trained above) is the single-device parameters."""
    with jax.enable_x64(True):
        # Reading it again compiles nothing: the cut of the padded leaves is compiled once.
        with CompileCounter() as counts:
            params = jax.device_get(engine.params)
        assert counts.compiles == 0
        index = engine.save_16bit_model(tmp_path / "export")
        exported = jzero.weights.load_exported(index)
    ref_params = reference()[4]
    assert jax.tree.map(np.shape, exported) == jax.tree.map(np.shape, ref_params)  # logical
    assert max_rel_error(exported, ref_params) < 1e-9
    # And bit for bit what engine.params hands out.
    jax.tree.map(np.testing.assert_array_equal, exported, params)


def test_the_streamed_offloaded_update_pads_and_cuts_each_group():
    """offload_optimizer with sub_group_size: the update runs group by group, each group's
    padded state cut to its logical shapes and padded back."""
    zero = {"offload_optimizer": {"device": "cpu"}, "sub_group_size": 5000}
    with jax.enable_x64(True):
        engine = engine_at(6, config(2, **zero))
        assert engine.plan.padded
        assert_trains_like_optax(engine)


def test_hpz_pads_to_the_state_shard_count():
    """ZeRO++ hpZ on replica 2 x data 3: gradients and optimizer state split 6 ways, params
    at rest 3 ways; one padded length per leaf serves both."""
    cfg = {**config(3, zero_hpz_partition_size=3), "mesh": {"replica": 2, "data": 3}}
    with jax.enable_x64(True):
        engine = engine_at(6, cfg)
        engine.resolve(reference()[1][0])
        assert engine.plan.options.zero.hpz and engine.plan.state_shards == 6
        assert all(leaf.padded % 6 == 0 for leaf in engine.plan.leaves)
        assert_trains_like_optax(engine)


def restored_view(n, directory, stage=3, step=None):
    """The logical state an engine on ``n`` devices holds after restoring ``directory``."""
    cfg = {**config(stage), "checkpoint": {"directory": str(directory)}}
    engine = engine_at(n, cfg)
    engine.restore(step)
    return engine, jax.device_get(logical_view(engine.plan, engine.state))


def assert_same_bits(a, b):
    fa, fb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (path, x), (_, y) in zip(fa, fb, strict=True):
        assert np.shape(x) == np.shape(y), path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


def test_checkpoints_move_between_8_6_12_and_1_device_bit_identically(tmp_path):
    with jax.enable_x64(True):
        cfg = {**config(3), "checkpoint": {"directory": str(tmp_path / "eight")}}
        engine = engine_at(8, cfg)
        for b in reference()[1][:2]:
            engine.train_step(b)
        engine.save()
        engine.wait_until_finished()
        written = jax.device_get(logical_view(engine.plan, engine.state))
        # The checkpoint holds the logical shapes, not the 8-device padding.
        assert jax.tree.map(np.shape, written.params) == jax.tree.map(np.shape, toy.make_params())
        # 6 devices read it, and save it again as step 10; 1 and 8 devices read that.
        shutil.copytree(tmp_path / "eight", tmp_path / "six")
        six, at_six = restored_view(6, tmp_path / "six")
        assert six.plan.padded
        assert_same_bits(at_six, written)
        six.save(10)
        six.wait_until_finished()
        _, at_one = restored_view(1, tmp_path / "six", step=10)
        assert_same_bits(at_one, written)
        _, at_eight = restored_view(8, tmp_path / "six", step=10)
        assert_same_bits(at_eight, written)
        # 12 devices, in a child (this process has 8): it restores the 8-device checkpoint,
        # trains nothing, and saves it again; 8 devices read that back.
        count = "--xla_force_host_platform_device_count"
        kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(count)]
        env = {**os.environ, "XLA_FLAGS": " ".join([*kept, f"{count}=12"])}  # an ISA limit too
        proc = subprocess.run(
            [sys.executable, str(SUPPORT / "padding_child.py"), str(tmp_path / "eight"),
             str(tmp_path / "twelve")],
            env=env, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "padded leaves on 12 devices: 5" in proc.stdout, proc.stdout
        _, from_twelve = restored_view(8, tmp_path / "twelve", step=10)
        assert_same_bits(from_twelve, written)


def test_pad_shards_false_keeps_the_divisible_rule():
    """``zero_optimization.pad_shards: false`` (and the NVMe tier, always): a leaf whose
    leading dimension 8 does not divide is split on one that divides, else stays whole."""
    engine = jzero.initialize(
        toy.make_params(),
        toy.loss_fn,
        tx(),
        {**config(2, pad_shards=False), "train_batch_size": 32},
    )
    by_name = {leaf.path: leaf for leaf in engine.plan.leaves}
    assert not engine.plan.padded
    assert by_name["embed"].state_dim == 1 and by_name["blocks.w"].state_dim == 1
    assert by_name["odd"].state_dim is None and by_name["head.b"].state_dim is None
    assert "no dimension of (5,) is divisible by the data axis size 8" in engine.describe()
