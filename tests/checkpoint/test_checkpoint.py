"""Checkpoints: exact resume at every stage, restore at another stage and device count, inspect,
export (format, values, memory) and every damaged-input message (saves cut by SIGKILL:
test_checkpoint_safety.py)."""

import argparse
import functools
import glob
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import toy
from numerics import max_rel_error
from repo import ROOT, SUPPORT

import jzero
from jzero.checkpoint import (
    Checkpointer,
    CheckpointError,
    abstract_target,
    inspect,
    list_steps,
)
from jzero.cli.checkpoint import add_commands
from jzero.plan import PlanOptions
from jzero.step import (
    StepOptions,
    from_logical,
    init_train_state,
    logical_view,
    restore_target,
)
from jzero.weights import export_checkpoint, load_exported

GLOBAL_BATCH = 32
CLIP = 0.5
NUM_STEPS, SAVE_AT = 10, 5
META = {"config": {"zero_optimization": {"stage": 3}}, "data_position": SAVE_AT, "seed": 0}


def optimizer():
    return optax.adamw(1e-2, weight_decay=1e-2)


KEEP_NONE_WHOLE = PlanOptions().replace(persistence_threshold=0)


def make_plan(stage, num_devices=8, dtype=jnp.float32):
    mesh = jzero.make_mesh(num_devices, devices=jax.devices()[:num_devices])
    params = toy.make_params(dtype=dtype)
    return jzero.make_plan(params, optimizer(), mesh, stage, KEEP_NONE_WHOLE)


def fresh_state(plan, dtype=jnp.float32):
    return init_train_state(plan, toy.make_params(dtype=dtype), optimizer())


def target_of(plan):
    """The restore target: the state's logical shapes (checkpoints hold no padding) in
    layouts the plan's shardings allow; ``from_logical`` pads what is read."""
    init = functools.partial(init_train_state, plan, optimizer=optimizer())
    return restore_target(plan, jax.eval_shape(init, plan.abstract_params))


def host(tree):
    return jax.tree.map(np.asarray, tree)


@functools.cache
def batches(dtype=np.float32):
    return toy.make_batches(NUM_STEPS, GLOBAL_BATCH, dtype=dtype)


@functools.cache
def uninterrupted(stage, directory, dtype=np.float32):
    """Trains 10 steps at one stage on 8 devices, saving (async) at step 5 while training on:
    (step function, losses, grad norms, final params, params at the save)."""
    with jax.enable_x64(dtype == np.float64):
        plan = make_plan(stage, dtype=dtype)
        step_fn = jzero.make_train_step(
            plan, toy.loss_fn, optimizer(), StepOptions(gradient_clipping=CLIP)
        )
        state, losses, norms = fresh_state(plan, dtype), [], []
        with Checkpointer(directory) as ckpt:
            for i, batch in enumerate(batches(dtype)):
                if i == SAVE_AT:
                    assert ckpt.save(SAVE_AT, logical_view(plan, state), meta=META)
                    at_save = host(logical_view(plan, state).params)
                state, metrics = step_fn(state, batch)
                losses.append(float(metrics["loss"]))
                norms.append(float(metrics["grad_norm"]))
        return step_fn, losses, norms, host(logical_view(plan, state).params), at_save


@functools.cache
def first_grad_norm():
    """The float64 global norm of the toy's first gradient on one device, without jzero."""
    return toy.first_grad_norm(GLOBAL_BATCH)


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def saved3(ckpt_root):
    """The stage-3, 8-device float32 run (what export and inspect read); its checkpoint
    directory holds step 5. Returns (directory, step_fn, losses, norms, final, at_save)."""
    directory = str(ckpt_root / "stage3")
    return (directory, *uninterrupted(3, directory))


def float64_run(ckpt_root, stage):
    """The float64 run of one stage (what the resume tests compare): (directory, ...)."""
    directory = str(ckpt_root / f"float64_stage{stage}")
    return (directory, *uninterrupted(stage, directory, np.float64))


