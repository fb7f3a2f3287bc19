"""Hybrid sharding across hosts: a ``replica`` axis (FSDP's HSDP, DeepSpeed's MiCS) and ZeRO++'s
hierarchical partition (hpZ).

On ``mesh: {replica: 2, data: 4}`` every stage must train like ``{data: 8}`` and like a
single-device optax loop, with its reduce-scatters and all-gathers inside the ``data`` groups
and only the gradient shards (a quarter of the gradient bytes) crossing the replica groups,
read from the compiled program. hpZ at stage 3 keeps its gathers inside groups of ``k``.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy
from numerics import EPS, max_rel_error, rounding_scale

import jzero
from jzero import hlo
from jzero.config import ConfigError
from jzero.costs import ModelShape, ParallelDims
from jzero.plan import model_state_bytes

BATCH = 32
HYBRID = {"replica": 2, "data": 4}


def config(stage, mesh=None, clip=0.5, **zero):
    cfg = {
        "train_batch_size": BATCH,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }
    return {**cfg, "mesh": mesh} if mesh else cfg


def run(cfg, steps=3, dtype=jnp.float32, tx=None):
    """(losses, grad norms, final params on the host, engine, compiled step)."""
    params = toy.make_params(dtype=dtype)
    batches = toy.make_batches(steps, BATCH, dtype=np.dtype(dtype))
    e = jzero.initialize(params, toy.loss_fn, tx or optax.adamw(1e-2, weight_decay=1e-2), cfg)
    compiled = e.lower(batches[0]).compile()
    metrics = [e.train_step(b) for b in batches]
    losses = [float(m["loss"]) for m in metrics]
    norms = [float(m["grad_norm"]) for m in metrics]
    return losses, norms, jax.device_get(e.params), e, compiled


# The runs that must compute what {data: 8} and the single-device loop compute are in float64
# (tests/support/numerics.py): float32 would differ by the reduction order (4 then 2 against 8 at
# once).
@functools.cache
def hybrid(stage):
    with jax.enable_x64(True):
        return run(config(stage, HYBRID), dtype=jnp.float64)


@functools.cache
def flat(stage):
    with jax.enable_x64(True):
        return run(config(stage, {"data": 8}), dtype=jnp.float64)


@functools.cache
def float64_reference(steps=3, clip=0.5):
    """The single-device optax loop (run's AdamW, DeepSpeed's clipping) in float64: (losses,
    grad norms before clipping, final params)."""
    with jax.enable_x64(True):
        params = toy.make_params(dtype=jnp.float64)
        tx = optax.adamw(1e-2, weight_decay=1e-2)
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(toy.loss_fn)(params, batch)
            norm = optax.global_norm(grads)
            grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, clip / (norm + 1e-6)), grads)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, norm

        losses, norms = [], []
        for b in toy.make_batches(steps, BATCH, dtype=np.float64):
            params, opt_state, loss, norm = step(params, opt_state, b)
            losses.append(float(loss))
            norms.append(float(norm))
        return losses, norms, jax.device_get(params)


def sharded_grad_bytes(plan):
    """Bytes of the gradient leaves ZeRO shards: the gradient the stage reduces, as the
    reduction carries it (padded to a multiple of the shard count where a leaf rests so:
    embed's 12 rows to 16 on 8 devices, head.b's and odd's 5 to 8)."""
    return sum(
        np.dtype(leaf.dtype).itemsize * math.prod(leaf.stored_shape())
        for leaf in plan.leaves
        if leaf.state_dim is not None
    )


# Stage 1 differs from stage 2 only in accumulating whole gradients over micro-batches (none
# here); its hybrid run is dist_hybrid.py's (test_two_processes_one_replica_each).
@pytest.mark.parametrize("stage", [2, 3])
def test_hybrid_trains_like_one_data_axis(stage):
    losses, norms, params, e, _ = hybrid(stage)
    ref_losses, ref_norms, ref_params, _, _ = flat(stage)
    assert dict(e.mesh.shape) == HYBRID and e.plan.data_parallel_size == 8
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(np.float64)}
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0)
    # Clipping sees the global norm over all shards, each counted once (not once per replica).
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-10, atol=0)
    assert max_rel_error(params, ref_params) < 1e-9
    # And both are the single-device loop; grad_norm shows a gradient's scale, which clipping
    # and Adam hide from the losses.
    single_losses, single_norms, single_params = float64_reference()
    np.testing.assert_allclose(losses, single_losses, rtol=1e-10, atol=0)
    np.testing.assert_allclose(norms, single_norms, rtol=1e-10, atol=0)
    assert max_rel_error(params, single_params) < 1e-9


