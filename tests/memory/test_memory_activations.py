"""The memory planner counts activations: the estimate's activation term (Korthikanti et al.
2022), the measured report with and without activation checkpointing, and the recommendation
that weighs the stage, then activation checkpointing, then offload."""

import argparse
import json
import math
import re

import pytest

from jzero import memory
from jzero.cli import memory as cli_memory
from jzero.costs import Dtypes, ModelShape, ParallelDims
from jzero.demo import plan

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 0, "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "model": {
        "vocab_size": 256,
        "seq_len": 16,
        "num_layers": 2,
        "num_heads": 2,
        "d_model": 32,
        "d_ff": 64,
    },
}
# The section without a policy means policy full (DeepSpeed's checkpointing).
CHECKPOINTED = {**CONFIG, "activation_checkpointing": {}}
SHAPE = {"seq_len": 2048, "micro_batch": 4, "hidden": 4096, "layers": 40, "heads": 32}
MODEL = ModelShape(7.5e9, seq_len=2048, hidden=4096, layers=40, heads=32)  # SHAPE's model


def run_cli(argv):
    parser = argparse.ArgumentParser(prog="jzero")
    cli_memory.add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def korthikanti(s, b, h, n, a, bytes_per_element=2):
    """Activation bytes per device, (without, with full recomputation), from the paper's terms:
    per layer 34 s b h + 5 a s^2 b in 16-bit, of which 2 s b h + a s^2 b are 1-byte dropout
    masks; full recomputation keeps 2 s b h per layer (16-bit) plus one layer rebuilt."""
    scale = bytes_per_element / 2
    values16 = 32 * s * b * h + 4 * a * s * s * b
    masks = 2 * s * b * h + a * s * s * b
    layer = scale * values16 + masks
    return n * layer, n * scale * 2 * s * b * h + layer


# -- the closed-form estimate ------------------------------------------------------------------


def test_estimate_activation_term_is_the_papers_formula():
    s, b, h, n, a = SHAPE.values()
    e = memory.estimate(MODEL, ParallelDims(64, micro_batch=4))
    per_layer = s * b * h * (34 + 5 * a * s / h)  # the paper's 16-bit form
    assert korthikanti(s, b, h, n, a)[0] == pytest.approx(n * per_layer, rel=1e-12)
    without, with_ac = korthikanti(s, b, h, n, a)
    assert with_ac == pytest.approx(2 * s * b * h * n + per_layer, rel=1e-12)
    assert e.counts_activations and len(e.rows) == 11  # 8 options and the NVMe tier's 3
    for r in e.rows:  # ZeRO does not shard activations: every option carries the same term
        assert r.activations == pytest.approx(without, rel=1e-12)
        assert r.activations_checkpointed == pytest.approx(with_ac, rel=1e-12)
        assert r.total_bytes(False) == pytest.approx(r.device_bytes + without, rel=1e-12)
        assert r.total_bytes(True) == pytest.approx(r.device_bytes + with_ac, rel=1e-12)
    assert without == 153_008_209_920 and with_ac == 6_509_559_808  # 153.01 / 6.51 GB
    fp32 = memory.estimate(
        MODEL, ParallelDims(64, micro_batch=4), dtypes=Dtypes(activations="fp32")
    ).row(0)
    f_without, f_with = korthikanti(s, b, h, n, a, 4)
    assert fp32.activations == pytest.approx(f_without, rel=1e-12)
    assert fp32.activations_checkpointed == pytest.approx(f_with, rel=1e-12)
    # Per layer 66 s b h + 9 a s^2 b: the 16-bit part doubled, the masks still 1 byte.
    assert f_without == pytest.approx(n * (66 * s * b * h + 9 * a * s * s * b), rel=1e-12)
    plain = memory.estimate(ModelShape(7.5e9), ParallelDims(64))  # no shape, no activation term
    assert not plain.counts_activations and plain.row(0).total_bytes(True) == 120e9


