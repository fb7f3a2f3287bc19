"""benchmarks/gpu_step_time.py, the step-time GPU check, runs on CPU in its --smoke mode: so that
the script a lent GPU runs cannot rot between sessions. Each run starts a process per variant,
so each runs the fewest variants its point needs: the floor against stage 3, and stage 3 against
the memory wall's loop with activation checkpointing in host memory (the variant that takes
every branch of the memory wall's set-up)."""

import json
import math
import os
import signal
import subprocess
import sys

import pytest
from procs import device_env
from repo import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_step_time.py"
VARIANTS = ["plain-dp", "zero-0", "zero-1", "zero-2", "zero-3"]
MEMORY_WALL = ["zero-3-unrolled", "zero-3-unrolled-ac", "zero-3-unrolled-ac-cpu", "zero-3-ac"]


def _run(args, tmp_path, timeout=240):
    env = device_env(8, OUT=str(tmp_path), JAX_PLATFORMS="cpu")
    # Its own process group, so that a timeout ends the script and its per-variant children.
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out


def _table(out):
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["variant", "ms/step"])
    assert set(lines[header + 1]) == {"-"}
    rows = {}
    for line in lines[header + 2 :]:
        cells = line.split()
        if not cells or cells[0] not in VARIANTS + MEMORY_WALL:
            break
        rows[cells[0]] = cells
    return rows


def test_smoke_times_plain_dp_against_stage_3_on_cpu(tmp_path):
    # The floor and stage 3 (the script's set-up is the same for every stage): what stages 0-2
    # move is tests/step/'s, and that every stage trains like the optax loop
    # tests/step/test_parity.py's.
    rc, out = _run(["--smoke", "--stages", "plain,3"], tmp_path)
    assert rc == 0, out
    rows = _table(out)
    assert list(rows) == ["plain-dp", "zero-3"], out
    for cells in rows.values():
        # variant, ms/step, vs plain DP, tokens/s, MFU, compile s, coll MiB, copies, MiB, temp,
        # peak
        assert len(cells) == 11, cells
        assert math.isfinite(float(cells[1])) and float(cells[1]) > 0, cells
        assert float(cells[5]) > 0, cells  # compile seconds
        assert cells[4] == "n/a", cells  # a CPU has no known bf16 peak
        assert float(cells[9]) > 0, cells  # the compiled step's temporaries
        assert cells[10] == "n/a", cells  # a CPU has no allocator statistics
    assert rows["plain-dp"][2] == "1.00"
    assert float(rows["zero-3"][6]) > 0  # 8 devices: stage 3 gathers and reduce-scatters
    assert "peak bf16 FLOP/s: unknown for this device" in out

    summary = json.loads((tmp_path / "gpu_step_time.json").read_text())
    assert list(summary["variants"]) == ["plain-dp", "zero-3"]
    assert summary["peak_flops_per_device"] is None
    for name, r in summary["variants"].items():
        assert r["status"] == "ok", (name, r)
        assert r["devices"] == 8 and r["platform"] == "cpu"
        assert len(r["step_seconds"]) == 2  # --smoke: 2 timed steps
        assert math.isfinite(r["step_seconds_median"]) and r["step_seconds_median"] > 0
        assert r["mfu"] is None
        assert r["tokens_per_second"] > 0
        assert all(math.isfinite(x) for x in r["losses"])
        assert r["flops_per_token"] == 6 * r["params"] + 12 * 2 * 64 * 16  # SMOKE sizes
    # Same init, same data, same AdamW: the floor starts from jzero's loss.
    first = [r["losses"][0] for r in summary["variants"].values()]
    assert max(first) - min(first) < 1e-2, first
    assert summary["variants"]["zero-3"]["collectives"]["reduce-scatter"]["count"] > 0


def test_a_spent_time_budget_skips_variants_with_a_note(tmp_path):
    rc, out = _run(["--smoke", "--stages", "plain,3", "--time-budget", "0"], tmp_path, 60)
    assert rc == 1, out  # nothing measured
    rows = _table(out)
    assert {name: cells[1] for name, cells in rows.items()} == {
        "plain-dp": "skipped",
        "zero-3": "skipped",
    }
    assert "note: zero-3 skipped: not started: the 0 s time budget is spent" in out
    summary = json.loads((tmp_path / "gpu_step_time.json").read_text())
    assert summary["variants"]["zero-3"]["status"] == "skipped"


def test_memory_wall_smoke_runs_stage3_scanned_and_unrolled_with_activation_checkpointing(
    tmp_path,
):
    # The loop of layers with activation checkpointing in host memory: the unrolled GPT, the
    # section and cpu_checkpointing at once (3-unrolled, 3-unrolled-ac and 3-ac set up a subset
    # of them). Each alone trains like the scan in tests/models/test_gpt_moe.py
    # (test_functional_unrolled_and_nnx_forms_agree) and
    # tests/rewrite/test_activation_checkpointing.py
    # (test_full_policy_cuts_temporaries_and_keeps_the_losses,
    # test_cpu_checkpointing_trains_with_unchanged_losses).
    stages = "3-unrolled-ac-cpu,3"  # in the order given: plain stage 3 runs first all the same
    rc, out = _run(["--smoke", "--name", "memory_wall", "--stages", stages], tmp_path)
    assert rc == 0, out
    rows = _table(out)
    assert list(rows) == ["zero-3", "zero-3-unrolled-ac-cpu"], out
    assert all(float(cells[1]) > 0 and float(cells[9]) > 0 for cells in rows.values())
    summary = json.loads((tmp_path / "gpu_memory_wall.json").read_text())
    losses = {name: r["losses"] for name, r in summary["variants"].items()}
    # The same model, written as a loop and rematerialised: the same training, to float noise.
    assert losses["zero-3-unrolled-ac-cpu"] == pytest.approx(losses["zero-3"], rel=1e-3)
