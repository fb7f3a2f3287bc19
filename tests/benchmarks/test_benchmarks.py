"""benchmarks/stages.py runs and prints its tables (on a tiny GPT), so the script behind the
README's step-time and layout-copy figures cannot rot."""

import os
import subprocess
import sys

from repo import ROOT


def test_stages_benchmark_prints_memory_collectives_copies_and_step_times():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    args = ["--no-bf16", "--layers", "2", "--d-model", "32", "--seq-len", "8", "--steps", "1"]
    args += ["--repeats", "1", "--devices", "2", "--hosts-stages", "2,3"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "stages.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for title in (
        "Per-device memory",
        "Collective bytes",
        "Layout copies",
        "Across hosts",
        "Step time on 2",
    ):
        assert title in out
    # Hybrid sharding: stages 2-3 send a quarter of their gradient bytes (2 Psi / 4 devices per
    # host, plus the leaves ZeRO leaves whole) across the two hosts, the flat mesh all of it.
    hosts = [line.split() for line in out.split("Across hosts")[1].splitlines()[3:8]]
    across = {(r[0], r[1]): float(r[3]) for r in hosts}
    assert set(across) == {
        ("2", "flat"),
        ("3", "flat"),
        ("2", "hybrid"),
        ("3", "hybrid"),
        ("3", "hpZ"),
    }
    for stage in "23":
        assert across[(stage, "hybrid")] < across[(stage, "flat")] / 3
    assert across[("3", "hpZ")] < across[("3", "flat")] / 3
    timed = out.split("Step time on 2")[1].splitlines()[3:9]
    names = [line[:12].strip() for line in timed]
    assert names == ["plain DP", "plain+remat", "stage 0", "stage 1", "stage 2", "stage 3"]
    assert all(float(line[12:].split()[0]) > 0 for line in timed)  # ms/step
    # On 2 devices the 2 stacked layers shard on their leading dimension; on 8 (the memory
    # tables) their state rests with layers and rows merged: no stage has layout copies
    # around its collectives on either (8 devices had 28 of them before the merge).
    assert [line.split()[-1] for line in timed[2:]] == ["0.00"] * 4
    copies = [line.split() for line in out.split("Layout copies")[1].splitlines()[3:7]]
    assert [c[0] for c in copies] == ["0", "1", "2", "3"]
    assert [c[1:] for c in copies] == [["0", "0.00"]] * 4


