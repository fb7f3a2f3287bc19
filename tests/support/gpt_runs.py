"""The tiny GPT trained by ZeRO++'s and overlap's tests: its batches of an affine rule, its runs
(cached per setting), and the float64 norm of its first gradient."""

import dataclasses
import functools
import warnings

import jax
import numpy as np
import optax

import jzero
from jzero.config import JzeroConfigWarning
from jzero.demo.gpt import GPTConfig, init_params, loss_fn

GPT = GPTConfig(seq_len=16, num_layers=2, num_heads=2, d_model=64, d_ff=128)


BATCH = 16


STEPS = 30  # the exact run's loss falls to about 0.41 of its first (measured)


def gpt_loss(params, batch):
    return loss_fn(params, batch, GPT)


def batches(num=STEPS):
    """Sequences of a fixed affine rule (next = 5 x + 3 mod 256): learnable, so the loss falls
    far (below half) in 30 steps and a broken quantizer would show."""
    out = []
    for i in range(num):
        tokens = [np.random.default_rng(i).integers(0, 256, (BATCH, 1))]
        for _ in range(GPT.seq_len):
            tokens.append((tokens[-1] * 5 + 3) % 256)
        out.append({"tokens": np.concatenate(tokens, 1).astype(np.int32)})
    return out


@functools.cache
def gpt_params(num_layers=2, dtype="float32"):
    """The tiny GPT's initial parameters, float64 (computing in float64) with ``dtype``, on the
    host (made once per setting, by one program rather than an eager compile per operation)."""
    cfg = dataclasses.replace(GPT, num_layers=num_layers, dtype=dtype)
    with jax.enable_x64(dtype == "float64"):
        params = jax.jit(lambda key: init_params(key, cfg))(jax.random.key(0))
        return cfg, jax.tree.map(lambda x: np.asarray(x, dtype), params)


@functools.cache
def gpt_run(stage=3, steps=STEPS, num_layers=2, dtype="float32", **zero):
    """(losses, compiled step text, engine, grad norms) of the tiny GPT trained ``steps`` steps;
    in float64 (under ``jax.enable_x64``) with ``dtype="float64"``."""
    with jax.enable_x64(dtype == "float64"):
        cfg, params = gpt_params(num_layers, dtype)
        config = {
            "train_batch_size": BATCH,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", JzeroConfigWarning)
            engine = jzero.initialize(
                params, lambda p, b: loss_fn(p, b, cfg), optax.adam(3e-3), config
            )
        data = batches(steps)
        metrics = [engine.train_step(b) for b in data]
        text = engine.lower(data[0]).compile().as_text()  # the step just run: cached, no compile
    losses = [float(m["loss"]) for m in metrics]
    return losses, text, engine, [float(m["grad_norm"]) for m in metrics]


@functools.cache
def first_grad_norm(num_layers=2):
    """optax's global norm of the float64 tiny GPT's gradient on gpt_run's first batch."""
    with jax.enable_x64(True):
        cfg, params = gpt_params(num_layers, "float64")
        grad = jax.grad(lambda p, b: loss_fn(p, b, cfg))
        grads_norm = jax.jit(lambda p, b: optax.global_norm(grad(p, b)))
        return float(grads_norm(params, batches(1)[0]))
