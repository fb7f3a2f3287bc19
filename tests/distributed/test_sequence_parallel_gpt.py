"""``sequence_parallel_size`` (DeepSpeed-Ulysses) through the engine, on the built-in GPT.

In float64 (each test enables x64) the losses and the first gradient norm at ``S = 4`` (ZeRO
stage 1) and at ``S = 2`` beside tensor parallelism (stage 3) equal ``S = 1``'s at 1e-10 (the
split only reorders sums); the compiled step holds the all-to-alls around every attention
within the seq groups; a sequence's temporaries per device fall by about S; a checkpoint moves
from S = 2 x T = 2 at stage 3 to S = 1 at stage 1; and sizes that do not divide the heads or
the sequence are clear errors. The tests share their engines (:func:`run`), so the checkpoint
test's programs are theirs.
"""

import functools

import jax
import numpy as np
import optax
import pytest

import jzero
from jzero.demo import gpt
from jzero.hlo import collectives_by_axes
from jzero.step import logical_view

CFG = gpt.GPTConfig(
    vocab_size=64, seq_len=16, num_layers=2, num_heads=4, d_model=32, d_ff=64, dtype="float64"
)
BATCH = 8


pytestmark = pytest.mark.usefixtures("x64")  # conftest's float64


def params():
    return jax.tree.map(lambda x: x.astype(np.float64), gpt.init_params(jax.random.key(0), CFG))


def loss(p, b):
    return gpt.loss_fn(p, b, CFG)


def batches(n=3):
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, 64, (BATCH, CFG.seq_len + 1), dtype=np.int32)}
            for _ in range(n)]  # fmt: skip


def config(stage, seq, tp=1, **extra):
    return {
        "train_batch_size": BATCH,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "sequence_parallel_size": seq,
        "tensor_parallel": {"autotp_size": tp},
        **extra,
    }


@functools.cache
def run(stage, seq, tp=1):
    engine = jzero.initialize(params(), loss, optax.adamw(1e-2), config(stage, seq, tp))
    metrics = [engine.train_step(b) for b in batches()]
    return engine, [(float(m["loss"]), float(m["grad_norm"])) for m in metrics]


@functools.cache
def first_grad_norm():
    """The one-device ``jax.grad``'s global norm on the first batch (clipping and Adam hide a
    gradient's scale from the losses)."""
    return float(optax.global_norm(jax.jit(jax.grad(loss))(params(), batches(1)[0])))


# Stage 1/2 (parameters whole) and stage 3 (parameters gathered over data x seq), the latter
# beside tensor parallelism, where each device's heads are split again over seq.
@pytest.mark.parametrize("stage, seq, tp", [(1, 4, 1), (3, 2, 2)])
def test_split_sequences_train_like_whole_ones(stage, seq, tp):
    engine, metrics = run(stage, seq, tp)
    _, whole = run(1, 1)
    assert dict(engine.mesh.shape) == {
        "data": 8 // (seq * tp),
        "seq": seq,
        **({"model": tp} if tp > 1 else {}),
    }
    np.testing.assert_allclose(metrics, whole, rtol=1e-10, atol=0)
    assert metrics[0][1] == pytest.approx(first_grad_norm(), rel=1e-10, abs=0)
    # The batch's rows are split over data only; ZeRO's shards over data x seq.
    assert engine.plan.data_parallel_size == 8 // (seq * tp)
    assert engine.plan.num_shards == 8 // tp
    mlp_in = engine.opt_state[0].mu["blocks"]["mlp_in"]
    assert "seq" in str(mlp_in.sharding.spec)
    assert float(engine.evaluate(batches(1)[0])) == pytest.approx(
        float(run(1, 1)[0].evaluate(batches(1)[0])), rel=1e-10
    )


def test_all_to_alls_sit_around_every_attention_within_the_seq_groups():
    engine, _ = run(1, 4)
    by_axes = collectives_by_axes(engine.lower(batches(1)[0]).compile(), engine.mesh)
    a2a = {axes: s["all-to-all"] for axes, s in by_axes.items() if s["all-to-all"].count}
    assert list(a2a) == [("seq",)]
    # q, k, v in and the output back, forward and backward, for each of the 2 layers.
    assert a2a[("seq",)].count >= 8 * CFG.num_layers
    # ZeRO's gradient reduce-scatter runs over data x seq together.
    assert by_axes[("data", "seq")]["reduce-scatter"].count > 0


