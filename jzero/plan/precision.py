"""Mixed precision: compute dtype, master weights, communication and accumulation dtypes, and
DeepSpeed's loss scaling.

Decisions:

* Under ``bf16`` or ``fp16`` the parameters a step computes with are a 16-bit copy; the float32
  *master* weights live in the optimizer's shards, laid out exactly like the Adam moments (the
  plan's update layout). Per device that is the ZeRO paper's K = 12: 4 bytes of master weight
  plus 8 of moments, sharded from stage 1 on, next to 2 bytes of 16-bit parameters (sharded at
  stage 3) and 2 bytes of 16-bit gradients (sharded from stage 2). The 16-bit copy is always
  the rounding of the masters, so a skipped step leaves both bit-identical.
* ``bf16.bf16_master_weights_and_grads`` (:attr:`Precision.master_dtype` bfloat16): no float32
  copy. The bfloat16 parameters *are* the master weights (``TrainState.master`` is empty, and
  :attr:`Precision.mixed` is false), their gradients are bfloat16 and are reduced in bfloat16
  in their shards, as DeepSpeed 0.19 does. The update itself runs in float32: the optimizer
  (wrapped by :func:`jzero.optim.float32_update`) sees the shard of the gradients and of the
  masters upcast, keeps its moments in float32 (bfloat16 with ``bf16_optimizer_states``), and
  the new master is rounded to bfloat16 in the update layout, to nearest or, with
  ``bf16.stochastic_rounding``, stochastically (:func:`jzero.optim.stochastic_round`), then
  gathered as parameters always are. Micro-batch gradients are still summed in float32
  (``grad_accum_dtype`` unset; ``bf16`` gives DeepSpeed's bfloat16 accumulator), and the
  gradient norm is taken in float32. Bytes per parameter at rest: 2 (params = masters) + 8
  (fp32 moments) or 4 (bf16 moments), against 2 + 4 + 8 with fp32 masters. Any ZeRO stage,
  0 included (DeepSpeed asks for 1-3; jzero's update is the same at stage 0). fp16 is refused.
* ``communication_data_type`` is the dtype of every gradient reduction (all-reduce at stage 0,
  reduce-scatter from stage 1; at stage 3 the transpose of the parameter gather). Under mixed
  precision it is also the dtype of the stage 1-2 parameter all-gather (fp32 gathers the masters
  and rounds after, 16-bit rounds first); stage 3 gathers the 16-bit parameters it holds.
  Without mixed precision parameters are gathered in their own dtype: gathering a rounded copy
  would change the model the optimizer holds. Default: follow the compute precision, as
  DeepSpeed does.
* ``data_types.grad_accum_dtype`` is the dtype of the buffer micro-batch gradients are summed
  in (only when ``gradient_accumulation_steps > 1``). Default float32 under mixed precision, so
  16-bit gradients are never summed in 16 bits; DeepSpeed's default is the gradient dtype.
* Loss scaling follows DeepSpeed's ``DynamicLossScaler``: on an overflow the step is skipped
  (parameters, optimizer state and the schedule's step count unchanged) and, once
  ``hysteresis`` overflows have been absorbed, the scale halves (never below
  ``min_loss_scale``); after ``loss_scale_window`` clean steps it doubles and the hysteresis is
  refilled (``consecutive_hysteresis`` refills it after every clean step). A static
  ``loss_scale > 0`` scales without ever changing.
* Any precision can skip steps with inf/NaN gradients the same way (at a fixed scale of 1 without
  fp16): every bit of the params, the master weights, the optimizer state and the step count
  stays as it was. Without mixed precision the params are the master weights. Whether a run
  skips (:attr:`Precision.skips`) follows the config:

  - ``fp16``: always (an overflow is how the dynamic scale learns).
  - ``bf16``: the top-level ``skip_nonfinite`` when it is set (true or false); when it is unset
    (``None``), ``bf16.skip_nonfinite or bf16.check_grad_overflow``. ``check_grad_overflow``
    defaults to true, as in DeepSpeed 0.19, whose bf16 optimizer skips a step with inf/NaN
    gradients.
  - float32: ``bool(skip_nonfinite)``; off unless asked for.

  Every step reports ``nonfinite`` (its gradients were not finite) and ``skipped`` (its update
  was skipped) in the metrics at every precision, and :class:`LossScaleState` counts both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["LossScaleState", "Precision", "cast_floating", "next_loss_scale"]

PyTree = Any


@dataclass(frozen=True)
class Precision:
    """How one training run uses dtypes.

    Attributes:
      compute_dtype: the dtype parameters are used in for the forward and backward pass; ``None``
        uses each parameter's own dtype with no master copy (full precision).
      comm_dtype: the dtype gradients are reduced in; ``None`` is the gradient's own dtype.
      accum_dtype: the dtype of the micro-batch gradient accumulator; ``None`` is float32 under
        mixed precision or 16-bit masters and the parameter dtype otherwise.
      loss_scale: a static loss scale (> 0), or 0 for DeepSpeed's dynamic loss scaling.
      scaled: whether the loss is scaled at all (fp16).
      initial_scale_power: DeepSpeed's dynamic loss-scaling parameters (this one and the
        next four).
      loss_scale_window: see ``initial_scale_power``.
      hysteresis: see ``initial_scale_power``.
      consecutive_hysteresis: see ``initial_scale_power``.
      min_loss_scale: see ``initial_scale_power``.
      skip_nonfinite: skip updates whose gradients are not finite, at any precision (fp16
        skips them whether or not this is set).
      master_dtype: ``None`` (float32 masters under mixed precision, else the params
        themselves), or a 16-bit float (bfloat16, ``bf16.bf16_master_weights_and_grads``):
        the params rest in it and are the masters, with no float32 copy
        (:attr:`low_precision_masters`); ``compute_dtype`` is then ``None``.
      stochastic_rounding: with ``master_dtype``, round each new master to it stochastically
        (``bf16.stochastic_rounding``; :func:`jzero.optim.stochastic_round`), with a key from
        the step count and the leaf's index; else to nearest.
    """

    compute_dtype: Any = None
    comm_dtype: Any = None
    accum_dtype: Any = None
    scaled: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    skip_nonfinite: bool = False
    master_dtype: Any = None
    stochastic_rounding: bool = False

    @property
    def low_precision_masters(self) -> bool:
        """Whether the 16-bit params are the master weights (no float32 copy)."""
        return self.master_dtype is not None

    @property
    def sixteen_bit(self) -> bool:
        """Whether the step computes in 16 bits (mixed precision or 16-bit masters): its loss
        is then reported in float32."""
        return self.mixed or self.low_precision_masters

    @property
    def mixed(self) -> bool:
        """Whether parameters are computed in a 16-bit copy of float32 master weights."""
        return self.compute_dtype is not None

    @property
    def dynamic(self) -> bool:
        """Whether the loss scale changes with overflows."""
        return self.scaled and self.loss_scale == 0

    @property
    def skips(self) -> bool:
        """Whether a step with non-finite gradients is skipped."""
        return self.scaled or self.skip_nonfinite

    @property
    def initial_scale(self) -> float:
        """The loss scale of the first step."""
        if not self.scaled:
            return 1.0
        return float(self.loss_scale) if self.loss_scale > 0 else 2.0**self.initial_scale_power

    def accumulator(self, param_dtype: Any) -> Any:
        """The accumulator dtype for a parameter of ``param_dtype``."""
        if self.accum_dtype is not None:
            return self.accum_dtype
        return jnp.float32 if self.sixteen_bit else param_dtype

    def communication(self, grad_dtype: Any) -> Any:
        """The dtype a gradient of ``grad_dtype`` is reduced in."""
        return grad_dtype if self.comm_dtype is None else self.comm_dtype

    def compute(self, param_dtype: Any) -> Any:
        """The dtype a floating parameter of ``param_dtype`` is used in."""
        return param_dtype if self.compute_dtype is None else self.compute_dtype


def cast_floating(tree: PyTree, dtype: Any) -> PyTree:
    """Casts the floating leaves of ``tree`` (arrays or ``ShapeDtypeStruct``) to ``dtype``."""

    def cast(x: Any) -> Any:
        if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x.astype(dtype)

    return jax.tree.map(cast, tree)


class LossScaleState(NamedTuple):
    """The loss scaler's state, carried in the train state and saved with checkpoints.

    Attributes:
      scale: the current loss scale (1 without fp16).
      good_steps: clean steps since the last overflow or the last doubling.
      hysteresis: overflows still absorbed before the scale halves.
      skipped: steps skipped so far.
      nonfinite: steps whose gradients were not finite so far.
    """

    scale: jax.Array
    good_steps: jax.Array
    hysteresis: jax.Array
    skipped: jax.Array
    nonfinite: jax.Array

    @classmethod
    def initial(cls, precision: Precision) -> LossScaleState:
        """The state before the first step."""
        return cls(
            scale=np.float32(precision.initial_scale),
            good_steps=np.int32(0),
            hysteresis=np.int32(precision.hysteresis),
            skipped=np.int32(0),
            nonfinite=np.int32(0),
        )


def next_loss_scale(precision: Precision, state: LossScaleState, finite: jax.Array):
    """The loss-scale state after a step whose gradients were ``finite`` (or not).

    Args:
      precision: the run's precision.
      state: the state the step ran with.
      finite: a boolean scalar, true when every gradient was finite.

    Returns:
      The next :class:`LossScaleState`.
    """
    bad = jnp.logical_not(finite)
    skipped = state.skipped + (bad & precision.skips).astype(jnp.int32)
    nonfinite = state.nonfinite + bad.astype(jnp.int32)
    if not precision.dynamic:
        return state._replace(skipped=skipped, nonfinite=nonfinite)
    # An overflow: absorb it in the hysteresis, or halve once the hysteresis is down to one.
    halve = state.hysteresis <= 1
    scale_bad = jnp.where(
        halve, jnp.maximum(state.scale / 2, precision.min_loss_scale), state.scale
    )
    hyst_bad = jnp.where(halve, state.hysteresis, state.hysteresis - 1)
    # A clean step: double after a full window of them.
    good = state.good_steps + 1
    double = good >= precision.loss_scale_window
    scale_good = jnp.where(double, state.scale * 2, state.scale)
    refill = double | precision.consecutive_hysteresis
    hyst_good = jnp.where(refill, precision.hysteresis, state.hysteresis)
    good = jnp.where(double, 0, good)
    return LossScaleState(
        scale=jnp.where(finite, scale_good, scale_bad).astype(jnp.float32),
        good_steps=jnp.where(finite, good, 0).astype(jnp.int32),
        hysteresis=jnp.where(finite, hyst_good, hyst_bad).astype(jnp.int32),
        skipped=skipped,
        nonfinite=nonfinite,
    )