@pytest.mark.parametrize("stage", [2, 3])  # stage 1: as test_hybrid_trains_like_one_data_axis
def test_only_gradient_shards_cross_the_replica_axis(stage):
    _, _, _, e, compiled = hybrid(stage)
    by_axes = hlo.collectives_by_axes(compiled, e.mesh)
    within, across = by_axes.get(("data",), {}), by_axes.get(("replica",), {})
    everywhere = by_axes.get(("replica", "data"), {})
    # Reduce-scatters and all-gathers run only inside the data groups (of 4 devices).
    for axes, stats in by_axes.items():
        if axes != ("data",):
            assert stats["reduce-scatter"].count == stats["all-gather"].count == 0, axes
    assert within["reduce-scatter"].bytes >= sharded_grad_bytes(e.plan)
    # Across the replica groups (of 2): one all-reduce of the gradient shards, Psi/4 bytes.
    assert across["all-reduce"].bytes == sharded_grad_bytes(e.plan) // 4
    assert sum(s.bytes for s in across.values()) == across["all-reduce"].bytes
    # Over every device: only the leaves ZeRO leaves whole, the loss and the norm (bytes).
    assert sum(s.bytes for s in everywhere.values()) < 1024


def test_flat_mesh_reduces_everything_over_all_devices():
    """The contrast: on {data: 8} the gradient's reduce-scatter spans all 8 devices."""
    _, _, _, e, compiled = flat(2)
    by_axes = hlo.collectives_by_axes(compiled, e.mesh)
    assert set(by_axes) == {("data",)}
    assert by_axes[("data",)]["reduce-scatter"].bytes == sharded_grad_bytes(e.plan)


@functools.cache
def hpz():
    with jax.enable_x64(True):
        return run(config(3, zero_hpz_partition_size=4), dtype=jnp.float64)


def test_hpz_gathers_within_groups_and_trains_like_stage3():
    losses, norms, params, e, compiled = hpz()
    ref_losses, ref_norms, ref_params, ref_e, ref_compiled = flat(3)
    assert dict(e.mesh.shape) == HYBRID and e.plan.options.zero.hpz
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-10, atol=0)
    assert max_rel_error(params, ref_params) < 1e-9
    np.testing.assert_allclose(norms, float64_reference()[1], rtol=1e-10, atol=0)
    by_axes = hlo.collectives_by_axes(compiled, e.mesh)
    within = by_axes[("data",)]
    # The forward and backward gathers (as many as plain stage 3's) stay inside the 4-groups.
    assert within["all-gather"].count == hlo.collectives(ref_compiled)["all-gather"].count
    psi = sharded_grad_bytes(e.plan)
    # Across hosts once per step: the gradient shards reduce-scattered into the optimizer's
    # 8-way shards, and the updated shards all-gathered back into the 4-way parameters.
    across = by_axes[("replica",)]
    assert across["reduce-scatter"].bytes == psi // 4
    assert across["all-gather"].bytes == psi // 4
    assert across["all-reduce"].count == 0
    everywhere = by_axes.get(("replica", "data"), {})
    assert sum(s.bytes for s in everywhere.values()) < 1024
    # What it costs: parameters 4-way sharded; optimizer state still 8-way.
    plan = e.plan
    model = model_state_bytes(plan)
    ref_model = model_state_bytes(ref_e.plan)
    assert model["opt_state"] == ref_model["opt_state"]
    whole = sum(
        np.dtype(leaf.dtype).itemsize * math.prod(leaf.shape)
        for leaf in plan.leaves
        if leaf.param_dim is None
    )
    assert model["params"] - whole == 2 * (ref_model["params"] - whole)


