"""Muon under ZeRO: each matrix orthogonalised once, whole, on the device that owns it.

Muon (Momentum Orthogonalized by Newton-Schulz) replaces the update of a hidden weight matrix by
an approximately orthogonal matrix: the Nesterov momentum of its gradient pushed through a few
quintic Newton-Schulz iterations. Every other leaf (embeddings, the output head, biases and
norm gains) is updated by AdamW, as Muon's users do. The update rule is
``optax.contrib.muon``'s, to the last bit in float64 (``tests/optim/test_muon.py``).

Decisions:

* **Why not just optax's update.** ``optax.contrib.muon`` as optax wrote it trains correctly
  under jzero at every stage: the update runs on sharded global arrays and GSPMD partitions
  each Newton-Schulz matmul. But then every iteration of every matrix needs collectives
  (``X X^T`` of a row-sharded ``X`` is an all-reduce, the next product an all-gather): the
  tests' toy (four 2-D leaves, stage 3) compiles to 15 more all-gathers and 15 more
  all-reduces than AdamW's step. DeepSpeed instead gathers a matrix's update once,
  orthogonalises it on one rank and scatters the result.
* **One exchange in, one out.** Inside jzero's step (which says where each leaf of the update rests:
  :mod:`jzero.optim.update_context`) the matrices are grouped by shape, stacked (transposed to rows
  <= columns, as the iteration itself does) into ``[B, rows, cols]``, padded with zero matrices to a
  multiple of the devices the leaves are sharded over, and constrained to be split over ``B``: each
  device then holds a few *whole* matrices, and the resharding from "every matrix in row shards" to
  "whole matrices, dealt out" is one all-to-all per group. Each device runs the iterations on its
  own matrices with no collective at all, and one all-to-all per group takes the results back to the
  leaves' shards. The exchange moves the momentum once in and the update once out: ``2 x (n-1)/n``
  of the orthogonalised leaves' float32 bytes per step, in place of a collective per iteration.
* **Where the matrices rest whole, in place.** A stacked leaf split only over its layer (or
  expert) axis, as ZeRO lays out a scan's stack whose layers the devices divide, holds whole
  matrices on each device already: they are orthogonalised there, with no collective at all
  (a layer count the devices do not divide is padded with zero matrices first). A stack of
  fewer layers than devices rests tiled (each device a piece of one layer's matrix,
  :mod:`jzero.plan`'s merged leading dimensions); gathering it is an all-gather of the leaf
  and a few permutes (GSPMD's way between those tilings), still none in the iterations.
* **Zero padding is free of NaNs.** A zero matrix is scaled by ``1 / (0 + eps)`` and stays zero.
* **optax's Muon passed in code** (:func:`from_optax_muon`, which ``jzero.initialize``
  applies) goes through the same exchange: optax's transformations are closures over the
  ones they combine, so jzero finds ``optax.contrib.scale_by_muon``'s update by its code
  object (shared by every instance; an optax whose update reads other variables is left
  alone) and rebuilds the closures above it with an update that reads the same
  hyperparameters and state and runs optax's own Newton-Schulz on each whole matrix. The
  caller's transformation is not modified, the state stays optax's ``MuonState`` (checkpoints
  and code that read it are unaffected), and the rest (labels, shape scaling, weight decay,
  AdamW) stays optax's code. Rebuilding from hyperparameters would need every factory's
  closure read and would change the state; a transformation of the user's own class (methods,
  not closures) is not rewritten: ``initialize`` warns, naming :func:`muon`.
* **Outside jzero's step** (a plain ``jax.jit`` on one device, the leafwise check, the streamed
  update of ``sub_group_size``) there is no layout: each leaf is orthogonalised where it is.
  The update is leafwise over whole leaves either way, so grouped updates stay exact.
* **Which leaves.** :func:`default_dimension_numbers`: a leaf of two or more dimensions whose
  path names no embedding, head or norm, and whose own name is no bias, scale or gain (``b``,
  ``bias``, ``*_bias``, ``scale``, ``*_scale``: a scanned stack of vectors is 2-D too), is a
  matrix (or a stack of them); its leading axis is a layer
  axis when it has three or more (a scanned stack, as jzero's models and ``nn.scan`` lay them
  out), plus one expert axis when its path names experts; the next axis is the matrix's input
  (reduction) axis and the rest its output axes, so a fused ``[L, d, 3, d]`` QKV weight is one
  ``d x 3d`` matrix per layer. Pass ``dimension_numbers`` (a function of ``(path, shape)``, or
  a tree of ``optax.contrib.MuonDimensionNumbers`` / ``None`` like optax's
  ``muon_weight_dimension_numbers``) for other layouts.
* **The state** is ``MuonState(count, mu)`` for the matrices and AdamW's for the rest (under
  ``optax.partition``), each sharded like its parameter. The iteration's coefficients are
  constants of the transformation, not state, so ``bf16_optimizer_states`` never rounds them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers

from jzero.optim.update_context import current_update_layout

__all__ = [
    "MuonOptions",
    "DEFAULT_NS_COEFFS",
    "MuonState",
    "default_dimension_numbers",
    "exchanges_once",
    "from_optax_muon",
    "muon",
    "newton_schulz",
    "scale_by_muon",
]

PyTree = Any
DimsRule = Callable[[str, tuple[int, ...]], "MuonDimensionNumbers | None"]

DEFAULT_NS_COEFFS = (3.4445, -4.7750, 2.0315)
"""The quintic iteration's coefficients (Keller Jordan's, optax's default)."""

