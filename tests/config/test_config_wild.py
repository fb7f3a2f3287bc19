"""DeepSpeed configs from the wild: Hugging Face / Accelerate / DeepSpeed-Chat load unchanged.

The fixtures under ``tests/fixtures/ds_configs`` are written after the published templates
(Transformers' and Accelerate's DeepSpeed docs, DeepSpeed-Chat's ``get_train_ds_config``).
Each loads with warnings only, its ``"auto"`` values resolve as asserted, and it trains a
step of tests/support/toy.py's model through ``jzero.initialize`` (the configs of one stage and
options compile the same step: the run-wide compile cache shares it).
"""

import logging
import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy
from config_checks import error_of, load_quietly
from numerics import needs_float16
from repo import FIXTURES

import jzero
from jzero.config import (
    ConfigError,
    JzeroConfigDeprecationWarning,
    JzeroConfigWarning,
    load_config,
    resolve_auto,
)

DS_CONFIGS = FIXTURES / "ds_configs"
DP = 8  # tests/conftest.py's virtual devices, all on the data axis


def auto_log(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if '"auto" resolved' in r.getMessage()]
    assert len(lines) == 1, lines
    return lines[0]


def train_one_step(cfg, params=None):
    params = toy.make_params(d=16, num_layers=2) if params is None else params
    engine = jzero.initialize(params, toy.loss_fn, optax.adamw(1e-3), config=cfg)
    (batch,) = toy.make_batches(1, engine.train_batch_size)
    loss = float(engine.train_step(batch)["loss"])
    assert np.isfinite(loss), loss
    return engine


# --- loading: "auto" recorded, aliases rewritten, no-effect keys listed ------------------------


def test_hf_zero3_template_records_each_auto_and_loads_with_warnings_only():
    cfg, messages = load_quietly(DS_CONFIGS / "hf_zero3.json")
    assert cfg.auto == (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "bf16.enabled",
        "fp16.enabled",
    )
    zero = cfg.zero_optimization
    assert cfg.gradient_clipping == 1.0
    assert zero.stage3_prefetch_bucket_size is None  # jzero's "no prefetch"
    assert zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_max_reuse_distance == 1_000_000_000  # written as a number: its meaning
    assert zero.stage3_gather_16bit_weights_on_model_save is False
    assert cfg.optimizer.params["lr"] == "auto"
    assert len(messages) == 1 and "have no effect in jzero" in messages[0]
    assert "zero_optimization.reduce_bucket_size" in messages[0]
    assert "bf16" not in messages[0]  # bf16.check_grad_overflow and bf16.enabled are used
    # The auto keys survive a round trip through to_dict.
    assert load_quietly(cfg.to_dict())[0] == cfg


def test_deprecated_aliases_map_to_the_canonical_keys_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(DS_CONFIGS / "deprecated_aliases.json")
    kinds = [w.category for w in caught]
    assert kinds.count(JzeroConfigDeprecationWarning) == 1 and len(kinds) == 2  # + no-effect
    messages = [str(w.message) for w in caught]
    zero = cfg.zero_optimization
    assert zero.offload_optimizer.device == "cpu"
    assert zero.offload_optimizer.pin_memory is False
    assert zero.offload_param.device == "none"
    assert zero.stage3_prefetch_bucket_size == 1048576
    assert zero.stage3_param_persistence_threshold == 1000
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    renamed = [m for m in messages if "other spellings" in m]
    assert renamed == [
        "These DeepSpeed keys are other spellings of jzero's keys and were read as those:\n"
        "  - zero_optimization.stage3_gather_fp16_weights_on_model_save: write "
        "stage3_gather_16bit_weights_on_model_save\n"
        "  - zero_optimization.prefetch_bucket_size: write stage3_prefetch_bucket_size\n"
        "  - zero_optimization.param_persistence_threshold: write "
        "stage3_param_persistence_threshold\n"
        "  - zero_optimization.max_live_parameters: write stage3_max_live_parameters\n"
        "  - zero_optimization.cpu_offload: write offload_optimizer: {device: cpu}\n"
        "  - zero_optimization.cpu_offload_param: write offload_param: {device: none}\n"
        "  - zero_optimization.cpu_offload_use_pin_memory: write pin_memory under "
        "offload_optimizer/offload_param\n"
        "Rename them to silence this warning."
    ]
    assert error_of(
        {"zero_optimization": {"max_reuse_distance": 1, "stage3_max_reuse_distance": 2}}
    ) == (
        "zero_optimization.max_reuse_distance and zero_optimization.stage3_max_reuse_distance"
        " are both set, but max_reuse_distance is another spelling of "
        "stage3_max_reuse_distance; keep only stage3_max_reuse_distance."
    )


