"""Long sequences in the cost model: a transformer's activations with each long-context technique
(blockwise attention, tiled loss and MLP, activation offload, the seq and context splits), and the
longest sequence that fits; pure formulas, nothing compiles."""

import argparse
import dataclasses

import pytest

from jzero import costs, memory
from jzero.cli import memory as cli_memory
from jzero.costs import PAPER, ModelShape, ParallelDims, Techniques

S, B, H, L, A, V = 8192, 2, 1024, 8, 16, 50000
MODEL = ModelShape(1e9, seq_len=S, hidden=H, layers=L, heads=A)
LAYOUT = ParallelDims(8, micro_batch=B)
PLAIN = Techniques()  # plain attention, no dropout, nothing tiled
BLOCKWISE = Techniques("blockwise")


def act(techniques=PLAIN, s=S, vocab=None, layout=LAYOUT, checkpointing="none", **kw):
    model = dataclasses.replace(MODEL, seq_len=s, vocab=vocab, techniques=techniques)
    return costs.activation_bytes(model, layout, checkpointing=checkpointing, **kw)


def quadratic(f, s):
    """(a1, a2) of f(s) = a1 s + a2 s^2, from f at s and 2s."""
    a2 = (f(2 * s) - 2 * f(s)) / (2 * s * s)
    return (f(s) - a2 * s * s) / s, a2


# -- the formulas ------------------------------------------------------------------------------


def test_the_papers_case_is_transformer_activations():
    for t, sp in ((1, 1), (2, 1), (1, 4), (2, 2)):
        layout = ParallelDims(8, micro_batch=B, model=t, seq=sp)
        for dtype in ("bf16", "fp32"):
            old = costs.transformer_activations(S, B, H, L, A, dtype, t, sp)
            new = (
                act(PAPER, layout=layout, dtype=dtype).device,
                act(PAPER, layout=layout, dtype=dtype, checkpointing="full").device,
            )
            assert new == pytest.approx(old, rel=1e-12)
    # The paper's 16-bit figure: per layer s b h (34 + 5 a s / h).
    assert act(PAPER).device == pytest.approx(L * S * B * H * (34 + 5 * A * S / H), rel=1e-12)


def test_plain_attention_keeps_the_scores_blockwise_none():
    # Plain, no dropout: a2 = L e a b / (t S), the softmax's [s, s] output a head in 16-bit.
    for t, sp in ((1, 1), (2, 4)):
        layout = ParallelDims(8, micro_batch=B, model=t, seq=sp)
        a1, a2 = quadratic(lambda s, lay=layout: act(PLAIN, s, layout=lay).device, S)
        assert a2 == pytest.approx(L * 2 * A * B / (t * sp), rel=1e-9)
        # The linear part: 4 e x whole + 12 e x / t split, x = s b h / S.
        assert a1 == pytest.approx(L * 2 * B * H * (4 + 12 / t) / sp, rel=1e-9)
    # With dropout the scores add a 1-byte mask and the dropped-out probabilities: (2e + 1).
    _, a2 = quadratic(lambda s: act(Techniques(dropout=True), s).device, S)
    assert a2 == pytest.approx(L * 5 * A * B, rel=1e-9)
    # Blockwise: no s^2 term at all, with or without dropout or checkpointing: doubling s
    # doubles every byte.
    for tech in (BLOCKWISE, Techniques("blockwise", dropout=True)):
        for ckpt in ("none", "full"):
            one, two = act(tech, S, checkpointing=ckpt), act(tech, 2 * S, checkpointing=ckpt)
            assert two.device == pytest.approx(2 * one.device, rel=1e-12)
    # What blockwise keeps beyond the linear terms: a float32 log-sum-exp a head and token.
    x = S * B * H
    assert act(BLOCKWISE).device == pytest.approx(L * (2 * 16 * x + 4 * A * S * B), rel=1e-12)
    plain, blockwise = act(PLAIN).device, act(BLOCKWISE).device
    assert plain - blockwise == pytest.approx(L * (2 * A * S * S * B - 4 * A * S * B), rel=1e-12)
    # Dropout without attention dropout's [s, s] mask: the two 1-byte s b h masks.
    with_dropout = act(Techniques("blockwise", dropout=True)).device
    assert with_dropout - blockwise == pytest.approx(L * 2 * x, rel=1e-12)


