"""Today's transformer shapes in the cost model: published parameter counts, the largest layer
from the shape, DeepSpeed's own estimators' figures as a column, and ``jzero estimate``'s
defaults following what jzero runs (blockwise attention, no dropout). Arithmetic only."""

import pytest
from cli_runs import run_cli

from jzero import costs, memory
from jzero.costs import Architecture, ModelShape, ParallelDims, Techniques

# The published totals, each from its model card or paper, and the shape that gives it.
PUBLISHED = {
    # Touvron et al. 2023, "Llama 2" (arXiv:2307.09288): the 7B model (6,738,415,616 in the
    # released index).
    "llama-2-7b": 6.74e9,
    # Meta, "Llama 3" model card (Meta-Llama-3-8B): 8.03B parameters
    # (8,030,261,248 in the released safetensors' index).
    "llama-3-8b": 8.03e9,
    # Meta, "Llama 3" model card (Meta-Llama-3-70B): 70.6B (70,553,706,496 in the index).
    "llama-3-70b": 70.55e9,
    # Qwen team, "Qwen2.5-7B" model card: "Number of Parameters: 7.61B".
    "qwen2.5-7b": 7.61e9,
    # Jiang et al. 2024, "Mixtral of Experts" (arXiv:2401.04088): 47B parameters
    # (46,702,792,704 in the released index), 13B active a token.
    "mixtral-8x7b": 46.7e9,
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_each_preset_has_its_published_parameter_count(name):
    arch = costs.PRESETS[name]
    assert abs(arch.params() - PUBLISHED[name]) <= 0.01 * PUBLISHED[name]


def test_the_parts_of_a_shape_count_as_each_architecture_builds_them():
    llama = costs.PRESETS["llama-3-8b"]  # SwiGLU, RMSNorm, rotary, GQA 32/8, untied
    h, f, kv = 4096, 14336, 8 * 128
    assert llama.block_params() == 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    assert llama.embedding_params() == 2 * 128256 * h + h  # embedding, head, final norm
    gpt2 = Architecture(768, 12, 12, 3072, 50257, mlp="gelu", norm="layernorm",
                        positions="learned", max_positions=1024, bias="all", tied=True)  # fmt: skip
    assert gpt2.params() == 124_439_808  # GPT-2 small, as its released checkpoint counts it
    mixtral = costs.PRESETS["mixtral-8x7b"]
    assert mixtral.expert_params() == 32 * 8 * 3 * 4096 * 14336
    # Active parameters a token: the 2 routed experts instead of 8 (the paper's 13B).
    active = mixtral.params() - mixtral.expert_params() * 6 // 8
    assert abs(active - 12.9e9) < 0.01 * 12.9e9


def test_the_largest_layer_is_computed_from_the_shape(capsys):
    llama = costs.PRESETS["llama-3-8b"]
    # jzero gathers a leaf at a time: the embedding (and the head) is the largest.
    assert llama.largest_layer_params() == llama.largest_module_params() == 128256 * 4096
    mixtral = costs.PRESETS["mixtral-8x7b"]
    assert mixtral.largest_layer_params() == 8 * 4096 * 14336  # the experts' stacked matrix
    assert mixtral.largest_module_params() == 32000 * 4096  # DeepSpeed's: a module's own
    shape = llama.model_shape(2048)
    assert shape.largest_layer_params == 128256 * 4096 and shape.vocab == 128256
    assert shape.techniques == Techniques("blockwise")  # what jzero runs
    assert llama.model_shape().hidden is None  # no sequence length: no activation shape
    # The CLI without a preset: a GPT's largest matrix from --hidden and --vocab.
    argv = ["estimate", "--params", "1e9", "--devices", "8", "--hidden", "2048"]
    argv += ["--seq-len", "1024", "--micro-batch", "1", "--layers", "16", "--heads", "16"]
    assert run_cli(argv) == 0  # the MLP's 2048 x 8192
    assert "the largest layer's 1.678e+07 parameters" in capsys.readouterr().out
    assert run_cli([*argv, "--vocab", "50000"]) == 0  # the 50000 x 2048 embedding
    assert "the largest layer's 1.024e+08 parameters" in capsys.readouterr().out


def deepspeed_zero2(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True):
    """DeepSpeed's estimate_zero2_model_states_mem_needs (runtime/zero/stage_1_and_2.py),
    additional_buffer_factor 1.5, written out as it is."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * 1.5
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * 1.5
    return int(cpu_mem), int(gpu_mem)


def deepspeed_zero3(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1,
                    cpu_offload=True, cpu_offload_params=True):  # fmt: skip
    """DeepSpeed's estimate_zero3_model_states_mem_needs (runtime/zero/stage3.py), zero_init,
    additional_buffer_factor 1.5, written out as it is."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            cpu_mem = total_params * 18 * gpus_factor * 1.5
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            cpu_mem = total_params * 16 * gpus_factor * 1.5
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        cpu_mem = largest_layer_params * 4 * num_gpus_per_node * 1.5
    return int(cpu_mem), int(gpu_mem)


@pytest.mark.parametrize(("devices", "per_node"), [(8, 8), (64, 8)])
def test_the_deepspeed_column_is_deepspeeds_formulas_for_the_70b_example(devices, per_node):
    # The seeds' example: a 70B model, DP = 8 (and 64 devices, 8 nodes); DeepSpeed's largest
    # module is Llama-3-70B's embedding.
    ll = costs.PRESETS["llama-3-70b"].largest_module_params()
    model = ModelShape(70e9, largest_layer_params=ll, largest_module_params=ll)
    e = memory.estimate(model, ParallelDims(devices, devices_per_node=per_node))
    nodes = devices // per_node
    for stage in (1, 2):
        for offload, cpu in (("none", False), ("optimizer", True)):
            host, device = deepspeed_zero2(70e9, per_node, nodes, cpu_offload=cpu)
            assert e.row(stage, offload).deepspeed == (device, host)
    for offload, cpu, params in (
        ("none", False, False),
        ("optimizer", True, False),
        ("optimizer+params", True, True),
    ):
        host, device = deepspeed_zero3(70e9, ll, per_node, nodes, cpu, params)
        assert e.row(3, offload).deepspeed == (device, host)
    assert e.row(0).deepspeed is None and e.row(3, "nvme").deepspeed is None
    # Beside jzero's: stage 3 without offload, DeepSpeed's 18 bytes against the paper's 16.
    assert e.row(3).deepspeed[0] - e.row(3).device_bytes == 2 * 70e9 / devices
    header = e.table().splitlines()[1]
    assert "DeepSpeed GB" in header and "device GiB" in header


def test_estimate_presets_and_defaults_follow_what_jzero_runs(capsys):
    argv = ["estimate", "--preset", "llama-3-8b", "--devices", "8", "--seq-len", "4096"]
    assert run_cli([*argv, "--micro-batch", "1"]) == 0
    out = capsys.readouterr().out
    arch = costs.PRESETS["llama-3-8b"]
    expected = memory.estimate(arch.model_shape(4096), ParallelDims(8, micro_batch=1))
    assert expected.table() in out  # blockwise attention, no dropout: the preset's techniques
    assert "Psi = 8.03e+09 parameters" in out
    paper = ["--attention", "plain", "--dropout", "on"]
    assert run_cli([*argv, "--micro-batch", "1", *paper]) == 0
    plain = capsys.readouterr().out
    act = [float(line.split()[3]) for line in (out, plain) for line in [line.splitlines()[3]]]
    assert act[0] < act[1] / 4  # no [s, s] scores, no dropout masks
    with pytest.raises(ValueError, match="pass --params .* or --preset"):
        run_cli(["estimate", "--devices", "8"])