def test_hpz_and_mics_set_the_mesh():
    e = jzero.initialize(
        toy.make_params(), toy.loss_fn, optax.sgd(0.1), config(2, mics_shard_size=2)
    )
    assert dict(e.mesh.shape) == {"replica": 4, "data": 2} and not e.plan.options.zero.hpz
    assert e.plan.batch.spec == jax.sharding.PartitionSpec(("replica", "data"))


# hpZ below stage 3 is ignored with a warning, as DeepSpeed ignores it there
# (tests/config/test_config_ds_accept.py).
@pytest.mark.parametrize(
    "zero, mesh, message",
    [
        (
            {"stage": 3, "zero_hpz_partition_size": 4, "mics_shard_size": 4},
            None,
            "are both set",
        ),
        (
            {"stage": 2, "mics_shard_size": 4},
            {"data": 2},
            "mesh.data is 2; remove mesh.data or set it to 4",
        ),
    ],
)
def test_hybrid_config_errors(zero, mesh, message):
    cfg = {"zero_optimization": zero, **({"mesh": mesh} if mesh else {})}
    with pytest.raises(ConfigError, match=message):
        jzero.load_config(cfg)


def test_an_unused_mesh_axis_is_an_error():
    with pytest.raises(ValueError) as err:
        jzero.initialize(
            toy.make_params(), toy.loss_fn, optax.sgd(0.1), config(2, {"data": 2, "other": 4})
        )
    assert str(err.value).startswith(
        "mesh axis 'other' (4 devices) is neither 'data', 'replica' nor named by any parameter's "
        "partition spec, so its devices would all compute the same rows (4x redundant work). "
        "Rename it to 'replica'"
    )


def test_precision_offload_and_accumulation_on_the_hybrid_mesh():
    extra = {
        "gradient_accumulation_steps": 2,
        "bf16": {"enabled": True},
    }
    zero = {"offload_optimizer": {"device": "cpu"}}
    a = run({**config(2, HYBRID, **zero), **extra})
    b = run({**config(2, {"data": 8}, **zero), **extra})
    ref_losses, ref_norms, _ = float64_reference()
    # bf16 gradients are summed in another order (4 then 2 instead of 8 at once) and rounded
    # to bf16 in between, so the two bf16 runs are each as far from the float64 run as bf16
    # rounding takes this training (rounding_scale), and so at most twice that from each other.
    np.testing.assert_allclose(a[0], b[0], rtol=0, atol=2 * rounding_scale(b[0], ref_losses))
    # The first step's gradient norm, from the same parameters: the toy rounds each gradient's
    # path to bf16 at most about 16 times (tests/step/test_parity.py), so within 16 bf16 unit
    # roundoffs of the float64 norm (a gradient x2 is 100% off), on both meshes.
    for norms in (a[1], b[1]):
        assert norms[0] == pytest.approx(ref_norms[0], rel=16 * EPS["bfloat16"], abs=0)
    by_axes = hlo.collectives_by_axes(a[4], a[3].mesh)
    assert by_axes[("replica",)]["all-reduce"].count >= 1