_NOT_MATRICES = ("embed", "wte", "wpe", "lm_head", "head", "unembed", "norm")
_VECTOR_NAMES = ("b", "bias", "scale", "gain", "g")


class MuonState(NamedTuple):
    """Muon's state: the update count and the momentum of each matrix (its parameter's shape)."""

    count: jax.Array
    mu: PyTree


def default_dimension_numbers(path: str, shape: tuple[int, ...]) -> MuonDimensionNumbers | None:
    """Which axes of the leaf at ``path`` (``jax.tree_util.keystr`` form) form Muon's matrix, or
    ``None`` for a leaf AdamW updates (fewer than two dimensions, or an embedding or head)."""
    name = path.lower()
    last = re.findall(r"\w+", name)[-1:] or [""]
    vector = last[0] in _VECTOR_NAMES or last[0].endswith(("_bias", "_scale", "_gain"))
    if len(shape) < 2 or vector or any(t in name for t in _NOT_MATRICES):
        return None
    stacked = 0 if len(shape) == 2 else 1 + ("expert" in name)
    stacked = min(stacked, len(shape) - 2)
    return MuonDimensionNumbers(stacked, tuple(range(stacked + 1, len(shape))))


def _as_rule(dimension_numbers: Any) -> DimsRule:
    """``dimension_numbers`` (None, a ``(path, shape)`` function, a tree of dimension numbers /
    None, or one ``MuonDimensionNumbers`` for every leaf of two or more dimensions) as a rule."""
    if dimension_numbers is None:
        return default_dimension_numbers
    if isinstance(dimension_numbers, MuonDimensionNumbers):
        return lambda _, shape: dimension_numbers if len(shape) >= 2 else None
    if callable(dimension_numbers):
        return dimension_numbers
    flat = jax.tree_util.tree_flatten_with_path(
        dimension_numbers, is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers)
    )[0]
    table = {jax.tree_util.keystr(p): d for p, d in flat}
    return lambda path, _: table.get(path)


def _axes(dims: MuonDimensionNumbers, ndim: int) -> tuple[tuple[int, ...], ...]:
    """(batch, reduction, output) axes of a leaf of ``ndim`` dimensions."""

    def norm(a: Any) -> tuple[int, ...]:
        return tuple(x % ndim for x in ((a,) if isinstance(a, int) else a))

    red, out = norm(dims.reduction_axis), norm(dims.output_axis)
    if set(red) & set(out):
        raise ValueError(f"Muon's reduction axes {red} and output axes {out} overlap.")
    batch = tuple(a for a in range(ndim) if a not in red + out)
    return batch, red, out