# Resuming runs the same compiled step on the same values, so it is bit for bit the run that
# never stopped, at any precision; in float64, so that the first gradient norm can be checked
# against the optax gradient at 1e-10 (a gradient scaled by a constant, which clipping would
# hide from the losses, fails that). Stage 1 restores whole parameters beside sharded optimizer
# state (stage 2's state is laid out the same, stage 0's is all whole leaves), stage 3 only
# sharded leaves.
@pytest.mark.parametrize("stage", [1, 3])
def test_resume_is_bit_identical(stage, ckpt_root):
    directory, step_fn, losses, norms, final, _ = float64_run(ckpt_root, stage)
    assert norms[0] == pytest.approx(first_grad_norm(), rel=1e-10, abs=0)
    ckpt = Checkpointer(directory)
    assert ckpt.all_steps() == [SAVE_AT] and ckpt.latest_step() == SAVE_AT
    with jax.enable_x64(True):
        plan = make_plan(stage, dtype=jnp.float64)  # a new plan, fresh arrays
        state, meta = ckpt.restore(target_of(plan))
        state = from_logical(plan, state)
        assert meta == META and int(state.step) == SAVE_AT
        resumed, resumed_norms = [], []
        for batch in batches(np.float64)[SAVE_AT:]:
            state, metrics = step_fn(state, batch)
            resumed.append(float(metrics["loss"]))
            resumed_norms.append(float(metrics["grad_norm"]))
        params = host(logical_view(plan, state).params)
    assert resumed == losses[SAVE_AT:] and resumed_norms == norms[SAVE_AT:]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(final), strict=True):
        assert a.dtype == np.float64
        np.testing.assert_array_equal(a, b)
    ckpt.close()
    ckpt.close()  # idempotent


def test_restore_into_host_memory(saved3):
    directory = saved3[0]
    plan = make_plan(1, num_devices=4)
    target = target_of(plan)
    offloaded = jax.tree.map(lambda s: s.sharding.with_memory_kind("pinned_host"), target.opt_state)
    target = target._replace(opt_state=abstract_target(target.opt_state, offloaded))
    state, _ = Checkpointer(directory).restore(target)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)}
    assert kinds == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"device"}
    mu = state.opt_state[0].mu["blocks"]["w"]
    assert mu.sharding.spec == jax.sharding.PartitionSpec("data")  # the leading dimension
    assert len(mu.sharding.device_set) == 4


def _child_env(num_devices):
    env = dict(os.environ)
    # The parent's other XLA flags (an instruction-set limit, say) reach the child too.
    count = "--xla_force_host_platform_device_count"
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(count)]
    env["XLA_FLAGS"] = " ".join([*flags, f"{count}={num_devices}"])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(SUPPORT), env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def test_restore_at_another_stage_and_device_count(ckpt_root, tmp_path):
    # In float64 (the child restores the float64 stage-3 run): fewer devices sum the gradient
    # in another order, which float32 Adam can amplify, near a zero gradient entry, by up to
    # lr on another CPU; float64 rounding stays far below 1e-10, and a wrong restore moves the
    # loss by percents.
    directory, _, losses, norms, final, _ = float64_run(ckpt_root, 3)
    assert norms[0] == pytest.approx(first_grad_norm(), rel=1e-10, abs=0)
    # One child of 4 devices (a process that has fewer devices than the save) restores at
    # stage 1 on its 4 and at stage 2 on 2 of them.
    runs = [(1, 4), (2, 2)]
    prefix = tmp_path / "restored"
    cmd = [sys.executable, str(SUPPORT / "ckpt_restore_child.py"), directory, str(NUM_STEPS)]
    cmd += [str(prefix), *(f"{stage}:{n}" for stage, n in runs)]
    proc = subprocess.Popen(cmd, env=_child_env(4), cwd=ROOT)
    try:
        assert proc.wait(timeout=300) == 0, "the restore child failed"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    flat_final = {
        jax.tree_util.keystr(p, simple=True, separator="."): x
        for p, x in jax.tree_util.tree_flatten_with_path(final)[0]
    }
    for stage, n in runs:
        with np.load(f"{prefix}_stage{stage}_{n}.npz") as z:
            assert int(z["devices"]) == n and int(z["process_devices"]) == 4
            assert int(z["start"]) == SAVE_AT
            assert json.loads(str(z["meta"])) == META
            np.testing.assert_allclose(z["losses"], losses[SAVE_AT:], rtol=1e-10, atol=0)
            np.testing.assert_allclose(z["norms"], norms[SAVE_AT:], rtol=1e-10, atol=0)
            restored = {k: z["param:" + k] for k in flat_final}
            assert {v.dtype for v in restored.values()} == {np.dtype(np.float64)}
            assert max_rel_error(restored, flat_final) < 1e-9


