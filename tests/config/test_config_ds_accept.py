"""What DeepSpeed 0.19 accepts, jzero loads; what would train something else, it refuses.

Each config here is small and our own, shaped like the public ``ds_config.json`` files that
DeepSpeed accepted and jzero used to refuse (and the other way round): keys DeepSpeed never
reads at the top level, ``sub_group_size: 0``, ``offload_param`` below stage 3; MoQ and
progressive layer dropping; and the messages met on the way. Only the last test trains.
"""

import math
import re

import optax
import pytest
import toy
from config_checks import error_of, load_quietly

import jzero
from jzero.config import ConfigError, load_config, resolve_batch_sizes
from jzero.subgroups import leaf_groups

DS_BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2},
}


def listed(message):
    """The dotted keys a no-effect warning lists."""
    return re.findall(r"^  - ([\w.]+):", message, re.M)


# --- 1. top-level keys DeepSpeed never reads ----------------------------------------------


def test_unknown_top_level_keys_are_ignored_with_one_warning_line():
    raw = {
        "_comment": "ZeRO-2 for 8 GPUs",
        **DS_BASE,
        "comms_config": {"verbose": False},
        "monitor_config": {"enabled": False},
        "cuda_visible_devices": "0,1,2,3",
    }
    cfg, messages = load_quietly(raw)
    assert messages == [
        "jzero does not know these keys and ignores them, as DeepSpeed ignores the "
        "keys it does not read: _comment, comms_config, monitor_config, cuda_visible_devices. "
        "Remove them to silence this warning."
    ]
    assert cfg == load_quietly(DS_BASE)[0]


@pytest.mark.parametrize(
    ("key", "known"),
    [
        ("zero_optimisation", "zero_optimization"),  # British spelling
        ("Zero-Optimization", "zero_optimization"),  # case and separators
        ("zero_optimizaton", "zero_optimization"),  # one edit
        ("gradient_cliping", "gradient_clipping"),
        ("train_batch_szie", "train_batch_size"),  # two neighbours swapped
        ("gradient_acumulation_step", "gradient_accumulation_steps"),  # two edits
        ("optimiser", "optimizer"),
        ("bf61", "bf16"),
    ],
)
def test_a_near_miss_of_a_top_level_key_is_still_refused(key, known):
    # Ignored, zero_optimisation would train at stage 0.
    assert error_of({**DS_BASE, key: {}, "_comment": "ignored"}) == (
        f"{key} is not a known key (did you mean '{known}'?); remove it or fix its name."
    )


def test_suggestions_point_only_to_close_matches():
    # Far from every key: ignored at the top level, with no suggestion anywhere.
    cfg, (message,) = load_quietly(
        {**DS_BASE, "warmup": 0.01, "train_iters": 320, "auto": ["seed"]}
    )
    assert message.startswith(
        "jzero does not know these keys and ignores them, as DeepSpeed ignores the "
        "keys it does not read: warmup, train_iters, auto."
    )
    assert cfg.auto == ()  # jzero's record of "auto" keys is not a key
    # Inside a section an unknown key is still refused; a far one gets no suggestion.
    assert error_of({"zero_optimization": {"_comment": "stage 2"}}) == (
        "zero_optimization._comment is not a known key; remove it or fix its name."
    )
    assert error_of({"bf16": {"enabld": True}}) == (
        "bf16.enabld is not a known key (did you mean 'enabled'?); remove it or fix its name."
    )


def test_an_unknown_top_level_key_set_by_an_override_is_refused():
    assert error_of(DS_BASE, ["steps=5"]) == (
        "steps is not a known key; fix its name in the override 'steps=5', or remove it."
    )


@pytest.mark.parametrize(
    "key",
    [
        "fp16.opt_level",  # Apex AMP's, in fp16 sections written for it
        "fp16.fp16_scale_tolerance",
        # A bf16 section copied from an fp16 one: bfloat16 trains without loss scaling.
        "bf16.loss_scale",
        "bf16.loss_scale_window",
        "bf16.hysteresis",
        "bf16.min_loss_scale",
        "bf16.initial_scale_power",
    ],
)
def test_an_unknown_key_of_a_section_deepspeed_reads_key_by_key_is_ignored(key):
    section, sub = key.split(".")
    raw = {**DS_BASE, section: {"enabled": True, sub: 0}}
    cfg, messages = load_quietly(raw)
    assert messages == [
        f"jzero does not know these keys and ignores them, as DeepSpeed ignores the keys it "
        f"does not read: {key}. Remove them to silence this warning."
    ]
    assert cfg == load_quietly({**DS_BASE, section: {"enabled": True}})[0]
    # Set on purpose, by an override, the same key is refused.
    assert error_of(DS_BASE, [f"{key}=0"]) == (
        f"{key} is not a known key; fix its name in the override '{key}=0', or remove it."
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (  # a typo of a key DeepSpeed reads in fp16 sections, copied with the rest
            {"bf16": {"enabled": True, "loss_scael": 0}},
            "bf16.loss_scael is not a known key (did you mean 'loss_scale'?); remove it or fix "
            "its name.",
        ),
        (
            {"fp16": {"enabled": True, "initial_scale_powr": 12}},
            "fp16.initial_scale_powr is not a known key (did you mean 'initial_scale_power'?); "
            "remove it or fix its name.",
        ),
        (  # an abbreviation: ignored, the run would train without clipping
            {"gradient_clip": 1.0},
            "gradient_clip is not a known key (did you mean 'gradient_clipping'?); remove it or "
            "fix its name.",
        ),
        (
            {"activation_checkpointing": {"partition_activation": True}},
            "activation_checkpointing.partition_activation is not a known key (did you mean "
            "'partition_activations'?); remove it or fix its name.",
        ),
    ],
)
def test_a_near_miss_in_a_section_deepspeed_reads_key_by_key_is_refused(raw, message):
    assert error_of({**DS_BASE, **raw}) == message


