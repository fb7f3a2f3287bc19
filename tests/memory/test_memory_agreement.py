"""``jzero estimate`` and ``jzero plan`` on one Llama-shaped model (RMSNorm, rotary positions,
grouped-query attention, SwiGLU, untied head): the closed form and the compiled plan count the
same model state at every stage, the same largest layer, and recommend the same stage.

The model is small (hidden 256, 2 layers, vocabulary 4096, 16 tokens a row) but its model
state outweighs its activations, as a real model's does; its leaves are all sharded at stage 3
(``stage3_param_persistence_threshold: 0``), as a large model's are. Four compilations.
"""

import jax
import jax.numpy as jnp
import pytest
from cli_runs import run_cli

from jzero import memory
from jzero.costs import PRESETS, Architecture, ParallelDims
from jzero.demo import llama, plan

ARCH = Architecture(256, 2, 4, 512, 4096, kv_heads=2)
SEQ = 16
CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "bf16": {"enabled": True},
    "zero_optimization": {"stage3_param_persistence_threshold": 0},
    "model": {"seq_len": SEQ},
}


@pytest.fixture(scope="module")
def planned():
    rows = memory.StageRows(compare_checkpointing=False)
    return plan.architecture_report(CONFIG, ARCH, rows=rows)


@pytest.mark.parametrize(
    "arch",
    [
        ARCH,
        Architecture(64, 2, 4, 160, 512, kv_heads=4, bias="qkv"),  # Qwen2's biases
        Architecture(64, 2, 4, 256, 512, mlp="gelu", norm="layernorm", bias="all", tied=True),
    ],
)
def test_the_llama_model_has_the_architectures_parameter_count(arch):
    shapes = jax.eval_shape(lambda: llama.init_params(jax.random.key(0), arch))
    assert sum(leaf.size for leaf in jax.tree.leaves(shapes)) == arch.params()


def test_the_blockwise_attention_is_the_softmax_attention(x64, monkeypatch):
    # In float64: the keys in blocks of 4 (jzero.ops.blockwise_attention over 4 blocks, each
    # masked causally) give the loss and gradients of one block of all 16 keys (the plain
    # causal softmax), the grouped-query heads read as they are.
    arch = Architecture(16, 2, 4, 32, 64, kv_heads=2)
    params = jax.tree.map(lambda w: w.astype("float64"), llama.init_params(jax.random.key(1), arch))
    tokens = jax.random.randint(jax.random.key(2), (2, 17), 0, 64)

    def loss_and_grads(block):
        """One compiled program per block size (the block is read while it is traced)."""
        monkeypatch.setattr(llama, "_ATTENTION_BLOCK", block)
        loss = lambda p: llama.loss_fn(p, {"tokens": tokens}, arch, dtype="float64")  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))(params)

    (blocks_loss, blocks), (whole_loss, whole) = loss_and_grads(4), loss_and_grads(16)
    assert abs(blocks_loss - whole_loss) < 1e-12
    for a, b in zip(jax.tree.leaves(blocks), jax.tree.leaves(whole), strict=True):
        assert jnp.max(jnp.abs(a - b)) < 1e-12


def test_estimate_and_plan_agree_on_the_model_state_at_every_stage(planned):
    est = memory.estimate(ARCH.model_shape(SEQ), ParallelDims(8, micro_batch=1))
    assert planned.devices == 8
    for stage in (0, 1, 2, 3):
        row = est.row(stage)
        counted = row.device_bytes - row.device.get("gathered layer", 0)
        measured = sum(planned.row(stage).device.values())  # params, grads, masters, moments
        assert abs(counted - measured) <= 0.1 * measured, (stage, counted, measured)
    # One largest layer: the leaf stage 3 gathers at once (here the 4096 x 256 embedding and
    # head), 4 bytes a parameter in the estimate (16-bit params and grads), the plan's 2 (its
    # bf16 params; their gradient is a temporary of the compiled step).
    assert est.row(3).device["gathered layer"] == 4 * ARCH.largest_layer_params()
    assert planned.row(3).gathered_layer == 2 * ARCH.largest_layer_params()


def test_estimate_and_plan_recommend_the_same_stage(planned):
    # 40 MB: stage 0 does not fit (16 Psi = 52 MB of model state), stage 1 does in both (the
    # estimate's 18.6 MB; the plan's compiled peak with the step's temporaries, 31.3 MB).
    budget = "40MB"
    est = memory.estimate(ARCH.model_shape(SEQ), ParallelDims(8, micro_batch=1), budget)
    ours, measured = est.recommendation, planned.with_device_memory(budget).recommendation
    assert (ours.fits, ours.stage, ours.offload) == (True, 1, "none")
    assert (measured.fits, measured.stage, measured.offload) == (True, 1, "none")


def test_plan_refuses_what_the_llama_model_does_not_build():
    with pytest.raises(ValueError, match="experts: 8 is not supported by the Llama-shaped"):
        plan.architecture_report(CONFIG, PRESETS["mixtral-8x7b"])


def test_plan_cli_preset_plans_that_architecture(monkeypatch, capsys):
    seen = {}

    class Report:
        def table(self):
            return "the table"

    def report(config, arch, devices, device_memory, **options):
        seen.update(config=config, arch=arch, devices=devices, memory=device_memory, **options)
        return Report()

    monkeypatch.setattr(plan, "architecture_report", report)
    argv = ["plan", "run.yaml", "--preset", "llama-3-8b", "--devices", "64"]
    assert run_cli([*argv, "--device-memory", "80GB", "--compare-ac", "never"]) == 0
    assert capsys.readouterr().out == "the table\n"
    assert seen["arch"] == PRESETS["llama-3-8b"] and seen["config"] == "run.yaml"
    assert (seen["devices"], seen["memory"]) == ("64", "80GB")
    assert seen["rows"].compare_checkpointing is False
    with pytest.raises(SystemExit):  # a mixture of experts is not a Llama-shaped model
        run_cli(["plan", "run.yaml", "--preset", "mixtral-8x7b"])
