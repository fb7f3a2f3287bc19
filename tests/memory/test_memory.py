"""The memory planner: ZeRO's closed forms, the measured per-stage report, the CLI and its plot."""

import math
import sys

import jax
import numpy as np
import optax
import pytest
import toy
from cli_runs import run_cli

import jzero
from jzero import memory
from jzero.costs import ModelShape, ParallelDims
from jzero.demo import plan

TINY = {"vocab_size": 256, "seq_len": 16, "num_layers": 2, "num_heads": 2, "d_model": 32}
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 0, "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "model": {**TINY, "d_ff": 64},
}
# The tiny GPT's parameters, from its shapes: embeddings, 2 stacked blocks, final LayerNorm.
D, F, V, T, L = 32, 64, 256, 16, 2
PSI = V * D + T * D + L * (4 * D + 3 * D * D + 3 * D + D * D + D + D * F + F + F * D + D) + 2 * D
BATCH_SHARD = 2 * (T + 1) * 4  # micro batch 2 of seq_len + 1 int32 tokens per device
PNG = b"\x89PNG\r\n\x1a\n"


def read_png(path):
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert np.ptp(image[..., :3]) > 0  # something was drawn
    return image


# -- the closed-form estimate ------------------------------------------------------------------


@pytest.mark.parametrize("psi,n", [(7.5e9, 64), (1.5e9, 8), (1e8, 1024), (3e6, 1)])
def test_estimate_is_the_zero_paper_formulas(psi, n):
    e = memory.estimate(ModelShape(psi), ParallelDims(n), offload="none")
    expect = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}
    assert [(r.stage, r.offload) for r in e.rows] == [(s, "none") for s in range(4)]
    assert {r.stage: r.device_bytes for r in e.rows} == pytest.approx(expect, rel=1e-12)
    assert [r.comm_psi for r in e.rows] == [2, 2, 2, 3]


def test_estimate_gives_the_papers_7_5b_on_64_devices_figures():
    e = memory.estimate(ModelShape(7.5e9), ParallelDims(64))
    assert [round(e.row(s).device_bytes / 1e9, 1) for s in range(4)] == [120.0, 31.4, 16.6, 1.9]
    table = e.table()
    # The table in GiB: 120 GB = 111.76 GiB, 31.41 GB = 29.25 GiB, 16.64 GB = 15.50 GiB ...
    for cells in ("0  none", "111.76", "29.25", "15.50", "1.75", "2 Psi all-reduce"):
        assert cells in table
    assert e.recommendation is None  # no device memory given


def test_estimate_offload_and_host_memory_follow_deepspeeds_estimators():
    psi, n, per_node, ll, buffer = 7.5e9, 64, 8, 2e8, 1.5
    nodes = n // per_node
    e = memory.estimate(
        ModelShape(psi, largest_layer_params=ll), ParallelDims(n, devices_per_node=per_node)
    )
    got = {(r.stage, r.offload): (r.device_bytes, r.host_bytes) for r in e.rows}
    expected = {
        (0, "none"): (16 * psi, 4 * psi * per_node * buffer),
        (1, "none"): (4 * psi + 12 * psi / n, 4 * psi * per_node * buffer),
        (2, "none"): (2 * psi + 14 * psi / n, 4 * psi * per_node * buffer),
        (3, "none"): (16 * psi / n + 4 * ll, 4 * ll * per_node * buffer),
        (1, "optimizer"): (2 * psi, psi * max(4 * n, 16) * buffer),
        (2, "optimizer"): (2 * psi, psi * max(4 * n, 16) * buffer),
        (3, "optimizer"): (4 * ll + 2 * psi / n, 16 * psi / nodes * buffer),
        (3, "optimizer+params"): (4 * ll, 18 * psi / nodes * buffer),
        # The NVMe tier, last: device as with the optimizer offloaded, 4 buffers of one group
        # (Psi/N elements here, less than sub_group_size 1e9) of 12 bytes in host memory.
        (1, "nvme"): (2 * psi, 4 * psi / n * 12 * buffer * per_node),
        (2, "nvme"): (2 * psi, 4 * psi / n * 12 * buffer * per_node),
        (3, "nvme"): (4 * ll + 2 * psi / n, 4 * psi / n * 12 * buffer * per_node),
    }
    assert list(got) == list(expected)
    assert [r.disk for r in e.rows if r.offload == "nvme"] == [24 * psi / nodes] * 3
    flat = lambda d: [x for pair in d.values() for x in pair]
    assert flat(got) == pytest.approx(flat(expected), rel=1e-12)
    only_offload = memory.estimate(
        ModelShape(psi, largest_layer_params=ll),
        ParallelDims(n, devices_per_node=per_node),
        offload="cpu",
    )
    assert {r.offload for r in only_offload.rows} == {"optimizer", "optimizer+params", "nvme"}


