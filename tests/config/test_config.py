"""Tests of the config schema: loading, DeepSpeed's defaults, every error message, warnings."""

import json
import re
import warnings

import pytest
from repo import FIXTURES, ROOT

from jzero.config import (
    Config,
    ConfigError,
    JzeroConfigDeprecationWarning,
    JzeroConfigWarning,
    load_config,
    resolve_batch_sizes,
)

FIXTURE = FIXTURES / "ds_config_example.json"
STAGE_CONFIGS = ["zero0.yaml", "zero1.yaml", "zero2.yaml", "zero3.yaml", "zero2_offload.yaml"]


def error_of(source, overrides=()):
    with pytest.raises(ConfigError) as info:
        load_config(source, overrides)
    return str(info.value)


# --- the shipped configs and the DeepSpeed example ---------------------------------------


@pytest.mark.parametrize("name", STAGE_CONFIGS)
def test_shipped_configs_load_without_warnings(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(ROOT / "configs" / name)
    assert cfg.zero_optimization.stage == int(name[4])
    assert resolve_batch_sizes(cfg, 8) == (32, 4, 1)
    assert cfg.optimizer.type == "AdamW" and cfg.scheduler.type == "WarmupCosineLR"
    assert cfg.model["d_model"] == 128 and cfg.data["source"] == "stdlib"
    assert cfg.train.steps == 150 and cfg.mesh.data == -1
    assert load_config(cfg.to_dict()) == cfg


def test_offload_config_asks_for_host_memory():
    cfg = load_config(ROOT / "configs" / "zero2_offload.yaml")
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.offload_optimizer.pin_memory


def test_deepspeed_example_loads_and_warns_once():
    with pytest.warns(JzeroConfigWarning) as record:
        cfg = load_config(FIXTURE)
    assert cfg.zero_optimization.overlap_comm  # it acts: not among the no-effect keys
    assert len(record) == 1
    assert str(record[0].message) == (
        "These DeepSpeed settings have no effect in jzero and are ignored:\n"
        "  - zero_optimization.allgather_partitions: XLA schedules, buckets and fuses "
        "collectives itself.\n"
        "  - zero_optimization.reduce_scatter: XLA schedules, buckets and fuses collectives "
        "itself; the stage decides the reduction.\n"
        "Remove them to silence this warning."
    )
    assert cfg.train_batch_size == 256
    assert cfg.optimizer.params["lr"] == 3e-5  # a JSON float, not the string "3e-5"
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.communication_data_type == "bf16"


# --- DeepSpeed's defaults ----------------------------------------------------------------


def test_defaults_are_deepspeeds():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.gradient_clipping == 1.0  # DeepSpeed >= 0.19.3
    zero = cfg.zero_optimization
    assert zero.stage == 0 and zero.stage3_param_persistence_threshold == 100_000
    assert zero.reduce_bucket_size == zero.allgather_bucket_size == 500_000_000
    # Not set: jzero gathers each parameter at its use (DeepSpeed: 5e7 and 1e9, see README).
    assert zero.stage3_prefetch_bucket_size is None and zero.stage3_max_reuse_distance is None
    assert zero.stage3_max_live_parameters == 1_000_000_000
    assert zero.offload_optimizer.device == "none" and zero.offload_optimizer.pin_memory
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.loss_scale, fp16.initial_scale_power) == (False, 0.0, 16)
    assert (fp16.loss_scale_window, fp16.hysteresis, fp16.min_loss_scale) == (1000, 2, 1.0)
    assert cfg.bf16.enabled is False and cfg.communication_data_type is None
    assert cfg.bf16.check_grad_overflow is True  # DeepSpeed >= 0.19: skip inf/NaN bf16 steps
    assert cfg.checkpoint.async_ is True and cfg.checkpoint.max_to_keep == 3
    hash(cfg)  # usable as a static argument of jax.jit


