"""Bytes a device puts on the wire per step, axis by axis: ZeRO's collectives over its group, the
activations' over the model, seq and expert axes and between pipeline stages, and offload's
to the host; and which of them cross hosts.

Decisions:

* Per device and on the wire: a ring collective over ``n`` devices sends ``(n-1)/n`` of its
  buffer (:func:`ring`).
* ZeRO's bytes are the stage table's elements a parameter
  (:meth:`~jzero.choices.stages.StageSpec.traffic`: ``2 Psi``, or ``3 Psi`` where the
  parameters are sharded) of the parameters a device holds.
* The activations' are counted per layer and micro-batch of ``X`` activation elements a device
  (:class:`LayerFlow`; its tokens are ``s / (S C)``): ``model`` Megatron's four all-reduces
  of ``X`` (two forward, two backward), ``seq`` Ulysses's eight all-to-alls of ``X / T``,
  ``context`` ring attention's keys and values around the ring, ``6 (C - 1) X / T``,
  ``expert`` four all-to-alls of ``k X`` (k the experts a token is routed to), ``pipe`` one
  micro-batch's activations forward to the next stage and their gradient back, at every chunk
  boundary under interleaving.
* An axis crosses hosts where its groups hold more devices than a node: the axes from it to
  the minor end of the mesh (:data:`~jzero.costs.shapes.AXES`) hold more than
  ``devices_per_node``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jzero.choices.stages import StageSpec
from jzero.costs.shapes import AXES, ParallelDims

__all__ = [
    "LayerFlow",
    "context_axis_bytes",
    "cross_host_elements",
    "crosses_hosts",
    "expert_axis_bytes",
    "model_axis_bytes",
    "offload_bytes",
    "pipe_axis_bytes",
    "ring",
    "seq_axis_bytes",
    "zero_bytes",
]


def ring(n: float) -> float:
    """The share of its buffer each of ``n`` devices sends in a ring collective, ``(n-1)/n``."""
    return (n - 1) / n


@dataclass(frozen=True)
class LayerFlow:
    """The activations a device's layers move: ``elements`` (X) of one layer and micro-batch,
    over ``layers`` layers and ``micro_batches`` micro-batches, ``element_bytes`` each."""

    elements: float
    layers: float
    micro_batches: float
    element_bytes: float


def zero_bytes(spec: StageSpec, params: float, grad_bytes: float, group: int) -> float:
    """ZeRO's bytes a step over its ``group`` of devices, at the stage ``spec``, for the
    ``params`` a device holds, ``grad_bytes`` an element on the wire."""
    return spec.traffic()[0] * params * grad_bytes * ring(group)


def offload_bytes(params: float, grad_bytes: float, group: int) -> float:
    """Bytes a step between a device and its host with the optimizer offloaded: its shard's
    gradients out and parameters back."""
    return 2 * params * grad_bytes / group


def model_axis_bytes(flow: LayerFlow, model: int) -> float:
    """The model axis' (T devices) bytes: four all-reduces of X a layer and micro-batch,
    ``2 (T-1)/T`` of the buffer each."""
    return (
        flow.micro_batches * flow.layers * 4 * 2 * flow.elements * flow.element_bytes * ring(model)
    )


def seq_axis_bytes(flow: LayerFlow, model: int, seq: int) -> float:
    """The seq axis' (S devices) bytes: eight all-to-alls of ``X / T`` a layer and
    micro-batch, ``(S-1)/S`` each."""
    x = flow.elements / model
    return flow.micro_batches * flow.layers * 8 * x * flow.element_bytes * ring(seq)


def context_axis_bytes(flow: LayerFlow, model: int, context: int) -> float:
    """The context axis' (C devices, ring attention) bytes: a device's keys and values, ``2 X /
    T``, passed C - 1 steps around the ring forward, and again with their gradients backward,
    ``6 (C - 1) X / T`` a layer and micro-batch (collective-permutes; every head counted, an
    upper bound under grouped-query attention)."""
    x = flow.elements / model
    return flow.micro_batches * flow.layers * 6 * (context - 1) * x * flow.element_bytes


def expert_axis_bytes(flow: LayerFlow, expert: int, per_token: int) -> float:
    """The expert axis' (E_p devices) bytes: four all-to-alls of ``k X`` a layer and
    micro-batch (k = ``per_token``, the experts a token is routed to), ``(E_p-1)/E_p`` each."""
    x, m = flow.elements, flow.micro_batches
    return m * flow.layers * 4 * per_token * x * flow.element_bytes * ring(expert)


def pipe_axis_bytes(flow: LayerFlow, virtual: int, split: int = 1) -> float:
    """The pipe axis' bytes: each micro-batch's activations across each stage's (each of its
    ``virtual`` chunks') boundary and their gradient back. ``split``: the devices that share one
    boundary's activations: the auto layout counts them split over the model axis (T), the
    estimate counts each device sending them whole (1)."""
    return 2 * flow.micro_batches * virtual * flow.elements / split * flow.element_bytes


def crosses_hosts(dims: ParallelDims, axis: str) -> bool:
    """Whether ``axis``'s groups span devices of several hosts: the axes from it to the minor
    end of the mesh hold more devices than a node."""
    minor = AXES[AXES.index(axis) :]
    return math.prod(dims.size(a) for a in minor) > dims.devices_per_node


def cross_host_elements(spec: StageSpec, replicas: int, shards: int, nodes: int) -> float:
    """Elements a parameter that cross nodes a step: with replicas, only the gradient shards
    (:meth:`~jzero.choices.stages.StageSpec.replica_traffic`); without, on several nodes, all
    of the stage's traffic; on one node, none."""
    if replicas > 1:
        return spec.replica_traffic(shards)[0]
    return spec.traffic()[0] if nodes > 1 else 0.0
