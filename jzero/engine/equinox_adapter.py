"""Equinox models in, plain pytrees inside: the one place the engine meets Equinox.

Decisions:

* An Equinox module is a callable pytree. Its floating-point arrays are the trainable
  parameters (``eqx.is_inexact_array``, Equinox's own rule for what a gradient flows to);
  its other arrays (integer counters, index tables) are the step's non-trainable ``extra``
  state, carried and replicated as a Flax model's BatchNorm statistics are; everything else
  (activation functions, shapes, static fields) is the module's static part, closed over. The
  parameters keep the module's structure (``eqx.partition``: ``None`` where a leaf is not a
  parameter), so leaf paths read as the module does (``blocks.0.attention.query_proj.weight``).
* ``model`` is a module, or a zero-argument constructor (``lambda: LM(key)``). A constructor is
  traced with ``eqx.filter_eval_shape`` and run inside the plan's ``jit``, so the model is
  created directly in its shards and never exists whole. A constructor is told apart from a
  Flax NNX one by what its abstract build returns.
* The loss is ``loss_fn(model, batch)``, with the model rebuilt by ``eqx.combine`` from the
  current arrays; ``engine.model`` is the same rebuild from the trained ones.
* Equinox is an optional extra (``pip install jzero[equinox]``), imported here only, and only
  when a model is given.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jzero._util import is_creator
from jzero.engine.flax_adapter import Adapted, split_aux

__all__ = ["adapt", "is_equinox"]

PyTree = Any


def _array(x: Any) -> bool:
    """An array, concrete (JAX's or NumPy's, as ``eqx.is_array`` takes them) or abstract."""
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def _inexact(x: Any) -> bool:
    """A floating (or complex) array: a trainable parameter (``eqx.is_inexact_array``)."""
    return _array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def _other_array(x: Any) -> bool:
    """An array that is not a parameter (integer, boolean): non-trainable state."""
    return _array(x) and not _inexact(x)


def is_equinox(model: Any) -> tuple[bool, Any]:
    """``(True, abstract module)`` when ``model`` is an Equinox module or a constructor of one
    (only looked at when Equinox is imported), else ``(False, None)``."""
    if "equinox" not in sys.modules:
        return False, None
    import equinox as eqx

    if isinstance(model, eqx.Module):
        return True, None
    if not is_creator(model):
        return False, None
    try:
        built = eqx.filter_eval_shape(model)
    except Exception:  # e.g. a Flax NNX constructor: the Flax adapter takes it
        return False, None
    return isinstance(built, eqx.Module), built


def adapt(model: Any, loss_fn: Callable[..., Any], abstract: Any = None) -> Adapted:
    """Sees an Equinox module (or its constructor, with ``abstract`` its traced build) as
    pytrees: parameters, non-trainable arrays, and the static rest closed over."""
    import equinox as eqx

    def split(module: Any) -> tuple[PyTree, PyTree, PyTree]:
        params, rest = eqx.partition(module, _inexact)
        extra, static = eqx.partition(rest, _other_array)
        return params, extra, static

    values = None
    if isinstance(model, eqx.Module):
        params, extra, static = split(model)
        values = (params, extra)

        def init_fn(key: jax.Array) -> tuple[PyTree, PyTree]:
            del key  # the module already holds its values
            return values

        abstract_params, abstract_extra = jax.eval_shape(lambda: values)
    else:
        constructor = model
        abstract_params, abstract_extra, static = split(abstract)

        def init_fn(key: jax.Array) -> tuple[PyTree, PyTree]:
            del key  # the constructor seeds its own keys
            params, extra, _ = split(constructor())
            return params, extra

    def to_model(params: PyTree, extra: PyTree) -> Any:
        return eqx.combine(params, extra, static)

    def loss_with_extra(params: PyTree, extra: PyTree, batch: PyTree) -> Any:
        loss, aux = split_aux(loss_fn(to_model(params, extra), batch))
        return loss, (aux, extra)

    return Adapted(
        abstract_params=abstract_params,
        abstract_extra=abstract_extra,
        init_fn=init_fn,
        loss_fn=loss_with_extra,
        to_model=to_model,
        values=values,
    )
