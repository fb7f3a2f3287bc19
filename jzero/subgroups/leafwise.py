"""The optimizer update one group of parameter leaves at a time (DeepSpeed's ``sub_group_size``).

DeepSpeed's ZeRO-3 runs the optimizer step over sub-groups of its flat partition so that only
one sub-group's fp32 master weights, gradients and optimizer state need be in fast memory at a
time (with ``offload_optimizer``/NVMe, the rest waits in host memory or in files). This module
is that step for any optax transformation that acts leaf by leaf: which leaves form a group and
which state each owns (:mod:`jzero.subgroups.ownership`), one group's update and the grouped
update (:mod:`jzero.subgroups.update`), and here the check that an optimizer is leafwise. Every
public name of the three is importable from :mod:`jzero.subgroups`.

Decisions:

* The grouped update is the one-call update (to the bit, op by op; see "Bits" in
  :mod:`jzero.subgroups.update`) exactly when the transformation is leafwise: a leaf's new
  parameter and state depend only on that leaf's inputs and the shared state, and the new
  shared state depends on no leaf's inputs. Adam, AdamW, SGD with momentum, Lion, Adagrad,
  RMSProp, Adafactor, LAMB and LARS (whose trust ratios use per-leaf norms), per-leaf
  clipping, ``MultiSteps``, and chains of them with ``inject_hyperparams``, schedules and masks
  are leafwise (:func:`check_leafwise` passes them). Not leafwise: ``clip_by_global_norm`` (or
  any transform that computes a global norm) inside the chain, ``apply_if_finite`` (one
  finiteness check over all leaves), ``MultiSteps`` with a ``should_skip_update_fn``,
  transforms that mix leaves, and anything whose Python code reads the shapes of other
  leaves. DeepSpeed's own gradient clipping is applied by the step before the update
  (:func:`jzero.step.make_train_step`), so it is unaffected.
* :func:`check_leafwise` decides this honestly in two ways: a data-flow analysis of the
  update's jaxpr at the real shapes (it costs no memory and finds every cross-leaf data
  dependence, even one that only acts for some values, e.g. clipping that did not trigger),
  then, when the tree is small enough, a bit comparison of the grouped and one-call updates
  on random values of the real shapes (it also catches Python-level dependence on other
  leaves' shapes, which no data flow shows). Above the size limit only the first runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jcore

from jzero._util import dotted
from jzero.subgroups.ownership import (
    param_leaf_owner,
)
from jzero.subgroups.update import (
    grouped_update,
)

__all__ = ["check_leafwise"]

PyTree = Any


def check_leafwise(
    optimizer: optax.GradientTransformation,
    abstract_params: PyTree,
    *,
    max_elements: int = 1 << 22,
    seed: int = 0,
) -> bool:
    """Raises if grouped updates of ``optimizer`` could differ from its one-call update.

    Two checks, the second only for small trees:

    1. Data flow (any size, no memory): the update's jaxpr at the real shapes is traced and
       every output's dependence on the inputs followed through all equations (into ``jit``,
       ``cond``, ``while`` and ``scan`` bodies; other primitives conservatively make each
       output depend on each input). A parameter's new value or state that depends on another
       parameter's gradient, value or state, or new shared state that depends on any
       parameter's, is a violation. This finds a cross-leaf dependence even where it acts only
       for some values (clipping that would not trigger on the data at hand). It can report a
       dependence that never changes a value (a false alarm), never miss a data dependence.
    2. Values (when params and state together have at most ``max_elements`` elements): one
       step with random gradients on random params (after a first step, so the moments are
       not zero) computed in one call and with each leaf its own group, both under ``jit``,
       compared up to compiler rounding (8 units in the last place of each leaf's largest
       value: XLA may round a one-leaf program differently, see "Bits" in
       :mod:`jzero.subgroups.update`; a cross-leaf effect moves values far more). This also
       catches what no data flow shows: Python code that reads other leaves' shapes
       (placeholders change them) or masks that change with them.
       Larger trees get only the first check, and a trace of the grouped update at the real
       shapes (``jax.eval_shape``), which catches structural failures but not such values.

    Args:
      optimizer: the optax transformation.
      abstract_params: the params (arrays or ``jax.ShapeDtypeStruct``) at their real shapes;
        shapes are not shrunk, since state shapes (factored moments) depend on them.
      max_elements: the most elements for which the value comparison runs.
      seed: the random values' seed.

    Returns:
      Whether the value comparison ran (``False``: the tree was over ``max_elements`` and only
      the data flow and a trace were checked).

    Raises:
      ValueError: naming the leaves whose update depends on other leaves, or the leaves
        whose grouped result differs, and the fix.
    """
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), abstract_params
    )
    abstract_state = jax.eval_shape(optimizer.init, abstract)
    owner = param_leaf_owner(optimizer, abstract, abstract_state)
    p_paths = _paths(abstract, "params")
    s_paths = _paths(abstract_state, "opt_state")
    _check_data_flow(optimizer, abstract, abstract_state, owner, p_paths, s_paths)

    singletons = [[i] for i in range(len(p_paths))]

    def grouped(g: PyTree, s: PyTree, p: PyTree) -> tuple[PyTree, PyTree]:
        return grouped_update(optimizer, g, s, p, singletons, owner)

    def one_call(g: PyTree, s: PyTree, p: PyTree) -> tuple[PyTree, PyTree]:
        updates, new_state = optimizer.update(g, s, p)
        return optax.apply_updates(p, updates), new_state

    want = jax.eval_shape(one_call, abstract, abstract_state, abstract)
    got = jax.eval_shape(grouped, abstract, abstract_state, abstract)
    if jax.tree.structure(want) != jax.tree.structure(got) or not all(
        a.shape == b.shape and a.dtype == b.dtype
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True)
    ):
        raise ValueError(_not_leafwise("the grouped update returns other shapes or dtypes"))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves((abstract, abstract_state)))
    if count > max_elements:
        return False

    keys = iter(jax.random.split(jax.random.key(seed), 3 * len(p_paths) + 1))
    params = jax.tree.map(lambda x: _random(next(keys), x), abstract)
    grads0 = jax.tree.map(lambda x: _random(next(keys), x), abstract)
    grads1 = jax.tree.map(lambda x: _random(next(keys), x), abstract)
    state = optimizer.init(params)
    params, state = jax.jit(one_call)(grads0, state, params)
    want = jax.jit(one_call)(grads1, state, params)
    got = jax.jit(grouped)(grads1, state, params)
    names = p_paths + s_paths
    differ = [
        name
        for name, a, b in zip(names, jax.tree.leaves(want), jax.tree.leaves(got), strict=True)
        if not _rounding_close(_host(a), _host(b))
    ]
    if differ:
        raise ValueError(
            _not_leafwise(
                "one step on random values gives other results when each leaf is updated on "
                f"its own, at {_first(differ)}"
            )
        )
    return True


# --- helpers -------------------------------------------------------------------------------


def _first(names: Sequence[str], n: int = 4) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _paths(tree: PyTree, root: str) -> list[str]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    keys = [dotted(path) for path, _ in flat]
    return [f"{root}.{k}" if k else root for k in keys]


def _host(x: Any) -> np.ndarray:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _rounding_close(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal, or (floating point) apart by no more than compiler rounding: 8 units in the last
    place of the leaf's largest magnitude. A cross-leaf effect (clipping, a global scale)
    moves values far more."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.tobytes() == b.tobytes():
        return True
    if not jnp.issubdtype(a.dtype, jnp.floating):
        return False
    x, y = a.astype(np.float64), b.astype(np.float64)
    if not np.array_equal(np.isnan(x), np.isnan(y)):
        return False
    x, y = np.nan_to_num(x), np.nan_to_num(y)
    scale = max(float(np.max(np.abs(x), initial=0.0)), float(np.finfo(np.float64).tiny))
    return bool(np.max(np.abs(x - y)) <= 8 * float(jnp.finfo(a.dtype).eps) * scale)


def _not_leafwise(why: str) -> str:
    return (
        f"The optimizer is not leafwise: {why}. Grouped updates (sub_group_size, NVMe offload) "
        "would change the training. Move cross-leaf transforms such as "
        "optax.clip_by_global_norm out of the chain (use the config's gradient_clipping, "
        "which the step applies before the update), or run without sub_group_size."
    )


def _random(key: jax.Array, x: Any) -> jax.Array:
    dtype = jnp.dtype(x.dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jax.random.normal(key, x.shape, dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return jax.random.randint(key, x.shape, -8, 8, dtype)
    return jnp.zeros(x.shape, dtype)


def _check_data_flow(
    optimizer: optax.GradientTransformation,
    params: PyTree,
    state: PyTree,
    owner: Sequence[int | None],
    p_paths: list[str],
    s_paths: list[str],
) -> None:
    """Raises if an output of ``optimizer.update`` depends on inputs of another leaf."""
    closed = jax.make_jaxpr(optimizer.update)(params, state, params)
    n = len(p_paths)
    own = [frozenset() if o is None else frozenset([o]) for o in owner]
    leaf = [frozenset([i]) for i in range(n)]
    in_deps = leaf + own + leaf  # grads, state, params (shared state carries no leaf)
    if len(in_deps) != len(closed.jaxpr.invars):
        raise ValueError(
            f"The update's jaxpr has {len(closed.jaxpr.invars)} inputs for {len(in_deps)} "
            "leaves of grads, state and params; its inputs cannot be told apart."
        )
    out_deps = _flow(closed.jaxpr, in_deps)
    out_owner: list[int | None] = list(range(n)) + list(owner)
    if len(out_deps) != len(out_owner):
        raise ValueError(
            _not_leafwise(f"its update returns {len(out_deps) - n} state leaves for {len(owner)}")
        )
    names = [f"the update of {p}" for p in p_paths] + [f"the new {s}" for s in s_paths]
    bad = []
    for name, deps, o in zip(names, out_deps, out_owner, strict=True):
        foreign = sorted(deps - ({o} if o is not None else set()))
        if foreign:
            bad.append(
                f"{name} reads the gradient, value or state of "
                f"{_first([p_paths[i] for i in foreign], 2)}"
            )
    if bad:
        raise ValueError(_not_leafwise("; ".join(bad[:3]) + (" ..." if len(bad) > 3 else "")))


def _flow(jaxpr: Any, in_deps: Sequence[frozenset]) -> list[frozenset]:
    """Per output of ``jaxpr``, the union of the dependence sets of the inputs it reads."""
    env: dict[Any, frozenset] = {}

    def read(v: Any) -> frozenset:
        return frozenset() if isinstance(v, jcore.Literal) else env.get(v, frozenset())

    for v, d in zip(jaxpr.invars, in_deps, strict=True):
        env[v] = d
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = _eqn_flow(eqn, ins)
        for v, d in zip(eqn.outvars, outs, strict=True):
            env[v] = d
    return [read(v) for v in jaxpr.outvars]


def _union(sets: Sequence[frozenset]) -> frozenset:
    return frozenset().union(*sets)


def _inner(j: Any) -> Any:
    return j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j


def _eqn_flow(eqn: Any, ins: list[frozenset]) -> list[frozenset]:
    """Dependence of one equation's outputs: exact through calls, ``cond``, ``while`` and
    ``scan``; every input to every output for any other primitive."""
    name, params, n_out = eqn.primitive.name, eqn.params, len(eqn.outvars)
    call = next((params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if k in params), None)
    if name == "cond":
        index, ops = ins[0], ins[1:]
        outs = [_flow(_inner(b), ops) for b in params["branches"]]
        return [index | _union(per_out) for per_out in zip(*outs, strict=True)]
    if name == "while":
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cconsts, bconsts, carry = ins[:nc], ins[nc : nc + nb], list(ins[nc + nb :])
        while True:
            pred = _flow(_inner(params["cond_jaxpr"]), cconsts + carry)[0]
            body = _flow(_inner(params["body_jaxpr"]), bconsts + carry)
            new = [c | b | pred for c, b in zip(carry, body, strict=True)]
            if new == carry:
                return carry
            carry = new
    if name == "scan":
        nc, nk = params["num_consts"], params["num_carry"]
        consts, carry, xs = ins[:nc], list(ins[nc : nc + nk]), ins[nc + nk :]
        while True:
            out = _flow(_inner(params["jaxpr"]), consts + carry + xs)
            new = [c | o for c, o in zip(carry, out[:nk], strict=True)]
            if new == carry:
                return carry + out[nk:]
            carry = new
    if call is not None and len(_inner(call).invars) == len(ins):
        return _flow(_inner(call), ins)
    every = _union(ins)
    return [every] * n_out