def test_a_gpt_neox_arguments_file_is_one_message(tmp_path):
    path = tmp_path / "neox.yml"
    path.write_text(
        "{\n"
        '  "pipe-parallel-size": 1,\n'
        '  "model-parallel-size": 1,\n'
        '  "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,\n'
        '  "seq_length": 128, "max_position_embeddings": 128, "pos_emb": "rotary",\n'
        '  "train_iters": 320, "lr_decay_iters": 320, "warmup": 0.01, "norm": "layernorm",\n'
        '  "optimizer": {"type": "Adam", "params": {"lr": 0.0006}},\n'
        '  "zero_optimization": {"stage": 1},\n'
        '  "train_micro_batch_size_per_gpu": 4,\n'
        "}\n"
    )
    assert error_of(path) == (
        "This looks like a GPT-NeoX arguments file, not a DeepSpeed config: 12 of its top-level "
        "keys are GPT-NeoX's own arguments (pipe-parallel-size, model-parallel-size, "
        "num_layers, ...: the model, data and schedule GPT-NeoX would build), which neither "
        "DeepSpeed nor jzero reads. Pass a DeepSpeed config instead: its DeepSpeed keys "
        "(optimizer, zero_optimization, train_micro_batch_size_per_gpu) in a file of their own, "
        "with jzero's model and data sections for the rest (see configs/zero2.yaml)."
    )


# --- 2. sub_group_size: 0 -------------------------------------------------------------------


def test_sub_group_size_zero_makes_each_leaf_its_own_group():
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "sub_group_size": 0}
    cfg, messages = load_quietly({**DS_BASE, "zero_optimization": zero})
    assert messages == []  # with offload it acts: not a no-effect key
    size = cfg.zero_optimization.sub_group_size
    # DeepSpeed closes a sub-group once it holds sub_group_size elements: at 0, after each
    # parameter, empty ones too.
    assert leaf_groups([12, 0, 64, 5, 1], size) == [[0], [1], [2], [3], [4]]
    assert error_of({"zero_optimization": {"sub_group_size": -1}}) == (
        "zero_optimization.sub_group_size: -1 is not allowed; it must be >= 0."
    )


# --- 3. keys DeepSpeed reads only in some settings, ignored in the others -------------------


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_offload_param_below_stage_3_is_ignored_with_a_warning(stage):
    zero = {"stage": stage, "offload_param": {"device": "cpu", "pin_memory": True}}
    cfg, (message,) = load_quietly({**DS_BASE, "zero_optimization": zero})
    assert listed(message) == ["zero_optimization.offload_param"]
    assert (
        f"  - zero_optimization.offload_param: it offloads the parameter shards of stage 3, and "
        f"stage {stage} keeps the parameters whole (DeepSpeed ignores it there too).\n"
    ) in message
    assert cfg.zero_optimization.offload_param.device == "none"
    assert load_config(cfg.to_dict()) == cfg


def test_stage_3_keys_below_it_do_not_reach_the_other_checks():
    # offload_param on NVMe without the optimizer state there is refused at stage 3 only.
    zero = {
        "stage": 2,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"},
        "zero_hpz_partition_size": 4,
    }
    cfg, (message,) = load_quietly({**DS_BASE, "zero_optimization": zero})
    assert listed(message) == [
        "zero_optimization.offload_param",
        "zero_optimization.zero_hpz_partition_size",
    ]
    offload = cfg.zero_optimization
    assert (offload.offload_param.device, offload.offload_optimizer.device) == ("none", "cpu")
    assert cfg.mesh_sizes() == {"data": -1}  # no hpZ replica axis
    assert "offload_optimizer.device is cpu" in error_of(
        {**DS_BASE, "zero_optimization": {**zero, "stage": 3, "zero_hpz_partition_size": 1}}
    )
    at_3 = load_quietly(
        {**DS_BASE, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}}
    )
    assert at_3[0].mesh_sizes() == {"data": 4, "replica": -1}


