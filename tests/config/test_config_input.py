"""Tests that no config input is silently lost: repeated keys, out-of-range optimizer and
schedule values, ``~`` in paths, and the keys that guard a run's data (checkpoint.overwrite,
skip_nonfinite, bf16.check_grad_overflow, train.max_consecutive_nonfinite)."""

import json
import os
import warnings

import pytest

from jzero.config import ConfigError, JzeroConfigWarning, load_config, resolve_optimizer


def error_of(source, overrides=()):
    with pytest.raises(ConfigError) as info:
        load_config(source, overrides)
    return str(info.value)


def no_warning_load(source, overrides=()):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_config(source, overrides)


# --- a key written twice ------------------------------------------------------------------


def test_yaml_nested_duplicate_key_names_path_file_and_lines(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "train_batch_size: 8\n"
        "zero_optimization:\n"
        "  stage: 2\n"
        "  offload_optimizer: {device: cpu}\n"
        "  stage: 3\n"
    )
    assert error_of(path) == (
        f"zero_optimization.stage is set twice in the config file {str(path)!r} (lines 3 and "
        "5); jzero refuses a repeated key (as DeepSpeed does) instead of silently keeping the "
        "last value. Delete one of them."
    )


def test_yaml_duplicate_at_top_level_and_deep_in_a_list(tmp_path):
    top = tmp_path / "top.yaml"
    top.write_text("seed: 1\ntrain: {steps: 3}\nseed: 2\n")
    assert error_of(top).startswith(
        f"seed is set twice in the config file {str(top)!r} (lines 1 and 3);"
    )
    deep = tmp_path / "deep.yaml"
    deep.write_text("model:\n  blocks:\n    - {width: 1}\n    - width: 2\n      width: 3\n")
    assert "model.blocks[1].width is set twice" in error_of(deep)


def test_yaml_merge_key_may_still_be_overridden(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text(
        "model: &base {d_model: 64, num_heads: 4}\n"
        "data: {<<: *base, d_model: 128}\n"  # overriding a merged key is not a duplicate
    )
    cfg = load_config(path)
    assert cfg.data["d_model"] == 128 and cfg.data["num_heads"] == 4


def test_json_nested_duplicate_key_names_path_file_and_lines(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(
        "{\n"
        '  "train_batch_size": 8,\n'
        '  "zero_optimization": {\n'
        '    "stage": 2,\n'
        '    "reduce_scatter": true,\n'
        '    "stage": 3\n'
        "  }\n"
        "}\n"
    )
    assert error_of(path) == (
        f"zero_optimization.stage is set twice in the config file {str(path)!r} (lines 4 and "
        "6); jzero refuses a repeated key (as DeepSpeed does) instead of silently keeping the "
        "last value. Delete one of them."
    )


def test_json_duplicate_in_a_list_and_key_split_over_lines(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"model": {"x": [{"a": 1,\n "a"\n :\n 2}]}}')
    assert error_of(path).startswith(
        f"model.x[0].a is set twice in the config file {str(path)!r} (lines 1 and 2);"
    )


def test_json_without_duplicates_loads_as_before(tmp_path):
    raw = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.8, 0.9]}},
        "model": {"nested": [{"a": 1}, {}], "empty": {}},
    }
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw, indent=2))
    cfg = no_warning_load(path)
    assert cfg == load_config(raw)
    assert cfg.to_dict()["model"] == raw["model"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"seed": 1,\n "steps_per_print": }')  # a trailing comma alone is allowed
    assert error_of(bad).startswith(f"The config file {str(bad)!r} is not valid YAML/JSON: line 2 ")


def test_duplicate_key_in_an_override():
    assert error_of(None, ["model={d_model: 64, d_model: 128}"]) == (
        "model.d_model is set twice in the override 'model={d_model: 64, d_model: 128}'; jzero "
        "refuses a repeated key (as DeepSpeed does) instead of silently keeping the last value. "
        "Delete one of them."
    )


# --- optimizer and schedule values in range -----------------------------------------------


