"""Offload that lowers the peak: the update streamed over sub-groups, partial offload (``ratio``),
and the NVMe tier (ZeRO-Infinity) with the optimizer state in files.

Every variant must train with the same bits as the run without offload: losses, parameters
and every optimizer-state leaf. The NVMe tier's own update programs may round a last bit
differently (the CPU code generator contracts other multiply-adds), so its float32 runs are
compared in float64 instead (tests/support/numerics.py), and its bf16 run within bf16's rounding.
"""

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy
from numerics import EPS
from offload_runs import (
    BATCH,
    F64,
    PSI,
    STEPS,
    assert_close_run,
    assert_first_norm,
    assert_same_run,
    config,
    flip_last_byte,
    host,
    nvme,
    reference,
    train,
)
from repo import SUPPORT

import jzero
from jzero import subgroups
from jzero.config import ConfigError, JzeroConfigWarning
from jzero.nvme import NvmeIOError
from jzero.plan import host_state_bytes, model_state_bytes


def main_body(text):
    """The lowered step's ``main`` function (the update's groups; nested functions apart)."""
    body = text.split("func.func public @main", 1)[1]
    return body.split("\n  func.func", 1)[0]


# -- sub-group streaming -----------------------------------------------------------------------
def streamed_groups(plan, sub):
    """The leaf groups the update streams over with ``sub_group_size`` ``sub`` (one without)."""
    sizes = [int(np.prod(leaf.shape)) for leaf in plan.leaves]
    return subgroups.merge_single_leaf_groups(subgroups.leaf_groups(sizes, sub)) if sub else [0]


@functools.cache
def cpu_offload_run(stage, bf16, sub, compute="device"):
    """(losses, params, optimizer state, None, grad norms), the step's lowered text and its
    number of groups of the run with the optimizer state in host memory, ``sub_group_size``
    ``sub`` (0: none): the run of the streaming test is the program without host compute of
    the host-compute test, one engine for both."""
    extra = {"sub_group_size": sub} if sub else {}
    run = train(
        config(stage, bf16, offload_optimizer={"device": "cpu", "compute": compute}, **extra)
    )
    e = run[3]
    text = e.lower(toy.make_batches(1, BATCH)[0]).as_text()
    groups = len(streamed_groups(e.plan, sub))
    e.close()
    return (*run[:3], None, run[4]), text, groups


