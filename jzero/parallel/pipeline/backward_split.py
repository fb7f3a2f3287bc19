"""A stage unit's backward pass split in two, for the zero-bubble pipeline schedule: an
*input-gradient* pass (the gradient the previous stage waits for) and a *weight-gradient*
pass (the parameters' gradients, which nobody waits for and which the schedule runs where a
stage would otherwise idle).

The unit (:func:`jzero.parallel.pipeline.stage_unit`, replayed at ZeRO stage 3) is traced
once and cut at its layer scan into three parts: what precedes the scan (*pre*: the
embedding under the first stage's ``cond``, positions, masks), the scan's body (one layer),
and what follows it (*post*: the head and the loss under the last stage's ``cond``). Then:

* **forward** runs pre, then the layers one ``jax.vjp`` each inside a scan (each layer's
  residuals, as its activation-checkpointing policy decides, are the scan's per-layer
  outputs), then post under ``jax.vjp``. It keeps the layers' residuals, post's, and the
  micro-batch's incoming activations.
* **input gradient** runs post's pullback, then, layer by layer in reverse order, the
  equations of the layer's pullback that its input cotangent needs, then pre's pullback for
  the activations' gradient. It keeps, per layer, what the weight pass will read of what it
  computed.
* **weight gradient** runs, per layer, the rest of the equations the weight cotangents need
  (on what the input pass kept), and post's and pre's pullbacks for their parameters' share
  (their shares of the input gradient are dead code there, which the compiler removes).

Decisions:

* **The layer's pullback is cut at the equation level** (:class:`_LayerCut`): traced once as
  one program (calls and checkpointed regions inlined), the equations its input cotangent
  depends on go to the input pass, the other equations its weight cotangents depend on to the
  weight pass, and what the second reads of the first's is kept between them: each weight's
  output cotangent, and what a checkpointed layer recomputed (one activation-sized array per
  weight per layer per micro-batch). So no work is done twice: cutting at the layer instead
  (the weight pass running the layer's whole pullback) re-runs the layer's input-gradient
  matmuls, and at the stage the whole chain, a third more work.
* **The split is exact**: the two passes run the one pullback's equations, once each.
* **Pre is recomputed** in both backward passes from the kept incoming activations (it is
  an embedding lookup, casts and masks); post's residuals are kept (it holds the head).
* **A residual that is a parameter, a scan constant or a per-layer parameter slice is not
  kept**: the backward passes read it again. So the kept bytes per micro-batch are the
  layers' activations, as the one-pass backward keeps.
* **Refused rather than wrong**: a scan constant or per-layer input that depends on the
  incoming activations (its cotangent would belong to both passes), and a layer carry that is
  not floating.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jzero.parallel.pipeline.layer_split import NoLayerScan, layer_scan_index
from jzero.parallel.pipeline.schedule import Residuals
from jzero.rewrite.trace import free_vars, inline_calls, needed_eqns, read, run_eqns

__all__ = ["BackwardSplit", "split_backward"]


@dataclasses.dataclass(frozen=True)
class BackwardSplit:
    """A stage unit's three passes (see the module docstring), of flat lists.

    * ``forward(params, carry_in, fixed) -> (carry_out, outs, saved)``;
    * ``input_grad(params, fixed, saved, d_carry_out, d_outs) -> (d_carry_in, kept)``;
    * ``weight_grad(params, fixed, saved, kept, d_outs) -> d_params``.

    ``fixed`` is the unit's remaining arguments, flattened (the stage predicates and the
    micro-batch); ``saved`` (forward to weight pass) and ``kept`` (input to weight pass) have
    the shapes :attr:`saved` and :attr:`kept`.
    """

    forward: Callable[..., tuple[list[Any], list[Any], list[Any]]]
    input_grad: Callable[..., tuple[list[Any], list[Any]]]
    weight_grad: Callable[..., list[Any]]
    saved: tuple[jax.ShapeDtypeStruct, ...]
    kept: tuple[jax.ShapeDtypeStruct, ...]


def _floating(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _zero_cotangent(x: Any) -> Any:
    """The zero cotangent of ``x``: zeros of its dtype, or ``float0`` for an integer value."""
    if _floating(x):
        return jnp.zeros(x.shape, x.dtype)
    return np.zeros(x.shape, jax.dtypes.float0)


def split_backward(
    unit: Callable[..., Any], params: list[Any], carry: list[Any], *fixed: Any
) -> BackwardSplit:
    """Cuts ``unit(params, carry, *fixed) -> (carry_out, outs)`` at its layer scan into the
    three passes of :class:`BackwardSplit`. ``params`` and ``carry`` are lists (values or
    shapes); ``fixed`` the rest of the unit's arguments, as the unit takes them.

    Raises:
      NoLayerScan: the unit runs no scan over its parameters.
      ValueError: what the split cannot keep exact (see the module docstring).
    """
    closed = inline_calls(jax.make_jaxpr(unit)(params, carry, *fixed))
    jaxpr, consts = closed.jaxpr, closed.consts
    n, nc = len(params), len(carry)
    k = layer_scan_index(jaxpr, n)
    if k is None:
        raise NoLayerScan("pipeline.schedule: zero_bubble needs the stage's layers under a scan")
    eqn = jaxpr.eqns[k]
    body = eqn.params["jaxpr"]
    ncon, ncar = eqn.params["num_consts"], eqn.params["num_carry"]
    reverse = bool(eqn.params["reverse"])
    pre, post = jaxpr.eqns[:k], jaxpr.eqns[k + 1 :]
    diff_vars = list(jaxpr.invars[: n + nc])
    fixed_vars = list(jaxpr.invars[n + nc :])
    scan_outs = list(eqn.outvars)
    # What post reads that neither the scan nor the differentiated inputs give it: values pre
    # computed (or the fixed inputs), returned by pre and differentiated through it.
    made_after = {v for e in post for v in e.outvars}
    reads = [u for e in post for u in e.invars] + list(jaxpr.outvars)
    pre_vals = free_vars(reads, made_after | set(scan_outs) | set(diff_vars))
    _refuse_carry_dependence(pre, diff_vars[n:], eqn, ncon, ncar)
    for v in [*eqn.invars[ncon : ncon + ncar], *eqn.outvars]:
        if not jnp.issubdtype(v.aval.dtype, jnp.inexact):
            raise ValueError(
                "pipeline.schedule: zero_bubble splits each layer's backward pass, which needs "
                f"the layer scan's carry and outputs floating, but one is {v.aval.str_short()}; "
                "use pipeline.schedule: 1f1b for this model."
            )

    def run_pre(diff: list[Any], fix: list[Any]) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(diff_vars, diff, strict=True))
        env.update(zip(fixed_vars, fix, strict=True))
        run_eqns(pre, env)
        return [read(env, v) for v in [*eqn.invars, *pre_vals]]

    def run_post(outs: list[Any], diff: list[Any], before: list[Any], fix: list[Any]) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(fixed_vars, fix, strict=True))
        env.update(zip(pre_vals, before, strict=True))
        env.update(zip(diff_vars, diff, strict=True))
        env.update(zip(scan_outs, outs, strict=True))
        run_eqns(post, env)
        return [jnp.asarray(read(env, v)) for v in jaxpr.outvars]

    def layer(cst: list[Any], c: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        env: dict[Any, Any] = dict(zip(body.jaxpr.constvars, body.consts, strict=True))
        env.update(zip(body.jaxpr.invars, [*cst, *c, *x], strict=True))
        run_eqns(body.jaxpr.eqns, env)
        out = [read(env, v) for v in body.jaxpr.outvars]
        return out[:ncar], out[ncar:]

    def parts(vals: list[Any]) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
        m = len(eqn.invars)
        return vals[:ncon], vals[ncon : ncon + ncar], vals[ncon + ncar : m], vals[m:]

    layer_res, post_res = Residuals(), Residuals()

    def pre_pullback(ps: list[Any], c_in: list[Any], fix: list[Any]) -> tuple[list[Any], Any]:
        return jax.vjp(lambda d: run_pre(d, fix), [*ps, *c_in])

    def post_pullback(
        saved_post: list[Any], ps: list[Any], c_in: list[Any], fix: list[Any], vals: list[Any]
    ) -> Any:
        return post_res.rebuild(saved_post, [*ps, *c_in, *fix, *vals])

    def forward(ps: list[Any], c_in: list[Any], fix: list[Any]) -> Any:
        vals = run_pre([*ps, *c_in], fix)
        cst, init, xs, before = parts(vals)

        def step(c: list[Any], x: list[Any]) -> tuple[list[Any], Any]:
            (c2, ys), pull = jax.vjp(layer, cst, c, x)
            return c2, (ys, layer_res.keep(pull, [*cst, *x]))

        final, (ys, res) = jax.lax.scan(step, init, xs, reverse=reverse)
        outs, pull = jax.vjp(lambda o, d, b: run_post(o, d, b, fix), [*final, *ys],
                             [*ps, *c_in], before)  # fmt: skip
        saved = [*c_in, *res, *post_res.keep(pull, [*ps, *c_in, *fix, *vals])]
        return outs[:nc], outs[nc:], saved

    def unpack(saved: list[Any]) -> tuple[list[Any], list[Any], list[Any]]:
        return saved[:nc], saved[nc : nc + layer_res.count], saved[nc + layer_res.count :]

    def input_grad(
        ps: list[Any], fix: list[Any], saved: list[Any], d_carry_out: list[Any],
        d_outs: list[Any],
    ) -> tuple[list[Any], list[Any]]:  # fmt: skip
        c_in, res, saved_post = unpack(saved)
        vals, pre_pull = pre_pullback(ps, c_in, fix)
        cst, init, xs, before = parts(vals)
        pull = post_pullback(saved_post, ps, c_in, fix, vals)
        d_scan, d_diff, d_before = pull([*d_carry_out, *d_outs])
        d_final, d_ys = d_scan[:ncar], d_scan[ncar:]

        def step(dc: list[Any], z: Any) -> tuple[list[Any], list[Any]]:
            r, x, dy = z
            return cut().input_pass(r, cst, x, dc, dy)

        d_init, d_each = jax.lax.scan(step, d_final, (res, xs, d_ys), reverse=not reverse)
        (d_pre,) = pre_pull([*map(_zero_cotangent, cst), *d_init,
                             *map(_zero_cotangent, xs), *d_before])  # fmt: skip
        d_in = [a + b for a, b in zip(d_pre[n:], d_diff[n:], strict=True)]
        return d_in, [*d_carry_out, *d_init, *d_each]

    def weight_grad(
        ps: list[Any], fix: list[Any], saved: list[Any], kept: list[Any], d_outs: list[Any]
    ) -> list[Any]:
        c_in, res, saved_post = unpack(saved)
        d_carry_out, d_init, d_each = kept[:nc], kept[nc : nc + ncar], kept[nc + ncar :]
        vals, pre_pull = pre_pullback(ps, c_in, fix)
        cst, init, xs, before = parts(vals)
        pull = post_pullback(saved_post, ps, c_in, fix, vals)
        _, d_diff, d_before = pull([*d_carry_out, *d_outs])
        floating = [_floating(c) for c in cst]

        def step(acc: list[Any], z: Any) -> tuple[list[Any], list[Any]]:
            r, x, between = z
            d_cst, d_x = cut().weight_pass(r, cst, x, between)
            d_float = [d for d, f in zip(d_cst, floating, strict=True) if f]
            acc = [a + d for a, d in zip(acc, d_float, strict=True)]
            return acc, list(d_x)

        acc0 = [jnp.zeros(c.shape, c.dtype) for c, f in zip(cst, floating, strict=True) if f]
        d_cst_f, d_xs = jax.lax.scan(step, acc0, (res, xs, d_each), reverse=reverse)
        it = iter(d_cst_f)
        d_cst = [next(it) if f else _zero_cotangent(c) for c, f in zip(cst, floating,
                 strict=True)]  # fmt: skip
        (d_pre,) = pre_pull([*d_cst, *d_init, *d_xs, *d_before])
        return [a + b for a, b in zip(d_pre[:n], d_diff[:n], strict=True)]

    cuts: list[_LayerCut] = []

    def cut() -> _LayerCut:  # the layer's pullback cut in two, once the residuals are known
        if not cuts:
            xs0 = [jax.ShapeDtypeStruct(v.aval.shape[1:], v.aval.dtype)
                   for v in eqn.invars[ncon + ncar :]]  # fmt: skip
            ys0 = [jax.ShapeDtypeStruct(v.aval.shape[1:], v.aval.dtype)
                   for v in eqn.outvars[ncar:]]  # fmt: skip
            cst0 = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars[:ncon]]
            carry0 = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                      for v in eqn.invars[ncon : ncon + ncar]]  # fmt: skip
            r0 = [jax.ShapeDtypeStruct(r.shape[1:], r.dtype) for r in layer_shapes]

            def pullback(r: list[Any], cst: list[Any], x: list[Any], dc: list[Any],
                         dy: list[Any]) -> list[Any]:  # fmt: skip
                d_cst, d_c, d_x = layer_res.rebuild(r, [*cst, *x])((dc, dy))
                return [*d_cst, *d_c, *d_x]

            # A checkpointed region of a pullback is the layer's recomputation and its
            # transposes; inlined, each equation runs in the pass that needs it (no forward
            # pass sits beside it for the compiler to merge the recomputation into).
            traced = jax.make_jaxpr(pullback)(r0, cst0, xs0, carry0, ys0)
            closed = inline_calls(traced, remat=True)
            cuts.append(_LayerCut(closed, [len(r0), ncon, len(xs0), ncar, len(ys0)]))
        return cuts[0]

    # One trace of each pass reads the residuals' layouts and the kept shapes.
    c0 = [jnp.zeros(c.shape, c.dtype) for c in carry]
    fix0 = jax.tree.leaves(fixed)
    saved = jax.eval_shape(lambda ps, c, f: forward(ps, c, f)[2], params, c0, fix0)
    layer_shapes = saved[nc : nc + layer_res.count]
    outs_shape = jax.eval_shape(lambda ps, c, f: forward(ps, c, f)[1], params, c0, fix0)
    kept = jax.eval_shape(
        lambda ps, f, s, dc, do: input_grad(ps, f, s, dc, do)[1], params, fix0, saved, c0,
        outs_shape,
    )  # fmt: skip
    return BackwardSplit(forward, input_grad, weight_grad, tuple(saved), tuple(kept))


class _LayerCut:
    """One layer's pullback, ``(residuals, constants, layer params, d_carry_out, d_outputs) ->
    (d_constants, d_carry_in, d_layer_params)``, cut in two: the equations the input
    cotangent needs (the input pass), and the rest of what the weight cotangents need (the
    weight pass), which reads what the input pass computed and it needs (kept between them:
    each weight's output cotangent, and what a checkpointed layer recomputed)."""

    def __init__(self, closed: Any, sizes: Sequence[int]) -> None:
        jaxpr = closed.jaxpr
        self.jaxpr, self.consts = jaxpr, closed.consts
        bounds = np.cumsum([0, *sizes])
        self.ins = [list(jaxpr.invars[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        ncon, ncar = sizes[1], sizes[3]
        outs = list(jaxpr.outvars)
        self.d_c = outs[ncon : ncon + ncar]
        self.d_cst, self.d_x = outs[:ncon], outs[ncon + ncar :]
        self.first = needed_eqns(jaxpr.eqns, self.d_c)
        done = {id(e) for e in self.first}
        self.second = [e for e in needed_eqns(jaxpr.eqns, [*self.d_cst, *self.d_x])
                       if id(e) not in done]  # fmt: skip
        known = {*self.ins[0], *self.ins[1], *self.ins[2], *jaxpr.constvars}
        made = {v for e in self.second for v in e.outvars}
        reads = [u for e in self.second for u in e.invars] + [*self.d_cst, *self.d_x]
        self.between = free_vars(reads, known | made)

    def _env(self, groups: Sequence[tuple[Sequence[Any], Sequence[Any]]]) -> dict[Any, Any]:
        env: dict[Any, Any] = dict(zip(self.jaxpr.constvars, self.consts, strict=True))
        for names, vals in groups:
            env.update(zip(names, vals, strict=True))
        return env

    def input_pass(self, r: list[Any], cst: list[Any], x: list[Any], dc: list[Any],
                   dy: list[Any]) -> tuple[list[Any], list[Any]]:  # fmt: skip
        """``(d_carry_in, between)``."""
        env = self._env(list(zip(self.ins, [r, cst, x, dc, dy], strict=True)))
        run_eqns(self.first, env)
        return [read(env, v) for v in self.d_c], [read(env, v) for v in self.between]

    def weight_pass(self, r: list[Any], cst: list[Any], x: list[Any],
                    between: list[Any]) -> tuple[list[Any], list[Any]]:  # fmt: skip
        """``(d_constants, d_layer_params)``."""
        env = self._env([*zip(self.ins[:3], [r, cst, x], strict=True), (self.between, between)])
        run_eqns(self.second, env)
        return [read(env, v) for v in self.d_cst], [read(env, v) for v in self.d_x]


def _refuse_carry_dependence(pre: Sequence[Any], carry_vars: Sequence[Any], eqn: Any,
                             ncon: int, ncar: int) -> None:  # fmt: skip
    """The scan's constants and per-layer inputs must not depend on the incoming activations
    (only its carry may), or their cotangents would belong to the input pass too."""
    tainted = set(carry_vars)
    for e in pre:
        if any(not isinstance(v, jex_core.Literal) and v in tainted for v in e.invars):
            tainted.update(e.outvars)
    others = [*eqn.invars[:ncon], *eqn.invars[ncon + ncar :]]
    if any(not isinstance(v, jex_core.Literal) and v in tainted for v in others):
        raise ValueError(
            "pipeline.schedule: zero_bubble needs the layers' constants and per-layer inputs "
            "independent of the activations that arrive from the previous stage; this model "
            "derives one from them. Use pipeline.schedule: 1f1b for it."
        )