def test_device_none_means_no_offload_and_ds_chat_sections_are_no_effect():
    cfg, messages = load_quietly(DS_CONFIGS / "ds_chat_hybrid.json")
    zero = cfg.zero_optimization
    assert (zero.offload_param.device, zero.offload_optimizer.device) == ("none", "none")
    assert cfg.auto == ()
    (message,) = messages
    for key in ("hybrid_engine", "zero_optimization.memory_efficient_linear"):
        assert f"  - {key}: " in message
    # Its tensorboard section is DeepSpeed's monitor, which jzero runs.
    assert "tensorboard" not in message
    tb = cfg.tensorboard
    assert tb.enabled and tb.job_name == "step3_actor_tensorboard"
    assert tb.output_path == "step3_tensorboard/ds_tensorboard_logs/"


def test_deepspeed_sections_without_an_effect_are_listed_not_refused():
    raw = {
        "train_micro_batch_size_per_gpu": 1,
        "pipeline": {"stages": "auto", "partition": "best"},
        "tensor_parallel": {"autotp_size": 1},
        "expert_parallel": {"enabled": True, "autoep_size": 1},
        "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False}}},
        "data_efficiency": {"enabled": True},
        "curriculum_learning": {"enabled": True},
        "flops_profiler": {"enabled": True},
        "autotuning": {"enabled": True},
        "csv_monitor": {"enabled": True},
        "wandb": {"enabled": True},
        "comet": {"enabled": True},
        "checkpoint": {"tag_validation": "Fail", "writer": {"type": "fast"}},
        "optimizer": {"type": "Adam", "legacy_fusion": False, "params": {"lr": 1e-3}},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "dump_state": True,
        "sparse_gradients": True,
        "amp": {"enabled": True},
        "timers": {"throughput": {"enabled": True}},
        "gradient_allreduce_op": "mean",
        "bf16": {"enabled": True, "check_grad_overflow": True},
    }
    cfg, (message,) = load_quietly(raw)
    listed = [line.split(":")[0].removeprefix("  - ") for line in message.splitlines()[1:-1]]
    used = {"train_micro_batch_size_per_gpu", "gradient_allreduce_op", "bf16", "optimizer",
            "tensor_parallel", "pipeline", "expert_parallel", "flops_profiler", "csv_monitor",
            "wandb"}  # fmt: skip
    inner = {"checkpoint.tag_validation", "checkpoint.writer", "optimizer.legacy_fusion",
             "pipeline.partition"}  # fmt: skip
    assert set(listed) == (set(raw) - used - {"checkpoint"}) | inner
    assert cfg.bf16.check_grad_overflow is True


@pytest.mark.parametrize(
    ("raw", "start"),
    [
        (
            {"pipeline": {"stages": 2}, "gradient_accumulation_steps": 1},
            "pipeline.stages: 2 needs at least 2 micro-batches",
        ),
        ({"pipeline": {"schedule": "zb"}}, "pipeline.schedule: 'zb' is not a schedule"),
        (
            {
                "pipeline": {"stages": 2},
                "gradient_accumulation_steps": 2,
                "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2},
            },
            "pipeline.stages: 2 does not compose with zero_hpz_partition_size > 1 (ZeRO++ hpZ) yet",
        ),
        (
            {"tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 4}}},
            "tensor_parallel.tp.tp_size: 4 does not match the 2 devices of",
        ),
        (
            {
                "expert_parallel": {"enabled": True, "autoep_size": 2},
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
                },
            },
            "expert_parallel.autoep_size: 2 does not compose with offload_optimizer.device: nvme",
        ),
        (
            {"compression_training": {"sparse_pruning": {"shared_parameters": {"enabled": True}}}},
            "compression_training.sparse_pruning.shared_parameters: DeepSpeed Compression",
        ),
        (
            {"sequence_parallel_size": 3, "model": {"num_heads": 4}},
            "sequence_parallel_size: 3 does not divide the 4 attention heads",
        ),
        ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op: 'sum' is not supported"),
        ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation: false"),
    ],
)
def test_features_that_would_change_what_is_trained_are_errors(raw, start):
    assert error_of(raw).startswith(start)


def test_typos_still_fail_with_did_you_mean():
    assert error_of({"gradient_cliping": 1.0}) == (
        "gradient_cliping is not a known key (did you mean 'gradient_clipping'?); remove it or "
        "fix its name."
    )
    assert error_of({"zero_optimization": {"stage3_prefetch_bucket_sise": "auto"}}) == (
        "zero_optimization.stage3_prefetch_bucket_sise is not a known key (did you mean "
        "'stage3_prefetch_bucket_size'?); remove it or fix its name."
    )
    assert "did you mean 'hybrid_engine'" in error_of({"hybrid_engin": {"enabled": False}})