def test_the_loss_keeps_the_logits_unless_tiled():
    whole = act(BLOCKWISE, vocab=V)
    assert whole.loss == 4 * S * B * V  # float32 logits [s, V] of b rows
    assert whole.device == pytest.approx(act(BLOCKWISE).device + 4 * S * B * V, rel=1e-12)
    assert act(BLOCKWISE, 2 * S, vocab=V).loss == 2 * whole.loss  # the s V term
    tiled = Techniques("blockwise", loss_chunk=1024)
    assert act(tiled, vocab=V).loss == 4 * 1024 * B * V  # one chunk, whatever s
    assert act(tiled, 2 * S, vocab=V).loss == act(tiled, vocab=V).loss
    assert act(tiled, 512, vocab=V).loss == 4 * 512 * B * V  # a sequence shorter than a chunk
    # Over the model axis (a vocabulary-parallel head) and the sequence splits.
    split = ParallelDims(16, micro_batch=B, model=2, seq=2, context=2)
    assert act(BLOCKWISE, vocab=V, layout=split).loss == 4 * S / 4 * B * V / 2
    # The loss is outside the checkpointed layers: the same with checkpointing.
    assert act(BLOCKWISE, vocab=V, checkpointing="full").loss == whole.loss
    assert act(BLOCKWISE).loss == 0  # no vocabulary: not counted


def test_the_tiled_mlp_keeps_one_chunk_of_the_intermediate():
    x = S * B * H
    whole = act(BLOCKWISE).device
    tiled = act(Techniques("blockwise", mlp_chunk=1024))
    # Each layer's [s, 4h] intermediate before and after the activation, 8 e x, leaves; one
    # chunk's is live while it is recomputed.
    assert whole - tiled.layers == pytest.approx(L * 16 * x, rel=1e-12)
    assert tiled.loss == 16 * 1024 * B * H


def test_checkpointing_and_activation_offload():
    x = S * B * H
    per_layer = act(BLOCKWISE).device / L
    full = act(BLOCKWISE, checkpointing="full")
    assert full.device == pytest.approx(L * 2 * x + per_layer, rel=1e-12) and full.host == 0
    off = act(Techniques("blockwise", offload=True), checkpointing="full")
    # The layer inputs in host memory; the device keeps the one in flight and one layer rebuilt.
    assert off.host == L * 2 * x
    assert off.device == pytest.approx(2 * x + per_layer, rel=1e-12)
    with pytest.raises(ValueError, match="checkpointing is 'none', which saves none"):
        act(Techniques("blockwise", offload=True))
    with pytest.raises(ValueError, match="checkpointing: 'some' is not allowed"):
        act(checkpointing="some")
    # A pipeline stage: L/P layers, in_flight micro-batches of them, one layer rebuilt.
    piped = ParallelDims(8, micro_batch=B, pipe=2)
    one = act(BLOCKWISE, layout=piped, checkpointing="full", in_flight=3)
    assert one.device == pytest.approx(L / 2 * 2 * x * 3 + per_layer, rel=1e-12)
    assert act(BLOCKWISE, layout=piped, in_flight=3).device == pytest.approx(
        L / 2 * per_layer * 3, rel=1e-12
    )