@pytest.mark.parametrize(
    ("optimizer", "message"),
    [
        (
            {"type": "AdamW", "params": {"lr": -0.001}},
            "optimizer.params.lr is -0.001; it must be >= 0 (torch.optim refuses a negative "
            "value too). Set it to 0 or a positive value.",
        ),
        (
            {"type": "Adam", "params": {"eps": -1e-8}},
            "optimizer.params.eps is -1e-08; it must be >= 0 (torch.optim refuses a negative "
            "value too). Set it to 0 or a positive value.",
        ),
        (
            {"type": "Lamb", "params": {"weight_decay": -0.1}},
            "optimizer.params.weight_decay is -0.1; it must be >= 0 (torch.optim refuses a "
            "negative value too). Set it to 0 or a positive value.",
        ),
        (
            {"type": "SGD", "params": {"momentum": -0.9}},
            "optimizer.params.momentum is -0.9; it must be >= 0 (torch.optim refuses a negative "
            "value too). Set it to 0 or a positive value.",
        ),
        (
            {"type": "Adagrad", "params": {"lr_decay": -1}},
            "optimizer.params.lr_decay is -1; it must be >= 0 (torch.optim refuses a negative "
            "value too). Set it to 0 or a positive value.",
        ),
        (
            {"type": "AdamW", "params": {"betas": [0.9, 1.0]}},
            "optimizer.params.betas is [0.9, 1.0]; each beta must be in [0, 1) (as in "
            "torch.optim), but betas[1] is 1.0. Set it to a value in [0, 1), e.g. betas: "
            "[0.9, 0.999].",
        ),
        (
            {"type": "Lion", "params": {"betas": [-0.1, 0.99]}},
            "optimizer.params.betas is [-0.1, 0.99]; each beta must be in [0, 1) (as in "
            "torch.optim), but betas[0] is -0.1. Set it to a value in [0, 1), e.g. betas: "
            "[0.9, 0.999].",
        ),
        (
            {"type": "AdamW", "params": {"lr": float("inf")}},
            "optimizer.params.lr: inf is not allowed; it must be finite (not inf or NaN). Set "
            "a finite value.",
        ),
        (
            {"type": "AdamW", "params": {"betas": [0.9, float("nan")]}},
            "optimizer.params.betas: [0.9, nan] is not allowed; it must be finite (not inf or "
            "NaN). Set a finite value.",
        ),
    ],
)
def test_optimizer_values_out_of_range_are_refused(optimizer, message):
    assert error_of({"optimizer": optimizer}) == message


@pytest.mark.parametrize(
    ("scheduler", "key", "value"),
    [
        ({"type": "WarmupLR"}, "warmup_min_lr", -1e-5),
        ({"type": "WarmupLR"}, "warmup_max_lr", -1),
        ({"type": "WarmupDecayLR", "params": {"total_num_steps": 10}}, "warmup_max_lr", -0.1),
        ({"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}, "cycle_min_lr", -0.01),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 0.0}}, "cycle_max_lr", -0.1),
        ({"type": "LRRangeTest"}, "lr_range_test_min_lr", -0.5),
        ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10}}, "cos_min_ratio", -0.5),
    ],
)
def test_negative_schedule_lrs_are_refused(scheduler, key, value):
    params = {**scheduler.get("params", {}), key: value}
    assert error_of({"scheduler": {"type": scheduler["type"], "params": params}}) == (
        f"scheduler.params.{key} is {value!r}; it must be >= 0 (a learning rate or lr ratio "
        "cannot be negative). Set it to 0 or a positive value."
    )


def test_edge_values_are_accepted():
    cfg = no_warning_load(
        {
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": 0, "betas": [0, 0.0], "eps": 0, "weight_decay": 0.0},
            },
            "scheduler": {
                "type": "OneCycle",
                "params": {"cycle_min_lr": 0, "cycle_max_lr": 0.0},
            },
        }
    )
    name, params = resolve_optimizer(cfg.optimizer)
    assert name == "adamw" and params["lr"] == 0.0 and params["betas"] == (0.0, 0.0)
    assert params["eps"] == 0.0
    sgd = no_warning_load({"optimizer": {"type": "SGD", "params": {"momentum": 0, "lr": 0}}})
    assert resolve_optimizer(sgd.optimizer)[1]["momentum"] == 0.0
    big = no_warning_load({"optimizer": {"type": "Adam", "params": {"betas": [0.999999, 0.5]}}})
    assert resolve_optimizer(big.optimizer)[1]["betas"] == (0.999999, 0.5)


# --- ~ in paths ---------------------------------------------------------------------------


