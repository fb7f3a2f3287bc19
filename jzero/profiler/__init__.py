"""DeepSpeed's ``flops_profiler``: the compiled step's FLOPs, bytes and MFU, the model's per module.

Import direction: imports nothing else of jzero's; :mod:`jzero.engine` and :mod:`jzero.train`
import it.

* :mod:`~jzero.profiler.cost`: XLA's cost of the compiled step (``cost_analysis``), the peak
  FLOP/s of known accelerators, MFU.
* :mod:`~jzero.profiler.modules`: the forward matmul FLOPs per parameter path, from the loss's
  jaxpr (scans counted by their length).
* :mod:`~jzero.profiler.report`: one step's :class:`FlopsProfile` and its printout.

Decisions:

* **Two FLOP counts, each honest about what it is.** XLA's count of the compiled step is what
  the devices execute (elementwise work, the optimizer, a replicated update on every device,
  recomputation); the model's count is 3x the forward matmuls (6 x params x tokens for a dense
  model), the figure MFU is defined on. Both are printed; MFU uses the model's.
* **No MFU without a known peak.** The peak comes from :data:`~jzero.profiler.cost.PEAK_FLOPS`
  or the config's ``flops_profiler.peak_flops``; on CPU the printout says the peak is unknown.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jzero.profiler.cost import PEAK_FLOPS as PEAK_FLOPS
from jzero.profiler.cost import StepCost as StepCost
from jzero.profiler.cost import mfu as mfu
from jzero.profiler.cost import peak_flops as peak_flops
from jzero.profiler.cost import step_cost as step_cost
from jzero.profiler.modules import module_flops as module_flops
from jzero.profiler.report import FlopsProfile as FlopsProfile

__all__ = [
    "PEAK_FLOPS",
    "FlopsProfile",
    "ProfileOptions",
    "StepCost",
    "mfu",
    "module_flops",
    "params_per_module",
    "peak_flops",
    "profile",
    "step_cost",
]


def params_per_module(params: Any, depth: int = -1) -> dict[str, int]:
    """Parameter counts per path (``blocks.attn_qkv``), or per its first ``depth`` components."""
    out: dict[str, int] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        key = ".".join(names if depth is None or depth < 0 else names[:depth]) or "(model)"
        out[key] = out.get(key, 0) + math.prod(x.shape)
    return out


@dataclasses.dataclass(frozen=True)
class ProfileOptions:
    """How :func:`profile` reads a step: DeepSpeed's ``flops_profiler`` settings that shape the
    profile (the printout's own, ``top_modules`` and ``detailed``, go to
    :meth:`FlopsProfile.format`)."""

    depth: int = -1
    """The per-module table's grouping (DeepSpeed's ``module_depth``); -1: whole paths."""
    peak: float | None = None
    """The peak FLOP/s per device, overriding :data:`PEAK_FLOPS`; ``None``: the table's."""
    recompute_fwd_factor: float = 0.0
    """Forward passes repeated by activation checkpointing."""


def profile(
    loss: Callable[..., Any],
    params: Any,
    args: tuple[Any, ...],
    compiled: Any,
    seconds: float,
    *,
    step: int,
    devices: Sequence[Any],
    options: ProfileOptions | None = None,
) -> FlopsProfile:
    """One step's :class:`FlopsProfile`.

    Args:
      loss: the loss, called as ``loss(params, *args)`` (traced only, never run).
      params: the params or their shapes.
      args: the loss's other arguments for the profiled step (e.g. the global batch).
      compiled: the step's ``jax.stages.Compiled``.
      seconds: the step's measured time.
      step: which step it was.
      devices: the devices the step ran on (the first one's kind picks the peak).
      options: the module table's depth, the peak and the recomputation
        (:class:`ProfileOptions`); ``None``: its defaults.
    """
    o = options if options is not None else ProfileOptions()
    device = devices[0]
    return FlopsProfile(
        step=step,
        cost=step_cost(compiled, len(devices)),
        seconds=seconds,
        forward=module_flops(loss, params, *args, depth=o.depth),
        params=params_per_module(params, o.depth),
        peak=peak_flops(device, o.peak),
        device_kind=str(getattr(device, "device_kind", "")),
        recompute_fwd_factor=o.recompute_fwd_factor,
    )