def test_ring_attention_divides_every_term_by_c():
    for tech in (BLOCKWISE, Techniques("blockwise", dropout=True)):
        ring = ParallelDims(8, micro_batch=B, context=4)
        base = act(tech, vocab=V, checkpointing="full")
        split = act(tech, vocab=V, layout=ring, checkpointing="full")
        assert split.device == pytest.approx(base.device / 4, rel=1e-12)
    # The ring computes by blocks: plain attention keeps no scores there.
    ring = ParallelDims(8, micro_batch=B, context=4)
    assert act(PLAIN, layout=ring).device == act(BLOCKWISE, layout=ring).device
    # Ulysses also divides by S, but keeps plain attention's scores (a/S heads of all s).
    uly = ParallelDims(8, micro_batch=B, seq=4)
    assert act(PLAIN, layout=uly).device == pytest.approx(act(PLAIN).device / 4, rel=1e-12)
    assert costs.sequence_step(uly) == 4
    assert costs.sequence_step(ParallelDims(16, seq=2, context=4)) == 16  # zig-zag: 2C chunks
    assert ParallelDims(16, seq=2, context=4).data == 2 and "context 4" in (
        ParallelDims(16, seq=2, context=4).name
    )


def test_longest_sequence_is_the_last_step_that_fits():
    def need(s):
        return 3.0 * s * s + 7 * s

    for budget, step in ((1e6, 1), (1e6, 16), (5e9, 24), (10.0, 1)):
        s = costs.longest_sequence(need, budget, step)
        assert s % step == 0 and need(s) <= budget < need(s + step)
    assert costs.longest_sequence(need, 1.0) == 0  # not even one step
    assert costs.longest_sequence(lambda s: 0.0, 1.0, 8, limit=100) == 96  # the limit


# -- the estimate and its table ----------------------------------------------------------------

SHAPE = ModelShape(
    7e9, seq_len=32768, hidden=4096, layers=32, heads=32, vocab=32000, techniques=Techniques()
)


def test_the_estimate_counts_the_models_techniques():
    layout = ParallelDims(64, micro_batch=1, context=4)
    for tech in (PLAIN, Techniques("blockwise", loss_chunk=512, offload=True)):
        model = dataclasses.replace(SHAPE, techniques=tech)
        row = memory.estimate(model, layout).row(3)
        no_offload = dataclasses.replace(model, techniques=dataclasses.replace(tech, offload=False))
        full = costs.activation_bytes(model, layout, checkpointing="full")
        assert row.activations == costs.activation_bytes(no_offload, layout).device
        assert (row.activations_checkpointed, row.activations_host) == (full.device, full.host)
    # The paper's accounting stays the default: no vocabulary, dropout, plain attention.
    assert ModelShape(1e9).techniques == PAPER
    with pytest.raises(ValueError, match="devices=64 can't be split .* context_parallel=3"):
        memory.estimate(SHAPE, ParallelDims(64, micro_batch=1, context=3))
    with pytest.raises(ValueError, match="loss_chunk: -1 is not allowed"):
        memory.estimate(dataclasses.replace(SHAPE, techniques=Techniques(loss_chunk=-1)), LAYOUT)
    bad = dataclasses.replace(SHAPE, techniques=Techniques("flash"))
    with pytest.raises(ValueError, match="attention: 'flash' is not allowed; .* plain, blockwise"):
        memory.estimate(bad, LAYOUT)


def test_the_sequence_report_adds_one_technique_a_row_and_finds_the_longest():
    layout = ParallelDims(64, micro_batch=1, seq=2, context=4)
    e = memory.estimate(SHAPE, layout, "80GB")
    report = e.sequence_report()
    assert [r.label for r in report.rows] == [
        "plain attention",
        "+ blockwise attention",
        "+ tiled loss (1024) and MLP (1024)",
        "+ ring attention over C = 4",
        "+ activation offload",
    ]
    acts = [r.activations_checkpointed for r in report.rows]
    assert acts == sorted(acts, reverse=True)  # each technique takes bytes out
    assert report.rows[-1].activations is None and report.rows[-1].host > 0
    assert report.states == e.row(3).device_bytes and report.usable == 72e9
    for r in report.rows:
        step = costs.sequence_step(r.layout)
        for ckpt, s in (("none", r.longest), ("full", r.longest_checkpointed)):
            if s is None:
                continue

            def total(n, r=r, ckpt=ckpt):
                model = dataclasses.replace(r.model, seq_len=n)
                need = costs.activation_bytes(model, r.layout, checkpointing=ckpt).device
                return report.states + need

            assert s > 0 and s % step == 0 and total(s) <= 72e9 < total(s + step)
    assert report.row("+ ring").layout.context == 4 and report.row("plain").layout.context == 1
    # The longer the sequence the blockwise row takes than the plain: its bytes grow as s.
    assert report.rows[1].longest > 3 * report.rows[0].longest
    text = report.table()
    assert "longest s AC" in text.splitlines()[1] and "ZeRO stage 3 without offload" in text
    # Stage 1's states leave less room; without a ring no ring row.
    one = memory.estimate(SHAPE, ParallelDims(64, micro_batch=1), "80GB").sequence_report(1)
    assert one.states == e.row(1).device_bytes and len(one.rows) == 4
    assert "longest" not in memory.estimate(SHAPE, layout).sequence_report().table()
    with pytest.raises(ValueError, match="needs the transformer's shape"):
        memory.estimate(ModelShape(1e9), ParallelDims(64, context=4)).sequence_report()