def test_round_trip_keeps_everything():
    raw = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.8, 0.9]}},
        "checkpoint": {"directory": "/tmp/ckpt", "async": False},
        "model": {"d_model": 64, "num_heads": 4, "extra": {"nested": [1, 2]}},
    }
    with pytest.warns(JzeroConfigWarning, match="zero_optimization.reduce_bucket_size"):
        cfg = load_config(raw)
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.gradient_accumulation_steps is None
    out = cfg.to_dict()
    assert out["checkpoint"]["async"] is False and "async_" not in out["checkpoint"]
    assert out["optimizer"]["params"]["betas"] == [0.8, 0.9]
    assert json.loads(json.dumps(out)) == out
    assert "reduce_bucket_size" not in out["zero_optimization"]  # no-effect and default
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(out) == cfg
    assert load_config(cfg) is cfg


# --- files and overrides -----------------------------------------------------------------


def test_yaml_floats_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer: {type: sgd, params: {lr: 3e-4}}\ngradient_clipping: 1E0\n")
    cfg = load_config(
        path, ["zero_optimization.stage=3", "optimizer.params.lr=1e-2", "train.log_dir=out"]
    )
    assert cfg.optimizer.params["lr"] == 1e-2 and cfg.gradient_clipping == 1.0
    assert cfg.zero_optimization.stage == 3 and cfg.train.log_dir == "out"
    assert load_config(path).optimizer.params["lr"] == 3e-4


def test_bad_override_and_missing_file(tmp_path):
    assert error_of(None, ["zero_optimization.stage"]) == (
        "The override 'zero_optimization.stage' is not of the form dotted.key=value; write it "
        "like zero_optimization.stage=3."
    )
    assert error_of({"seed": 1}, ["seed.x=2"]) == (
        "The override 'seed.x=2' goes into seed, which is 1, not a mapping; override that key "
        "itself instead."
    )
    missing = str(tmp_path / "nope.yaml")
    assert error_of(missing) == (
        f"The config file {missing!r} does not exist; pass the path of a YAML or JSON config, "
        "e.g. configs/zero2.yaml."
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    assert error_of(bad) == (
        "The config must be a mapping of keys at the top level, not [1, 2]; write it as "
        "`key: value` lines (YAML) or a JSON object."
    )


# --- unknown keys, wrong values ----------------------------------------------------------


def test_unknown_key_names_path_and_suggests():
    assert error_of({"zero_optimization": {"stage": 1, "overlap_com": True}}) == (
        "zero_optimization.overlap_com is not a known key (did you mean 'overlap_comm'?); "
        "remove it or fix its name."
    )
    assert error_of({"zero_optimizaton": {}}) == (
        "zero_optimizaton is not a known key (did you mean 'zero_optimization'?); remove it "
        "or fix its name."
    )
    assert error_of({"checkpoint": {"xyzzy": 1}}) == (
        "checkpoint.xyzzy is not a known key; remove it or fix its name."
    )
    assert error_of(None, ["train.step=5"]) == (
        "train.step is not a known key (did you mean 'steps'?); remove it or fix its name."
    )


def test_deprecated_key_names_its_replacement():
    # Read as its replacement, as DeepSpeed 0.19 does, with one warning naming the new spelling.
    with pytest.warns(JzeroConfigDeprecationWarning) as caught:
        cfg = load_config({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert [str(w.message) for w in caught] == [
        "These DeepSpeed keys are other spellings of jzero's keys and were read as those:\n"
        "  - zero_optimization.cpu_offload: write offload_optimizer: {device: cpu}\n"
        "Rename them to silence this warning."
    ]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"zero_optimization": {"stage": 4}},
            "zero_optimization.stage: 4 is not allowed; it must be one of 0, 1, 2, 3.",
        ),
        (
            {"zero_optimization": {"stage": True}},
            "zero_optimization.stage: true is not allowed; it must be one of 0, 1, 2, 3.",
        ),
        (
            {"zero_optimization": {"reduce_bucket_size": "big"}},
            "zero_optimization.reduce_bucket_size: 'big' is not allowed; it must be an integer.",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
            "zero_optimization.offload_optimizer.device: 'gpu' is not allowed; it must be one "
            "of 'none', 'cpu', 'nvme'.",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
            "zero_optimization.offload_param.device is nvme, but offload_optimizer.device is "
            "none: jzero runs the parameters' files through the NVMe tier's step, which keeps "
            "the optimizer state on NVMe too. Set offload_optimizer: {device: nvme, nvme_path: "
            "DIR}, or offload_param.device to cpu.",
        ),
        (
            {"communication_data_type": "bfp16"},
            "communication_data_type: 'bfp16' is not allowed; it must be one of 'fp32', "
            "'fp16', 'bf16'.",
        ),
        ({"gradient_clipping": -1}, "gradient_clipping: -1.0 is not allowed; it must be >= 0.0."),
        (
            {"fp16": {"enabled": "yes"}},
            "fp16.enabled: 'yes' is not allowed; it must be true or false.",
        ),
        (
            {"mesh": {"data": 0}},
            "mesh.data: 0 is not allowed; it must be -1 (all devices) or >= 1.",
        ),
        ({"train_batch_size": 0}, "train_batch_size: 0 is not allowed; it must be >= 1."),
        ({"model": []}, "model: [] is not allowed; it must be a mapping."),
        (
            {"zero_optimization": 2},
            "zero_optimization: 2 is not allowed; it must be a mapping of keys.",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}},
            "zero_optimization.offload_optimizer.ratio: 1.5 is not allowed; it must be between "
            "0.0 and 1.0.",
        ),
        ({"optimizer": {"params": {}}}, "optimizer.type is required; set it."),
        (
            {"model": {"d_model": 130, "num_heads": 4}},
            "model.d_model: 130 is not divisible by model.num_heads (4); choose a d_model that "
            "is a multiple of num_heads.",
        ),
        (
            {"model": {"num_layers": 0}},
            "model.num_layers: 0 is not allowed; it must be a positive integer.",
        ),
    ],
)
def test_wrong_values_name_path_value_and_what_is_allowed(raw, message):
    assert error_of(raw) == message