def test_checkpoint_moves_between_hybrid_and_flat_meshes(tmp_path, x64):
    # In float64: the restored step on another mesh computes the saver's loss up to the
    # float64 rounding of the batch mean's other reduction order.
    def engine(mesh, directory, devices=None):
        cfg = config(2, mesh)
        cfg["checkpoint"] = {"directory": str(directory)}
        m = None if devices is None else jzero.make_mesh(devices, devices=jax.devices()[:devices])
        params = toy.make_params(dtype=jnp.float64)
        options = jzero.InitOptions(mesh=m)
        return jzero.initialize(params, toy.loss_fn, optax.adamw(1e-2), cfg, options=options)

    batches = toy.make_batches(3, BATCH, dtype=np.float64)
    first_norm = float64_reference()[1][0]  # the initial gradient's, whatever the optimizer
    sizes = {}
    for name, mesh in (("hybrid", HYBRID), ("flat", {"data": 8})):
        e = engine(mesh, tmp_path / name)
        norms = [float(e.train_step(b)["grad_norm"]) for b in batches[:2]]
        assert norms[0] == pytest.approx(first_norm, rel=1e-10, abs=0)
        e.save()
        e.wait_until_finished()
        sizes[name] = sum(f.stat().st_size for f in (tmp_path / name).rglob("*") if f.is_file())
        saved = jax.device_get((e.params, e.opt_state))
        state_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(saved))
        after = float(e.train_step(batches[2])["loss"])
        e.close()
        if name == "flat":
            continue
        for target, devices in (({"data": 8}, None), ({"data": 4}, 4), (HYBRID, None)):
            r = engine(target, tmp_path / name, devices)
            r.restore()
            got = jax.device_get((r.params, r.opt_state))
            for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(saved), strict=True):
                np.testing.assert_array_equal(x, y)
            assert float(r.train_step(batches[2])["loss"]) == pytest.approx(after, rel=1e-10)
            r.close()
    # Each shard is written once, not once per replica: a second copy of the state would add
    # state_bytes (about 420 KB); the two checkpoints differ only by Orbax's packing (chunks
    # and metadata, about 10%).
    assert abs(sizes["hybrid"] - sizes["flat"]) < state_bytes / 2


def test_launch_replicas_become_the_replica_axis(monkeypatch):
    from jzero.distributed import launch

    env = launch.child_env({}, 0, 2, 1234, 4, replicas=2)
    assert env["JZERO_REPLICAS"] == "2"
    monkeypatch.setenv("JZERO_REPLICAS", "2")
    e = jzero.initialize(toy.make_params(), toy.loss_fn, optax.sgd(0.1), config(2))
    assert dict(e.mesh.shape) == HYBRID
    with pytest.raises(ValueError, match="--replicas 2 contradicts the config's mesh.replica: 4"):
        jzero.initialize(
            toy.make_params(), toy.loss_fn, optax.sgd(0.1), config(2, {"replica": 4, "data": 2})
        )
    with pytest.raises(ValueError, match="--replicas is 0; it must be a positive integer"):
        launch.launch(["true"], 1, replicas=0)


def test_estimate_with_replicas():
    from jzero import memory

    psi = 7.5e9
    hybrid_est = memory.estimate(ModelShape(psi), ParallelDims(64, replica=8))
    flat_est = memory.estimate(ModelShape(psi), ParallelDims(64))
    # Model states are sharded within each group of 8 devices, not over all 64.
    assert hybrid_est.row(3).device_bytes == pytest.approx(16 * psi / 8)
    assert flat_est.row(3).device_bytes == pytest.approx(16 * psi / 64)
    # Only the gradient shards cross hosts: 2 Psi / 8; flat on 8 nodes: all of the traffic.
    assert [hybrid_est.row(s).cross_host_psi for s in (0, 1, 2, 3)] == [2.0, 0.25, 0.25, 0.25]
    assert [flat_est.row(s).cross_host_psi for s in (0, 1, 2, 3)] == [2.0, 2.0, 2.0, 3.0]
    one_node = memory.estimate(ModelShape(psi), ParallelDims(8))
    assert one_node.row(3).cross_host_psi == 0
    assert "cross-host/step" in hybrid_est.table() and "hybrid: 8 replicas" in hybrid_est.table()
    with pytest.raises(ValueError, match="replicas: 3 does not divide devices=64"):
        memory.estimate(ModelShape(psi), ParallelDims(64, replica=3))


def test_memory_report_shows_the_bytes_across_replicas():
    from jzero import memory

    _, _, _, e, compiled = hybrid(2)
    with jax.enable_x64(True):  # hybrid(2) is the float64 engine
        report = memory.memory_report(e, toy.make_batches(1, BATCH, dtype=np.float64)[0])
    row = report.rows[0]
    by_axes = hlo.collectives_by_axes(compiled, e.mesh)
    across = sum(s.bytes for a, st in by_axes.items() if "replica" in a for s in st.values())
    assert row.cross_replica_bytes == across > 0
    assert "x-replica/step" in report.table()
