"""ZeRO++ building blocks: block-quantized all-gather (qwZ) and reduce-scatter (qgZ).

DeepSpeed's ZeRO++ shrinks stage 3's two big collectives by sending integers instead of
floats: qwZ quantizes the weights each device contributes to the forward all-gather, qgZ
replaces the gradient reduce-scatter by an all-to-all of quantized chunks that every device
dequantizes and sums itself. The functions here are those two collectives, written for use
inside ``jax.shard_map`` (as jzero's step does, over the mesh axis ``"data"``), plus the
quantizer they share:

* :func:`quantize` / :func:`dequantize`: symmetric per-block quantization to 8 or 4 bits.
* :func:`quantized_all_gather`: a drop-in for :func:`jzero.rewrite.gather.all_gather` whose forward
  gather moves int8 (or packed 4-bit) bytes; its backward pass is the ordinary reduce-scatter.
* :func:`quantized_psum_scatter`: the tiled reduce-scatter of a gradient as a quantized
  all-to-all followed by a local float32 sum.
* :func:`quantized_psum`: the all-reduce as the two above (reduce-scatter, then gather).

Decisions:

* **Blocks are the array's own, flattened row-major.** ``quantize`` flattens ``x``, pads it
  with zeros to a multiple of ``block`` and gives each block of ``block`` consecutive
  elements one float32 scale (``absmax / qmax``, ``qmax`` 127 for 8 bits and 7 for 4 bits),
  whatever the input's dtype: the scale then never overflows fp16 nor loses bf16's bits.
  ``q`` is ``round(x / scale)`` clipped to ``[-qmax, qmax]``, so every element is recovered to
  within half its block's scale. A block of zeros (or one whose scale underflows to zero)
  gets scale 1 and quantizes to zeros, exactly; a block holding a NaN or an infinity gets a
  non-finite scale, so it dequantizes to non-finite values and an overflow check on the
  result (fp16 loss scaling) still sees it.
* **4 bits are really 4 bits.** Two values share a byte (``uint8``, each value stored as
  ``q + 8`` in a nibble, the even-indexed element of a pair in the low nibble), so ``block``
  must be even; 8 bits are ``int8``, one value a byte.
* **Each device quantizes its own piece.** The all-gather quantizes the local shard with its
  own blocks and the all-to-all quantizes each outgoing chunk with its own, so the gathered
  bytes are the concatenation of every device's and dequantize piece by piece; nothing
  depends on block boundaries lining up with shard boundaries, so any shape, any ``dim`` and
  shards whose size is not a multiple of ``block`` work (the padding travels, at most
  ``block - 1`` elements per piece).
* **One collective per call, all bytes.** The float32 scales are bitcast to 4 bytes each and
  appended to their block's payload, so a gather (or exchange) is a single ``s8``/``u8``
  collective of ``block + 4`` bytes per block at 8 bits (``block / 2 + 4`` at 4 bits): with
  the default block of 256 that is 0.254 (0.129) of the float32 bytes. Sending the scales as
  a second collective would double the number of collectives for 1.6% of the bytes.
* **Only the forward gather is quantized (qwZ)** unless ``grad_bits`` asks for more: the
  custom VJP of :func:`quantized_all_gather` reduce-scatters the cotangent unquantized, in
  ``grad_dtype`` (default: x's dtype) like :func:`jzero.rewrite.gather.all_gather`; with
  ``grad_bits`` (qwZ and qgZ together) it is :func:`quantized_psum_scatter` instead.
* **A piece smaller than a block is one block of its own size.** The block actually used is
  ``min(block, piece size)`` (rounded up to even at 4 bits), so a small piece (a bias's shard
  of 8 elements) sends its 8 bytes plus one 4-byte scale, never a padded block of 256: the
  quantized bytes never exceed about a quarter of float32 plus 4 bytes a piece.
* **The reduce-scatter sums in float32 and returns x's dtype**, a drop-in for
  ``jax.lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)``. It is a
  single-level all-to-all (ZeRO++'s hierarchical intra-/inter-node exchange needs a two-level
  mesh) and is not differentiable: it is meant for gradients.
* **The all-reduce flattens**, so it needs no dimension divisible by the axis size: the flat
  array is padded to a multiple of ``n * block``, reduce-scattered, the summed shard
  quantized again and gathered, then unpadded. Its error is the reduce-scatter's plus one more
  quantization of the sum.
* **An axis of size 1 communicates nothing, so nothing is quantized**: all three collectives
  return their input unchanged there (the gather's gradient too).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "dequantize",
    "quantize",
    "quantized_all_gather",
    "quantized_psum",
    "quantized_psum_scatter",
]

_QMAX = {8: 127, 4: 7}
_SCALE_BYTES = 4  # float32 scales, bitcast to bytes for the wire


def _check(bits: int, block: int) -> None:
    if bits not in _QMAX:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if block < 1 or (bits == 4 and block % 2):
        raise ValueError(f"block must be positive (and even for 4 bits), got {block}")


def _byte_dtype(bits: int) -> Any:
    return jnp.int8 if bits == 8 else jnp.uint8


def quantize(x: jax.Array, bits: int = 8, block: int = 256) -> tuple[jax.Array, jax.Array]:
    """Symmetric per-block quantization of a float array.

    Args:
      x: a floating array of any shape (fp32, bf16, fp16, ...).
      bits: 8 (``int8``, one value a byte) or 4 (two values packed in each ``uint8``).
      block: elements sharing one scale, consecutive in ``x`` flattened row-major (the last
        block is padded with zeros); even for 4 bits.

    Returns:
      ``(q, scales)``: ``q`` of shape ``(num_blocks, block)`` int8 at 8 bits or
      ``(num_blocks, block // 2)`` uint8 at 4 bits, and float32 ``scales`` of shape
      ``(num_blocks,)``, where ``num_blocks = ceil(x.size / block)``.
    """
    _check(bits, block)
    qmax = _QMAX[bits]
    flat = x.reshape(-1).astype(jnp.float32)
    blocks = -(-flat.size // block)
    flat = jnp.pad(flat, (0, blocks * block - flat.size))
    xb = flat.reshape(blocks, block)
    scales = jnp.max(jnp.abs(xb), axis=1) / qmax
    # Zero (or underflowed) blocks get scale 1; NaN stays NaN, so a bad block stays visible.
    scales = jnp.where(scales == 0, jnp.float32(1), scales)
    q = jnp.clip(jnp.round(xb / scales[:, None]), -qmax, qmax)
    if bits == 8:
        return q.astype(jnp.int8), scales
    nibbles = (q + 8).astype(jnp.uint8).reshape(blocks, block // 2, 2)
    return nibbles[..., 0] | (nibbles[..., 1] << 4), scales


def dequantize(
    q: jax.Array,
    scales: jax.Array,
    shape: tuple[int, ...],
    dtype: Any,
    bits: int = 8,
    block: int = 256,
) -> jax.Array:
    """The inverse of :func:`quantize`: the blocks times their scales, unpadded.

    Args:
      q: ``quantize``'s integers, ``(num_blocks, block)`` (8 bits) or
        ``(num_blocks, block // 2)`` (4 bits).
      scales: ``quantize``'s float32 scales, ``(num_blocks,)``.
      shape: the shape of the quantized array.
      dtype: the dtype to return.
      bits: the ``bits`` ``q`` was made with.
      block: the ``block`` ``q`` was made with.

    Returns:
      An array of ``shape`` and ``dtype`` (the products are formed in float32, then cast).
    """
    _check(bits, block)
    if bits == 8:
        values = q.astype(jnp.float32)
    else:
        low = (q & 15).astype(jnp.float32) - 8
        high = (q >> 4).astype(jnp.float32) - 8
        values = jnp.stack([low, high], axis=-1).reshape(q.shape[0], block)
    flat = (values * scales[:, None].astype(jnp.float32)).reshape(-1)
    return flat[: math.prod(shape)].reshape(shape).astype(dtype)


def _pack(x: jax.Array, bits: int, block: int) -> jax.Array:
    """``x`` quantized into one byte buffer: each block's payload then its scale's 4 bytes."""
    q, scales = quantize(x, bits, block)
    scale_bytes = jax.lax.bitcast_convert_type(scales, q.dtype)  # (num_blocks, 4)
    return jnp.concatenate([q, scale_bytes], axis=1)


def _unpack(buf: jax.Array, shape: tuple[int, ...], dtype: Any, bits: int, block: int):
    """The inverse of :func:`_pack`."""
    q, scale_bytes = buf[:, :-_SCALE_BYTES], buf[:, -_SCALE_BYTES:]
    scales = jax.lax.bitcast_convert_type(scale_bytes, jnp.float32)
    return dequantize(q, scales, shape, dtype, bits, block)


def _fit(block: int, size: int, bits: int) -> int:
    """The block used for a piece of ``size`` elements: ``block``, or the piece if smaller."""
    fitted = max(1, min(block, size))
    return fitted + fitted % 2 if bits == 4 else fitted


def _axis_size(axis_name: Any) -> int:
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    return math.prod(jax.lax.axis_size(a) for a in names)


def _gather(x: jax.Array, axis_name: Any, dim: int, bits: int, block: int) -> jax.Array:
    """The quantized tiled all-gather itself, without a custom gradient."""
    n = _axis_size(axis_name)
    if n == 1:
        return x
    block = _fit(block, x.size, bits)
    pieces = jax.lax.all_gather(_pack(x, bits, block), axis_name)  # (n, blocks, bytes)
    unpack = jax.vmap(lambda b: _unpack(b, x.shape, x.dtype, bits, block))
    stacked = jnp.moveaxis(unpack(pieces), 0, dim)  # (..., n, x.shape[dim], ...)
    return stacked.reshape(x.shape[:dim] + (n * x.shape[dim],) + x.shape[dim + 1 :])


def quantized_all_gather(
    x: jax.Array,
    axis_name: Any,
    dim: int,
    grad_dtype: Any = None,
    bits: int = 8,
    block: int = 256,
    grad_bits: int | None = None,
) -> jax.Array:
    """A tiled all-gather that sends quantized bytes; its transpose reduce-scatters exactly
    (or, with ``grad_bits``, by :func:`quantized_psum_scatter`).

    Inside ``shard_map``: each device quantizes its local shard with its own blocks, the
    bytes (payload and scales, one buffer) are all-gathered and every device's piece is
    dequantized and concatenated along ``dim`` in device order: the layout of
    ``jax.lax.all_gather(x, axis_name, axis=dim, tiled=True)``, to within half a block's
    scale per element.

    Args:
      x: the local shard, floating.
      axis_name: the mesh axis (or tuple of axes) to gather over.
      dim: the dimension of ``x`` the shards are concatenated along (negative counts back).
      grad_dtype: the dtype the backward reduce-scatter runs in (default: x's dtype).
      bits: 8 or 4.
      block: elements per scale (even for 4 bits).
      grad_bits: ``None`` (the backward reduce-scatter is exact) or 8 / 4: the backward is
        ZeRO++'s quantized reduce-scatter (qgZ), summed in float32, returned in x's dtype.

    Returns:
      The gathered array, ``x.shape`` with ``dim`` multiplied by the axis size, in x's dtype.
    """
    _check(bits, block)
    if grad_bits is not None:
        _check(grad_bits, block)
    dim = dim % x.ndim
    if _axis_size(axis_name) == 1:
        return x
    reduce_dtype = x.dtype if grad_dtype is None else jnp.dtype(grad_dtype)

    @jax.custom_vjp
    def gather(x: jax.Array) -> jax.Array:
        return _gather(x, axis_name, dim, bits, block)

    def fwd(x: jax.Array) -> tuple[jax.Array, None]:
        return gather(x), None

    def bwd(_: None, ct: jax.Array) -> tuple[jax.Array]:
        if grad_bits is not None:
            return (quantized_psum_scatter(ct, axis_name, dim, grad_bits, block).astype(x.dtype),)
        reduced = jax.lax.psum_scatter(
            ct.astype(reduce_dtype), axis_name, scatter_dimension=dim, tiled=True
        )
        return (reduced.astype(x.dtype),)

    gather.defvjp(fwd, bwd)
    return gather(x)


def quantized_psum_scatter(
    x: jax.Array, axis_name: Any, dim: int, bits: int = 8, block: int = 256
) -> jax.Array:
    """ZeRO++ qgZ: a tiled reduce-scatter done as a quantized all-to-all and a local sum.

    Inside ``shard_map``: ``x`` is split along ``dim`` into one chunk per device, each chunk is
    quantized with its own blocks, the all-to-all sends chunk ``i`` (payload and scales, one
    buffer) to device ``i``, and each device dequantizes what it received and sums it in
    float32. The result approximates
    ``jax.lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)``: each device's
    contribution is off by at most half its block's scale per element. Not differentiable
    (apply it to gradients).

    Args:
      x: this device's full-size contribution, floating; ``x.shape[dim]`` divisible by the
        axis size.
      axis_name: the mesh axis (or tuple of axes) to reduce over.
      dim: the dimension to scatter along (negative counts back).
      bits: 8 or 4.
      block: elements per scale (even for 4 bits).

    Returns:
      This device's chunk of the sum, ``x.shape`` with ``dim`` divided by the axis size, in
      x's dtype.
    """
    _check(bits, block)
    dim = dim % x.ndim
    n = _axis_size(axis_name)
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of {x.shape} does not divide into {n} chunks")
    if n == 1:
        return x
    chunk = x.shape[:dim] + (x.shape[dim] // n,) + x.shape[dim + 1 :]
    block = _fit(block, math.prod(chunk), bits)
    chunks = jnp.moveaxis(x.reshape(x.shape[:dim] + (n, -1) + x.shape[dim + 1 :]), dim, 0)
    packed = jax.vmap(lambda c: _pack(c, bits, block))(chunks)  # (n, blocks, bytes)
    received = jax.lax.all_to_all(packed, axis_name, 0, 0)  # [j]: my chunk from device j
    unpack = jax.vmap(lambda b: _unpack(b, chunk, jnp.float32, bits, block))
    return jnp.sum(unpack(received), axis=0).astype(x.dtype)


def quantized_psum(x: jax.Array, axis_name: Any, bits: int = 8, block: int = 256) -> jax.Array:
    """An all-reduce (sum) as a quantized reduce-scatter and a quantized all-gather.

    The array is flattened and padded to a multiple of ``n * block`` elements, so any shape
    works; the summed shard each device holds after the reduce-scatter is quantized again for
    the gather. Not differentiable (apply it to gradients).

    Args:
      x: this device's contribution, floating, any shape.
      axis_name: the mesh axis (or tuple of axes) to reduce over.
      bits: 8 or 4.
      block: elements per scale (even for 4 bits).

    Returns:
      Approximately ``jax.lax.psum(x, axis_name)``, in x's shape and dtype.
    """
    _check(bits, block)
    n = _axis_size(axis_name)
    if n == 1:
        return x
    flat = x.reshape(-1)
    step = n * block
    flat = jnp.pad(flat, (0, -flat.size % step))
    shard = quantized_psum_scatter(flat, axis_name, 0, bits, block)
    summed = _gather(shard, axis_name, 0, bits, block)
    return summed[: x.size].reshape(x.shape)
