"""The engine: the one stateful object, a thin shell over the pure plan and step.

``jzero.initialize`` reads the config, builds the mesh and the plan, creates the parameters and
the optimizer state directly in their shards, and returns an :class:`Engine`. Each engine
method is a few lines over :mod:`jzero.plan` and :mod:`jzero.step`; a user who wants full
control calls those directly.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jzero import config as config_lib
from jzero import optim
from jzero.mesh import make_mesh
from jzero.plan import Plan, make_plan
from jzero.step import TrainState, make_eval_step, make_train_step, state_shardings

__all__ = ["Engine", "initialize"]

logger = logging.getLogger(__name__)
PyTree = Any


def _abstract(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(np.shape(x)), np.result_type(x)), tree)


def _copy_into(tree: PyTree, shardings: Any) -> PyTree:
    """Fresh buffers laid out by ``shardings``, so the user's arrays survive buffer donation."""
    return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings)(tree)


def _is_abstract(tree: PyTree) -> bool:
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


class Engine:
    """Trains one model with one ZeRO plan. Build it with :func:`jzero.initialize`.

    Attributes:
      config: the resolved :class:`jzero.config.Config`.
      plan: the sharding :class:`jzero.plan.Plan`.
      state: the :class:`jzero.step.TrainState` (params, optimizer state, step).
      train_batch_size / micro_batch_size / accumulation_steps: the resolved batch arithmetic.
    """

    def __init__(
        self,
        *,
        config: config_lib.Config,
        plan: Plan,
        state: TrainState,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation,
        learning_rate: Callable[[jax.Array], jax.Array] | None,
        batch_sizes: tuple[int, int, int],
        stateful: bool = False,
        to_model: Callable[[PyTree, PyTree], Any] | None = None,
    ):
        self.config = config
        self.plan = plan
        self.state = state
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.learning_rate = learning_rate
        self.train_batch_size, self.micro_batch_size, self.accumulation_steps = batch_sizes
        self.stateful = stateful
        self._to_model = to_model
        self._steps: dict[bool, Callable[..., Any]] = {}
        self._evals: dict[bool, Callable[..., Any]] = {}

    # -- state -------------------------------------------------------------------------------
    @property
    def params(self) -> PyTree:
        """The current parameters, sharded per the plan."""
        return self.state.params

    @property
    def model(self) -> Any:
        """The trained Flax model: an NNX module (or Linen variables) over the current arrays."""
        if self._to_model is None:
            raise AttributeError(
                "engine.model exists for Flax models (jzero.initialize(model=...)); "
                "this engine trains a plain pytree: use engine.params."
            )
        return self._to_model(self.state.params, self.state.extra)

    @property
    def opt_state(self) -> PyTree:
        """The current optimizer state, sharded per the plan."""
        return self.state.opt_state

    @property
    def global_step(self) -> int:
        """Optimizer updates applied so far."""
        return int(self.state.step)

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The device mesh."""
        return self.plan.mesh

    # -- the step ----------------------------------------------------------------------------
    def _check_batch(self, batch: PyTree) -> None:
        flat = jax.tree_util.tree_flatten_with_path(batch)[0]
        if not flat:
            raise ValueError(
                "The batch is empty; pass a pytree of arrays with a leading batch dim."
            )
        for path, x in flat:
            lead = np.shape(x)[0] if np.ndim(x) else None
            if lead != self.train_batch_size:
                name = jax.tree_util.keystr(path, simple=True, separator=".") or "<batch>"
                raise ValueError(
                    f"Batch leaf {name!r} has leading dim {lead} but train_batch_size is "
                    f"{self.train_batch_size} (= train_micro_batch_size_per_gpu "
                    f"{self.micro_batch_size} x gradient_accumulation_steps "
                    f"{self.accumulation_steps} x data-parallel size {self.plan.num_shards}). "
                    "Pass a global batch of that size, or change the config's batch keys."
                )

    def _has_aux(self, batch: PyTree) -> bool:
        if self.stateful:
            return False
        micro = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((self.micro_batch_size, *np.shape(x)[1:]), x.dtype),
            batch,
        )
        out = jax.eval_shape(self.loss_fn, self.plan.abstract_params, micro)
        if isinstance(out, tuple) and len(out) == 2:
            return True
        if isinstance(out, jax.ShapeDtypeStruct) and out.shape == ():
            return False
        raise ValueError(
            f"loss_fn must return a scalar loss or a (loss, aux) pair, but it returned {out}. "
            "Return the mean loss of the batch it is given."
        )

    def _step_fn(self, batch: PyTree) -> Callable[..., Any]:
        has_aux = self._has_aux(batch)
        if has_aux not in self._steps:
            self._steps[has_aux] = make_train_step(
                self.plan,
                self.loss_fn,
                self.optimizer,
                accumulation_steps=self.accumulation_steps,
                gradient_clipping=self.config.gradient_clipping,
                has_aux=has_aux,
                stateful=self.stateful,
                learning_rate=self.learning_rate,
            )
        return self._steps[has_aux]

    def train_step(self, batch: PyTree) -> dict[str, jax.Array]:
        """Runs one optimizer step on a global batch (leading dim ``train_batch_size``).

        Returns:
          The metrics: ``loss``, ``grad_norm``, ``lr`` and any aux values, as JAX scalars.
        """
        self._check_batch(batch)
        self.state, metrics = self._step_fn(batch)(self.state, batch)
        return metrics

    def evaluate(self, batch: PyTree) -> jax.Array:
        """The mean loss of the current parameters on a global batch (no update).

        The batch's leading dim must be divisible by the data-parallel size.
        """
        lead = {np.shape(x)[0] for x in jax.tree.leaves(batch)}
        if len(lead) != 1 or next(iter(lead)) % self.plan.num_shards:
            raise ValueError(
                f"An evaluation batch needs one leading dim divisible by the data-parallel size "
                f"{self.plan.num_shards}, but its leaves have leading dims {sorted(lead)}."
            )
        has_aux = self._has_aux(batch)
        if has_aux not in self._evals:
            self._evals[has_aux] = make_eval_step(
                self.plan, self.loss_fn, has_aux=has_aux, stateful=self.stateful
            )
        return self._evals[has_aux](self.state.params, self.state.extra, batch)

    def lower(self, batch: PyTree) -> jax.stages.Lowered:
        """The ``jax.stages.Lowered`` of the step, for ``.compile().memory_analysis()``."""
        self._check_batch(batch)
        return self._step_fn(batch).lower(self.state, batch)

    def describe(self) -> str:
        """The plan report: every leaf's shape, spec per category and per-device bytes."""
        return self.plan.describe()


