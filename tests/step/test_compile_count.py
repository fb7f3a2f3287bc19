"""What the first step costs: the programs ``initialize`` and the first ``train_step`` compile.

One program makes the whole state (``jit(init)``) and one is the step (``jit(step)``): no eager
operation compiles a program of its own (the seed's key, optax's placeholders), the Flax model
is built once, and re-fitting the stage-3 layout to a scan's layers compiles nothing. A
regression that adds a compilation fails here; the seconds are the benchmark's
(``benchmarks/compile_time.py``).

With the persistent compilation cache (``train.compile_cache``), a second ``jzero train``
process of the same config loads the step from the cache and compiles nothing.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from procs import device_env
from repo import ROOT

import jzero
from jzero.distributed import CompileCounter, compile_cache_dir

W = 16
BATCH = {"x": np.ones((8, W), np.float32), "y": np.zeros((8, W), np.float32)}


def _loop_params(layers: int = 2) -> dict:
    rng = np.random.default_rng(0)
    return {
        f"layer_{i}": {
            "w": (rng.normal(size=(W, W)) / 4).astype(np.float32),
            "b": np.zeros(W, np.float32),
            "s": np.ones(W, np.float32),
        }
        for i in range(layers)
    }


def _loop_loss(p, b):
    h = b["x"]
    for i in range(len(p)):
        layer = p[f"layer_{i}"]
        h = jnp.tanh(h @ layer["w"] + layer["b"]) * layer["s"]
    return jnp.mean((h - b["y"]) ** 2)


def _scan_init(key):  # 8 stacked layers: stage 3 first shards dim 0, then the scan's refit
    return {"w": jax.random.normal(key, (8, W, W)) / 4}


def _scan_loss(p, b):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), b["x"], p["w"])
    return jnp.mean((h - b["y"]) ** 2)


class _Net(nnx.Module):  # jzero train's path: an NNX constructor, with BatchNorm state
    def __init__(self, rngs):
        self.dense = nnx.Linear(W, W, rngs=rngs)
        self.norm = nnx.BatchNorm(W, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.dense(x))


def _nnx_loss(model, b):
    return jnp.mean((model(b["x"]) - b["y"]) ** 2)


MODELS = {
    "loop": dict(params=_loop_params(), loss_fn=_loop_loss),
    "scan": dict(params=_scan_init, loss_fn=_scan_loss),
    "nnx": dict(model=lambda: _Net(nnx.Rngs(0)), loss_fn=_nnx_loss),
}


# Each model once, both stages among them: the scan at stage 3 (the layout's refit), NNX at
# stage 3 (the model built once, its state sharded), the loop at stage 0 (nothing sharded).
@pytest.mark.parametrize(("model", "stage"), [("loop", 0), ("nnx", 3), ("scan", 3)])
def test_initialize_and_the_first_step_compile_one_init_and_one_step(model, stage):
    config = {
        "train_batch_size": 8,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    with CompileCounter() as first:
        engine = jzero.initialize(optimizer=optax.adam(1e-3), config=config, **MODELS[model])
        start = engine.plan.leaves[0].param_dim
        metrics = engine.train_step(BATCH)
        jax.block_until_ready(metrics["loss"])
    # Programs, compiled or loaded from the run's persistent cache (conftest): exactly these two.
    assert first.names == ["jit(init)", "jit(step)"], first.names
    assert first.programs == 2
    if model == "scan" and stage == 3:  # the layout was re-fitted to the scan: no program
        assert (start, engine.plan.leaves[0].param_dim) == (0, 1)
    with CompileCounter() as second:
        jax.block_until_ready(engine.train_step(BATCH)["loss"])
    assert second.programs == 0, second.names


def test_the_cache_directory_is_a_cache_folder_never_the_checkpoint_volume(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert compile_cache_dir("auto") == tmp_path / "home" / ".cache" / "jzero" / "compile_cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache_dir("auto") == tmp_path / "xdg" / "jzero" / "compile_cache"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))  # JAX's own setting
    assert compile_cache_dir("auto") == tmp_path / "jax"
    assert compile_cache_dir(str(tmp_path / "c")) == tmp_path / "c"
    assert compile_cache_dir("~/c") == tmp_path / "home" / "c"
    assert compile_cache_dir(None) is None


TINY = [
    "--quiet",
    "--set",
    "checkpoint.directory=null",  # no checkpoints unless a test names a folder
    "--set",
    "model={vocab_size: 256, seq_len: 16, num_layers: 2, num_heads: 2, d_model: 32, d_ff: 32}",
    "--set",
    "data={source: stdlib, max_bytes: 100000}",
    "--set",
    "train_micro_batch_size_per_gpu=1",
    "--set",
    "train.eval_interval=0",
    "--set",
    "zero_optimization.stage=3",
]


def _train(log_dir: Path, *flags: str) -> dict:
    # The run's flags, but not its shared compilation cache (conftest): each child's cache is
    # the one its flags name, or none.
    env = {
        k: v
        for k, v in device_env(8).items()
        if k != "JAX_COMPILATION_CACHE_DIR" and not k.startswith("JAX_PERSISTENT_CACHE_")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "jzero.cli", "train", "configs/zero2.yaml", *TINY]
        + ["--set", f"train.log_dir={log_dir}", *flags],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((log_dir / "summary.json").read_text())


def test_a_second_process_loads_the_step_from_the_persistent_cache(tmp_path):
    """Without a checkpoint directory nothing is saved (Orbax's save compiles programs of its
    own), so both runs are the same: initialize, the step (the memory report compiles it, the
    loop reuses it), one step. The first compiles and writes them, the second loads them."""
    cache = tmp_path / "cache"
    # A folder per run: a fresh run into one holding another run's metrics.jsonl is refused.
    first = _train(tmp_path / "first", "--steps", "1", "--compile-cache", str(cache))
    assert first["compile_cache"] == str(cache)
    assert first["compiles"] == 2 and first["cache_misses"] == 2 and first["cache_hits"] == 0
    assert sorted(p.name.split("-")[0] for p in cache.iterdir()) == ["jit_init", "jit_step"]
    second = _train(tmp_path / "second", "--steps", "1", "--compile-cache", str(cache))
    assert second["compiles"] == 0 and second["cache_misses"] == 0
    assert second["cache_hits"] == 2
    assert second["final_loss"] == first["final_loss"]  # the cached step computes the same
    off = _train(tmp_path / "off", "--steps", "1", "--no-compile-cache")
    assert off["compile_cache"] is None and off["cache_hits"] == 0 and off["compiles"] == 2
