"""The GPU checks' scripts (benchmarks/gpu_check.py, gpu_comm.py) and the ZeRO++ comm
benchmark run on CPU in their --smoke mode, so that the scripts a lent GPU runs cannot rot: each
with the fewest variants its table and its claims need. gpu_comm.py and comm.py share one child
process (``tests/support/bench_smoke.py``: JAX and jzero imported once); gpu_check.py starts a
process per variant and runs in its own process group."""

import json
import os
import signal
import subprocess
import sys

import bench_smoke
import pytest
from procs import device_env
from repo import ROOT

# int8 rounds each weight to within half its block's scale (absmax / 254): see
# tests/comm/test_zeropp.py, whose 50-step runs allow 2% of the loss.
QUANT_REL = 0.02


def test_gpu_check_smoke_runs_on_cpu_and_prints_its_table(tmp_path):
    # A process per variant: no offload (the base), the host tier updated on the host (its
    # set-up takes every host-offload branch: pinned_host, sub-groups, compute: host) and the
    # NVMe tier. The whole and streamed host tiers train the same bits in
    # tests/plan/test_offload.py's
    # test_optimizer_offload_rests_in_pinned_host_and_trains_bit_identically and
    # tests/nvme/test_offload_tiers.py's
    # test_subgroups_stream_the_update_in_order_with_the_same_bits.
    # Its own process group, so that a timeout ends the script and its per-variant children.
    script = str(ROOT / "benchmarks" / "gpu_check.py")
    proc = subprocess.Popen(
        [sys.executable, script, "--smoke", "--variants", "none,host,nvme"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=device_env(8, OUT=str(tmp_path)),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["variant", "opt"])
    rows = [lines[header + 2 + i].split()[:2] for i in range(3)]
    assert rows == [["none", "device"], ["host", "pinned_host"], ["nvme", "nvme"]]
    assert "memory_analysis() reports no host bytes on this backend" in out
    # CPU: host offload, whole or streamed, changes no bit; the NVMe tier's update programs may
    # round a last bit of a float32 master differently (tests/support/nvme_bits_child.py), which
    # moves
    # its bf16 copy only where the master sits on a bf16 rounding boundary (about one element
    # in 2**16), by one bf16 ulp: the loss (about 5.5) moves by the few such elements' gradient
    # times their ulp, orders below 1e-4; a variant that trains differently (another batch, a
    # stale group of the state) moves the loss of its later steps by far more.
    diff = float(out.split("largest difference from none ")[1].split()[0])
    assert diff < 1e-4
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(summary["variants"]) == ["none", "host", "nvme"]
    assert summary["variants"]["host"]["plan_host_bytes"] > 0
    assert summary["variants"]["none"]["plan_host_bytes"] == 0


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """``gpu_comm.py --smoke`` and ``comm.py --smoke --stages 3`` in one child process: a folder
    of each run's ``<name>.out``, ``.err`` and ``.json`` (``bench_smoke.py``), with the scripts'
    own ``.json`` summaries in its ``summaries`` folder (``$OUT``)."""
    out = tmp_path_factory.mktemp("gpu_smoke")
    (out / "summaries").mkdir()
    runs = [["gpu_comm", "gpu_comm", ["--smoke"]], ["comm", "comm", ["--smoke", "--stages", "3"]]]
    env = bench_smoke.smoke_env(OUT=str(out / "summaries"), JAX_PLATFORMS="cpu")
    bench_smoke.launch(runs, out, env, timeout=240)
    return out


def _ran(folder, name):
    """What the shared child's run ``name`` printed (it must have exited 0)."""
    return bench_smoke.result(folder, name)[0]


def test_gpu_comm_smoke_runs_on_cpu(shared):
    # exact and all: overlap, qwZ and qgZ together, which no library test runs at once.
    _ran(shared, "gpu_comm")
    summary = json.loads((shared / "summaries" / "gpu_comm.json").read_text())
    rows = {r["variant"]: r for r in summary["variants"]}
    assert list(rows) == ["exact", "all"] and all(r["status"] == "ok" for r in rows.values())
    exact, every = rows["exact"], rows["all"]
    assert exact["mfu"] is None  # a CPU has no known peak
    assert every["async_collectives"] == 0  # CPU collectives are synchronous
    # The gathers send int8 (half of bf16; a quarter of the f32 the CPU compiler widens bf16
    # to), and the reduce-scatters became int8 all-to-alls.
    gathered = [r["collectives"]["all-gather"]["bytes"] for r in (every, exact)]
    assert gathered[0] <= 0.6 * gathered[1]
    assert every["collectives"]["reduce-scatter"]["count"] == 0
    # "all" quantizes (int8 gathers and gradients): the smoke's 3 steps at lr 1e-4 barely move
    # the weights, so the losses differ by the int8 rounding of the forward's weights, half a
    # block scale each (0.4% of the block's largest) through the GPT's 4 matmul layers: 1%.
    assert every["losses"][-1] == pytest.approx(exact["losses"][-1], rel=0.01)


def test_comm_benchmark_smoke(shared):
    # --smoke at stage 3: exact and qwZ, 3 steps, a tiny GPT. Stage 2's qgZ row is config
    # alone here: its int8 all-to-alls are tests/comm/test_zeropp.py's
    # test_qgz_reduces_int8_at_a_quarter_of_the_bytes_and_trains_the_same.
    out = _ran(shared, "comm")
    assert "collective bytes per step" in out and "loss after" in out, out
    summary = json.loads((shared / "summaries" / "comm.json").read_text())
    rows = {(r["stage"], r["variant"]): r for r in summary["bytes"]}
    assert set(rows) == {(3, "exact"), (3, "qwZ")}
    base, qwz = rows[(3, "exact")], rows[(3, "qwZ")]
    assert set(qwz["all-gather"]) == {"s8"}
    assert qwz["all-gather"]["s8"] <= 0.3 * base["all-gather"]["f32"]
    last = {(r["stage"], r["variant"]): r["losses"][-1] for r in summary["losses"]}
    # The smoke's 3 steps at lr 1e-4 barely move the weights: the losses differ by the int8
    # rounding of the forward's weights alone, half of QUANT_REL's allowance (which counts the
    # 50 steps' updates too).
    for key, loss in last.items():
        assert loss == pytest.approx(last[(key[0], "exact")], rel=QUANT_REL / 2), key