def _optimizer(
    cfg: config_lib.Config, optimizer: optax.GradientTransformation | None
) -> tuple[optax.GradientTransformation, Callable[[jax.Array], jax.Array] | None]:
    if optimizer is not None:
        if cfg.optimizer is not None:
            raise ValueError(
                "An optax optimizer was passed to jzero.initialize and the config has an "
                f"'optimizer' section ({cfg.optimizer.type}). Pass one of the two."
            )
        if cfg.scheduler is not None:
            raise ValueError(
                "The config has a 'scheduler' section, but jzero can't change the learning rate "
                "of an optax optimizer it did not build. Put the schedule into your optax "
                "optimizer, or describe the optimizer in the config's 'optimizer' section."
            )
        return optimizer, None
    if cfg.optimizer is None:
        raise ValueError(
            "No optimizer: pass optimizer=<an optax transformation> to jzero.initialize, or add "
            "an 'optimizer' section to the config, e.g. {type: AdamW, params: {lr: 0.001}}."
        )
    return optim.build_optimizer(cfg), optim.build_schedule(cfg)


def initialize(
    params: PyTree | None = None,
    loss_fn: Callable[..., Any] | None = None,
    optimizer: optax.GradientTransformation | None = None,
    config: str | Mapping[str, Any] | config_lib.Config | None = None,
    init_fn: Callable[[jax.Array], PyTree] | None = None,
    *,
    model: Any = None,
    init_args: tuple = (),
    mesh: jax.sharding.Mesh | None = None,
    param_specs: PyTree | None = None,
) -> Engine:
    """Builds a ZeRO engine, DeepSpeed's ``deepspeed.initialize`` for JAX.

    Args:
      params: the initial parameters (arrays), or their abstract shapes
        (``jax.ShapeDtypeStruct``) together with ``init_fn``.
      loss_fn: ``loss_fn(params, batch) -> loss`` or ``(loss, aux)``: the mean loss of the
        batch it is given, written for full (unsharded) parameters.
      optimizer: an optax transformation; ``None`` builds the config's ``optimizer`` and
        ``scheduler`` sections.
      config: a dict, a YAML/JSON file path or a :class:`jzero.config.Config`.
      init_fn: ``init_fn(key) -> params``; parameters are then created directly in their
        shards, so no device ever holds the full model at stage 3.
      mesh: a mesh to use instead of the config's ``mesh`` section.
      param_specs: your own ``PartitionSpec`` per parameter leaf on other mesh axes.
      model: a Flax NNX module (or a function that builds one; it is then built directly
        in its shards) with ``loss_fn(model, batch)``, or a Linen module with ``init_args``
        (see :mod:`jzero.flax_adapter`). Non-trainable state (BatchNorm statistics) is
        carried through the step and never sharded as parameters.
      init_args: example inputs for a Linen module's ``init``.

    Returns:
      The :class:`Engine`.
    """
    cfg = config_lib.load_config(config)
    config_lib.check_supported(cfg)
    if loss_fn is None:
        raise ValueError("loss_fn is required: loss_fn(params, batch) -> mean loss of the batch.")
    extra: PyTree = ()
    adapted = None
    if model is not None:
        from jzero import flax_adapter  # Flax is needed only for Flax models

        if params is not None or init_fn is not None:
            raise ValueError("Pass either model=... or params/init_fn, not both.")
        adapted = flax_adapter.adapt(model, loss_fn, init_args)
        params, loss_fn = adapted.abstract_params, adapted.loss_fn
        init_fn = (lambda key: adapted.init_fn(key)[0]) if adapted.values is None else None
        if adapted.values is not None:
            params, extra = adapted.values
    if params is None and init_fn is None:
        raise ValueError("Pass params (arrays or jax.ShapeDtypeStruct) or init_fn(key) -> params.")
    mesh = mesh if mesh is not None else make_mesh(dict(vars(cfg.mesh)))
    key = jax.random.key(cfg.seed)
    if params is None:
        params = jax.eval_shape(init_fn, key)
    abstract = _abstract(params)
    tx, schedule = _optimizer(cfg, optimizer)
    plan = make_plan(
        abstract,
        tx,
        mesh,
        cfg.zero_optimization.stage,
        persistence_threshold=cfg.zero_optimization.stage3_param_persistence_threshold,
        param_specs=param_specs,
    )
    sizes = config_lib.resolve_batch_sizes(cfg, plan.num_shards)
    if init_fn is not None:
        made = jax.eval_shape(init_fn, key)
        if jax.tree.structure(made) != jax.tree.structure(abstract) or any(
            (a.shape, a.dtype) != (b.shape, b.dtype)
            for a, b in zip(jax.tree.leaves(made), jax.tree.leaves(abstract), strict=True)
        ):
            raise ValueError(
                "init_fn(key) creates parameters that differ from the params given: "
                f"{made} vs {abstract}. Pass params=None to take init_fn's shapes."
            )
        values = jax.jit(init_fn, out_shardings=plan.params)(key)
    elif _is_abstract(params):
        raise ValueError(
            "params are abstract (jax.ShapeDtypeStruct) but no init_fn was given to create them. "
            "Pass init_fn(key) -> params, or concrete arrays."
        )
    else:
        values = _copy_into(params, plan.params)
    if adapted is not None and adapted.values is None:
        extra = jax.jit(lambda key: adapted.init_fn(key)[1], out_shardings=plan.replicated)(key)
    elif extra:
        extra = _copy_into(extra, plan.replicated)
    shardings = state_shardings(plan)
    opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(values)
    state = TrainState(
        step=jax.device_put(jnp.zeros((), jnp.int32), plan.replicated),
        params=values,
        opt_state=opt_state,
        extra=extra,
    )
    total = sum(math.prod(leaf.shape) for leaf in plan.leaves)
    logger.info(
        "jzero: stage %d, %s parameters, data-parallel %d, batch %d = %d x %d x %d",
        plan.stage.stage,
        f"{total:,}",
        plan.num_shards,
        *sizes,
        plan.num_shards,
    )
    return Engine(
        config=cfg,
        plan=plan,
        state=state,
        loss_fn=loss_fn,
        optimizer=tx,
        learning_rate=schedule,
        batch_sizes=sizes,
        stateful=adapted is not None,
        to_model=None if adapted is None else adapted.to_model,
    )
