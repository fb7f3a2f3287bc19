"""Host offload: DeepSpeed's offload_optimizer / offload_param as JAX memory kinds. State rests
in host memory between steps, training is bit-identical to the run without offload, and every
refusal says why and what to do."""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy
from offload_runs import assert_first_norm
from repo import FIXTURES

import jzero
from jzero.engine import settings
from jzero.plan import PlanOptions, host_state_bytes, model_state_bytes
from jzero.plan import memory_kinds as offload

BATCH = 32
STEPS = 3
BATCHES = toy.make_batches(STEPS, BATCH)
HOST = {"device": "cpu"}  # DeepSpeed's default pin_memory: true


def config(stage, bf16=False, **zero):
    return {
        "train_batch_size": BATCH,
        "gradient_clipping": 0.5,
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }


@functools.cache
def run(stage, bf16=False, opt=None, param=None):
    """An engine after STEPS steps and its losses; ``opt`` / ``param`` are offload sections as
    sorted item tuples (hashable), ``None`` for none."""
    zero = {}
    if opt is not None:
        zero["offload_optimizer"] = dict(opt)
    if param is not None:
        zero["offload_param"] = dict(param)
    e = jzero.initialize(
        toy.make_params(), toy.loss_fn, optax.adamw(1e-2), config(stage, bf16, **zero)
    )
    metrics = [e.train_step(b) for b in BATCHES]
    # Bit-identity with the run without offload cannot see a bug both share: the first
    # grad_norm against optax's float64 gradient can (clipping and Adam hide its scale).
    assert_first_norm([float(metrics[0]["grad_norm"])], jnp.bfloat16 if bf16 else jnp.float32)
    return e, [float(m["loss"]) for m in metrics]


def section(**kw):
    return tuple(sorted({**HOST, **kw}.items()))


def kinds(tree):
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def assert_same_state(a, b):
    """Every leaf of the two train states has the same bits (params, masters, moments, step)."""
    la, lb = jax.tree.leaves(a.state), jax.tree.leaves(b.state)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def step_compiles(e):
    return e._step._cache_size() if e._step is not None else 0


# The offloaded update's paths: params whole at stages 1-2 (the updated shards gathered back;
# stage 1 and 2 differ only in the gradient reduction, before the update) or sharded at 3, and
# with bf16 the float32 masters offloaded too. (2, bf16) and the stage-3 pair reuse the runs
# the tests below need anyway.
@pytest.mark.parametrize(
    "stage, bf16",
    [(1, False), (2, True), (3, False), (3, True)],
    ids=["1-fp32", "2-bf16", "3-fp32", "3-bf16"],
)
def test_optimizer_offload_rests_in_pinned_host_and_trains_bit_identically(stage, bf16):
    e, losses = run(stage, bf16, opt=section())
    ref, ref_losses = run(stage, bf16)
    assert kinds(e.state.opt_state) == {"pinned_host"}
    assert kinds(e.state.params) == {"device"}
    assert kinds(ref.state.opt_state) == {"device"}
    if bf16:
        assert kinds(e.state.master) == {"pinned_host"}
        assert kinds(ref.state.master) == {"device"}
    else:
        assert e.state.master == ()
    assert losses == ref_losses and losses[0] != losses[-1]  # exact, and it trained
    assert_same_state(e, ref)
    assert step_compiles(e) == 1  # the state came back in the kinds the step takes


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_param_offload_at_stage_3_rests_params_in_pinned_host(bf16):
    e, losses = run(3, bf16, param=section())
    ref, ref_losses = run(3, bf16)
    assert kinds(e.state.params) == {"pinned_host"}
    assert kinds(e.state.opt_state) == {"device"}
    if bf16:
        assert kinds(e.state.master) == {"device"}
    assert losses == ref_losses
    assert_same_state(e, ref)
    rows = e.describe().splitlines()[3 : 3 + len(e.plan.leaves)]  # one per leaf
    assert all(" host" in row for row in rows)  # the params column marks the host layout
    assert " host" not in ref.describe()


def test_unpinned_host_for_both_offloads_at_stage_3():
    unpinned = section(pin_memory=False)
    e, losses = run(3, opt=unpinned, param=unpinned)
    ref, ref_losses = run(3)
    assert kinds(e.state.params) == kinds(e.state.opt_state) == {"unpinned_host"}
    assert losses == ref_losses
    assert_same_state(e, ref)


def test_plan_bytes_and_report_under_offload():
    e, _ = run(2, True, opt=section())
    ref, _ = run(2, True)

    def shard_bytes(tree):  # what one device really holds, from the live arrays
        return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))

    opt_bytes, master_bytes = shard_bytes(e.state.opt_state), shard_bytes(e.state.master)
    host = host_state_bytes(e.plan)
    assert host == {"params": 0, "grads": 0, "master_params": master_bytes, "opt_state": opt_bytes}
    device = model_state_bytes(e.plan)
    assert device["opt_state"] == 0 and device["master_params"] == 0
    assert device["params"] == shard_bytes(e.state.params) > 0
    # Offload moves bytes from device to host memory; the total is the same plan.
    ref_device = model_state_bytes(ref.plan)
    assert ref_device["opt_state"] == opt_bytes and ref_device["master_params"] == master_bytes
    assert not any(host_state_bytes(ref.plan).values())
    report = e.describe()
    assert (
        f"per-device model state in host memory: params 0 B, grads 0 B, master_params "
        f"{master_bytes:,} B, opt_state {opt_bytes:,} B, total {master_bytes + opt_bytes:,} B"
    ) in report
    assert "per-device model state in device memory: " in report
    assert "host memory" not in ref.describe()


