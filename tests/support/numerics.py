"""Numerical comparisons that hold on any x86-64 CPU, whatever its instruction set.

The rule the suite follows:

* Where a test's point is that jzero computes what a reference computes (the single-device
  optax loop, another stage, another layout), it runs in float64 (``jax.enable_x64``) and
  compares at 1e-10 relative (losses, norms) or 1e-9 of each leaf's scale (parameters):
  float64 rounding, even amplified by Adam, stays many orders below that, and any real defect
  (a gradient x2, a missing shard, a wrong mean) is far above it.
* Where a test must run in float32 or a 16-bit dtype (mixed precision, quantization, the
  programs a user runs), its bound is derived from the quantity's conditioning, and one comment
  says how: the unit roundoff of the dtype (``EPS``) times the number of rounding steps that
  can accumulate, or the float32 reference's own distance from the float64 truth
  (:func:`rounding_scale`), which measures how much this computation amplifies rounding on the
  machine at hand.
* Adam (and every optimizer that normalises the gradient) amplifies rounding wherever a
  gradient entry is near zero: such an entry's update can flip between +lr and -lr. So float32
  parameters after k Adam steps are compared on the scale ``lr * k`` (how far Adam can move
  them), never relative to their own magnitude.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

# Unit roundoff (half the gap between 1 and the next number) of each floating dtype.
EPS = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
}


@functools.cache
def float16_compiles() -> bool:
    """Whether XLA:CPU here compiles float16 conversions. Under ``--xla_cpu_max_isa=SSE4_2``
    it does not: its code calls ``__truncsfhf2`` and ``__extendhfsf2``, which its JIT does not
    link ("Symbols not found"), so every program that rounds to float16 fails to load."""
    try:
        f = jax.jit(lambda x: (x.astype(jnp.float16) * 2).astype(jnp.float32))
        return bool(f(jnp.ones(3, jnp.float32))[0] == 2)
    except Exception:  # noqa: BLE001 - XLA's JaxRuntimeError, whatever its module
        return False


# Skips a test where XLA:CPU cannot compile float16 conversions (an instruction-set limit of
# SSE4.2, float16_compiles); it runs everywhere else, CI's AVX2 run too.
needs_float16 = pytest.mark.skipif(
    not float16_compiles(),
    reason="XLA:CPU under this instruction-set limit cannot compile float16 conversions",
)


def max_rel_error(params, ref) -> float:
    """The largest leaf error, each relative to the reference leaf's largest magnitude."""
    errs = []
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        errs.append(np.max(np.abs(a - b)) / np.max(np.abs(b)))
    return float(max(errs))


def max_abs_error(params, ref) -> float:
    """The largest elementwise distance over every leaf, in float64."""
    return float(
        max(
            np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)))
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref), strict=True)
        )
    )


def rounding_scale(low, high) -> float:
    """How far a low-precision run of a computation lands from its float64 run: the largest
    elementwise distance over every leaf, floored at one float32 unit roundoff of the
    largest magnitude (a computation that happens to round exactly still has that much)."""
    floor = EPS["float32"] * max(
        float(np.max(np.abs(np.asarray(h, np.float64)))) for h in jax.tree.leaves(high)
    )
    return max(max_abs_error(low, high), floor)


def optax_loop(loss, params, tx, data):
    """The single-device optax loop on ``data``: (losses, gradient global norms), the reference
    jzero's steps are compared with."""
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, b):
        value, grads = jax.value_and_grad(loss)(params, b)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value, optax.global_norm(grads)

    losses, norms = [], []
    for b in data:
        params, opt, value, norm = step(params, opt, b)
        losses.append(float(value))
        norms.append(float(norm))
    return losses, norms
