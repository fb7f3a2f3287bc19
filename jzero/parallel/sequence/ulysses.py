"""Sequence parallelism (DeepSpeed-Ulysses): attention over a sequence split across the ``seq``
mesh axis, by two all-to-alls around an unchanged attention function.

Outside attention every op of a transformer block (projections, MLP, norms) acts on each token
alone, so each device keeps only its own ``T/S`` tokens. :func:`sequence_parallel_attention`
wraps an attention function so that, inside ``jax.shard_map`` with ``seq`` manual, it sees the
whole sequence for a group of ``H/S`` heads; :mod:`jzero.parallel.sequence.layout` cuts a
replicated batch into each device's tokens and gives their positions.

Decisions:

* **All-to-all, not all-gather or ring attention.** Ulysses trades the sequence split for a
  head split: ``all_to_all(split heads, concat seq)`` turns each device's ``[B, T/S, H, Dh]``
  into ``[B, T, H/S, Dh]``, attention runs unchanged on full sequences (a causal mask, ALiBi,
  a kernel such as ``jax.nn.dot_product_attention`` all see every position), and one
  all-to-all back restores ``[B, T/S, H, Dh]``. Each device then does ``1/S`` of the attention
  work with no change to the attention code, and its activation memory outside attention is
  ``~1/S``. An all-gather of k and v (Megatron's context parallelism) would keep every head and
  hold the full k/v on every device. Past the head count, ring attention
  (:mod:`jzero.parallel.sequence.ring`, the ``context`` axis) takes over, and the two compose:
  ``attn_fn`` may be :func:`~jzero.parallel.sequence.ring.ring_attention`.
* **Communication:** four all-to-alls of the activations per attention call in the forward
  pass (q, k, v in, the output back), each moving ``(S-1)/S`` of a ``[B, T/S, H, Dh]`` tensor
  per device: a constant volume per device as ``T`` and ``S`` grow together, where an
  all-gather's grows with ``S``. The backward pass is four more (an all-to-all's transpose is
  the all-to-all the other way). XLA may fuse the three inputs' into one tuple all-to-all.
* **One model code with and without sequence parallelism.** Where ``axis`` is not a bound
  mesh axis (a plain call, ``jax.jit`` with no ``shard_map``, or ``shard_map`` with ``seq``
  left automatic) or its size is 1, the wrapper calls the attention function directly. An
  unbound axis is detected by ``jax.lax.axis_size`` raising ``NameError`` (JAX's "unbound
  axis name"), the one public test JAX offers; a bound axis's size is a Python int at trace
  time, so the choice costs nothing at run time.
* **Grouped-query attention:** k and v may have fewer heads than q. Each head count is split
  into ``S`` contiguous groups, so device ``j`` holds q heads ``j*H/S ...`` and kv heads
  ``j*Hkv/S ...``: the pairing ``q head h -> kv head h // (H/Hkv)`` (``jnp.repeat``'s, and
  ``jax.nn.dot_product_attention``'s) is kept within each device. A head count ``S`` does not
  divide is an error naming the counts and the sizes that would work: an uneven split cannot
  give each device whole heads. (DeepSpeed repeats kv heads when ``Hkv < S``; here the caller
  does so, with ``jnp.repeat(k, r, axis=head_dim)``, where it wants that.)
* **Beside tensor parallelism** (AutoTP's column-parallel q, k, v split the heads over
  ``model``, an axis the step leaves to the compiler), the all-to-alls run with ``model``
  manual too, on each device's own ``H/T`` heads (device ``(m, s)`` then attends over heads
  group ``s`` of model-axis group ``m``). Left to the compiler, the all-to-all on a
  heads-split array first all-gathered the heads over ``model``.
* ``*args`` and ``**kwargs`` go to the attention function unchanged: they must be valid for
  the full sequence and the device's group of heads (a scalar scale, a dropout key; not a
  per-head bias of all ``H`` heads).
* The sequence dimension is contiguous per device: device ``j`` of ``seq`` holds tokens
  ``j*T/S ... (j+1)*T/S - 1`` of the sequence it is given, the order
  ``PartitionSpec(..., "seq")`` gives and the order the all-to-all concatenates in. Under
  ring attention that sequence is one ring member's zig-zag tokens, in their order.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jzero._util import divisors
from jzero.distributed.mesh import SEQ_AXIS
from jzero.parallel.sequence.layout import bound_axis_size
from jzero.parallel.tensor import MODEL_AXIS

__all__ = ["heads_axis", "sequence_parallel_attention"]


def _check_heads(
    q: jax.Array, k: jax.Array, v: jax.Array, head_dim: int, size: int, axis: str
) -> None:
    """Raises ``ValueError`` for a head count of q, k or v that ``size`` does not divide."""
    arrays = {"q": q, "k": k, "v": v}
    heads = {name: x.shape[head_dim] for name, x in arrays.items()}
    for name, n in heads.items():
        if n % size == 0:
            continue
        common = math.gcd(*heads.values())
        counts = (
            f"{common} heads"
            if len(set(heads.values())) == 1
            else f"both head counts (q {heads['q']}, k/v {heads['k']})"
        )
        fix = (
            f" Or repeat k's and v's heads {size // heads['k']} times "
            f"(jnp.repeat(k, {size // heads['k']}, axis={head_dim}), the same for v) so that "
            f"each device gets whole ones, as DeepSpeed does when the k/v heads are fewer than "
            f"the devices."
            if name != "q" and heads["q"] % size == 0 and size % heads["k"] == 0
            else ""
        )
        raise ValueError(
            f"sequence_parallel_attention: {name} has {n} heads (dimension {head_dim} of its "
            f"local shape {tuple(arrays[name].shape)}), which the {size} devices of the "
            f"{axis!r} axis cannot split into whole heads. Choose sequence_parallel_size "
            f"(the {axis!r} axis size) among the divisors of {counts}: "
            f"{', '.join(map(str, divisors(common)))}.{fix}"
        )


def sequence_parallel_attention(
    attn_fn: Callable[..., jax.Array],
    axis: str = SEQ_AXIS,
    *,
    seq_dim: int = 1,
    head_dim: int = 2,
) -> Callable[..., jax.Array]:
    """Wraps an attention function for DeepSpeed-Ulysses sequence parallelism.

    Args:
      attn_fn: ``attn_fn(q, k, v, *args, **kwargs) -> out``, attention over full sequences,
        with ``out`` shaped like ``q`` (``[B, T, H, Dh]`` in the default layout).
      axis: the mesh axis the sequence is split over.
      seq_dim: the sequence dimension of q, k, v and the output.
      head_dim: the heads dimension of q, k, v and the output.

    Returns:
      A function with ``attn_fn``'s signature that takes this device's sequence chunks
      ``[B, T/S, H, Dh]`` (k and v may have fewer heads: grouped-query attention) and returns
      this device's chunk of the attention output, computed over the whole sequence. Where
      ``axis`` is unbound or of size 1 it is ``attn_fn`` itself, called directly.

    Raises:
      ValueError: ``seq_dim`` and ``head_dim`` the same dimension; or (when called under a
        bound ``axis`` of size ``S > 1``) a head count of q, k or v that ``S`` does not divide.

    Example:
      >>> attn = sequence_parallel_attention(causal_attention)  # doctest: +SKIP
      >>> step = jax.shard_map(lambda q, k, v: attn(q, k, v), mesh=mesh,
      ...     in_specs=P("data", "seq"), out_specs=P("data", "seq"))  # doctest: +SKIP
    """
    if seq_dim == head_dim:
        raise ValueError(
            f"sequence_parallel_attention: seq_dim and head_dim are both {seq_dim}; they must "
            "name different dimensions of q, k and v. Pass the layout's sequence and heads "
            "dimensions (seq_dim=1, head_dim=2 for [B, T, H, Dh])."
        )

    @functools.wraps(attn_fn)
    def wrapped(q: jax.Array, k: jax.Array, v: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        size = bound_axis_size(axis)
        if size is None or size == 1:
            return attn_fn(q, k, v, *args, **kwargs)
        ndim = q.ndim
        s_dim, h_dim = seq_dim % ndim, head_dim % ndim
        if s_dim == h_dim:
            raise ValueError(
                f"sequence_parallel_attention: seq_dim={seq_dim} and head_dim={head_dim} are "
                f"the same dimension of the {ndim}-d q, k and v. Pass different dimensions."
            )

        # Array arguments beside q, k, v (a mask, document ids) enter the model axis's
        # shard_map below as operands, replicated over it; the others are closed over.
        at = [i for i, a in enumerate(args) if isinstance(a, jax.Array | np.ndarray)]

        def ulysses(q: jax.Array, k: jax.Array, v: jax.Array, *arrays: jax.Array) -> jax.Array:
            _check_heads(q, k, v, h_dim, size, axis)
            rest = list(args)
            for i, a in zip(at, arrays, strict=True):
                rest[i] = a

            def heads_to_seq(x: jax.Array) -> jax.Array:  # [B, T/S, H, Dh] -> [B, T, H/S, Dh]
                return jax.lax.all_to_all(x, axis, split_axis=h_dim, concat_axis=s_dim, tiled=True)

            out = attn_fn(heads_to_seq(q), heads_to_seq(k), heads_to_seq(v), *rest, **kwargs)
            # [B, T, H/S, Dh] -> [B, T/S, H, Dh]
            return jax.lax.all_to_all(out, axis, split_axis=s_dim, concat_axis=h_dim, tiled=True)

        arrays = [args[i] for i in at]
        model = heads_axis(q, k, v, h_dim)
        if model is None:
            return ulysses(q, k, v, *arrays)
        # Heads split over the model axis too (tensor parallelism): each device's all-to-alls
        # move its own model-axis heads, with that axis manual, never gathering them first.
        spec = P(*([None] * h_dim), model)
        return jax.shard_map(
            ulysses,
            mesh=jax.sharding.get_abstract_mesh(),
            in_specs=(spec, spec, spec, *[P()] * len(arrays)),
            out_specs=spec,
            axis_names={model},
            check_vma=False,
        )(q, k, v, *arrays)

    return wrapped


def heads_axis(q: jax.Array, k: jax.Array, v: jax.Array, head_dim: int) -> str | None:
    """The tensor-parallel axis the heads are split over, when the current abstract mesh has
    one left to the compiler (AutoTP's ``model``: its column-parallel q/k/v split the heads)
    and it divides every head count; else ``None``."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or MODEL_AXIS not in mesh.axis_names:
        return None
    kind = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))[MODEL_AXIS]
    size = int(mesh.shape[MODEL_AXIS])
    if kind != AxisType.Auto or size <= 1:
        return None
    if any(x.shape[head_dim] % size for x in (q, k, v)):
        return None
    return MODEL_AXIS