# --- the mesh section: data plus other named axes ----------------------------------------


def test_mesh_takes_other_named_axes_after_data():
    cfg = load_config({"mesh": {"model": 2, "data": 4}}, ["mesh.expert=1"])
    assert cfg.mesh.data == 4 and dict(cfg.mesh.axes) == {"model": 2, "expert": 1}
    assert cfg.mesh.sizes() == {"data": 4, "model": 2, "expert": 1}
    assert list(cfg.mesh.sizes()) == ["data", "model", "expert"]  # data first
    assert cfg.to_dict()["mesh"] == {"data": 4, "model": 2, "expert": 1}
    assert load_config(cfg.to_dict()) == cfg
    assert hash(cfg) == hash(load_config(cfg.to_dict()))
    assert load_config({}).mesh.sizes() == {"data": -1}


@pytest.mark.parametrize(
    "mesh, message",
    [
        (
            {"dta": 8},
            "mesh.dta looks like a misspelling of mesh.data (did you mean 'data'?); fix its "
            "name, or name the new mesh axis differently.",
        ),
        (
            {"model": 0},
            "mesh.model: 0 is not allowed; it must be -1 (all devices) or >= 1.",
        ),
        (
            {"model": "two"},
            "mesh.model: 'two' is not allowed; a mesh axis size must be an integer, -1 (the "
            "devices left) or >= 1.",
        ),
        (
            {"model": -2},
            "mesh.model: -2 is not allowed; it must be >= -1.",
        ),
        (
            {"model-parallel": 2},
            "mesh.model-parallel: 'model-parallel' is not a valid mesh axis name; name an axis "
            "with letters, digits and underscores, e.g. model.",
        ),
        (
            {"data": -1, "model": -1},
            "mesh: data: -1, model: -1 are all -1, but only one axis can take the devices left "
            "over; give every other axis a size.",
        ),
    ],
)
def test_bad_mesh_axes_are_clear_errors(mesh, message):
    assert error_of({"mesh": mesh}) == message


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
            "fp16.enabled and bf16.enabled are both true, but only one precision can be used; "
            "set one of them to false.",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
            "zero_optimization.offload_optimizer needs stage 1, 2 or 3 (what it moves to host "
            "memory is sharded there), but zero_optimization.stage is 0; set the stage to 1, "
            "2 or 3, or offload_optimizer.device to none.",
        ),
        (
            {"bf16": {"enabled": True}, "bfloat16": {"enabled": True}},
            "Both bf16 and bfloat16 (its old name) are set; keep only bf16.",
        ),
    ],
)
def test_impossible_combinations(raw, message):
    assert error_of(raw) == message