def test_estimate_recommends_the_lowest_stage_that_fits_and_offload_only_if_needed():
    psi, n, ll = 7.5e9, 64, 1e8
    need = {
        (r.stage, r.offload): r.device_bytes
        for r in memory.estimate(ModelShape(psi), ParallelDims(n)).rows
    }

    def advice(mem):
        rec = memory.estimate(
            ModelShape(psi, largest_layer_params=ll), ParallelDims(n), device_memory=mem
        ).recommendation
        return rec.fits, rec.stage, rec.offload

    assert advice("80GB") == (True, 1, "none")  # 120 GB > 72 usable >= 31.4 GB
    stage2 = 2 * psi + 14 * psi / n
    assert advice(math.ceil(stage2 / 0.9) + 1) == (True, 2, "none")
    assert advice(math.floor(stage2 / 0.9) - 1) == (True, 3, "none")
    stage3 = 16 * psi / n + 4 * ll
    assert advice(math.floor(stage3 / 0.9) - 1) == (True, 3, "optimizer")
    assert need[(3, "none")] == pytest.approx(16 * psi / n)
    rec = memory.estimate(
        ModelShape(psi, largest_layer_params=ll), ParallelDims(n), device_memory="0.4GB"
    ).recommendation
    assert not rec.fits and (rec.stage, rec.offload) == (3, "optimizer+params")
    assert str(rec) == (
        "No stage fits: the smallest option, ZeRO stage 3 with optimizer+params offload to host "
        "memory, needs 0.37 GiB per device, 0.04 GiB more than the 0.34 GiB usable (90% of "
        "0.37 GiB). Use more devices, devices with more memory, or a smaller model or micro "
        "batch."
    )


@pytest.mark.parametrize(
    "text,expected",
    [("80GB", 80e9), ("80GiB", 80 * 2**30), ("8e10", 8e10), ("512 MiB", 2**29), ("1.5tb", 1.5e12)],
)
def test_sizes_are_read_in_decimal_and_binary_units(text, expected):
    assert memory.parse_size(text) == expected


@pytest.mark.parametrize("bad", ["80XB", "GB", "-5GB", "0", "", "eighty"])
def test_a_bad_size_is_a_clear_error(bad):
    with pytest.raises(ValueError) as e:
        memory.estimate(ModelShape(7.5e9), ParallelDims(64), device_memory=bad)
    assert str(e.value) == (
        f"device memory: {bad!r} is not a memory size. Write a positive number of bytes with an "
        "optional unit, one of B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers "
        "of 1024), e.g. 80GB, 80GiB or 8e10."
    )


def test_bad_estimate_arguments_are_clear_errors():
    with pytest.raises(ValueError) as e:
        memory.estimate(ModelShape("lots"), ParallelDims(64))
    assert str(e.value) == (
        "params: 'lots' is not allowed; it must be a positive number, e.g. 7.5e9."
    )
    with pytest.raises(ValueError) as e:
        memory.estimate(ModelShape(7.5e9), ParallelDims(12.5))
    assert str(e.value) == "devices: 12.5 is not allowed; it must be a positive integer, e.g. 64."
    with pytest.raises(ValueError) as e:
        memory.estimate(ModelShape(7.5e9), ParallelDims(12, devices_per_node=8))
    assert str(e.value) == (
        "devices_per_node: 8 does not divide devices=12, but the devices must fill whole nodes. "
        "Pass a devices_per_node that divides 12, e.g. 4."
    )
    # default: the largest divisor <= 8
    assert memory.estimate(ModelShape(7.5e9), ParallelDims(12)).devices_per_node == 4
    with pytest.raises(ValueError, match=r"^offload: 'nvme' is not allowed; it must be 'cpu'"):
        memory.estimate(ModelShape(7.5e9), ParallelDims(64), offload="nvme")
    with pytest.raises(
        ValueError, match=r"^margin: 1\.5 is not allowed; .* e\.g\. 0\.1 for 10%\.$"
    ):
        memory.estimate(ModelShape(7.5e9), ParallelDims(64), margin=1.5)