def test_json_reads_as_hjson_comments_and_trailing_commas(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(
        "{\n"
        "  // ZeRO-2, as in a hand-edited ds_config.json\n"
        '  "train_micro_batch_size_per_gpu": 2,\n'
        '  "zero_optimization": {"stage": 2, /* no offload */ "overlap_comm": true,},\n'
        "}\n"
    )
    cfg, _ = load_quietly(path)
    assert cfg.zero_optimization.stage == 2 and cfg.train_micro_batch_size_per_gpu == 2
    path.write_text(
        '{\n  // a comment\n  "seed": 1,\n  "zero_optimization": {"stage": 1,\n  "stage": 2,},\n}'
    )
    assert error_of(path).startswith(
        f"zero_optimization.stage is set twice in the config file {str(path)!r}; jzero refuses"
    )
    path.write_text('{\n  // a comment\n  "seed": 1\n  "stage": 2\n}')
    assert error_of(path).startswith(
        f"The config file {str(path)!r} is not valid YAML/JSON: line 4 "
    )


# --- resolve_auto: what the code decides ------------------------------------------------------


def test_auto_precision_follows_the_params_dtype(caplog):
    cfg, _ = load_quietly(DS_CONFIGS / "hf_zero3.json", ["train_micro_batch_size_per_gpu=2"])
    bf16_params = toy.make_params(d=16, num_layers=2, dtype=jnp.bfloat16)
    with caplog.at_level(logging.INFO, logger="jzero"):
        out = resolve_auto(cfg, bf16_params, optimizer_given=True, data_parallel_size=DP)
    assert (out.bf16.enabled, out.fp16.enabled, out.auto) == (True, False, ())
    assert out.optimizer is None and out.scheduler is None
    assert auto_log(caplog) == (
        'jzero: "auto" resolved: train_batch_size=16, gradient_accumulation_steps=1, '
        "gradient_clipping=1.0, zero_optimization.stage3_param_persistence_threshold=100000, "
        "zero_optimization.stage3_gather_16bit_weights_on_model_save=false, "
        "zero_optimization.reduce_bucket_size=500000000, "
        "zero_optimization.stage3_prefetch_bucket_size=not set, "
        "bf16.enabled=true (floating-point params: bfloat16), "
        "fp16.enabled=false (floating-point params: bfloat16), "
        "optimizer.params.lr=from the optax optimizer, "
        "optimizer.params.betas=from the optax optimizer, "
        "optimizer.params.eps=from the optax optimizer, "
        "optimizer.params.weight_decay=from the optax optimizer, "
        "scheduler.params.warmup_min_lr=from the optax optimizer, "
        "scheduler.params.warmup_max_lr=from the optax optimizer, "
        "scheduler.params.warmup_num_steps=from the optax optimizer, "
        "scheduler.params.total_num_steps=from the optax optimizer"
    )
    assert any("sections are not used" in r.getMessage() for r in caplog.records)
    f32 = resolve_auto(cfg, toy.make_params(d=16), optimizer_given=True, data_parallel_size=DP)
    assert (f32.bf16.enabled, f32.fp16.enabled) == (False, False)
    explicit_fp16 = load_quietly(
        {"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": "auto"}}
    )[0]
    both = resolve_auto(explicit_fp16, bf16_params, optimizer_given=True, data_parallel_size=DP)
    assert (both.bf16.enabled, both.fp16.enabled) == (False, True)


def test_auto_optimizer_values_without_an_optimizer_are_one_clear_error():
    cfg, _ = load_quietly(DS_CONFIGS / "hf_zero2.json", ["train_micro_batch_size_per_gpu=2"])
    with pytest.raises(ConfigError) as info:
        resolve_auto(cfg, toy.make_params(d=16), optimizer_given=False, data_parallel_size=DP)
    assert str(info.value) == (
        "optimizer.params.lr, optimizer.params.betas, optimizer.params.eps, "
        "optimizer.params.weight_decay, scheduler.params.warmup_min_lr, "
        'scheduler.params.warmup_max_lr, scheduler.params.warmup_num_steps are "auto", which '
        "takes the value from the optax optimizer passed to jzero.initialize, and none was "
        "passed. Pass optimizer=optax.adamw(...) (the config's optimizer and scheduler sections "
        "are then not used), or write the values in the config."
    )