def test_tilde_is_expanded_in_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "c.yaml"
    path.write_text(
        "checkpoint: {directory: ~/ckpt}\ntrain: {log_dir: ~/runs/a}\n"
        "data: {source: text, path: ~/corpus.txt}\n"
    )
    cfg = load_config(path)
    assert cfg.checkpoint.directory == os.path.join(str(tmp_path), "ckpt")
    assert cfg.train.log_dir == os.path.join(str(tmp_path), "runs/a")
    assert cfg.data["path"] == os.path.join(str(tmp_path), "corpus.txt")
    assert cfg.data["source"] == "text"
    assert load_config(cfg.to_dict()) == cfg
    over = load_config(None, ["checkpoint.directory=~/other"])
    assert over.checkpoint.directory == os.path.join(str(tmp_path), "other")
    plain = load_config({"checkpoint": {"directory": "rel/~x"}, "data": {"path": 3}})
    assert plain.checkpoint.directory == "rel/~x" and plain.data["path"] == 3


# --- the new keys -------------------------------------------------------------------------


def test_new_keys_default():
    cfg = no_warning_load({})
    assert cfg.checkpoint.overwrite is False
    assert cfg.skip_nonfinite is None
    assert cfg.bf16.check_grad_overflow is True  # DeepSpeed 0.19
    assert cfg.bf16.skip_nonfinite is False
    assert cfg.train.max_consecutive_nonfinite == 32
    out = cfg.to_dict()
    assert out["checkpoint"]["overwrite"] is False and out["skip_nonfinite"] is None
    assert out["bf16"]["check_grad_overflow"] is True
    assert out["train"]["max_consecutive_nonfinite"] == 32


def test_new_keys_parse_and_round_trip():
    raw = {
        "checkpoint": {"directory": "/tmp/c", "overwrite": True},
        "skip_nonfinite": True,
        "bf16": {"enabled": True, "check_grad_overflow": False},
        "train": {"max_consecutive_nonfinite": 0},
    }
    cfg = no_warning_load(raw)
    assert cfg.checkpoint.overwrite is True and cfg.skip_nonfinite is True
    assert cfg.bf16.check_grad_overflow is False and cfg.train.max_consecutive_nonfinite == 0
    out = cfg.to_dict()
    assert out["checkpoint"]["overwrite"] is True and out["skip_nonfinite"] is True
    assert out["bf16"]["check_grad_overflow"] is False
    assert out["train"]["max_consecutive_nonfinite"] == 0
    assert json.loads(json.dumps(out)) == out
    assert no_warning_load(out) == cfg
    assert no_warning_load(None, ["skip_nonfinite=false"]).skip_nonfinite is False


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"checkpoint": {"overwrite": "yes"}},
            "checkpoint.overwrite: 'yes' is not allowed; it must be true or false.",
        ),
        ({"skip_nonfinite": 1}, "skip_nonfinite: 1 is not allowed; it must be true or false."),
        (
            {"bf16": {"check_grad_overflow": "true"}},
            "bf16.check_grad_overflow: 'true' is not allowed; it must be true or false.",
        ),
        (
            {"train": {"max_consecutive_nonfinite": -1}},
            "train.max_consecutive_nonfinite: -1 is not allowed; it must be >= 0.",
        ),
        (
            {"train": {"max_consecutive_nonfinite": 2.5}},
            "train.max_consecutive_nonfinite: 2.5 is not allowed; it must be an integer.",
        ),
        (
            {"fp16": {"enabled": True}, "skip_nonfinite": False},
            "skip_nonfinite: false cannot be used with fp16.enabled: true: fp16 loss scaling "
            "always skips a step whose gradients overflow (and lowers the loss scale). Remove "
            "skip_nonfinite, or use bf16 or float32 to apply such steps.",
        ),
        (
            {"bf16": {"enabled": True, "skip_nonfinite": True}, "skip_nonfinite": False},
            "bf16.skip_nonfinite: true and skip_nonfinite: false contradict each other; remove "
            "one of them (skip_nonfinite: false with bf16.check_grad_overflow: false applies "
            "steps with inf/NaN gradients).",
        ),
    ],
)
def test_new_keys_reject_wrong_values(raw, message):
    assert error_of(raw) == message


def test_check_grad_overflow_is_a_real_key_now():
    cfg = no_warning_load({"bf16": {"enabled": True, "check_grad_overflow": True}})
    assert cfg.bf16.check_grad_overflow is True
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        load_config({"bf16": {"enabled": True, "check_grad_overflow": False}})
    assert not [w for w in record if issubclass(w.category, JzeroConfigWarning)]