def test_estimate_cli_prints_the_table_and_writes_a_png(tmp_path, capsys):
    plot = tmp_path / "estimate.png"
    argv = ["estimate", "--params", "7.5e9", "--devices", "64", "--devices-per-node", "8"]
    rc = run_cli([*argv, "--device-memory", "80GB", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert rc == 0
    assert (
        memory.estimate(ModelShape(7.5e9), ParallelDims(64, devices_per_node=8), "80GB").table()
        in out
    )
    assert "Recommendation: ZeRO stage 1; it needs 29.25 GiB per device of 67.06 GiB usable" in out
    read_png(plot)
    with pytest.raises(ValueError, match=r"^device memory: '80 gigs' is not a memory size"):
        run_cli([*argv, "--device-memory", "80 gigs"])


def test_plotting_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError) as e:
        memory.estimate(ModelShape(7.5e9), ParallelDims(64)).plot(str(tmp_path / "x.png"))
    assert str(e.value) == (
        "Plotting needs matplotlib, which is not installed. Install it with "
        "`pip install jzero[plot]` (or `pip install matplotlib`), or leave out --plot."
    )


def test_plot_bars_stay_readable_and_say_what_fits(tmp_path):
    """A budget 26x the bars once drew them a few pixels long under a legend that hid the
    budget line: the bars keep their own scale, each says whether it fits and by how much."""
    mib = 2**20
    parts = ("params", "grads", "opt state", "activations and temporaries")

    def sizes(*mibs):
        return {k: m * mib for k, m in zip(parts, mibs, strict=True)}

    bars = [
        ("0\nnone\nno AC", sizes(3, 3, 6, 53), {}),
        ("3\noptimizer\n+AC", sizes(1, 1, 0, 16), {"opt state": mib}),
    ]
    for limit, verdicts in (
        (1.68 * 2**30, ["fits: 65.00 MiB of 1.68 GiB, 4%", "fits: 18.00 MiB of 1.68 GiB, 1%"]),
        (30 * mib, ["does not fit: 65.00 MiB, 35.00 MiB over 30.00 MiB", "fits: 18.00 MiB of"]),
    ):
        path = tmp_path / "bars.png"
        fig = memory.plot_bars(str(path), "t", bars, limit=limit, unit=("MiB", mib), recommended=1)
        read_png(path)
        ax = fig.axes[0]
        axis = ax.get_window_extent()
        ends = {}
        for patch in ax.patches:
            if patch.get_fill():
                box = patch.get_window_extent()
                ends[round(box.y0)] = max(ends.get(round(box.y0), 0), box.x1 - axis.x0)
        assert len(ends) == 2
        assert max(ends.values()) >= 0.4 * axis.width  # the longest bar spans the plot
        assert min(ends.values()) >= 0.1 * axis.width
        texts = [t.get_text() for t in ax.texts]
        assert texts[0] == verdicts[0] and texts[1].startswith("recommended: " + verdicts[1])
        assert texts[1].endswith("\nhost per device: 1.00 MiB")
        labels = [t.get_text() for t in ax.get_yticklabels()]
        assert labels == ["stage 0", "\u2605 stage 3, offload optimizer +AC"]
        assert fig.legends[0].get_window_extent().y1 <= axis.y0  # below the bars, outside
        assert any(line.get_linestyle() == "--" for line in ax.lines) == (limit < 3 * 65 * mib)


# -- the measured report -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def report():
    """Every stage of the tiny GPT, compiled once each on the 8 CPU devices (without the
    activation-checkpointing comparison: tests/memory/test_memory_activations.py has it)."""
    return plan.plan_report(CONFIG, compare_checkpointing=False)


def test_plan_model_state_is_what_the_compiled_step_takes_as_arguments(report):
    assert report.devices == report.measured_devices == 8
    extras = set()
    for stage in range(4):
        r = report.row(stage)
        assert set(r.device) == {"params", "grads", "opt_state"}
        # Arguments: params + optimizer state + this device's batch rows + scalar step state.
        extra = r.argument_bytes - r.device["params"] - r.device["opt_state"] - BATCH_SHARD
        extras.add(extra)
        assert r.other_argument_bytes == BATCH_SHARD + extra  # the batch is not model state
        # The step's temporaries hold at least one full local gradient; the peak holds the
        # resident state, the batch rows and that gradient at once.
        assert r.temp_bytes >= r.device["grads"]
        assert r.peak >= r.resident_bytes + BATCH_SHARD + r.device["grads"]
    (extra,) = extras  # the same few scalars at every stage
    assert 4 <= extra <= 64


def test_plan_shards_what_each_stage_promises(report):
    full = 4 * PSI  # fp32; every leaf of the tiny GPT splits 8 ways
    params = [report.row(s).device["params"] for s in range(4)]
    grads = [report.row(s).device["grads"] for s in range(4)]
    opt = [report.row(s).device["opt_state"] for s in range(4)]
    assert params == [full, full, full, full // 8]
    assert grads == [full, full, full // 8, full // 8]
    scalars = opt[0] - 2 * full  # Adam's moments are 2 x params; the rest is replicated scalars
    assert opt[1:] == [2 * full // 8 + scalars] * 3
    # Stage 3 gathers the token embedding whole; a stacked block leaf only one layer at a time.
    assert report.row(3).gathered_layer == V * D * 4
    assert report.row(3).gathered_leaf == "embed.tokens"
    assert [report.row(s).gathered_layer for s in range(3)] == [0, 0, 0]
    peaks = [report.row(s).peak for s in range(4)]
    assert peaks[0] > peaks[1] >= peaks[2] > peaks[3]


def test_recommendation_moves_up_a_stage_at_the_thresholds_the_table_predicts(report):
    peaks = {s: report.row(s).peak for s in range(4)}

    def lowest_fitting(mem):
        return next((s for s in range(4) if peaks[s] <= 0.9 * mem), None)

    seen = []
    for stage in range(4):
        for mem in (math.ceil(peaks[stage] / 0.9) + 1, math.floor(peaks[stage] / 0.9) - 1):
            rec = report.with_device_memory(mem).recommendation
            expected = lowest_fitting(mem)
            if expected is None:
                assert not rec.fits and rec.stage == 3
            else:
                assert (rec.fits, rec.stage, rec.offload) == (True, expected, "none")
            seen.append(rec.stage)
    assert seen[:2] == [0, 1]  # just above stage 0's peak: stage 0; just below: stage 1
    tiny = report.with_device_memory(math.floor(peaks[3] / 0.9) - 1)
    text = str(tiny.recommendation)
    assert text.startswith("No stage fits: the smallest option, ZeRO stage 3, needs ")
    assert tiny.table().endswith(text)
    assert tiny.table().splitlines()[7].split()[-1] == "no"  # stage 3 does not fit


def test_plan_table_names_every_column_and_where_it_was_measured(report):
    table = report.with_device_memory("1MB").table()
    header = table.splitlines()[2].split()
    assert header[:2] == ["stage", "offload"] and header[-1] == "fits"
    for column in ("params", "grads", "opt", "host", "gathered", "args", "temp", "peak"):
        assert column in header
    assert "measured on the local 8 devices" in table
    assert f"{PSI:,} parameters, 8 devices" in table


def test_plan_errors_are_clear():
    with pytest.raises(ValueError) as e:
        plan.plan_report(
            {**CONFIG, "train_micro_batch_size_per_gpu": None, "train_batch_size": 32}, devices=6
        )
    assert "train_batch_size=32" in str(e.value) and "data-parallel size of 6" in str(e.value)
    assert "32 is not divisible by 1 x 6 = 6" in str(e.value)
    with pytest.raises(ValueError) as e:
        plan.plan_report(CONFIG, devices="0")
    assert str(e.value) == "devices: '0' is not allowed; it must be a positive integer, e.g. 8."
    with pytest.raises(ValueError, match=r"^zero_optimization\.stage: 5 is not a ZeRO stage"):
        plan.plan_report(CONFIG, stages=(5,))


def test_plan_cli_prints_the_table_and_writes_a_png(report, tmp_path, capsys, monkeypatch):
    config = tmp_path / "tiny.json"
    config.write_text(__import__("json").dumps(CONFIG))
    calls = []

    def fake_plan_report(config, devices=None, device_memory=None, *, overrides=(), margin=0.1):
        calls.append((str(config), devices, device_memory, tuple(overrides), margin))
        return report.with_device_memory(device_memory)  # the compiled fixture, no recompiling

    monkeypatch.setattr(plan, "plan_report", fake_plan_report)
    plot = tmp_path / "plan.png"
    mem = str(math.floor(report.row(0).peak / 0.9) - 1)
    argv = ["plan", str(config), "--device-memory", mem, "--set", "seed=1", "--plot", str(plot)]
    assert run_cli(argv) == 0
    assert calls == [(str(config), None, mem, ("seed=1",), 0.1)]
    out = capsys.readouterr().out
    assert report.with_device_memory(mem).table() in out
    assert "Recommendation: ZeRO stage 1;" in out
    read_png(plot)


def test_memory_report_of_an_engine():
    engine = jzero.initialize(
        toy.make_params(num_layers=4, d=64),
        toy.loss_fn,
        optax.adamw(1e-3),
        {
            "train_batch_size": 32,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        },
    )
    plan_only = memory.memory_report(engine)
    (row,) = plan_only.rows
    assert not row.measured and plan_only.measured_devices is None
    # blocks.w (4, 64, 64) is sharded on a layer's dim: one 64x64 layer is gathered, not 4.
    assert (row.gathered_layer, row.gathered_leaf) == (64 * 64 * 4, "blocks.w")
    batch = toy.make_batches(1, 32)[0]
    measured = memory.memory_report(engine, batch, device_memory="1GB")
    (row,) = measured.rows
    assert row.temp_bytes >= row.gathered_layer  # a gathered layer is a temporary
    # The report's peak is the compiler's: arguments + temporaries + outputs - aliased.
    mem = engine.lower(batch).compile().memory_analysis()
    compiled_peak = mem.argument_size_in_bytes + mem.temp_size_in_bytes
    compiled_peak += mem.output_size_in_bytes - mem.alias_size_in_bytes
    assert row.peak == compiled_peak
    assert measured.recommendation.fits and measured.recommendation.stage == 3
    # More devices than the machine has: the model state is planned on an abstract mesh.
    wide = memory.memory_report(engine, devices=64)
    (row64,) = wide.rows
    assert wide.devices == 64
    small = 4 * (5 + 5 * 3)  # head.b (5,) and odd (5, 3): nothing of them divides by 64
    sharded = 4 * sum(x.size for x in jax.tree.leaves(toy.make_params(num_layers=4, d=64))) - small
    one_row = 4 * (1 + 3)  # they rest padded to 64 rows, one row a device
    assert row64.device["params"] == sharded // 64 + one_row
    assert row64.device["grads"] == sharded // 64 + one_row
    assert "the plan on 64 devices" in wide.table()


def test_plan_for_more_devices_than_the_machine_has(report):
    # 16 devices on an 8-device machine: the model state is planned on an abstract mesh, the
    # compiled part is measured locally (and said to be). Without the activation-checkpointing
    # comparison: the fixture's stage 3 step, not one more (test_memory_activations.py has it).
    wide = plan.plan_report(CONFIG, devices=16, stages=(3,), compare_checkpointing=False)
    assert wide.devices == 16 and wide.measured_devices == 8
    full = 4 * PSI  # every leaf of the tiny GPT splits 16 ways too
    row = wide.row(3)
    assert row.device["params"] == row.device["grads"] == full // 16
    scalars = report.row(0).device["opt_state"] - 2 * full
    assert row.device["opt_state"] == 2 * full // 16 + scalars
    assert "the plan on 16 devices" in wide.table()
    assert "measured on the local 8 devices" in wide.table()