def test_a_sequences_temporaries_per_device_fall_by_about_s():
    """One 2048-token sequence per data group: at S=4 each device holds 512 of its tokens."""
    cfg = gpt.GPTConfig(vocab_size=256, seq_len=2048, num_layers=1, num_heads=4, d_model=64,
                        d_ff=128)  # fmt: skip
    with jax.enable_x64(False):
        temps = {}
        for seq in (1, 4):
            rows = 8 // seq  # one sequence per data group
            engine = jzero.initialize(
                gpt.init_params(jax.random.key(0), cfg),
                lambda p, b: gpt.loss_fn(p, b, cfg),
                optax.sgd(1e-3),
                {"train_batch_size": rows, "sequence_parallel_size": seq},
            )
            batch = {"tokens": np.zeros((rows, cfg.seq_len + 1), np.int32)}
            temps[seq] = engine.lower(batch).compile().memory_analysis().temp_size_in_bytes
    assert temps[4] <= 0.4 * temps[1], temps


def test_checkpoints_move_between_split_and_whole_sequences(tmp_path):
    """Saved at S = 2 x T = 2, stage 3 (the trained engine :func:`run` shares); restored at
    S = 1, T = 1, stage 1: every parameter and optimizer state bit for bit, and the next
    step's loss is the split engine's loss on the same parameters."""
    split, _ = run(3, 2, 2)
    split.save_checkpoint(tmp_path / "ckpt")
    split.wait_until_finished()
    cfg = {**config(1, 1), "checkpoint": {"directory": str(tmp_path / "ckpt")}}
    whole = jzero.initialize(params(), loss, optax.adamw(1e-2), cfg)
    whole.restore()
    written = jax.device_get(logical_view(split.plan, split.state))
    restored = jax.device_get(logical_view(whole.plan, whole.state))
    for field in ("params", "opt_state"):
        got, want = getattr(restored, field), getattr(written, field)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(x, y)  # a checkpoint holds the logical values
    b = batches(1)[0]
    expected = float(split.evaluate(b))  # the loss the split engine's next step reports
    assert float(whole.train_step(b)["loss"]) == pytest.approx(expected, rel=1e-10, abs=0)


@pytest.mark.parametrize(
    "model, seq, message",
    [
        ({"num_heads": 4, "d_model": 32, "seq_len": 16}, 8,
         r"sequence_parallel_size: 8 does not divide the 4 attention heads"),
        ({"num_heads": 8, "d_model": 32, "seq_len": 12}, 8,
         r"sequence_parallel_size: 8 does not divide the 12 tokens of a sequence"),
    ],
)  # fmt: skip
def test_sizes_that_do_not_divide_heads_or_sequence_are_clear_errors(model, seq, message):
    with pytest.raises(ValueError, match=message):
        jzero.load_config({"model": model, "sequence_parallel_size": seq})


def test_a_user_loss_whose_sequence_does_not_divide_names_the_numbers():
    short = [{"tokens": b["tokens"][:, :11]} for b in batches(1)]  # 10 positions on S=4
    engine = jzero.initialize(params(), loss, optax.sgd(1e-2), config(1, 4))
    with pytest.raises(ValueError, match=r"10.*4"):
        engine.train_step(short[0])


def test_beside_tensor_parallelism_the_all_to_alls_move_only_each_devices_heads():
    """T=2 x S=2: the heads are split over model, and each device's all-to-alls move its own;
    sequence parallelism adds no all-gather over model to what T=2 alone has."""
    split, _ = run(3, 2, 2)
    alone, _ = run(3, 1, 2)

    def model_gathers(engine):
        by_axes = collectives_by_axes(engine.lower(batches(1)[0]).compile(), engine.mesh)
        return by_axes[("model",)]["all-gather"].bytes, by_axes

    with_seq, by_axes = model_gathers(split)
    assert with_seq == model_gathers(alone)[0]
    # q, k, v in and the output back, forward and backward, 2 layers: each all-to-all moves
    # this device's 2 of the 4 heads (a [4 rows, 8 tokens, 2 heads, 8] float64 chunk).
    a2a = by_axes[("seq",)]["all-to-all"]
    assert a2a.count >= 8 * CFG.num_layers and a2a.bytes == a2a.count * 4 * 8 * 2 * 8 * 8
