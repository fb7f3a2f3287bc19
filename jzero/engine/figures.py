"""What the engine's step costs: the model's FLOPs of a step and the peak memory per device.

Each figure is computed here only: the engine's methods (``model_flops``, ``peak_bytes``), the
monitors' :class:`~jzero.monitor.TrainLog` (through :func:`jzero.monitor.step_rates`) and
``jzero train``'s lines and summary (:mod:`jzero.train`) all read them from here.

Decisions:

* **The model's FLOPs are traced, never run**: 3x the loss's forward matmuls
  (:func:`jzero.profiler.module_flops`), plus the forward passes
  ``flops_profiler.recompute_fwd_factor`` says activation checkpointing repeats. They are
  traced once per batch shape: the engine keeps them (``jzero train`` asks before its first
  step, the monitors at it, and both get the one trace).
* **The peak memory per device** is the allocator's figure on an accelerator (it moves as the
  run goes, so it is handed out as a function to read it). On CPU, which keeps none, it is
  the compiled step's peak (:func:`compiled_peak_bytes`, ``stage: auto``'s measure too: the
  arguments, less the state a CPU counts among them though it rests in host memory, plus
  the temporaries and the outputs not aliased to an input), of the executable the step runs:
  not compiled again. Under the NVMe tier that is its gradient program (the update programs
  hold one group each).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jzero.plan import host_state_bytes

__all__ = ["model_flops", "peak_bytes", "traceable_loss"]

PyTree = Any


def _shapes(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def traceable_loss(setup: Any, batch: PyTree) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The loss of ``setup`` (a :class:`jzero.engine.resolve.Setup`) as
    ``loss(params, extra, batch)`` and the shapes of ``(extra, batch)``."""
    args = (_shapes(setup.extra), _shapes(batch))
    loss = setup.loss_fn if setup.takes_extra else (lambda p, _, b: setup.loss_fn(p, b))
    return loss, args


def _key(tree: PyTree) -> tuple[Any, ...]:
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, *((tuple(np.shape(x)), np.dtype(x.dtype)) for x in leaves))


def model_flops(setup: Any, batch: PyTree) -> float:
    """The model's FLOPs of one step of ``setup`` (a :class:`jzero.engine.resolve.Setup`) on a
    global batch of ``batch``'s shapes (arrays or ``jax.ShapeDtypeStruct``), kept in
    ``setup.traced`` by the shapes they were traced at (see the module's decisions)."""
    from jzero import profiler

    factor = setup.config.flops_profiler.recompute_fwd_factor
    params = setup.plan.abstract_params
    traced = setup.traced
    key = (_key(params), _key(setup.extra), _key(batch), factor)
    if key not in traced:
        loss, args = traceable_loss(setup, batch)
        forward = sum(profiler.module_flops(loss, params, *args).values())
        traced[key] = (3.0 + factor) * forward
    return traced[key]


def compiled_peak_bytes(compiled: Any, host_state_bytes: int) -> int:
    """A compiled step's peak bytes per device (see the module's decisions)."""
    mem = compiled.memory_analysis()
    args = mem.argument_size_in_bytes
    if host_state_bytes and not getattr(mem, "host_argument_size_in_bytes", 0):
        args -= host_state_bytes  # one memory space: the host state is among the arguments
    fresh = max(mem.output_size_in_bytes - mem.alias_size_in_bytes, 0)
    return int(args + mem.temp_size_in_bytes + fresh)


def peak_bytes(
    setup: Any, step: Callable[..., Any], state: Any, batch: PyTree
) -> Callable[[], int | None]:
    """A function that reads the peak memory per device of ``step`` (the step of ``setup``, as
    the engine runs it) on ``state`` and the global batch ``batch`` (as the step takes it): see
    the module's decisions. ``None`` where the allocator's statistics name no peak."""
    plan = setup.plan
    device = plan.mesh.local_devices[0]
    if device.memory_stats() is not None:
        return lambda: device.memory_stats().get("peak_bytes_in_use")
    if not hasattr(step, "lower"):
        return lambda: None
    host = sum(host_state_bytes(plan, setup.accumulation_steps or 1).values())
    peak = compiled_peak_bytes(step.lower(state, batch).compile(), host)
    return lambda: peak