@pytest.mark.parametrize("stage, bf16", [(2, True), (3, False)])
def test_subgroups_stream_the_update_in_order_with_the_same_bits(stage, bf16):
    run, full_text, groups = cpu_offload_run(stage, bf16, PSI // 4)
    assert_same_run(run, reference(stage, bf16))
    assert groups >= 2
    batch = toy.make_batches(1, BATCH)[0]
    text = main_body(full_text)
    plain = jzero.initialize(
        toy.make_params(),
        toy.loss_fn,
        optax.adamw(1e-2),
        config(stage, bf16, offload_optimizer={"device": "cpu"}),
    )
    plain_text = main_body(plain.lower(batch).as_text())
    plain.close()
    barriers = text.count("stablehlo.optimization_barrier")
    # One barrier between consecutive groups: group g + 1's state is brought in only after
    # group g's results were sent back to host memory.
    assert barriers - plain_text.count("stablehlo.optimization_barrier") == groups - 1
    # In order: each barrier joins the previous group's results (values the step computed)
    # with the next group's state as it rests in host memory (the step's arguments), so the
    # next group is brought in only once the previous one is done.
    for line in text.splitlines():
        if "stablehlo.optimization_barrier" in line and "%arg" in line:
            operands = re.findall(r"%[\w#]+", line.split("optimization_barrier", 1)[1])
            assert any(o.startswith("%arg") for o in operands), line[:200]
            assert any(not o.startswith("%arg") for o in operands), line[:200]
    streamed = [
        line
        for line in text.splitlines()
        if "stablehlo.optimization_barrier" in line and "%arg" in line
    ]
    assert len(streamed) == groups - 1


@pytest.mark.parametrize(
    "stage, bf16, sub", [(2, True, PSI // 4), (3, False, PSI // 4), (1, False, 0)]
)
def test_host_compute_updates_each_group_where_it_rests_with_the_same_bits(stage, bf16, sub):
    """offload_optimizer.compute: host: one compute_on("device_host") call per group in the
    step (one for all leaves without sub_group_size), none with compute on the device, and
    every bit as in the run without offload."""
    run, text, groups = cpu_offload_run(stage, bf16, sub, compute="host")
    assert_same_run(run, reference(stage, bf16))
    on_host = [
        line
        for line in main_body(text).splitlines()
        if "call @" in line and '_xla_compute_type = "host"' in line
    ]
    assert len(on_host) == groups, on_host
    if sub:  # the streaming test's run (compute on the device), trained once for both
        device_text = cpu_offload_run(stage, bf16, sub)[1]
    else:
        device = {"device": "cpu", "compute": "device"}
        plain = jzero.initialize(
            toy.make_params(),
            toy.loss_fn,
            optax.adamw(1e-2),
            config(stage, bf16, offload_optimizer=device),
        )
        device_text = plain.lower(toy.make_batches(1, BATCH)[0]).as_text()
        plain.close()
    assert "_xla_compute_type" not in device_text


def layers_params():
    rng = np.random.default_rng(0)
    return {f"l{i}": jnp.asarray(rng.normal(size=(64, 64)) / 8, jnp.float32) for i in range(6)}


def layers_loss(params, batch):
    x = batch["x"] @ jnp.ones((toy.IN, 64)) / 8
    for i in range(6):
        x = jnp.tanh(x @ params[f"l{i}"])
    return jnp.mean(x**2)


def test_partial_offload_ratio_puts_about_half_in_host_memory():
    batches = toy.make_batches(STEPS, BATCH)
    runs = {}
    for ratio in (None, 0.5):
        zero = {} if ratio is None else {"offload_optimizer": {"device": "cpu", "ratio": ratio}}
        e = jzero.initialize(
            layers_params(), layers_loss, optax.adamw(1e-2), config(2, True, **zero)
        )
        metrics = [e.train_step(b) for b in batches]
        losses = [float(m["loss"]) for m in metrics]
        runs[ratio] = (losses, host(e.params), host(e.opt_state), e, float(metrics[0]["grad_norm"]))
    assert runs[0.5][0] == runs[None][0] and runs[0.5][4] == runs[None][4]
    for a, b in zip(runs[0.5][1] + runs[0.5][2], runs[None][1] + runs[None][2], strict=True):
        np.testing.assert_array_equal(a, b)
    # The first gradient's norm against float64's: the 7 bf16 layers round each gradient's
    # path about 14 times, so within 16 bf16 unit roundoffs (a gradient x2 is 100% off).
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda x: np.asarray(x, np.float64), layers_params())
        b64 = {"x": np.asarray(batches[0]["x"], np.float64)}
        want = float(optax.global_norm(jax.grad(layers_loss)(p64, b64)))
    assert runs[None][4] == pytest.approx(want, rel=16 * EPS["bfloat16"], abs=0)
    plan = runs[0.5][3].plan
    on_host = host_state_bytes(plan)
    on_device = model_state_bytes(plan)
    moved = on_host["opt_state"] + on_host["master_params"]
    total = moved + on_device["opt_state"] + on_device["master_params"]
    assert moved / total == pytest.approx(0.5, abs=0.01)  # 3 of the 6 equal layers
    kinds = {s.memory_kind for s in jax.tree.leaves(plan.master)}
    assert kinds == {"device", "pinned_host"}


def test_nvme_trains_like_the_state_in_memory(tmp_path):
    """Stage 2, pipelined reads and writes, in float64. Stage 3 in float64 is
    test_nvme_params.py::test_parameters_on_nvme_train_like_the_run_in_memory[False] (its
    optimizer state on NVMe too); stages 1-3 bit for bit, the next test."""
    stage = 2
    pipelined = {"pipeline_read": True, "pipeline_write": True}
    cfg = config(stage, offload_optimizer=nvme(tmp_path, **pipelined), sub_group_size=PSI // 3)
    run = train(cfg, dtype=F64)
    assert_close_run(run, reference(stage, dtype=F64))
    e = run[3]
    store = e._disk.store
    # The files hold the state: one version of every state leaf's shards, each array's data
    # starting on a 4 KiB boundary (the header and the padding are at most 4 KiB an array).
    opt_bytes = sum(x.nbytes for x in run[2] if x.size > 1)
    arrays = sum(len(x.sharding.device_set) for x in jax.tree.leaves(e.opt_state))
    assert opt_bytes <= store.disk_bytes() <= opt_bytes + 4096 * (arrays + 8)
    e.close()
    assert not os.listdir(tmp_path)  # the store's directory is gone, nothing else touched


def test_nvme_is_bit_identical_without_fused_multiply_adds(tmp_path):
    """The same float32 arithmetic as the run in memory: every bit agrees once the CPU code
    generator stops contracting multiply-adds (optimization level 0), with LLVM's module split
    at its default (in this process where the suite's XLA_FLAGS already say so, else in a child
    process). `make test`'s --xla_cpu_parallel_codegen_split_count=1 compiles each program as
    one LLVM module, which gave the NVMe tier's update programs other last bits (every element
    differed), so there the child runs."""
    import json
    import subprocess
    import sys

    level, split = "--xla_backend_optimization_level", "--xla_cpu_parallel_codegen_split_count"
    flags = os.environ.get("XLA_FLAGS", "").split()
    if f"{level}=0" in flags and not any(f.startswith(split) for f in flags):
        import nvme_bits_child

        # The runs in memory are this file's references (the same config, optimizer and
        # batches as the child's), trained once for the tests above.
        ran = {s: (reference(s)[0], reference(s)[1] + reference(s)[2]) for s in (1, 2, 3)}
        out = nvme_bits_child.compare(str(tmp_path), ran)
    else:
        kept = [f for f in flags if not f.startswith((level, split))]
        env = dict(os.environ, XLA_FLAGS=" ".join([*kept, f"{level}=0"]))
        child = SUPPORT / "nvme_bits_child.py"
        proc = subprocess.run(
            [sys.executable, str(child), str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {s: {"losses_equal": True, "differing": 0} for s in ("1", "2", "3", "3p")}


def test_nvme_mixed_precision_keeps_masters_on_disk(tmp_path):
    cfg = config(2, True, offload_optimizer=nvme(tmp_path), sub_group_size=PSI // 2)
    run = train(cfg)
    assert_close_run(run, reference(2, True), reference(2, dtype=F64))
    e = run[3]
    assert all(0 in x.shape for x in jax.tree.leaves(e.state.master))
    masters = sum(4 * int(np.prod(leaf.shape)) for leaf in e.plan.leaves)
    assert e._disk.store.disk_bytes() >= masters + sum(x.nbytes for x in run[2] if x.size > 1)
    e.close()


def test_nvme_read_error_stops_the_step_and_keeps_the_state(tmp_path, x64):
    cfg = config(2, offload_optimizer=nvme(tmp_path), sub_group_size=PSI // 3)
    cfg["checkpoint"] = {"directory": str(tmp_path / "ckpt")}
    tx = optax.adamw(1e-2, weight_decay=1e-2)
    e = jzero.initialize(toy.make_params(dtype=F64), toy.loss_fn, tx, cfg)
    batches = toy.make_batches(STEPS, BATCH, dtype=np.float64)
    assert_first_norm([float(e.train_step(batches[0])["grad_norm"])], F64)
    e.save()
    e.wait_until_finished()
    store = e._disk.store
    files = sorted(f for f in os.listdir(store.directory) if not f.startswith("."))
    victim = os.path.join(store.directory, files[-1])
    flip_last_byte(victim)
    params_before = host(e.params)
    with pytest.raises(NvmeIOError, match=re.escape(os.path.basename(victim))):
        e.train_step(batches[1])
    assert int(e.state.step) == 1
    # The unfinished version's files are gone; the previous version's stay as they were.
    assert sorted(f for f in os.listdir(store.directory) if not f.startswith(".")) == files
    for a, b in zip(host(e.params), params_before, strict=True):
        np.testing.assert_array_equal(a, b)
    # The previous state comes back from the checkpoint and training goes on as before.
    e.restore()
    metrics = [e.train_step(b) for b in batches[1:]]
    # In float64: the restored run continues the run in memory (and its gradients' scale).
    ref = reference(2, dtype=F64)
    np.testing.assert_allclose([float(m["loss"]) for m in metrics], ref[0][1:], rtol=1e-10)
    np.testing.assert_allclose([float(m["grad_norm"]) for m in metrics], ref[3][1:], rtol=1e-10)
    e.close()


def test_nvme_checkpoint_restores_without_nvme(tmp_path):
    cfg = config(2, offload_optimizer=nvme(tmp_path / "nvme"), sub_group_size=PSI // 3)
    (tmp_path / "nvme").mkdir()
    cfg["checkpoint"] = {"directory": str(tmp_path / "ckpt")}
    e = jzero.initialize(toy.make_params(), toy.loss_fn, optax.adamw(1e-2, weight_decay=1e-2), cfg)
    batches = toy.make_batches(STEPS, BATCH)
    norms = [float(e.train_step(b)["grad_norm"]) for b in batches[:2]]
    assert_first_norm(norms, np.float32)
    e.save()
    e.wait_until_finished()
    want = float(e.train_step(batches[2])["loss"])
    e.close()
    plain = config(2)
    plain["checkpoint"] = {"directory": str(tmp_path / "ckpt")}
    r = jzero.initialize(
        toy.make_params(), toy.loss_fn, optax.adamw(1e-2, weight_decay=1e-2), plain
    )
    r.restore()
    assert float(r.train_step(batches[2])["loss"]) == want
    r.close()


def test_bad_nvme_paths_fail_at_initialize(tmp_path):
    def init(path):
        return jzero.initialize(
            toy.make_params(), toy.loss_fn, optax.sgd(0.1), config(2, offload_optimizer=nvme(path))
        )

    with pytest.raises(ValueError, match="does not exist"):
        init(tmp_path / "missing")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="which is a file, not a directory"):
        init(a_file)
    with pytest.raises(ConfigError, match="compute: 'host' updates the optimizer state"):
        jzero.load_config(
            {"zero_optimization": {"stage": 2, "offload_optimizer": nvme(tmp_path, compute="host")}}
        )
    with pytest.raises(ConfigError, match="belongs under offload_optimizer"):
        jzero.load_config(
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {"device": "cpu", "compute": "host"},
                }
            }
        )
    with pytest.raises(ConfigError, match="nvme_path is not set"):
        jzero.load_config(
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}
        )
    with pytest.raises(ConfigError, match="offload_param.device is nvme, but offload_optimizer"):
        jzero.load_config({"zero_optimization": {"stage": 3, "offload_param": nvme(tmp_path)}})
    # Parameters rest whole below stage 3: DeepSpeed ignores offload_param there, so does jzero.
    with pytest.warns(JzeroConfigWarning, match="offload_param: it offloads the parameter"):
        jzero.load_config(
            {
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": nvme(tmp_path),
                    "offload_param": nvme(tmp_path),
                }
            }
        )


def test_nvme_path_without_room_or_write_access(tmp_path, monkeypatch):
    from jzero.nvme import store as nvme_lib

    def adamw(**zero):
        return jzero.initialize(
            toy.make_params(), toy.loss_fn, optax.adamw(1e-2), config(2, **zero)
        )

    monkeypatch.setattr(nvme_lib, "free_bytes", lambda _: 1000)
    with pytest.raises(ValueError, match=r"\(1,000 bytes\), but the offloaded state needs"):
        adamw(offload_optimizer=nvme(tmp_path))
    monkeypatch.undo()
    monkeypatch.setattr(nvme_lib.os, "access", lambda *a: False)
    with pytest.raises(ValueError, match="is not writable by this process"):
        adamw(offload_optimizer=nvme(tmp_path))


def test_nvme_keeps_the_optimizer_state_out_of_host_memory(tmp_path, children):
    """The optimizer state lives on disk, from ``initialize`` on: the run holds at least 70% of
    the state's bytes less than the run with the state in memory at initialize, 60% less
    between steps, and a step adds under 30% of them. With the parameters on NVMe too, the
    run holds at least 70% of their bytes less again."""
    import json
    import sys

    child = SUPPORT / "nvme_memory_child.py"
    count = "--xla_force_host_platform_device_count"
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(count)]
    env = dict(  # one device: the marks do not depend on the machine's load (see the child)
        os.environ,
        XLA_FLAGS=" ".join([*kept, f"{count}=1"]),
        MALLOC_MMAP_THRESHOLD_="65536",
    )
    # One after the other (each in a process of its own, forked by the child once it has
    # imported JAX), in this order: the later ones read the programs the earlier ones compiled
    # from the run's cache, so compiling adds nothing to their marks (and running at once,
    # whichever compiled a program first would move the others' marks).
    modes = ("memory", "nvme", "nvme+params")
    proc = children.start([sys.executable, str(child), str(tmp_path), *modes], env)
    assert children.finish(proc, timeout=600) == 0, "".join(proc.err)[-3000:]
    records = [json.loads(line) for line in proc.out if line.startswith("{")]
    assert [r["mode"] for r in records] == list(modes), proc.out
    out = {r["mode"]: r for r in records}
    memory, nvme, both = records
    state, params = nvme["state"], nvme["params"]
    # initialize writes the state to its files group by group: it never holds all of it.
    assert memory["init"] - nvme["init"] > 0.7 * state, out
    # While it runs, a step adds to what the same step holds with the state in memory (its
    # gathers and gradients) the gradients as a whole array (the gradient program hands them to
    # the update programs) and one group of the state (read, updated, being written): the
    # latter under 30% of the state's bytes. With the parameters on NVMe the step reads them in
    # instead of holding them between steps.
    assert nvme["growth"] - memory["growth"] - params < 0.3 * state, out
    assert both["growth"] - memory["growth"] - params < 0.3 * state, out
    # Between steps the state is on disk, and with offload_param the parameters too (the NVMe
    # tier's own compiled programs, one a group, take some of the difference back).
    assert memory["held"] - nvme["held"] > 0.6 * state, out
    assert nvme["held"] - both["held"] > 0.7 * params, out
    assert nvme["init"] - both["init"] > 0.7 * params, out
