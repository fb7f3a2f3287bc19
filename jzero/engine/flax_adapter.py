"""Flax models in, plain pytrees inside: the one place the engine meets Flax.

Decisions:

* The core speaks pytrees. A Flax model is split into its trainable parameters (a pure dict,
  what ZeRO shards) and everything else (BatchNorm statistics, RNG counters, caches: the
  step's non-trainable ``extra`` state, replicated, never sharded as if it were parameters).
* NNX: ``model`` is a module or a zero-argument constructor. A constructor is traced with
  ``nnx.eval_shape`` and run under ``jit`` with the plan's ``out_shardings``, so the model is
  created directly in its shards. The loss is ``loss_fn(model, batch)``; the model it gets is
  rebuilt from the current arrays, and whatever the forward pass wrote into non-parameter
  variables (running statistics) is carried to the next step.
* Linen: ``model`` is a module and ``InitOptions.init_args`` its example inputs. With only
  a ``params`` collection the loss is ``loss_fn(params, batch)``; with others
  (``batch_stats``) it is ``loss_fn(params, state, batch) -> (loss, new_state)`` where
  ``state`` holds the other collections, Flax's usual ``apply(..., mutable=[...])`` pattern.
* Partition annotations are read, not applied: NNX ``sharding`` metadata
  (``nnx.Param(..., sharding=("model", None))``, ``nnx.with_partitioning``) through
  ``nnx.get_partition_spec``, Linen ``nn.with_partitioning`` boxes through
  ``nn.get_partition_spec``. They become ``param_specs`` for the plan, which adds the data axis
  on a dimension they leave free. NNX's eager sharding is switched off while jzero builds and
  rebuilds a model (the plan's ``out_shardings`` place the arrays), so a constructor needs no
  mesh context; Linen boxes are unboxed, so the loss sees plain arrays.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from flax import linen, nnx
from jax.sharding import PartitionSpec

from jzero._util import is_creator

__all__ = ["Adapted", "adapt"]

PyTree = Any


@dataclass(frozen=True)
class Adapted:
    """A model seen as pytrees.

    Attributes:
      abstract_params: trainable parameters as ``jax.ShapeDtypeStruct``.
      abstract_extra: non-trainable state as ``jax.ShapeDtypeStruct``.
      init_fn: ``init_fn(key) -> (params, extra)``, jittable.
      loss_fn: ``loss_fn(params, extra, batch) -> (loss, (aux, new_extra))``.
      to_model: ``to_model(params, extra)`` rebuilds the user's model object.
      values: ``(params, extra)`` when the model already held concrete arrays, else ``None``.
      param_specs: the model's own ``PartitionSpec`` per parameter (``PartitionSpec()`` where
        it has none), or ``None`` when no parameter is annotated.
    """

    abstract_params: PyTree
    abstract_extra: PyTree
    init_fn: Callable[[jax.Array], tuple[PyTree, PyTree]]
    loss_fn: Callable[[PyTree, PyTree, PyTree], Any]
    to_model: Callable[[PyTree, PyTree], Any]
    values: tuple[PyTree, PyTree] | None = None
    param_specs: PyTree | None = None


def split_aux(out: Any) -> tuple[Any, Any]:
    if isinstance(out, tuple) and len(out) == 2:
        return out
    return out, {}


def _specs_or_none(specs: PyTree) -> PyTree | None:
    """``specs`` with every leaf a ``PartitionSpec``, or ``None`` when none names an axis."""
    is_spec = lambda x: isinstance(x, PartitionSpec)
    specs = jax.tree.map(lambda s: s if is_spec(s) else PartitionSpec(), specs, is_leaf=is_spec)
    if all(s == PartitionSpec() for s in jax.tree.leaves(specs, is_leaf=is_spec)):
        return None
    return specs


def _adapt_nnx(model: Any, loss_fn: Callable[..., Any]) -> Adapted:
    values = None
    if isinstance(model, nnx.Module):
        graphdef, params, extra = nnx.split(model, nnx.Param, ...)
        values = (nnx.to_pure_dict(params), nnx.to_pure_dict(extra))

        def init_fn(key: jax.Array) -> tuple[PyTree, PyTree]:
            del key  # the module already holds its values
            return values

        with nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(lambda: nnx.merge(graphdef, params, extra))
    else:
        constructor = model

        def init_fn(key: jax.Array) -> tuple[PyTree, PyTree]:
            del key  # the constructor seeds its own nnx.Rngs
            with nnx.use_eager_sharding(False):
                _, p, e = nnx.split(constructor(), nnx.Param, ...)
            return nnx.to_pure_dict(p), nnx.to_pure_dict(e)

        with nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(constructor)
    graphdef, p_template, e_template = nnx.split(abstract, nnx.Param, ...)
    param_specs = _specs_or_none(nnx.to_pure_dict(nnx.get_partition_spec(p_template)))

    def to_model(params: PyTree, extra: PyTree) -> Any:
        with nnx.use_eager_sharding(False):
            p = jax.tree.map(lambda x: x, p_template)
            e = jax.tree.map(lambda x: x, e_template)
            nnx.replace_by_pure_dict(p, params)
            nnx.replace_by_pure_dict(e, extra)
            return nnx.merge(graphdef, p, e)

    def loss_with_extra(params: PyTree, extra: PyTree, batch: PyTree) -> Any:
        module = to_model(params, extra)
        loss, aux = split_aux(loss_fn(module, batch))
        _, _, new_extra = nnx.split(module, nnx.Param, ...)
        return loss, (aux, nnx.to_pure_dict(new_extra))

    return Adapted(
        abstract_params=nnx.to_pure_dict(p_template),
        abstract_extra=nnx.to_pure_dict(e_template),
        init_fn=init_fn,
        loss_fn=loss_with_extra,
        to_model=to_model,
        values=values,
        param_specs=param_specs,
    )


def _adapt_linen(model: linen.Module, loss_fn: Callable[..., Any], init_args: tuple) -> Adapted:
    def init_fn(key: jax.Array) -> tuple[PyTree, PyTree]:
        variables = dict(linen.meta.unbox(model.init(key, *init_args)))
        params = variables.pop("params", {})
        return params, variables

    # The keys are made inside the traces: an eager key would compile a program of its own.
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), *init_args))
    param_specs = _specs_or_none(linen.get_partition_spec(boxed).get("params", {}))
    abstract_params, abstract_extra = jax.eval_shape(lambda: init_fn(jax.random.key(0)))
    takes_state = len(inspect.signature(loss_fn).parameters) >= 3
    if abstract_extra and not takes_state:
        raise ValueError(
            f"The Linen model has collections besides 'params' ({', '.join(abstract_extra)}), "
            "so jzero must carry them between steps: write the loss as "
            "loss_fn(params, state, batch) -> (loss, new_state), calling "
            "model.apply({'params': params, **state}, ..., mutable=list(state))."
        )

    def loss_with_extra(params: PyTree, extra: PyTree, batch: PyTree) -> Any:
        if takes_state:
            out, new_extra = loss_fn(params, extra, batch)
        else:
            out, new_extra = loss_fn(params, batch), extra
        loss, aux = split_aux(out)
        return loss, (aux, dict(new_extra))

    def to_model(params: PyTree, extra: PyTree) -> Any:
        return {"params": params, **extra}

    return Adapted(
        abstract_params, abstract_extra, init_fn, loss_with_extra, to_model, param_specs=param_specs
    )


def adapt(model: Any, loss_fn: Callable[..., Any], init_args: tuple = ()) -> Adapted:
    """Sees a Flax NNX module (or its constructor) or a Linen module as pytrees."""
    if isinstance(model, linen.Module):
        if not init_args:
            raise ValueError(
                "A Linen model needs example inputs to initialise: pass options="
                "jzero.InitOptions(init_args=(example_batch_inputs,)) to jzero.initialize."
            )
        return _adapt_linen(model, loss_fn, tuple(init_args))
    if isinstance(model, nnx.Module) or is_creator(model):
        return _adapt_nnx(model, loss_fn)
    raise TypeError(
        f"model must be a Flax NNX module, a function that builds one, or a Linen module; got "
        f"{type(model).__name__} (jzero never calls a model that is not one of those). For a "
        "pytree of arrays, a callable one included, pass params=... instead."
    )