def test_stage3_layers_benchmark_prints_each_way_of_writing_the_model():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "stage3_layers.py"), "--layers", "2"]
        + ["--width", "64", "--batch", "8", "--ac-batch", "512", "--ac-width", "32"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tables = proc.stdout.split("\n\n")
    rows = tables[0].splitlines()[3:]
    names = [row[:22].strip() for row in rows]
    assert names == [
        "scan (stacked layers)",
        "Python loop, pytree",
        "Python loop, Linen",
        "nnx.List of layers",
    ]
    assert all(float(row.split()[-1]) > 0 for row in rows)
    # Activation checkpointing: the scan and the loop, each at stages 0 and 3.
    ac = [row.split() for row in tables[1].splitlines()[3:7]]
    assert [(r[-5], r[-4]) for r in ac] == [("layers)", "0"), ("layers)", "3")] + [
        ("pytree", "0"),
        ("pytree", "3"),
    ]
    # The model's own jax.checkpoint per layer, no section: on CPU no less than the plain loop.
    own = tables[1].splitlines()[7]
    assert own.startswith("loop + jax.checkpoint")
    assert float(own.split()[4]) >= float(ac[2][-3])
    # Gather settings: reuse and reshard_after_forward: false gather each layer once, the
    # default twice (less the last layer, whose two gathers meet).
    gathers = {row[:38].strip(): float(row.split()[-2]) for row in tables[2].splitlines()[3:]}
    assert gathers["stage3_max_reuse_distance: 1e9"] == gathers["reshard_after_forward: false"]
    assert gathers["(defaults)"] > 1.5 * gathers["reshard_after_forward: false"]


def test_offload_benchmark_prints_every_tier():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    args = ["--stages", "2", "--layers", "1", "--d-model", "32", "--seq-len", "8"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "offload.py"), *args, "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    timed = proc.stdout.split("Step time")[1].splitlines()[3:8]
    rows = {line.split()[1]: line.split() for line in timed}
    assert list(rows) == ["none", "optimizer", "optimizer+subgroups", "optimizer+host", "nvme"]
    assert float(rows["nvme"][-1]) > 0  # the NVMe tier's files hold the state
    assert all(float(r[-1]) == 0 for name, r in rows.items() if name != "nvme")


def _smoke(script):
    """``benchmarks/<script>.py --smoke`` on 8 virtual CPU devices; it must exit 0."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_compile_time_benchmark_prints_the_table_and_the_compilations():
    proc = _smoke("compile_time")
    rows = [line.split() for line in proc.stdout.splitlines()[3:]]
    assert [r[:2] for r in rows] == [["loop", "2"], ["scan", "2"]]
    for r in rows:  # seconds (compiles) for plain jit, plain DP, stage 0 and stage 3, and
        # jzero's ratios to plain DP and plain jit
        assert [r[3], r[7], r[11]] == ["(2)", "(2)", "(2)"] and r[5].startswith("(")
        assert all(float(r[i]) > 0 for i in (2, 4, 6, 10))
        assert all(r[i].endswith("x") for i in (8, 9, 12, 13))


def test_tensor_parallel_benchmark_prints_bytes_per_tp_size():
    proc = _smoke("tensor_parallel")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    rows = [dict(zip(cells[0], row, strict=True)) for row in cells[2:]]
    assert [(r["T"], r["S"], r["stage"], r["mesh"]) for r in rows] == [
        ("1", "1", "1", "{data: 8}"),
        ("2", "1", "1", "{data: 4, model: 2}"),
        ("1", "2", "1", "{data: 4, seq: 2}"),
    ]
    one, two, seq = rows
    # Megatron's split halves (about: norms, biases and positions stay whole) each device's
    # share of the model state, at the same global batch.
    assert float(two["model state MiB"]) < float(one["model state MiB"])
    assert float(one["vs T=S=1"]) == 1.0 and float(two["vs T=S=1"]) < 0.75
    # The model axis carries the row-parallel all-reduces at T = 2; T = 1 has no model axis.
    assert float(one["model MiB"]) == 0 and float(two["model MiB"]) > 0
    # Ulysses's all-to-alls run within the seq groups only; ZeRO shards over data x seq, so
    # its state per device is the same as over 8 data devices.
    assert float(seq["seq MiB"]) > 0 and float(one["seq MiB"]) == float(two["seq MiB"]) == 0
    assert float(seq["model state MiB"]) == float(one["model state MiB"])
    assert all(float(r["ZeRO MiB"]) > 0 for r in rows)  # ZeRO's collectives
    assert all(float(r["temp MiB"]) > 0 and float(r["ms/step"]) > 0 for r in rows)


def test_sequence_parallel_benchmark_prints_temporaries_falling_by_about_s():
    proc = _smoke("sequence_parallel")
    rows = [line.strip("|").split("|") for line in proc.stdout.splitlines() if line[:3] == "| 6"]
    (row,) = rows  # sequence length 64, one sequence per data group
    one, four, ratio = (float(c) for c in row[1:])
    assert four < one and ratio < 0.5  # a quarter of the tokens and heads' scores a device


def test_pipeline_benchmark_prints_the_bubble_memory_and_bytes_between_stages():
    proc = _smoke("pipeline")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    rows = [dict(zip(cells[0], row, strict=True)) for row in cells[2:]]
    assert [(r["P"], r["schedule"], r["mesh"]) for r in rows] == [
        ("1", "-", "{data: 8}"),
        ("2", "gpipe", "{pipe: 2, data: 4}"),
        ("2", "1f1b", "{pipe: 2, data: 4}"),
    ]
    one, gpipe, f1b = rows
    # (P-1)/(M+P-1) at M = 4, P = 2; none without a pipeline.
    assert float(one["bubble"]) == 0 and float(gpipe["bubble"]) == float(f1b["bubble"]) == 0.2
    # Half the layers a device: less model state (the optimizer state over 4 devices, not 8).
    assert float(gpipe["model state MiB"]) == float(f1b["model state MiB"])
    assert float(f1b["model state MiB"]) < float(one["model state MiB"])
    # Activations move between the stages; 1F1B keeps P micro-batches of them, GPipe M.
    assert float(one["pipe MiB"]) == 0 and float(gpipe["pipe MiB"]) == float(f1b["pipe MiB"]) > 0
    assert float(f1b["temp MiB"]) < float(gpipe["temp MiB"])
    assert all(float(r["ZeRO MiB"]) > 0 and float(r["ms/step"]) > 0 for r in rows)


def test_moe_benchmark_prints_expert_bytes_falling_with_ep_and_the_all_to_alls():
    proc = _smoke("moe")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    rows = [dict(zip(cells[0], row, strict=True)) for row in cells[2:]]
    assert [(r["E_p"], r["stage"], r["mesh"]) for r in rows] == [
        ("1", "1", "{data: 8}"),
        ("2", "1", "{data: 4, expert: 2}"),
    ]
    one, two = rows
    # Half the experts a device: the expert params (whole at stage 1) halve; the dense
    # leaves' state stays sharded over all 8 devices.
    assert float(two["expert MiB"]) < float(one["expert MiB"])
    # Tokens reach their experts by all-to-all only where there is an expert axis.
    assert float(one["all-to-all MiB"]) == 0 and float(two["all-to-all MiB"]) > 0
    # The same model and data: the same loss after the same steps. float32 sums in another
    # order move a loss of ~5 by ~1e-6 over 3 AdamW steps at lr 3e-3; 1e-3 is far above that
    # and far below a wrong expert (the loss then differs in the first step by ~1e-1).
    assert abs(float(one["loss"]) - float(two["loss"])) < 1e-3
    assert "dense twin" in proc.stdout and all(float(r["ms/step"]) > 0 for r in rows)


def test_optimizers_benchmark_prints_state_bytes_and_muons_traffic():
    proc = _smoke("optimizers")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    rows = {r["optimizer"]: r for r in (dict(zip(cells[0], c, strict=True)) for c in cells[2:])}
    assert list(rows) == [
        "AdamW fp32 state",
        "AdamW bf16 state",
        "AdamW 8-bit state",
        "Muon + AdamW",
    ]
    state = {k: float(r["opt-state MiB"]) for k, r in rows.items()}
    fp32 = state["AdamW fp32 state"]
    # bf16 moments are half of fp32's, int8/uint8 codes with their scales under 0.3x, and
    # Muon keeps one moment for its matrices (AdamW's two for the rest).
    assert state["AdamW bf16 state"] < 0.6 * fp32
    assert state["AdamW 8-bit state"] <= 0.3 * fp32
    assert state["Muon + AdamW"] < 0.75 * fp32
    # Muon's exchange is the only traffic AdamW's step lacks; AdamW moves no all-to-all.
    assert float(rows["AdamW fp32 state"]["all-to-all MiB"]) == 0
    assert float(rows["Muon + AdamW"]["collectives MiB"]) > float(
        rows["AdamW fp32 state"]["collectives MiB"]
    )
    assert "Muon adds" in proc.stdout and "Psi beside ZeRO's 2 Psi" in proc.stdout
    assert all(float(r["ms/step"]) > 0 and float(r["eval loss"]) > 0 for r in rows.values())


def test_training_curves_benchmark_draws_the_monitors_series(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    plot = tmp_path / "curves.png"
    script = str(ROOT / "benchmarks" / "training_curves.py")
    proc = subprocess.run(
        [sys.executable, script, "--smoke", "--plot", str(plot)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]
    # The table is the CSV monitor's series: every step's loss and MFU (6 steps of 16 samples),
    # the eval losses at 0 and every 3 steps.
    assert [r[0] for r in rows] == ["0", "16", "32", "48", "64", "80", "96"]
    assert [bool(r[2]) for r in rows] == [True, False, False, True, False, False, True]
    assert all(r[1] and float(r[3]) > 0 for r in rows[1:])
    assert "measured f32 matmul rate" in proc.stdout
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