def run_cli(argv):
    parser = argparse.ArgumentParser(prog="jzero")
    cli_memory.add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_estimate_cli_prints_the_long_sequence_table(capsys):
    argv = ["estimate", "--params", "7e9", "--devices", "64", "--device-memory", "80GB"]
    argv += ["--seq-len", "32768", "--micro-batch", "1", "--hidden", "4096", "--layers", "32"]
    argv += ["--heads", "32", "--vocab", "32000", "--dropout", "off", "--cp", "4", "--sp", "2"]
    argv += ["--attention", "plain", "--largest-layer-params", "0"]  # SHAPE's
    assert run_cli([*argv, "--stage", "2"]) == 0
    out = capsys.readouterr().out
    e = memory.estimate(SHAPE, ParallelDims(64, micro_batch=1, seq=2, context=4), "80GB")
    assert e.table() in out and e.sequence_report(2).table() in out
    assert "Long sequences, activations per device by technique" in out
    assert "+ ring attention over C = 4" in out and "plain attention (ring over C = 4" in out
    # Only the offloaded options listed: the table still adds stage 3's states without offload.
    tiled = ["--loss-chunk", "256", "--attention", "blockwise"]
    assert run_cli([*argv, "--offload", "cpu", *tiled]) == 0
    out = capsys.readouterr().out
    assert "+ tiled loss (256) and MLP (1024)" in out and "stage 3 without offload" in out
    run_cli(argv[:5])  # no shape: no long-sequence table
    assert "Long sequences" not in capsys.readouterr().out
    parser = argparse.ArgumentParser(prog="jzero")
    cli_memory.add_commands(parser.add_subparsers(dest="command"))
    help_text = parser._subparsers._group_actions[0].choices["estimate"].format_help()
    for flag in ("--vocab", "--loss-chunk", "--mlp-chunk", "--activation-offload", "--cp"):
        assert flag in help_text


def test_the_ring_passes_keys_and_values_around_the_context_axis():
    s, h, layers, c = 32768, 4096, 32, 4
    layout = ParallelDims(64, devices_per_node=8, micro_batch=1, context=c, micro_batches=1)
    row = memory.estimate(SHAPE, layout).row(3)
    x = s // c * h  # the device's tokens times h
    assert row.context_axis_bytes == 6 * (c - 1) * x * 2 * layers  # bf16 keys, values, grads
    assert memory.estimate(SHAPE, ParallelDims(64, micro_batch=1)).row(3).context_axis_bytes == 0
    assert "context GiB/step" in memory.estimate(SHAPE, layout).table().splitlines()[1]
    # The step time's prediction prices it (the auto layout's ranking).
    choice = argparse.Namespace(stage=3, offload=False, checkpointing=False)
    rates = costs.Rates(100.0, 10.0, 100.0, 5.0)
    predicted = costs.predict(layout, choice, SHAPE, costs.Work(1e15, 2, 2), rates)
    assert predicted.axis_bytes["context"] == row.context_axis_bytes
    assert not costs.crosses_hosts(layout, "context")  # 4 x seq 1 x model 1 devices in a node
