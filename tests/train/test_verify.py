"""`jzero verify`: the built-in GPT at stage 3 with AutoTP 2 trains exactly as plain data
parallelism (float64, every step within the bound); against a config with another
`gradient_clipping` the verdict is DIFFERENT, from the first step whose loss shows it."""

from jzero import cli

CONFIG = """\
train_batch_size: 16
zero_optimization: {stage: 3, stage3_param_persistence_threshold: 0}
tensor_parallel: {autotp_size: 2}
gradient_clipping: %s
optimizer: {type: AdamW, params: {lr: 0.003}}
model: {vocab_size: 256, seq_len: 16, num_layers: 2, num_heads: 2, d_model: 32, d_ff: 64}
data: {source: stdlib, max_bytes: 20000}
"""


def test_verify_passes_a_layout_and_names_the_step_a_real_difference_starts(tmp_path, capsys):
    tp, clipped = tmp_path / "tp.yaml", tmp_path / "clipped.yaml"
    tp.write_text(CONFIG % "1.0")
    clipped.write_text(CONFIG % "0.1")
    assert cli.main(["verify", str(tp), "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "config:    ZeRO stage 3 over {data=4, model=2}, batch 16 = 4 x 1 x 4" in out
    assert "reference: ZeRO stage 0 over {data=8}, batch 16 = 2 x 1 x 8" in out
    assert "bound 2.2e-10 (1e+06 units of float64 rounding)" in out
    assert "verdict: the same training (every step within the bound)" in out

    assert cli.main(["verify", str(tp), "--against", str(clipped), "--steps", "3"]) == 1
    out = capsys.readouterr().out
    assert "the configs differ in: gradient_clipping" in out
    # Step 1's gradient norm is the same (clipping acts after it); its update is not.
    assert "verdict: DIFFERENT from step 2 on" in out