def _to_matrices(x: jax.Array, dims: MuonDimensionNumbers) -> jax.Array:
    """``x`` as ``[batch, fan_in, fan_out]``."""
    batch, red, out = _axes(dims, x.ndim)
    size = lambda axes: math.prod(x.shape[a] for a in axes)  # noqa: E731
    return x.transpose(batch + red + out).reshape(size(batch), size(red), size(out))


def _from_matrices(m: jax.Array, like: jax.Array, dims: MuonDimensionNumbers) -> jax.Array:
    batch, red, out = _axes(dims, like.ndim)
    order = batch + red + out
    m = m.reshape(tuple(like.shape[a] for a in order))
    return m.transpose(tuple(order.index(a) for a in range(like.ndim)))


def newton_schulz(x: jax.Array, coeffs: tuple[float, float, float], steps: int, eps: float):
    """The quintic Newton-Schulz iteration on one matrix with rows <= columns: ``x`` scaled to
    unit Frobenius norm, then ``steps`` times ``x <- a x + (b A + c A A) x`` with ``A = x x^T``.
    Its singular values go to about 1 (between roughly 0.7 and 1.2), its singular vectors stay."""
    a, b, c = (jnp.asarray(k, x.dtype) for k in coeffs)
    x = x / (jnp.linalg.norm(x) + eps)
    for _ in range(steps):  # unrolled: a handful of matmuls, no loop for collectives to hide in
        g = x @ x.T
        x = a * x + (b * g + c * g @ g) @ x
    return x


def _orthogonalize(
    leaves: list[tuple[str, jax.Array, MuonDimensionNumbers]],
    ns: Callable[[jax.Array], jax.Array],
) -> list[jax.Array]:
    """Each leaf's matrices orthogonalised: dealt out whole over the axes their leaves are
    sharded on (one all-to-all per group of equal shapes each way), or where they are."""
    layout = current_update_layout()
    out: list[jax.Array | None] = [None] * len(leaves)
    groups: dict[tuple, list[tuple[int, jax.Array, bool]]] = {}
    for i, (path, x, dims) in enumerate(leaves):
        if path in layout and _batch_sharded(layout[path], dims, tuple(x.shape)):
            out[i] = _in_place(x, dims, layout[path], ns)  # whole matrices on each device
            continue
        if path in layout and _divides(layout[path], x.shape):
            # Pinned where it rests, so the exchange below starts from the finished momentum
            # (else GSPMD moves each operand of its last sum on its own).
            x = jax.lax.with_sharding_constraint(x, layout[path])
        m = _to_matrices(x, dims)
        wide = m.shape[1] <= m.shape[2]
        m = m if wide else m.transpose(0, 2, 1)  # rows <= columns, as the iteration wants
        sharding = layout.get(path)
        axes = () if sharding is None else _spec_axes(sharding.spec)
        groups.setdefault((m.shape[1:], m.dtype, axes), []).append((i, m, wide))
    for (_, _, axes), members in groups.items():
        stack = jnp.concatenate([m for _, m, _ in members])
        if axes:
            sharding = layout[leaves[members[0][0]][0]]
            n = math.prod(sharding.mesh.shape[a] for a in axes)
            pad = -stack.shape[0] % n
            stack = jnp.concatenate([stack, jnp.zeros((pad, *stack.shape[1:]), stack.dtype)])
            dealt = NamedSharding(sharding.mesh, P(axes if len(axes) > 1 else axes[0]))
            stack = jax.lax.with_sharding_constraint(stack, dealt)
        done = jax.vmap(ns)(stack)
        if axes:  # pinned too: one exchange of the result, not one per operand of its last sum
            done = jax.lax.with_sharding_constraint(done, dealt)
        start = 0
        for i, m, wide in members:
            part = done[start : start + m.shape[0]]
            start += m.shape[0]
            part = part if wide else part.transpose(0, 2, 1)
            path, x, dims = leaves[i]
            y = _from_matrices(part, x, dims)
            if axes:
                y = jax.lax.with_sharding_constraint(y, layout[path])
            out[i] = y
    return out  # type: ignore[return-value]