def test_bfloat16_alias_and_disabled_sections_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config({"bfloat16": {"enabled": True}, "tensorboard": {"enabled": False}})
    assert cfg.bf16.enabled


def test_every_no_effect_key_is_listed():
    raw = {
        "wall_clock_breakdown": True,
        "zero_optimization": {
            "stage": 3,
            "stage3_module_granularity_threshold": 1e4,
            "sub_group_size": 1,
        },
        "optimizer": {"type": "Adam", "params": {"lr": 0.1, "set_grad_none": True}},
        "activation_checkpointing": {"partition_activations": True},
    }
    with pytest.warns(JzeroConfigWarning) as record:
        load_config(raw)
    assert len(record) == 1
    listed = re.findall(r"^  - ([\w.]+):", str(record[0].message), re.M)
    assert listed == [
        "zero_optimization.stage3_module_granularity_threshold",
        "wall_clock_breakdown",
        # No effect here because nothing is offloaded (it streams the offloaded update).
        "zero_optimization.sub_group_size",
        "optimizer.params.set_grad_none",
        # No effect here because the mesh has no model axis (it acts with one).
        "activation_checkpointing.partition_activations",
    ]


# --- batch sizes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "dp", "expected"),
    [
        ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 8, (64, 4, 2)),
        ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 8, (64, 4, 2)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
        ({"train_batch_size": 32}, 8, (32, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 4}, 8, (32, 4, 1)),
        (
            {
                "train_batch_size": 48,
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 3,
            },
            8,
            (48, 2, 3),
        ),
        (
            {
                "train_batch_size": 16,
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
            },
            4,
            (16, 4, 1),
        ),
    ],
)
def test_batch_sizes_resolve_like_deepspeed(raw, dp, expected):
    assert resolve_batch_sizes(load_config(raw), dp) == expected


@pytest.mark.parametrize(
    ("raw", "dp", "message"),
    [
        (
            {
                "train_batch_size": 30,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 1,
            },
            8,
            "The batch sizes do not fit together: train_batch_size=30, "
            "train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1, with a "
            "data-parallel size of 8. DeepSpeed's rule is train_batch_size = "
            "train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size, "
            "but 4 x 1 x 8 = 32. Fix: set train_batch_size to 32, or set one of the three to "
            '"auto" (or remove it) and jzero derives it.',
        ),
        (
            {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
            8,
            "The batch sizes do not fit together: train_batch_size=30, "
            "train_micro_batch_size_per_gpu=4, gradient_accumulation_steps not set (derived), "
            "with a data-parallel size of 8. DeepSpeed's rule is train_batch_size = "
            "train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size, "
            "but 30 is not divisible by 4 x 8 = 32. Fix: set train_batch_size to a multiple of "
            "32 (e.g. 32), or change train_micro_batch_size_per_gpu.",
        ),
        (
            {"train_batch_size": 20},
            8,
            "The batch sizes do not fit together: train_batch_size=20, "
            "train_micro_batch_size_per_gpu not set (derived), gradient_accumulation_steps not "
            "set (1, DeepSpeed's default), with a data-parallel size of 8. DeepSpeed's rule is "
            "train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
            "data-parallel size, but 20 is not divisible by 1 x 8 = 8. Fix: set train_batch_size "
            "to a multiple of 8 (e.g. 16), or change gradient_accumulation_steps.",
        ),
        (
            {"gradient_accumulation_steps": 2},
            8,
            "No batch size is set; set train_micro_batch_size_per_gpu (the batch per device) or "
            "train_batch_size (the global batch), optionally with gradient_accumulation_steps.",
        ),
    ],
)
def test_batch_size_errors(raw, dp, message):
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(load_config(raw), dp)
    assert str(info.value) == message
