"""Parallel sizes ``"auto"``: the layout ranked by the cost model, compiled in that order, the
first whose compiled step fits ``device_memory`` kept (compiled once) and recorded; a budget
nothing fits and a fixed size that can't work are clear errors.

The built-in GPT of ``tests/support/compositions.py`` (float64, 4 heads, 8 tokens, 2 layers) on
8 devices; only the sizes each test needs are "auto", so each compiles a few small steps."""

import jax
import numpy as np
import optax
import pytest
from compositions import CLIP, LR, TINY, batches, gpt, model_config, params, reference
from numerics import max_rel_error

import jzero
from jzero.config import ConfigError
from jzero.distributed import CompileCounter

pytestmark = pytest.mark.float64


def settings(rows, budget, **sizes):
    """``rows`` rows a step, ``budget`` per device, the given sizes (the rest 1)."""
    return {
        "train_batch_size": rows,
        "gradient_clipping": CLIP,
        "device_memory": budget,
        "zero_optimization": {"stage": sizes.pop("stage", 0)},
        "tensor_parallel": {"autotp_size": sizes.pop("model", 1), "num_heads": TINY["num_heads"]},
        "sequence_parallel_size": sizes.pop("seq", 1),
        "pipeline": {"stages": sizes.pop("pipe", 1)},
        "model": {"seq_len": TINY["seq_len"], "num_layers": TINY["num_layers"]},
        **sizes,
    }


def engine(config):
    cfg = model_config(())
    return jzero.initialize(
        params(cfg), lambda p, b: gpt.loss_fn(p, b, cfg), optax.adamw(LR), config
    )


def mesh_of(e):
    return {a: n for a, n in e.mesh.shape.items() if n > 1}


def test_a_roomy_budget_and_a_batch_over_every_device_is_plain_data_parallelism(caplog):
    e = engine(settings(8, "1GB", stage="auto", model="auto", seq="auto"))
    with caplog.at_level("INFO", logger="jzero"):
        e.train_step(batches()[0])
    assert mesh_of(e) == {"data": 8} and e.plan.stage.stage == 0
    cfg = e.config
    assert (cfg.autotp_size(), cfg.sequence_parallel_size, cfg.zero_optimization.stage) == (1, 1, 0)
    assert not cfg.auto and cfg.to_dict()["tensor_parallel"]["autotp_size"] == 1
    assert any("auto layout chose data 8, stage 0" in r.message for r in caplog.records)
    assert e.plan.dims.name == "data 8"  # the plan's layout is the one the cost model ranked


def test_fewer_rows_than_devices_splits_tokens_or_heads_and_trains_like_one_device():
    rows = 2
    e = engine(settings(rows, "1GB", stage=1, model="auto", seq="auto"))
    data = batches(rows)
    metrics = [e.train_step(b) for b in data]
    axes = mesh_of(e)
    assert e.mesh.shape["data"] <= rows and ("model" in axes or "seq" in axes), axes
    assert e.micro_batch_size * e.mesh.shape["data"] * e.accumulation_steps == rows
    want, want_params = reference(model_config(()), rows, rows)
    got = [(float(m["loss"]), float(m["grad_norm"])) for m in metrics]
    np.testing.assert_allclose(got, want, rtol=1e-10)
    assert max_rel_error(jax.device_get(e.params), want_params) < 1e-9


@pytest.fixture(scope="module")
def needs():
    """Every candidate's compiled need when nothing fits (one tp candidate per size)."""
    with pytest.raises(ConfigError) as info:
        engine(settings(8, 1, model="auto")).train_step(batches()[0])
    return str(info.value)


def _need(message, name):
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    text = message.split(f"{name}, stage 0 needs ")[1].split(";")[0].split(".")[0:2]
    number, unit = ".".join(text).split(" ")[:2]
    return float(number) * units[unit.rstrip(".")]


def test_a_budget_below_every_candidate_lists_each_need(needs):
    assert needs.startswith("auto layout found no layout that fits 1 B per device:"), needs
    for name in ("data 8", "data 4 x model 2", "data 2 x model 4"):
        assert f"{name}, stage 0 needs" in needs, needs
    assert "device_memory" in needs


def test_a_budget_only_tensor_parallelism_fits_keeps_it_compiled_once(needs, caplog, tmp_path):
    """And a run resumed from its checkpoint before its first step compiles the layout the
    checkpoint recorded only, and goes on as the first run does."""
    plain, split = _need(needs, "data 8"), _need(needs, "data 4 x model 2")
    assert split < plain
    budget = int((plain + split) / 2)
    ckpt = {"checkpoint": {"directory": str(tmp_path)}}
    e = engine({**settings(8, budget, model="auto"), **ckpt})
    with caplog.at_level("INFO", logger="jzero"), CompileCounter() as first:
        e.train_step(batches()[0])
    line = next(r.message for r in caplog.records if "auto layout chose" in r.message)
    tried = 1 + line.count("short by")
    assert e.mesh.shape.get("model", 1) > 1
    assert f"auto layout chose {e.plan.dims.name}, stage" in line, line
    # One compilation per candidate tried, the kept one's reused by the step's first call.
    assert first.names.count("jit(step)") == tried, first.names
    with CompileCounter() as second:
        e.train_step(batches()[1])
    assert second.programs == 0, second.names
    assert e.peak_bytes(batches()[1])() <= budget
    e.save()
    e.wait_until_finished()
    went_on = float(e.train_step(batches()[0])["loss"])
    resumed = engine({**settings(8, budget, model="auto"), **ckpt})
    resumed.restore()
    with CompileCounter() as again:
        loss = float(resumed.train_step(batches()[0])["loss"])
    assert again.names.count("jit(step)") == 1, again.names
    assert dict(resumed.mesh.shape) == dict(e.mesh.shape)
    assert loss == pytest.approx(went_on, rel=1e-12)


def test_a_fixed_size_that_does_not_divide_the_devices_says_the_fix():
    with pytest.raises(ConfigError) as info:
        engine(settings(8, "1GB", pipe=3, model="auto", gradient_accumulation_steps="auto"))
    message = str(info.value)
    assert "pipeline.stages: 3 does not divide the 8 devices" in message
    assert "(1, 2, 4, 8)" in message and '"auto"' in message


def test_jzero_plan_auto_prints_the_ranked_candidates_and_trains_nothing(tiny_gpt):
    """The built-in GPT with two heads: tensor parallel 1 and 2 are the candidates, each
    compiled (abstract state) for its need; a roomy budget keeps the first ranked."""
    from jzero.demo.plan import auto_layout_table

    model = ", ".join(f"{k}: {v}" for k, v in tiny_gpt.items())
    table = auto_layout_table(
        "configs/zero0.yaml",
        "1GiB",
        overrides=[f"model={{{model}}}", "tensor_parallel.autotp_size=auto",
                   "train_batch_size=8", "train_micro_batch_size_per_gpu=null"],
    )  # fmt: skip
    lines = table.splitlines()
    assert lines[0] == "auto layout within 1.0 GiB per device, predicted fastest first", lines
    assert [line.split()[0] for line in lines[2:]] == ["1", "2"]
    assert sum("KEPT" in line for line in lines) == 1 and "KEPT" in lines[2]
    assert {"data 8", "data 4 x model 2"} == {lines[i][5:39].strip() for i in (2, 3)}