def _parse_safetensors(path):
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    return header, raw[8 + n :]


def test_export_safetensors_and_npz(saved3, tmp_path):
    directory, params = saved3[0], saved3[5]  # the gathered params when step 5 was saved
    out = export_checkpoint(directory, SAVE_AT, tmp_path / "p.safetensors")
    header, data = _parse_safetensors(out)
    meta = header.pop("__metadata__")
    assert set(header) == {"embed", "blocks.w", "blocks.b", "head.w", "head.b", "odd"}
    spans = sorted(tuple(v["data_offsets"]) for v in header.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(data)  # no gap, nothing after
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    flat = {".".join(map(str, k)): v for k, v in _flat_dict(params).items()}
    for key, info in header.items():
        assert info["dtype"] == "F32" and info["shape"] == list(flat[key].shape)
        begin, end = info["data_offsets"]
        got = np.frombuffer(data[begin:end], "<f4").reshape(info["shape"])
        np.testing.assert_array_equal(got, flat[key])
    assert json.loads(meta["jzero.paths"])["blocks.w"] == ["blocks", "w"]
    loaded = load_exported(out)
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, b)
    for name in ("p16.safetensors", "p16.npz"):
        out = export_checkpoint(directory, SAVE_AT, tmp_path / name, dtype="bfloat16")
        loaded = load_exported(out)
        assert jax.tree.structure(loaded) == jax.tree.structure(params)
        for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
            assert a.dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(a, b.astype(ml_dtypes.bfloat16))
    header, _ = _parse_safetensors(tmp_path / "p16.safetensors")
    assert header["blocks.w"]["dtype"] == "BF16"
    assert header["blocks.w"]["data_offsets"][1] - header["blocks.w"]["data_offsets"][0] == (
        4 * 64 * 64 * 2
    )
    # The export is a valid start for a new run.
    engine = jzero.initialize(
        load_exported(tmp_path / "p.safetensors"),
        toy.loss_fn,
        optimizer(),
        {"train_batch_size": GLOBAL_BATCH, "zero_optimization": {"stage": 2}},
    )
    for a, b in zip(jax.tree.leaves(engine.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


def _flat_dict(tree, prefix=()):
    out = {}
    for k, v in tree.items():
        out.update(_flat_dict(v, (*prefix, k)) if isinstance(v, dict) else {(*prefix, k): v})
    return out


LEAF = (512, 4096)  # 8 MiB of float32
LEAVES = 16


@pytest.fixture(scope="module")
def child_reads(saved3, tmp_path_factory):
    """What tests/support/ckpt_read_child.py reads apart from this process: the exports of a
    checkpoint of 16 leaves of 8 MiB, with their resident-memory peaks, and the restore of a
    stage-3 copy with a shard cut short and no jzero file record. On one device: with 8 virtual
    CPU devices the exports' high-water mark hardly moves (0.1 MiB measured, against 8-16 MiB on
    one), so it would not see an export that holds the whole tree. Returns (the exports'
    folder, {"peaks": {dtype: KiB}, "error": the restore's message})."""
    root = tmp_path_factory.mktemp("child_reads")
    params = {f"layer{i}": {"w": jnp.full(LEAF, i, jnp.float32)} for i in range(LEAVES)}
    with Checkpointer(root / "big", async_save=False) as ckpt:
        ckpt.save(1, {"params": params})
    del params
    damaged = root / "damaged"
    shutil.copytree(saved3[0], damaged)
    big = max(glob.glob(str(damaged / "5/state/ocdbt.process_*/d/*")), key=os.path.getsize)
    with open(big, "r+b") as f:
        f.truncate(os.path.getsize(big) // 2)
    (damaged / "5/jzero_files.json").unlink()
    child = [sys.executable, str(SUPPORT / "ckpt_read_child.py"), str(root / "big"), str(root)]
    proc = subprocess.run(
        [*child, str(damaged)],
        env=_child_env(1),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, json.loads(proc.stdout.strip().splitlines()[-1])


def test_export_memory_stays_near_the_largest_leaf(child_reads):
    # The restored leaves are allocated by TensorStore, which tracemalloc does not see, so the
    # child reads its resident-memory high-water mark (reset through clear_refs).
    root, result = child_reads
    leaf_kib = LEAF[0] * LEAF[1] * 4 // 1024
    total_kib = LEAVES * leaf_kib
    for dtype, peak in result["peaks"].items():
        # The least of 3 runs (the child says why). Measured: at most 2 leaves (TensorStore's
        # read buffer, the decoded chunk, the array); restoring the whole tree first: 14-16.
        assert peak < 4 * leaf_kib and peak < total_kib / 4, (dtype, peak, leaf_kib)
    assert sorted(result["peaks"]) == ["bfloat16", "float32"]
    loaded = load_exported(root / "big_float32.safetensors")
    assert sorted(loaded) == sorted(f"layer{i}" for i in range(LEAVES))
    np.testing.assert_array_equal(loaded["layer7"]["w"], np.full(LEAF, 7, np.float32))
    loaded = load_exported(root / "big_bfloat16.safetensors")
    np.testing.assert_array_equal(loaded["layer3"]["w"], np.full(LEAF, 3, ml_dtypes.bfloat16))


def test_inspect_lists_steps_leaves_and_meta(saved3, capsys):
    directory = saved3[0]
    text = inspect(directory)
    assert "complete steps: [5]" in text
    assert "step 5 (saved on 8 devices):" in text
    assert "tree params: 6 leaves, 70,992 bytes" in text
    lines = [" ".join(line.split()) for line in text.splitlines()]
    assert "params.blocks.w 4x64x64 float32 65,536 (None, 'data')" in lines
    assert "params.head.b 5 float32 20 ()" in lines
    assert "opt_state.0.mu.embed 12x64 float32 3,072 (None, 'data')" in lines
    assert "step () int32 4 ()" in lines
    assert '"data_position": 5,' in text and '"stage": 3' in text
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["checkpoint", "inspect", directory])
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == text


def test_cli_export(saved3, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    out = tmp_path / "cli.safetensors"
    args = parser.parse_args(
        ["checkpoint", "export", saved3[0], "--step", "5", "--out", str(out), "--dtype", "bf16"]
    )
    assert args.func(args) == 0
    assert f"to {out} ({out.stat().st_size:,} bytes)" in capsys.readouterr().out
    header, _ = _parse_safetensors(out)
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}


@pytest.fixture
def damaged(saved3, tmp_path):
    """A private copy of the stage-3 checkpoint and the largest shard file in it."""
    directory = tmp_path / "copy"
    shutil.copytree(saved3[0], directory)
    files = glob.glob(str(directory / "5/state/ocdbt.process_*/d/*"))
    big = max(files, key=os.path.getsize)
    return directory, Path(big), Path(big).relative_to(directory / "5").as_posix()


def test_missing_directory_and_step(saved3, tmp_path):
    missing = tmp_path / "nope"
    for call in (
        lambda: inspect(missing),
        lambda: export_checkpoint(missing, None, tmp_path / "x.npz"),
    ):
        with pytest.raises(CheckpointError, match=r"The checkpoint directory .*nope' does not"):
            call()
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpointer(missing).restore(target_of(make_plan(3)))
    assert list_steps(missing) == [] and Checkpointer(missing).latest_step() is None
    with pytest.raises(CheckpointError, match=r"Step 7 is not .* the steps there are \[5\]\."):
        Checkpointer(saved3[0]).restore(target_of(make_plan(3)), step=7)


def test_shape_mismatch_names_the_leaf(saved3):
    params = toy.make_params(d=32)
    plan = jzero.make_plan(params, optimizer(), jzero.make_mesh(8), 3, KEEP_NONE_WHOLE)
    with pytest.raises(
        CheckpointError,
        match=r"Leaf 'params.blocks.b' has shape \(4, 64\) in step 5 .* but \(4, 32\) in the",
    ):
        Checkpointer(saved3[0]).restore(target_of(plan))
    no_sharding = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), target_of(plan))
    with pytest.raises(CheckpointError, match=r"Target leaf 'step' .* carries no sharding"):
        Checkpointer(saved3[0]).restore(no_sharding)


def test_truncated_shard_is_named(damaged, child_reads):
    directory, big, rel = damaged
    size = big.stat().st_size
    with open(big, "r+b") as f:
        f.truncate(size // 2)
    msg = rf"step 5 in .* is damaged: the file {rel} has {size // 2} bytes but {size} were"
    with pytest.raises(CheckpointError, match=msg):
        Checkpointer(directory).restore(target_of(make_plan(3)))
    with pytest.raises(CheckpointError, match=msg):
        export_checkpoint(directory, 5, directory / "x.safetensors")
    assert "DAMAGED: the file " + rel in inspect(directory)
    # Without jzero's file record the read itself fails, and is still reported by step (in a
    # child process: see tests/support/ckpt_read_child.py).
    error = child_reads[1]["error"]
    assert error is not None and re.match(r"Reading checkpoint step 5 in .* failed", error), error


def test_deleted_shard_and_manifest_are_named(damaged):
    directory, big, rel = damaged
    big.unlink()
    with pytest.raises(CheckpointError, match=rf"step 5 in .* is damaged: the file {rel} is miss"):
        Checkpointer(directory).restore(target_of(make_plan(3)))
    # A deleted OCDBT manifest would read as zeros; without the record the structure check
    # still catches it.
    (directory / "5/jzero_files.json").unlink()
    (directory / "5/state/ocdbt.process_0/manifest.ocdbt").unlink()
    with pytest.raises(
        CheckpointError, match="damaged: state/ocdbt.process_0/manifest.ocdbt is missing"
    ):
        Checkpointer(directory).restore(target_of(make_plan(3)))


def test_bad_arguments_are_explained(saved3, tmp_path):
    directory = saved3[0]
    with pytest.raises(CheckpointError, match=r"no tree 'weights'; its trees are \[.*'params'"):
        export_checkpoint(directory, 5, tmp_path / "x.npz", tree="weights")
    with pytest.raises(CheckpointError, match=r"Export dtype 'int8' is not supported"):
        export_checkpoint(directory, 5, tmp_path / "x.npz", dtype="int8")
    with pytest.raises(FileNotFoundError, match="output directory .* does not exist"):
        export_checkpoint(directory, 5, tmp_path / "no" / "x.npz")
    ckpt = Checkpointer(tmp_path / "new")
    with pytest.raises(CheckpointError, match="meta is not JSON-serialisable"):
        ckpt.save(1, {"x": np.zeros(2)}, meta={"when": object()})
    with pytest.raises(CheckpointError, match="State leaf 'x' is a str"):
        ckpt.save(1, {"x": "text"})
    with pytest.raises(CheckpointError, match="save_interval_steps=-1 is invalid"):
        Checkpointer(tmp_path / "new", save_interval_steps=-1)
    every3 = Checkpointer(tmp_path / "every3", save_interval_steps=3, async_save=False)
    assert not every3.save(1, {"x": np.zeros(2)})
    assert every3.save(1, {"x": np.zeros(2)}, force=True) and every3.save(3, {"x": np.ones(2)})
    assert not every3.save(3, {"x": np.ones(2)})  # already saved by this checkpointer
    every3.close()
    with Checkpointer(tmp_path / "every3") as other:
        with pytest.raises(CheckpointError, match=r"holds the checkpoints of an earlier run"):
            other.save(3, {"x": np.ones(2)})
    with Checkpointer(tmp_path / "every3") as same_run:
        single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        same_run.restore({"x": jax.ShapeDtypeStruct((2,), jnp.float32, sharding=single)})
        with pytest.raises(CheckpointError, match=r"step 3 already exists .* overwrite=True"):
            same_run.save(3, {"x": np.ones(2)})
    with pytest.raises(CheckpointError, match="is closed"):
        every3.save(6, {"x": np.ones(2)})


def test_a_save_lowers_no_program(tmp_path):
    """Stage 1's parameters are held whole by all 8 devices: each is written whole by one of
    them. Orbax's replica-parallel writing split each among the 8 and lowered and compiled a
    slicing program per slice shape during the save (jzero.checkpoint.orbax_io's
    MIN_REPLICA_SLICE_BYTES keeps it for slices of 1 MiB or more)."""
    plan = make_plan(1)
    view = jax.block_until_ready(logical_view(plan, fresh_state(plan)))
    assert any(len(x.sharding.device_set) == 8 and x.sharding.is_fully_replicated
               for x in jax.tree.leaves(view.params))  # fmt: skip
    lowered = []

    def listen(event, seconds, **kwargs):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(event)

    jax.clear_caches()  # a slice lowered by an earlier test would not be lowered again
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        with Checkpointer(str(tmp_path)) as ckpt:
            assert ckpt.save(1, view, meta=META)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert lowered == []
    with Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.latest_step() == 1