def test_deepspeed_example_config_trains_with_optimizer_offload():
    path = FIXTURES / "ds_config_example.json"
    with pytest.warns(jzero.config.JzeroConfigWarning) as record:
        e = jzero.initialize(toy.make_params(), toy.loss_fn, config=str(path))
    ours = [w for w in record if issubclass(w.category, jzero.config.JzeroConfigWarning)]
    assert len(ours) == 1 and "zero_optimization.allgather_partitions" in str(ours[0].message)
    assert e.plan.options.precision.comm_dtype == np.dtype("bfloat16")
    batches = toy.make_batches(2, 256)
    losses = [float(e.train_step(b)["loss"]) for b in batches]
    assert all(math.isfinite(x) for x in losses) and e.global_step == 2
    assert kinds(e.state.opt_state) == {"pinned_host"}
    assert kinds(e.state.params) == {"device"}


# -- refusals --------------------------------------------------------------------------------


def config_error(cfg):
    with pytest.raises(ValueError) as info:
        jzero.load_config(cfg)
    return str(info.value)


def test_nvme_needs_a_path():
    msg = config_error(config(2, offload_optimizer={"device": "nvme"}))
    assert msg == (
        "zero_optimization.offload_optimizer.device is nvme but nvme_path is not set; set "
        "offload_optimizer.nvme_path to a directory on a fast local disk."
    )


def test_offload_below_its_stage_is_refused():
    below_optimizer = (
        "zero_optimization.offload_optimizer needs stage 1, 2 or 3 (what it moves to host "
        "memory is sharded there), but zero_optimization.stage is 0; set the stage to 1, 2 or "
        "3, or offload_optimizer.device to none."
    )
    below_params = (
        "zero_optimization.offload_param needs stage 3 (what it moves to host memory is "
        "sharded there), but zero_optimization.stage is 2; set the stage to 3, or "
        "offload_param.device to none."
    )
    assert config_error(config(0, offload_optimizer=HOST)) == below_optimizer
    # A config's offload_param below stage 3 is ignored with a warning, as DeepSpeed ignores
    # it (tests/config/test_config_ds_accept.py). The plan a user builds refuses both.
    params, mesh, tx = toy.make_params(), jzero.make_mesh({"data": 8}), optax.adam(1e-3)
    with pytest.raises(ValueError) as info:
        jzero.make_plan(params, tx, mesh, 0, PlanOptions().replace(offload_optimizer="pinned_host"))
    assert str(info.value) == below_optimizer
    with pytest.raises(ValueError) as info:
        jzero.make_plan(params, tx, mesh, 2, PlanOptions().replace(offload_params="pinned_host"))
    assert str(info.value) == below_params


def test_partial_parameter_offload_is_refused():
    zero = jzero.load_config(config(3, offload_param={**HOST, "ratio": 0.5})).zero_optimization
    with pytest.raises(ValueError) as info:
        settings.memory_kinds(zero)
    assert str(info.value) == (
        "zero_optimization.offload_param.ratio is 0.5, but jzero offloads all of the parameters "
        "or none of them (ratio splits the optimizer state: offload_optimizer.ratio). Set ratio "
        "to 1.0 (the default)."
    )


class FakeMemory(NamedTuple):
    kind: str


class FakeDevice:
    """A device that addresses only the given memory kinds."""

    platform = "fakeaccel"

    def __init__(self, *kinds):
        self.kinds = kinds

    def addressable_memories(self):
        return [FakeMemory(k) for k in self.kinds]


def test_unsupported_memory_kind_lists_what_the_devices_have():
    with pytest.raises(ValueError) as info:
        offload.check_memory_kind("some_kind", "zero_optimization.offload_optimizer", jax.devices())
    assert str(info.value) == (
        "zero_optimization.offload_optimizer asks for host memory of kind 'some_kind', but the "
        "cpu devices address only ['device', 'pinned_host', 'unpinned_host']. In the config, set "
        "device: none to keep the state in device memory."
    )
    zero = jzero.load_config(config(2, offload_optimizer=HOST)).zero_optimization
    with pytest.raises(ValueError) as info:
        settings.memory_kinds(zero, [FakeDevice("device")] * 2)
    assert str(info.value) == (
        "zero_optimization.offload_optimizer (pin_memory: True) asks for host memory of kind "
        "'pinned_host', but the fakeaccel devices address only ['device']. In the config, set "
        "device: none to keep the state in device memory."
    )
    # Only the kinds that every device has count.
    mixed = [FakeDevice("device", "pinned_host"), FakeDevice("device", "unpinned_host")]
    assert offload.available_memory_kinds(mixed) == ["device"]
    unpinned = jzero.load_config(
        config(2, offload_optimizer={**HOST, "pin_memory": False})
    ).zero_optimization
    with pytest.raises(ValueError, match="set pin_memory: true to use pinned_host"):
        settings.memory_kinds(unpinned, [FakeDevice("device", "pinned_host")])


def test_memory_kinds_from_config_reads_a_device_iterator_once_per_key():
    # A mesh's devices.flat is an iterator: both offload sections must see every device.
    zero = jzero.load_config(
        config(3, offload_optimizer=HOST, offload_param={**HOST, "pin_memory": False})
    ).zero_optimization
    mesh = jzero.make_mesh({"data": 8})
    assert settings.memory_kinds(zero, mesh.devices.flat) == (
        "pinned_host",
        "unpinned_host",
    )
    assert settings.memory_kinds(jzero.load_config(config(3)).zero_optimization) == (
        None,
        None,
    )


# -- the GPU check script ----------------------------------------------------------------------