def test_all_batch_sizes_auto_are_taken_from_the_first_batch(caplog):
    """Hugging Face's templates leave every batch key "auto": the first batch given to
    train_step sets them (its leading dim is the global batch), and the config records them."""
    cfg, _ = load_quietly(DS_CONFIGS / "hf_zero2.json")
    with caplog.at_level(logging.INFO, logger="jzero"):
        engine = jzero.initialize(toy.make_params(d=16, num_layers=2), toy.loss_fn,
                                  optax.adamw(1e-3), config=cfg)  # fmt: skip
        assert engine.train_batch_size is None
        assert "train_batch_size=from the first batch" in auto_log(caplog)
        losses = [float(engine.train_step(b)["loss"]) for b in toy.make_batches(2, 16)]
    assert all(np.isfinite(losses))
    assert (engine.train_batch_size, engine.micro_batch_size, engine.accumulation_steps) == (
        16,
        16 // DP,
        1,
    )
    assert engine.config.train_batch_size == 16
    assert engine.config.train_micro_batch_size_per_gpu == 16 // DP
    assert "batch sizes from the first batch: train_batch_size 16" in caplog.text
    # Another batch size afterwards is the usual clear error.
    with pytest.raises(ValueError, match="has leading dim 8 but train_batch_size is 16"):
        engine.train_step(toy.make_batches(1, 8)[0])


def test_a_config_without_batch_keys_takes_them_from_the_first_batch(caplog):
    """Hugging Face's test-suite ZeRO-3 config sets no batch key at all (the Trainer and
    Accelerate fill them in): through the engine the first batch sets them, as for "auto"
    (``jzero train`` fills them from ``train.micro_batch_size``: tests/train/test_command.py)."""
    cfg, _ = load_quietly(DS_CONFIGS / "hf_zero3_no_batch.json")
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (None, None)
    with caplog.at_level(logging.INFO, logger="jzero"):
        engine = jzero.initialize(toy.make_params(d=16, num_layers=2), toy.loss_fn,
                                  optax.adamw(1e-3), config=cfg)  # fmt: skip
        assert engine.train_batch_size is None
        assert "the config sets no batch size" in caplog.text
        losses = [float(engine.train_step(b)["loss"]) for b in toy.make_batches(2, 24)]
    assert all(np.isfinite(losses))
    sizes = (engine.train_batch_size, engine.micro_batch_size, engine.accumulation_steps)
    assert sizes == (24, 24 // DP, 1)
    assert engine.config.train_batch_size == 24
    assert engine.config.train_micro_batch_size_per_gpu == 24 // DP
    assert engine.config.gradient_accumulation_steps == 1
    assert caplog.text.count("batch sizes from the first batch: train_batch_size 24") == 1
    with pytest.raises(ValueError, match="has leading dim 8 but train_batch_size is 24"):
        engine.train_step(toy.make_batches(1, 8)[0])


# --- one training step each -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hf_zero2.json", "hf_zero3.json"])
def test_hf_templates_train_a_step(name, caplog):
    # Hugging Face fills the batch "auto"s from its TrainingArguments; here the override does.
    cfg, _ = load_quietly(DS_CONFIGS / name, ["train_micro_batch_size_per_gpu=1"])
    with caplog.at_level(logging.INFO, logger="jzero"):
        engine = train_one_step(cfg)
    line = auto_log(caplog)
    assert "train_batch_size=8" in line and "gradient_clipping=1.0" in line
    assert engine.config.auto == () and engine.config.optimizer is None
    assert engine.config.bf16.enabled is False and engine.config.fp16.enabled is False
    assert engine.config.gradient_clipping == 1.0


def test_hf_offload_template_with_bf16_params_trains_a_step(caplog):
    cfg, _ = load_quietly(
        DS_CONFIGS / "hf_zero3_offload.json", ["train_micro_batch_size_per_gpu=1"]
    )
    params = toy.make_params(d=16, num_layers=2, dtype=jnp.bfloat16)
    with caplog.at_level(logging.INFO, logger="jzero"):
        engine = train_one_step(cfg, params)
    assert "bf16.enabled=true" in auto_log(caplog)
    assert engine.config.bf16.enabled is True
    assert engine.config.zero_optimization.stage3_max_reuse_distance is None
    assert engine.config.zero_optimization.offload_param.device == "cpu"


@pytest.mark.parametrize(
    "name",
    [pytest.param("ds_chat_hybrid.json", marks=needs_float16), "deprecated_aliases.json"],
)  # DeepSpeed-Chat's config trains in fp16
def test_configs_train_a_step_from_the_path(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # DeepSpeed-Chat's tensorboard output_path is relative
    with pytest.warns(JzeroConfigWarning):
        engine = train_one_step(str(DS_CONFIGS / name))
    assert engine.train_batch_size == 8
    engine.close()
    if engine.config.tensorboard.enabled:  # its monitor ran: one event file where it says
        job = tmp_path / "step3_tensorboard" / "ds_tensorboard_logs" / "step3_actor_tensorboard"
        assert len(list(job.glob("events.out.tfevents.*"))) == 1