def _batch_sharded(
    sharding: NamedSharding, dims: MuonDimensionNumbers, shape: tuple[int, ...]
) -> bool:
    """Whether ``sharding`` splits only batch axes of the leaf (each device holds whole
    matrices: a scanned stack of layers sharded over its layer axis)."""
    batch, _, _ = _axes(dims, len(shape))
    split = [d for d, entry in enumerate(sharding.spec) if entry]
    return bool(split) and all(d in batch for d in split)


def _in_place(
    x: jax.Array,
    dims: MuonDimensionNumbers,
    sharding: NamedSharding,
    ns: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """The matrices of a leaf split over its batch axes, orthogonalised where they rest: no
    collective. A batch axis the devices do not divide is padded with zero matrices to a
    multiple of them first, so each device holds whole matrices (the padding is cut after)."""
    pad = [(0, 0)] * x.ndim
    for d, count in enumerate(_split_counts(sharding)):
        pad[d] = (0, -x.shape[d] % count)
    padded = jax.lax.with_sharding_constraint(jnp.pad(x, pad), sharding)
    batch, red, out = _axes(dims, x.ndim)
    order = batch + red + out
    lead = tuple(padded.shape[a] for a in batch)
    fan_in = math.prod(x.shape[a] for a in red)
    fan_out = math.prod(x.shape[a] for a in out)
    m = padded.transpose(order).reshape(*lead, fan_in, fan_out)
    wide = fan_in <= fan_out
    one = ns if wide else (lambda a: ns(a.T).T)
    for _ in batch:  # one vmap per batch axis: no sharded axes are merged
        one = jax.vmap(one)
    y = one(m).reshape(tuple(padded.shape[a] for a in order))
    y = y.transpose(tuple(order.index(a) for a in range(x.ndim)))
    y = jax.lax.with_sharding_constraint(y, sharding)
    return y[tuple(slice(0, n) for n in x.shape)]


def _entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes one partition-spec entry splits a dimension over (``None``: none)."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _split_counts(sharding: NamedSharding) -> list[int]:
    """For each dimension the spec names, how many devices split it (1: none)."""
    sizes = sharding.mesh.shape
    return [math.prod(sizes[a] for a in _entry_axes(e)) for e in sharding.spec]


def _divides(sharding: NamedSharding, shape: tuple[int, ...]) -> bool:
    """Whether ``sharding`` splits every dimension of ``shape`` evenly."""
    return all(shape[d] % n == 0 for d, n in enumerate(_split_counts(sharding)))


def _spec_axes(spec: P) -> tuple[str, ...]:
    """The mesh axes a partition spec splits over, in order."""
    return tuple(a for entry in spec for a in _entry_axes(entry))


def _momentum(
    updates: PyTree, state: Any, beta: float, nesterov: bool
) -> tuple[PyTree, jax.Array, PyTree]:
    """Muon's momentum step, as optax's: the new moment, the new count, and the bias-corrected
    (Nesterov when asked) direction that is orthogonalised."""
    mu = optax.tree.update_moment(updates, state.mu, beta, 1)
    count = optax.safe_increment(state.count)
    if nesterov:
        mu_hat = jax.tree.map(
            lambda m, g: beta * m + (1 - beta) * g,
            optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
            optax.tree.bias_correction(updates, beta, count),
        )
    else:
        mu_hat = optax.tree.bias_correction(mu, beta, count)
    return mu, count, mu_hat


def scale_by_muon(
    beta: float = 0.95,
    ns_steps: int = 5,
    ns_coeffs: tuple[float, float, float] = DEFAULT_NS_COEFFS,
    eps: float = 1e-8,
    nesterov: bool = True,
    mu_dtype: Any = None,
    dimension_numbers: Any = None,
) -> optax.GradientTransformation:
    """Muon's direction for the matrices it is given: bias-corrected (Nesterov) momentum,
    orthogonalised by :func:`newton_schulz`, as ``optax.contrib.scale_by_muon`` computes it.

    Args:
      beta: the momentum's decay.
      ns_steps: Newton-Schulz iterations.
      ns_coeffs: the iteration's ``(a, b, c)``.
      eps: added to the Frobenius norm before scaling.
      nesterov: Nesterov momentum (the default) or plain.
      mu_dtype: the momentum's dtype (``None``: the parameters').
      dimension_numbers: which axes form each matrix (see :func:`default_dimension_numbers`).
    """
    rule = _as_rule(dimension_numbers)
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)

    def init(params: PyTree) -> MuonState:
        mu = jax.tree.map(lambda p: jnp.zeros(p.shape, mu_dtype or p.dtype), params)
        return MuonState(jnp.zeros([], jnp.int32), mu)

    def update(updates: PyTree, state: MuonState, params: PyTree = None):
        del params
        mu, count, mu_hat = _momentum(updates, state, beta, nesterov)
        flat, treedef = jax.tree_util.tree_flatten_with_path(mu_hat)
        leaves = []
        for path, x in flat:
            key = jax.tree_util.keystr(path)
            dims = rule(key, tuple(x.shape))
            if dims is None:
                raise ValueError(
                    f"Muon was given {key} of shape {tuple(x.shape)}, which its dimension "
                    "numbers do not make a matrix; update it with AdamW (jzero.optim.muon does) "
                    "or give it dimension numbers."
                )
            leaves.append((key, x, dims))
        ns = lambda m: newton_schulz(m, ns_coeffs, ns_steps, eps)  # noqa: E731
        directions = treedef.unflatten(_orthogonalize(leaves, ns))
        if mu_dtype is not None:
            mu = jax.tree.map(lambda m: m.astype(mu_dtype), mu)
        return directions, MuonState(count, mu)

    return optax.GradientTransformation(init, update)