def test_estimate_recommends_activation_checkpointing_only_when_no_stage_fits_without():
    def advice(mem, micro_batch):
        e = memory.estimate(MODEL, ParallelDims(64, micro_batch=micro_batch), mem)
        rec = e.recommendation
        return rec.fits, rec.stage, rec.offload, rec.activation_checkpointing, rec.lever, e

    # 80 GB, micro batch 4: 153 GB of activations leave every stage short without checkpointing;
    # with it stage 1 needs 31.41 + 6.51 = 37.92 GB (35.31 GiB) of the 72 usable (67.06 GiB).
    fits, stage, offload, ac, lever, e = advice("80GB", 4)
    assert (fits, stage, offload, ac, lever) == (True, 1, "none", True, "activation checkpointing")
    text = str(e.recommendation)
    assert text.startswith(
        "Recommendation: ZeRO stage 1 with activation checkpointing (policy full); it needs "
        "35.31 GiB per device of 67.06 GiB usable (90% of 74.51 GiB)."
    )
    short3 = e.row(3).total_bytes(False) - 72e9
    assert (
        "without activation checkpointing: stage 0 by 187.20 GiB, stage 1 by 104.69 GiB, " in text
    )
    assert (
        f"stage 3 by {short3 / 2**30:.2f} GiB; with activation checkpointing: stage 0 by 50.77 GiB"
        in text
    )
    assert e.table().endswith(text)
    fits_column = [re.split(r"\s{2,}", line.strip())[-2] for line in e.table().splitlines()[3:7]]
    assert fits_column == ["no", "AC", "AC", "AC"]
    # Micro batch 1 (38.25 GB of activations) on 80 GB: stage 1 fits without checkpointing
    # (69.66 GB), so it is stage 1 without, although stage 1 with it would fit too.
    fits, stage, offload, ac, lever, e = advice("80GB", 1)
    assert (fits, stage, offload, ac, lever) == (True, 1, "none", False, "stage")
    assert (
        e.row(1).total_bytes(True)
        < e.row(1).total_bytes(False)
        <= 72e9
        < e.row(0).total_bytes(False)
    )
    assert "Recommendation: ZeRO stage 1; it needs 64.87 GiB per device" in str(e.recommendation)
    # Too small for any stage even with checkpointing: offload is the last lever.
    fits, stage, offload, ac, lever, _ = advice("8GB", 4)
    assert (fits, stage, offload, ac, lever) == (True, 3, "optimizer", True, "offload")


def test_estimate_cli_shows_totals_with_and_without_checkpointing(capsys):
    argv = ["estimate", "--params", "7.5e9", "--devices", "64", "--device-memory", "80GB"]
    shape = ["--seq-len", "2048", "--micro-batch", "4", "--hidden", "4096", "--layers", "40"]
    paper = ["--attention", "plain", "--dropout", "on", "--largest-layer-params", "0"]
    assert run_cli([*argv, *shape, "--heads", "32", *paper]) == 0
    out = capsys.readouterr().out
    assert memory.estimate(MODEL, ParallelDims(64, micro_batch=4), "80GB").table() in out
    header = out.splitlines()[1]
    for column in ("act GiB", "act AC GiB", "total GiB", "total AC GiB"):
        assert column in header
    assert "Korthikanti et al. 2022" in out
    assert "Recommendation: ZeRO stage 1 with activation checkpointing (policy full)" in out
    with pytest.raises(ValueError) as e:
        run_cli([*argv, *shape])
    assert "heads is missing; pass all of seq_len, micro_batch, hidden, layers, heads" in str(
        e.value
    )
    parser = argparse.ArgumentParser(prog="jzero")
    cli_memory.add_commands(parser.add_subparsers(dest="command"))
    help_text = parser._subparsers._group_actions[0].choices["estimate"].format_help()
    assert "s*b*h*(34 + 5*a*s/h)" in help_text and "16-bit" in help_text
    assert "66*s*b*h + 9*a*s^2*b" in help_text  # how fp32 is counted


# -- the measured report -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def both():
    """Stages 0 and 1 of the tiny GPT, each compiled without and with activation checkpointing
    (no device memory: both are measured); 4 compilations."""
    return plan.plan_report(CONFIG, stages=(0, 1))


