"""A step's predicted time on a layout: its bytes per axis over each axis' bandwidth, a latency
per collective, and its FLOPs over the devices' rate, stretched by the pipeline's bubble.

Decisions:

* Analytic, before any compilation (the auto layout ranks its candidates by it and compiles
  them in that order): the bytes are :mod:`jzero.costs.traffic`'s closed forms, priced at the
  inter-host bandwidth where an axis' groups cross hosts (and offload's always), else the
  intra-host one; each collective adds the latency.
* Compute is the step's FLOPs (traced by the caller) over the devices' FLOP rate, a third more
  with activation checkpointing, divided by ``1 - bubble`` (the schedule's table: ``(P-1)/(M+P-1)``
  for 1F1B); nothing is assumed to overlap.
* Rates: the config's ``auto_layout`` section over the platform's defaults
  (:data:`PLATFORM_RATES`).
* The bubble is read from the schedule's table (:mod:`jzero.choices.schedules`), the one the
  pipeline's engine runs, imported only when there is a pipeline: the cost model loads without
  JAX or NumPy (``jzero estimate``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from jzero.choices.stages import stage_spec
from jzero.costs import traffic
from jzero.costs.shapes import ModelShape, ParallelDims

__all__ = ["PLATFORM_RATES", "Prediction", "Rates", "StageChoice", "Work", "bubble", "predict"]


@dataclass(frozen=True)
class Rates:
    """What the step time divides by: bandwidths in GB/s, TFLOP/s per device, microseconds."""

    intra_host_gbps: float
    inter_host_gbps: float
    tflops: float
    latency_us: float

    @classmethod
    def of(cls, section: Any, platform: str) -> Rates:
        """The rates ``section`` (the config's ``auto_layout``, or ``None``) gives over the
        ``platform``'s defaults."""
        base = PLATFORM_RATES.get(platform, PLATFORM_RATES["cpu"])
        given = {f.name: getattr(section, f.name, None) for f in dataclasses.fields(cls)}
        return dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})


PLATFORM_RATES = {
    "gpu": Rates(intra_host_gbps=300.0, inter_host_gbps=25.0, tflops=200.0, latency_us=10.0),
    "tpu": Rates(intra_host_gbps=100.0, inter_host_gbps=25.0, tflops=100.0, latency_us=10.0),
    "cpu": Rates(intra_host_gbps=10.0, inter_host_gbps=1.0, tflops=0.05, latency_us=20.0),
}
"""Default rates per platform (``cuda``/``rocm`` read as ``gpu``): round figures of an NVLink
GPU node with a 200 Gb/s NIC per GPU, a TPU slice, and a CPU host's shared memory. Set
``auto_layout`` in the config to your machine's."""


@dataclass(frozen=True)
class Work:
    """What one step of the global batch computes, and the bytes of the elements it moves."""

    flops: float
    """The step's FLOPs, forward and backward, over all devices."""
    grad_bytes: int
    """Bytes of a gradient (and gathered parameter) element on the wire."""
    act_bytes: int
    """Bytes of an activation element."""


class StageChoice(Protocol):
    """A ZeRO stage with its offload and activation checkpointing
    (:class:`jzero.engine.auto_stage.Candidate`)."""

    stage: int
    offload: bool
    checkpointing: bool


@dataclass(frozen=True)
class Prediction:
    """A step's predicted bytes on each axis (per device, on the wire), its time and the part
    of it spent computing."""

    axis_bytes: dict[str, float]
    seconds: float
    compute_seconds: float


def predict(
    dims: ParallelDims, stage: StageChoice, shape: ModelShape, work: Work, rates: Rates
) -> Prediction:
    """The step time of ``shape`` on ``dims`` (its ``micro_batch``, ``micro_batches`` and
    ``virtual`` set, ``devices_per_node`` the devices of a host) at ``stage``, doing ``work``
    at ``rates`` (the module's decisions)."""
    t, p, m = dims.model, dims.pipe, dims.micro_batches
    local_params = shape.params / (t * p)
    group = dims.shards * dims.replica
    layers = (shape.layers or 1) / p
    tokens = (shape.seq_len or 1) / (dims.seq * dims.context)
    x = dims.micro_batch * tokens * (shape.hidden or 1)
    flow = traffic.LayerFlow(x, layers, m, work.act_bytes)
    out: dict[str, float] = {}
    count: dict[str, float] = {}
    spec = stage_spec(stage.stage)
    out["data"] = traffic.zero_bytes(spec, local_params, work.grad_bytes, group)
    if spec.shard_params:  # each layer gathered forward and backward, then the rest once
        count["data"] = 2 * layers * m + 1
    else:  # a reduce-scatter and an all-gather, or one all-reduce
        count["data"] = 2 if spec.reduce_scatter else 1
    if t > 1:
        out["model"], count["model"] = traffic.model_axis_bytes(flow, t), m * layers * 4
    if dims.seq > 1:
        out["seq"], count["seq"] = traffic.seq_axis_bytes(flow, t, dims.seq), m * layers * 8
    if dims.context > 1:
        c = dims.context
        out["context"] = traffic.context_axis_bytes(flow, t, c)
        count["context"] = m * layers * 3 * (c - 1)
    if dims.expert > 1:
        k = shape.experts_per_token
        out["expert"] = traffic.expert_axis_bytes(flow, dims.expert, k)
        count["expert"] = m * layers * 4
    if p > 1:
        out["pipe"], count["pipe"] = (
            traffic.pipe_axis_bytes(flow, dims.virtual, t),
            2 * m * dims.virtual,
        )
    if stage.offload:  # gradients to the host, parameters back: at the inter-host rate
        out["host"], count["host"] = traffic.offload_bytes(local_params, work.grad_bytes, group), 2
    comm = 0.0
    for axis, nbytes in out.items():
        cross = axis == "host" or traffic.crosses_hosts(dims, axis)
        gbps = rates.inter_host_gbps if cross else rates.intra_host_gbps
        comm += nbytes / (gbps * 1e9) + count[axis] * rates.latency_us * 1e-6
    flops = work.flops * (4 / 3 if stage.checkpointing else 1.0)
    compute = flops / (dims.devices * rates.tflops * 1e12) / (1 - bubble(dims))
    return Prediction(out, compute + comm, compute)


def bubble(dims: ParallelDims) -> float:
    """The pipeline schedule's idle fraction from its table (``(P-1)/(M+P-1)`` for 1F1B and
    GPipe), or 0 without a pipeline."""
    if dims.pipe <= 1:
        return 0.0
    from jzero.choices.schedules import make_schedule  # NumPy: only with a pipeline

    return make_schedule(dims.schedule, dims.pipe, dims.micro_batches, dims.virtual).bubble