def _scale_by_shape(rule: DimsRule, consistent_rms: float | None) -> optax.GradientTransformation:
    """Each matrix's direction scaled for its shape: ``sqrt(max(1, fan_out / fan_in))``
    (Keller Jordan's), or ``consistent_rms * sqrt(max(fan_in, fan_out))`` (Moonshot's, to
    match AdamW's update RMS)."""

    def update(updates: PyTree, state: Any, params: PyTree = None):
        del params

        def scale(path: Any, x: jax.Array) -> jax.Array:
            _, red, out = _axes(rule(jax.tree_util.keystr(path), tuple(x.shape)), x.ndim)
            fan_in = max(1, math.prod(x.shape[a] for a in red))  # >= 1: empty test leaves
            fan_out = max(1, math.prod(x.shape[a] for a in out))
            if consistent_rms is None:
                return jnp.sqrt(jnp.maximum(1, fan_out / fan_in)) * x
            return jnp.sqrt(jnp.maximum(fan_in, fan_out)) * consistent_rms * x

        return jax.tree_util.tree_map_with_path(scale, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


@dataclasses.dataclass(frozen=True)
class MuonOptions:
    """Muon's rarely tuned settings, beside :func:`muon`'s rates and weight decays: the
    Newton-Schulz iteration, the momentum's form and dtype, the matrices' scaling and the betas
    of the AdamW that takes the leaves that are no matrix. The names and defaults are
    ``optax.contrib.muon``'s."""

    ns_steps: int = 5
    """Newton-Schulz iterations."""
    ns_coeffs: tuple[float, float, float] = DEFAULT_NS_COEFFS
    """The quintic iteration's coefficients."""
    eps: float = 1e-8
    """Added to a matrix's norm before the iteration, and AdamW's epsilon."""
    nesterov: bool = True
    """Nesterov momentum, for Muon and AdamW alike."""
    mu_dtype: Any = None
    """The momentum's dtype (Muon's and AdamW's first moment); ``None``: the parameters'."""
    consistent_rms: float | None = None
    """Each matrix's direction scaled by ``consistent_rms * sqrt(max(fan_in, fan_out))``
    (Moonshot's, to match AdamW's update RMS); ``None``: by ``sqrt(max(1, fan_out / fan_in))``
    (Keller Jordan's)."""
    adam_b1: float = 0.9
    """AdamW's first-moment decay."""
    adam_b2: float = 0.999
    """AdamW's second-moment decay."""
    adam_eps_root: float = 0.0
    """AdamW's epsilon inside the square root."""


def muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    beta: float = 0.95,
    weight_decay: float = 0.0,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    adam_weight_decay: float = 0.0,
    dimension_numbers: Any = None,
    options: MuonOptions | None = None,
) -> optax.GradientTransformation:
    """Muon for the matrices, AdamW for every other leaf: ``optax.contrib.muon``'s update, with
    each matrix orthogonalised once, whole, on the device that owns it inside jzero's step.

    The arguments are ``optax.contrib.muon``'s, its rarely tuned ones (the Newton-Schulz
    iteration, ``eps``, ``nesterov``, ``mu_dtype``, ``consistent_rms``, AdamW's betas) grouped
    in ``options`` (:class:`MuonOptions`). ``dimension_numbers`` is its
    ``muon_weight_dimension_numbers``, or a function of ``(path, shape)``; ``None`` takes
    :func:`default_dimension_numbers`, which leaves embeddings and heads to AdamW, where optax's
    default makes every 2-D leaf a matrix. ``adam_learning_rate`` ``None``: ``learning_rate``.

    Example:
      >>> tx = muon(0.02, adam_learning_rate=3e-4, options=MuonOptions(ns_steps=5))
      >>> params = {"w": jnp.ones((4, 8)), "b": jnp.ones(8)}
      >>> updates, _ = tx.update(params, tx.init(params), params)
      >>> [tuple(updates[k].shape) for k in ("b", "w")]
      [(8,), (4, 8)]
    """
    o = options if options is not None else MuonOptions()
    rule = _as_rule(dimension_numbers)

    def labels(params: PyTree) -> PyTree:
        return jax.tree_util.tree_map_with_path(
            lambda p, x: (
                "adam" if rule(jax.tree_util.keystr(p), tuple(x.shape)) is None else "muon"
            ),
            params,
        )

    matrices = optax.chain(
        scale_by_muon(beta, o.ns_steps, o.ns_coeffs, o.eps, o.nesterov, o.mu_dtype, rule),
        _scale_by_shape(rule, o.consistent_rms),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
    others = optax.adamw(
        learning_rate if adam_learning_rate is None else adam_learning_rate,
        b1=o.adam_b1,
        b2=o.adam_b2,
        eps=o.eps,
        eps_root=o.adam_eps_root,
        weight_decay=adam_weight_decay,
        mu_dtype=o.mu_dtype,
        nesterov=o.nesterov,
    )
    return optax.partition({"muon": matrices, "adam": others}, labels)


# -- optax.contrib.muon passed in code ---------------------------------------------------------

# The free variables of optax.contrib.scale_by_muon's update (optax 0.2.8): what its rule reads.
# An optax whose update reads others is not recognised (its Muon then runs as optax wrote it).
_OPTAX_UPDATE_VARS = frozenset(
    {
        "adaptive",
        "beta",
        "eps",
        "mu_dtype",
        "nesterov",
        "ns_steps",
        "preconditioning",
        "weight_dimension_numbers",
    }
)
_MAX_DEPTH = 64
_MARK = "_jzero_exchanges_once"  # on the functions from_optax_muon puts in optax's place


@functools.cache
def _optax_muon() -> tuple[Any, tuple[Callable[..., Any], ...]]:
    """The code of ``optax.contrib.scale_by_muon``'s update (every instance shares it) and
    optax's Muon factories, or ``(None, ())`` for an optax without them."""
    contrib = getattr(optax, "contrib", None)
    factory = getattr(contrib, "scale_by_muon", None)
    if factory is None:
        return None, ()
    code = factory().update.__code__
    if frozenset(code.co_freevars) != _OPTAX_UPDATE_VARS:
        return None, ()
    return code, (factory, contrib.muon)


def _exchange_once_update(optax_update: types.FunctionType) -> Callable[..., Any]:
    """``optax.contrib.scale_by_muon``'s update, reading the same hyperparameters and state
    (optax's ``MuonState(count, mu, ns_coeffs)``), with each matrix orthogonalised by optax's
    own Newton-Schulz (``orthogonalize_via_newton_schulz``, every preconditioning) once, whole,
    where :func:`_orthogonalize` deals it (one exchange in and one out inside jzero's step)."""
    hp = dict(
        zip(
            optax_update.__code__.co_freevars,
            (c.cell_contents for c in optax_update.__closure__ or ()),
            strict=True,
        )
    )
    orthogonalize = optax_update.__globals__["orthogonalize_via_newton_schulz"]
    beta, nesterov = hp["beta"], hp["nesterov"]

    def update(updates: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        del params
        dims = hp["weight_dimension_numbers"]
        dims = dims(updates) if callable(dims) else dims
        mu, count, mu_hat = _momentum(updates, state, beta, nesterov)
        flat, treedef = jax.tree_util.tree_flatten_with_path(mu_hat)
        leaves = []
        for (path, x), d in zip(flat, treedef.flatten_up_to(dims), strict=True):
            if x.ndim == 2:  # optax orthogonalises a 2-D leaf as (rows, columns) whatever d says
                d = MuonDimensionNumbers(0, 1)
            elif not isinstance(d, MuonDimensionNumbers):
                raise ValueError(
                    f"optax.contrib.muon was given {jax.tree_util.keystr(path)} of shape "
                    f"{tuple(x.shape)} with no MuonDimensionNumbers; give it dimension numbers "
                    "(muon_weight_dimension_numbers) or leave it to Adam."
                )
            leaves.append((jax.tree_util.keystr(path), x, d))
        coeffs = state.ns_coeffs

        def ns(m: jax.Array) -> jax.Array:
            return orthogonalize(m, coeffs, hp["ns_steps"], hp["preconditioning"], hp["eps"])

        out = treedef.unflatten(_orthogonalize(leaves, ns))
        if hp["adaptive"]:  # scaled by the dual norm of the momentum, as optax does
            out = jax.tree.map(lambda x, y: jnp.sum(x.conj() * y) * y, mu_hat, out)
        return out, state._replace(count=count, mu=optax.tree.cast(mu, hp["mu_dtype"]))

    setattr(update, _MARK, True)
    return update


def _exchanging(factory: Callable[..., Any]) -> Callable[..., Any]:
    """``factory`` (``optax.contrib.muon`` or ``scale_by_muon``, as ``optax.inject_hyperparams``
    holds it) whose transformations orthogonalise once (:func:`from_optax_muon`)."""

    @functools.wraps(factory)
    def make(*args: Any, **kwargs: Any) -> optax.GradientTransformation:
        return from_optax_muon(factory(*args, **kwargs))

    setattr(make, _MARK, True)
    return make


class _Rebuild:
    """A transformation rebuilt with ``swap(obj)`` (not ``None``) in place of ``obj`` wherever
    it occurs: in the closures of its functions (optax's transformations are closures over the
    transformations they combine), in tuples (``GradientTransformation``), lists, dicts and
    ``functools.partial``. What holds nothing swapped is the same object; what does is a copy
    (a function with new cells for the changed variables and its other cells shared), so the
    caller's transformation is never modified."""

    def __init__(self, swap: Callable[[Any], Any]):
        self.swap = swap
        self._done: dict[int, Any] = {}

    def __call__(self, obj: Any, depth: int = 0) -> Any:
        key = id(obj)
        if key in self._done:
            return self._done[key]
        self._done[key] = obj  # a cycle meets the object itself
        new = self.swap(obj)
        if new is None:
            new = obj if depth > _MAX_DEPTH else self._inside(obj, depth + 1)
        self._done[key] = new
        return new

    def _inside(self, obj: Any, depth: int) -> Any:
        if isinstance(obj, types.FunctionType):
            cells = list(obj.__closure__ or ())
            changed = False
            for i, cell in enumerate(cells):
                try:
                    value = cell.cell_contents
                except ValueError:  # a variable not yet bound
                    continue
                new = self(value, depth)
                if new is not value:
                    cells[i], changed = types.CellType(new), True
            if not changed:
                return obj
            fn = types.FunctionType(
                obj.__code__, obj.__globals__, obj.__name__, obj.__defaults__, tuple(cells)
            )
            for name in ("__kwdefaults__", "__qualname__", "__doc__", "__module__"):
                setattr(fn, name, getattr(obj, name))
            fn.__dict__.update(obj.__dict__)
            return fn
        if isinstance(obj, functools.partial):
            parts = (obj.func, obj.args, obj.keywords)
            new = tuple(self(p, depth) for p in parts)
            if all(a is b for a, b in zip(new, parts, strict=True)):
                return obj
            return functools.partial(new[0], *new[1], **new[2])
        if type(obj) in (tuple, list) or (isinstance(obj, tuple) and hasattr(obj, "_fields")):
            items = [self(x, depth) for x in obj]
            if all(a is b for a, b in zip(items, obj, strict=True)):
                return obj
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        if type(obj) is dict:
            items = {k: self(v, depth) for k, v in obj.items()}
            return obj if all(items[k] is v for k, v in obj.items()) else items
        return obj


def from_optax_muon(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` with every ``optax.contrib.muon`` (or ``scale_by_muon``) inside it orthogonalising
    each matrix once, whole, as :func:`muon` does; ``tx`` itself when it holds none.

    ``jzero.initialize`` applies it to the optimizer it is given, so passing optax's Muon just
    works: under ZeRO each matrix is gathered (dealt out whole) once and its update scattered
    once, where optax's own update of the sharded matrix runs collectives in every Newton-Schulz
    iteration. The update is optax's: the same hyperparameters, the same state
    (``optax.contrib.MuonState``), optax's own Newton-Schulz on each whole matrix (every
    ``preconditioning`` and coefficient table), the same labels, scaling, weight decay and
    AdamW for the other leaves (equal in float64 to 1e-10, ``tests/optim/test_muon.py``).

    Found wherever optax keeps it: ``optax.contrib.muon(...)`` itself, inside ``optax.chain``,
    ``optax.partition``, ``optax.masked``, ``optax.MultiSteps`` and the like (their closures),
    and under ``optax.inject_hyperparams(optax.contrib.muon)``. Not found in a transformation
    of your own class, whose methods jzero does not rewrite: pass :func:`muon` there.

    Example:
      >>> tx = from_optax_muon(optax.contrib.muon(0.02))
      >>> exchanges_once(tx), exchanges_once(optax.contrib.muon(0.02))
      (True, False)
    """
    code, factories = _optax_muon()
    if code is None:
        return tx

    def swap(obj: Any) -> Any:
        if isinstance(obj, types.FunctionType) and obj.__code__ is code:
            return _exchange_once_update(obj)
        if any(obj is f for f in factories):
            return _exchanging(obj)
        return None

    return _Rebuild(swap)(tx)


def exchanges_once(tx: optax.GradientTransformation) -> bool:
    """Whether ``tx`` holds an ``optax.contrib.muon`` that :func:`from_optax_muon` made
    orthogonalise once (what ``jzero.initialize`` checks before warning about optax's Muon)."""
    found: list[Any] = []

    def mark(obj: Any) -> None:
        if getattr(obj, _MARK, False) and isinstance(obj, types.FunctionType):
            found.append(obj)

    _Rebuild(mark)(tx)
    return bool(found)