def test_the_inference_tp_size_without_autotp_is_ignored_with_a_warning():
    cfg, (message,) = load_quietly({**DS_BASE, "tensor_parallel": {"tp": {"tp_size": 4}}})
    assert listed(message) == ["tensor_parallel.tp.tp_size"]
    assert cfg.autotp_size() == 1 and cfg.mesh_sizes() == {"data": -1}


def test_pipeline_and_autotp_keys_jzero_does_not_act_on_warn_unless_they_ask_for_nothing():
    inert = {"partition": "uniform", "seed_layers": False, "activation_checkpoint_interval": 0}
    quiet = {**DS_BASE, "pipeline": {"stages": 1, **inert, "pipe_partitioned": True}}
    assert load_quietly({**quiet, "tensor_parallel": {"keep_module_on_host": False}})[1] == []
    assert load_quietly({**DS_BASE, "pipeline": {"stages": 1}})[1] == []  # none written
    asked = {"partition": "parameters", "seed_layers": True, "activation_checkpoint_interval": 1}
    tp = {"keep_module_on_host": True, "preset_model": "llama", "tp_grain_size": 64}
    _, (message,) = load_quietly({**DS_BASE, "pipeline": asked, "tensor_parallel": tp})
    assert listed(message) == [
        "pipeline.partition",
        "pipeline.seed_layers",
        "pipeline.activation_checkpoint_interval",
        "tensor_parallel.keep_module_on_host",
        "tensor_parallel.preset_model",
    ]
    assert "equally many layers" in message and "params=<a function of a key>" in message


# --- 4. what changes the trained model is refused -------------------------------------------


@pytest.mark.parametrize(
    ("key", "what"),
    [
        (
            "quantize_training",
            "DeepSpeed's MoQ (quantize-aware training: the weights are quantized to fewer bits "
            "as training goes)",
        ),
        (
            "progressive_layer_drop",
            "DeepSpeed's Progressive Layer Dropping (the model skips layers with a probability "
            "that grows over the steps)",
        ),
    ],
)
def test_moq_and_progressive_layer_drop_enabled_are_refused(key, what):
    assert error_of({**DS_BASE, key: {"enabled": True, "theta": 0.5}}) == (
        f"{key}.enabled: {what} would change what is trained, and jzero does not implement "
        f"it; set enabled: false there or remove the {key} section."
    )
    assert load_quietly({**DS_BASE, key: {"enabled": False}})[1] == []


# --- messages -----------------------------------------------------------------------------


def test_one_bit_optimizers_suggest_the_optimizer_they_are():
    lamb = {"type": "OneBitLamb", "params": {"lr": 1e-3, "freeze_step": 100, "cuda_aware": False}}
    assert error_of({**DS_BASE, "optimizer": lamb}) == (
        "optimizer.type: 'OneBitLamb' is Lamb with its communication compressed to 1 bit, a "
        "CUDA/NCCL feature jzero does not have (XLA runs the collectives). For the optimizer "
        "itself, uncompressed (as 'OneBitLamb' runs until its freeze_step), set type: Lamb and "
        "remove freeze_step, cuda_aware from its params."
    )
    adam = {"type": "ZeroOneAdam", "params": {"lr": 1e-3}}
    assert error_of({**DS_BASE, "optimizer": adam}).endswith("set type: Adam.")


def test_a_batch_size_not_written_is_said_to_be_derived():
    def message(raw):
        with pytest.raises(ConfigError) as info:
            resolve_batch_sizes(load_config(raw), 8)
        return str(info.value)

    assert message({"train_batch_size": 20}).startswith(
        "The batch sizes do not fit together: train_batch_size=20, "
        "train_micro_batch_size_per_gpu not set (derived), gradient_accumulation_steps not set "
        "(1, DeepSpeed's default), with a data-parallel size of 8."
    )
    written = {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}
    assert message({**written, "gradient_accumulation_steps": "auto"}).startswith(
        "The batch sizes do not fit together: train_batch_size=30, "
        "train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=auto (derived), with a "
        "data-parallel size of 8."
    )


# --- one step of such a config --------------------------------------------------------------


def test_a_config_of_these_shapes_trains_a_step():
    raw = {
        "_comment": "offload for a small GPU",
        **DS_BASE,
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"},
            "sub_group_size": 0,
        },
    }
    cfg, messages = load_quietly(raw)
    assert len(messages) == 2
    engine = jzero.initialize(
        toy.make_params(d=16, num_layers=2), toy.loss_fn, optax.adamw(1e-3), config=cfg
    )
    (batch,) = toy.make_batches(1, engine.train_batch_size)
    loss = float(engine.train_step(batch)["loss"])
    assert math.isfinite(loss)
    zero = engine.config.zero_optimization
    assert (zero.sub_group_size, zero.offload_param.device) == (1, "none")