def table_unit(table):
    """The bytes of the unit the table's sizes are in, from its "Per-device memory (KiB)" line."""
    name = table.splitlines()[1].split("(")[1].rstrip(")")
    return {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[name]


def peaks(report):
    return {(r.stage, ac): r.peak_with(ac) for r in report.rows for ac in (False, True)}


def test_plan_measures_activations_with_and_without_checkpointing(both):
    for r in both.rows:
        assert (r.checkpointing, r.other_checkpointing) == ("none", "full")
        assert r.temp_with(False) == r.temp_bytes and r.temp_with(True) == r.other_temp_bytes
        # Checkpointing each layer keeps less for the backward pass; nothing else changes.
        assert r.temp_with(True) < r.temp_with(False)
        assert r.peak_with(True) - r.temp_with(True) == r.peak_with(False) - r.temp_with(False)
    lines = both.table().splitlines()
    assert lines[2].split()[-4:] == ["temp", "AC", "peak", "AC"]
    unit = table_unit(both.table())
    for line, r in zip(lines[4:6], both.rows, strict=True):
        cells = line.split()
        expect = [r.temp_with(False), r.peak_with(False), r.temp_with(True), r.peak_with(True)]
        assert cells[-4:] == [f"{v / unit:.2f}" for v in expect]
    assert "temp AC, peak AC: policy full" in both.table()


def test_no_stage_fits_without_checkpointing_but_one_does_with_it(both):
    p = peaks(both)
    # The tiny case: stage 0 with checkpointing needs less than stage 1 without.
    assert p[1, True] < p[0, True] < p[1, False] < p[0, False]
    usable = p[1, False] - 1  # no stage fits without activation checkpointing
    report = both.with_device_memory(math.ceil(usable / 0.9))
    rec = report.recommendation
    assert rec.usable >= p[0, True] and rec.usable < p[1, False]
    assert (rec.fits, rec.stage, rec.offload, rec.checkpointing) == (True, 0, "none", "full")
    assert rec.lever == "activation checkpointing"
    text = str(rec)
    assert text.startswith(
        "Recommendation: ZeRO stage 0 with activation checkpointing (policy full); it needs "
    )
    assert "no stage fits without it, stage 0 is the lowest that fits with it" in text
    short = [(s, o, c, round(b)) for s, o, c, b in rec.short]
    assert short == [
        (0, "none", "none", round(p[0, False] - rec.usable)),
        (1, "none", "none", round(p[1, False] - rec.usable)),
    ]
    assert "Short of the " in text and "without activation checkpointing: stage 0 by " in text
    assert report.table().endswith(text)
    assert [line.split()[-1] for line in report.table().splitlines()[4:6]] == ["AC", "AC"]
    # Less memory: only stage 1 with checkpointing fits.
    rec = both.with_device_memory(math.ceil((p[0, True] - 1) / 0.9)).recommendation
    assert (rec.fits, rec.stage, rec.checkpointing) == (True, 1, "full")


def test_a_stage_that_fits_without_checkpointing_wins_over_checkpointing(both):
    p = peaks(both)
    usable = p[1, False]  # stage 1 fits without; stage 0 only with checkpointing
    rec = both.with_device_memory(math.ceil(usable / 0.9)).recommendation
    assert p[0, True] <= rec.usable < p[0, False]
    assert (rec.fits, rec.stage, rec.offload, rec.checkpointing) == (True, 1, "none", "none")
    assert rec.lever == "stage" and not rec.activation_checkpointing
    assert str(rec).startswith("Recommendation: ZeRO stage 1; it needs ")
    assert "Lever: the ZeRO stage; stage 1 is the lowest that fits without activation" in str(rec)


def test_plan_cli_measures_checkpointing_only_where_it_can_change_the_advice(
    both, tmp_path, capsys, monkeypatch
):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(CONFIG))
    real, reports = plan.plan_report, []

    def two_stages(*args, **kwargs):  # the real measurement, of stages 0 and 1 only
        reports.append(real(*args, stages=(0, 1), **kwargs))
        return reports[-1]

    monkeypatch.setattr(plan, "plan_report", two_stages)
    p = peaks(both)
    mem = str(math.ceil(p[1, False] / 0.9))  # stage 1 fits without; stage 0 does not
    assert run_cli(["plan", str(config), "--device-memory", mem]) == 0
    out = capsys.readouterr().out
    (report,) = reports
    assert out.startswith(report.table())
    # Stage 0 does not fit without checkpointing: measured with it too (the same bytes as the
    # fixture's compilation); stage 1 fits: not compiled again.
    assert report.row(0).temp_with(True) == both.row(0).temp_with(True)
    assert report.row(0).temp_with(False) == both.row(0).temp_with(False)
    assert report.row(1).temp_with(False) == both.row(1).temp_with(False)
    assert report.row(1).other_temp_bytes is None and report.row(1).peak_with(True) is None
    lines = out.splitlines()
    assert "temp AC" in lines[2] and "peak AC" in lines[2]
    stage0, stage1 = lines[4].split(), lines[5].split()
    unit = table_unit(out)
    assert stage0[-5:] == [
        f"{both.row(0).temp_with(False) / unit:.2f}",
        f"{both.row(0).peak_with(False) / unit:.2f}",
        f"{both.row(0).temp_with(True) / unit:.2f}",
        f"{both.row(0).peak_with(True) / unit:.2f}",
        "AC",
    ]
    assert stage1[-3:] == ["-", "-", "yes"]
    assert "Recommendation: ZeRO stage 1; it needs " in out
    # --compare-ac never/always reach the library; auto (the default) is its default.
    calls = []
    monkeypatch.setattr(plan, "plan_report", lambda *a, **k: calls.append(k) or both)
    for flag in ("never", "always"):
        run_cli(["plan", str(config), "--compare-ac", flag])
    assert [c.get("compare_checkpointing") for c in calls] == [False, True]
    capsys.readouterr()


def test_plan_of_a_config_that_checkpoints_compares_without(both):
    p = peaks(both)
    # Stage 1 fits with checkpointing (the config's) but not without: the step without it is
    # measured as well, to know that it does not fit.
    report = plan.plan_report(CHECKPOINTED, device_memory=math.ceil(p[1, True] / 0.9), stages=(1,))
    (row,) = report.rows
    assert (row.checkpointing, row.other_checkpointing) == ("full", "none")
    assert row.temp_bytes == both.row(1).temp_with(True)
    assert row.other_temp_bytes == both.row(1).temp_with(False)
    assert row.temp_with(False) == both.row(1).temp_with(False)
    header = report.table().splitlines()[2]
    assert "temp no AC" in header and "peak no AC" in header
    assert "temp, peak: activation_checkpointing policy full (the config's)" in report.table()
    rec = report.recommendation
    assert (rec.fits, rec.stage, rec.checkpointing) == (True, 1, "full")
