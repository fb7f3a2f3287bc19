"""A parameter pending its gather, and the all-gather (with a chosen transpose) that resolves it.

The collective half of :mod:`jzero.rewrite.gather`: :func:`all_gather` moves a shard to the full
value, and a :class:`Pending` is a parameter still in its shard that the replay
(:mod:`jzero.rewrite.interpreter`) gathers where it is used. At stage 2 the parameter is whole
and only its gradient is sharded: a :class:`Scattered` parameter is read as it is, and
:func:`scatter_grad` reduce-scatters each use's cotangent there (in a layer scan's backward,
one layer at a time), into a stand-in of the gradient's shard.

Decisions:

* The transpose of each gather (the gradient's reduce-scatter) runs in the communication dtype
  when one is given (``communication_data_type``), else in the parameter's dtype; a custom VJP
  is used only when that differs from the shard's dtype or the transpose is quantized.
* ZeRO++: with ``bits`` every gather of a floating parameter is quantized (qwZ,
  :func:`jzero.comm.quantization.quantized_all_gather`), and with ``grad_bits`` every transpose
  is the quantized reduce-scatter (qgZ); a pending gather carries both, so casts and nested
  calls keep them. Non-floating arrays are always gathered exactly.
* A shard that rests padded (:mod:`jzero.plan.padding`) is gathered padded and cut to the
  logical length after the gather (``size``); the cut's transpose pads the gradient with zeros
  before its reduce-scatter, so the padding never reaches the loss or the gradients.
* A leaf split over another mesh axis (tensor parallelism's ``model``) is gathered over ZeRO's
  axis with that axis manual too (:func:`jzero.comm.manual.over_axes`): each device gathers
  only its model-axis piece, never the whole weight.
* An expert leaf (expert parallelism) is sharded by ZeRO over the axes besides ``expert``: its
  pending gather carries those (``axis``) in place of the replay's.
* Stage 2's reduce-scatter at the use splits the use's trailing dimensions flattened (a stacked
  leaf's layers kept): every layer splits evenly wherever its element count does, whatever
  its shape, and each device's piece is one contiguous block of the layer.
* A pending gather passes through dtype casts that do not widen it (so a bf16 copy is gathered
  in bf16, at half the bytes); a widening cast is recorded (``dtype``) and applied after the
  gather, so a bf16 parameter the model upcasts is still gathered in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jzero.comm import over_axes, quantized_all_gather, quantized_psum_scatter, trailing_spec

__all__ = ["Scattered", "all_gather", "scatter_grad"]


@dataclass(frozen=True)
class Pending:
    """A parameter still in its shard: gathering ``shard`` on ``dim`` gives the full value."""

    shard: Any
    dim: int
    dtype: Any = None  # a widening cast applied after the gather (the gather stays narrow)
    index: int = -1  # the parameter leaf it comes from (``jax.tree.leaves`` order)
    bits: int = 0  # ZeRO++ qwZ: the forward gather sends this many bits a value (0: exact)
    grad_bits: int = 0  # ZeRO++ qgZ: the gradient's reduce-scatter likewise (0: exact)
    size: int | None = None  # the logical length of ``dim``: a padded gather is cut to it
    spec: tuple = ()  # the leaf's entries on the mesh's other axes (tensor parallelism), per dim
    axis: Any = None  # the axes this leaf's shards span, where not the replay's (an expert leaf)
    shards: int | None = None  # their size, where ``axis`` is set

    @property
    def key(self) -> tuple[int, str, str]:
        """Which gathered value this is: the leaf, the dtype gathered, the dtype after it."""
        return (self.index, str(self.shard.dtype), str(self.dtype))

    def numel(self, shards: int) -> int:
        """Elements of the gathered value (``shards``: the replay's axis size)."""
        return int(self.shard.size) * (self.shards if self.shards is not None else shards)

    def gather(self, axis_name: str, grad_dtype: Any, shard: Any = None, dim: int | None = None):
        shard = self.shard if shard is None else shard
        d = self.dim if dim is None else dim
        axis_name = axis_name if self.axis is None else self.axis

        def gather(s: Any) -> Any:
            return all_gather(s, axis_name, d, grad_dtype, bits=self.bits, grad_bits=self.grad_bits)

        # A leaf split over another axis too (tensor parallelism) is gathered piece by piece
        # over it (jzero.comm.manual); a scanned layer's slice has the leaf's trailing dims.
        spec = trailing_spec(self.spec, shard.ndim) if self.spec else P()
        x = over_axes(gather, (spec,), spec)(shard)
        if self.size is not None and x.shape[d] != self.size:
            # The shards rest padded (jzero.plan.padding): the padding stays out of the loss,
            # and the slice's transpose puts zeros there in the gradient's reduce-scatter.
            x = jax.lax.slice_in_dim(x, 0, self.size, axis=d)
        return x if self.dtype is None else x.astype(self.dtype)


def all_gather(
    x: jax.Array,
    axis_name: str,
    dim: int,
    grad_dtype: Any = None,
    *,
    bits: int = 0,
    grad_bits: int = 0,
) -> jax.Array:
    """A tiled all-gather whose transpose reduce-scatters in ``grad_dtype`` (default: x's).

    ``bits`` (8 or 4) sends the gather quantized (ZeRO++ qwZ,
    :func:`jzero.comm.quantization.quantized_all_gather`); ``grad_bits`` (8 or 4) makes the
    transpose ZeRO++'s quantized reduce-scatter (qgZ,
    :func:`jzero.comm.quantization.quantized_psum_scatter`). Both apply to floating arrays only;
    0 is exact.
    """
    if not jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
        bits = grad_bits = 0
    if bits:
        grad = grad_bits or None
        return quantized_all_gather(x, axis_name, dim, grad_dtype, bits, grad_bits=grad)
    if not grad_bits and (grad_dtype is None or jax.numpy.dtype(grad_dtype) == x.dtype):
        return jax.lax.all_gather(x, axis_name, axis=dim, tiled=True)

    @jax.custom_vjp
    def gather(x: jax.Array) -> jax.Array:
        return jax.lax.all_gather(x, axis_name, axis=dim, tiled=True)

    def fwd(x: jax.Array) -> tuple[jax.Array, None]:
        return gather(x), None

    def bwd(_: None, ct: jax.Array) -> tuple[jax.Array]:
        if grad_bits:
            return (quantized_psum_scatter(ct, axis_name, dim, grad_bits).astype(x.dtype),)
        reduced = jax.lax.psum_scatter(
            ct.astype(grad_dtype or x.dtype), axis_name, scatter_dimension=dim, tiled=True
        )
        return (reduced.astype(x.dtype),)

    gather.defvjp(fwd, bwd)
    return gather(x)


@dataclass(frozen=True)
class Scattered:
    """A whole parameter whose gradient is reduce-scattered where it is used (ZeRO stage 2).

    ``whole`` is the value the loss reads; ``stand_in`` is what the step differentiates in its
    place: zeros of the gradient's local shard, ``whole``'s trailing dimensions flattened and
    split over ``axis`` (leading dimensions kept: a stacked leaf's layers). The transpose of
    each use (:func:`scatter_grad`) reduce-scatters the use's cotangent into the stand-in's
    shape, so a layer scan's backward reduces one layer at a time.
    """

    whole: Any
    stand_in: Any
    axis: Any
    grad_bits: int = 0  # ZeRO++ qgZ: the reduce-scatter sends this many bits a value (0: exact)

    def take(self, grad_dtype: Any, whole: Any = None, stand_in: Any = None) -> Any:
        """The whole value (or one layer's ``whole`` and ``stand_in``), its gradient scattered."""
        whole = self.whole if whole is None else whole
        stand_in = self.stand_in if stand_in is None else stand_in
        return scatter_grad(whole, stand_in, self.axis, grad_dtype, grad_bits=self.grad_bits)


def scatter_grad(
    whole: jax.Array,
    stand_in: jax.Array,
    axis_name: Any,
    grad_dtype: Any = None,
    *,
    grad_bits: int = 0,
) -> jax.Array:
    """``whole``, whose cotangent goes to ``stand_in`` reduce-scattered over ``axis_name``.

    ``stand_in`` has ``whole``'s leading ``stand_in.ndim - 1`` dimensions and, last, the
    shard of the rest flattened (their element count divided by the axis size): the
    cotangent is flattened so, summed over the axis in ``grad_dtype`` (default: its own) and
    split, each device keeping its contiguous piece; ``grad_bits`` (8 or 4) sends it
    quantized (:func:`jzero.comm.quantization.quantized_psum_scatter`). ``whole`` gets no
    cotangent: it is the resting parameter, not what the step differentiates.
    """
    lead = stand_in.ndim - 1

    @jax.custom_vjp
    def take(whole: jax.Array, stand_in: jax.Array) -> jax.Array:
        return whole

    def fwd(whole: jax.Array, stand_in: jax.Array) -> tuple[jax.Array, None]:
        return whole, None

    def bwd(_: None, ct: jax.Array) -> tuple[None, jax.Array]:
        flat = ct.reshape(*ct.shape[:lead], -1)
        if grad_bits and jax.numpy.issubdtype(flat.dtype, jax.numpy.floating):
            reduced = quantized_psum_scatter(flat, axis_name, lead, grad_bits)
        else:
            reduced = jax.lax.psum_scatter(
                flat.astype(grad_dtype or flat.dtype), axis_name, scatter_dimension=lead, tiled=True
            )
        return None, reduced.astype(stand_in.dtype)

    take.defvjp(fwd, bwd)
    return take(whole, stand_in)
