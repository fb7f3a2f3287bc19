"""The composed layouts' runs and checks, shared by ``tests/distributed/test_compose_two.py``
(every pair of axes) and ``test_compose_three.py`` (every three): see the former's docstring.
Each test module runs its own layouts (its own process under ``-n``), in float64."""

import functools
import itertools
import re

import jax
import numpy as np
import optax
import pytest
from numerics import max_rel_error

import jzero
from jzero.demo import gpt
from jzero.hlo import replica_groups, source_target_pairs

BATCH, STEPS, LR, CLIP = 8, 2, 1e-2, 0.5
TINY = {"vocab_size": 32, "seq_len": 8, "num_layers": 2, "num_heads": 4, "d_model": 16,
        "d_ff": 32, "dtype": "float64"}  # fmt: skip
MOE = {"num_experts": 4, "experts_per_token": 2, "capacity_factor": 4.0}  # no token dropped
AXES = ("model", "seq", "pipe", "expert", "replica")
PAIRS = list(itertools.combinations(AXES, 2))
TRIPLES = list(itertools.combinations(AXES, 3))


def model_config(axes):
    if "expert" not in axes:
        return gpt.GPTConfig(**TINY)
    split_rows = "seq" in axes or "context" in axes  # a device routes part of each row
    return gpt.GPTConfig(**TINY, **MOE, moe_aux_loss_coef=0.0 if split_rows else 0.01)


def config(axes, stage):
    on = set(axes)
    return {
        "train_batch_size": BATCH,
        "gradient_accumulation_steps": 2 if "pipe" in on else 1,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "tensor_parallel": {"autotp_size": 2 if "model" in on else 1},
        "sequence_parallel_size": 2 if "seq" in on else 1,
        "context_parallel_size": 2 if "context" in on else 1,
        "pipeline": {"stages": 2 if "pipe" in on else 1},
        "expert_parallel": {"autoep_size": 2 if "expert" in on else 1},
        **({"mesh": {"replica": 2}} if "replica" in on else {}),
    }


@functools.cache
def params(cfg):
    """The GPT's initial parameters in float64, as numpy arrays: made once per model config
    (eagerly, one small program per leaf shape), read by every engine and reference of it."""
    made = gpt.init_params(jax.random.key(0), cfg)
    return jax.device_get(jax.tree.map(lambda x: x.astype(np.float64), made))


def batches(size=BATCH):
    """:data:`STEPS` global batches of ``size`` rows."""
    rng = np.random.default_rng(1)
    return [{"tokens": rng.integers(0, TINY["vocab_size"], (size, TINY["seq_len"] + 1),
                                    dtype=np.int32)} for _ in range(STEPS)]  # fmt: skip


@functools.cache
def reference(cfg, rows, size=BATCH):
    """The single-device optax loop with DeepSpeed's clipping on :func:`batches` of ``size``
    rows; the loss is the mean over groups of ``rows`` rows (an MoE layer's routing groups; for
    the dense GPT the plain mean)."""
    tx = optax.adamw(LR)

    def loss(p, batch):
        def one(group):  # a group's loss, routed on its own tokens as one device routes them
            value = gpt.loss_fn(p, group, cfg)
            return value[0] if isinstance(value, tuple) else value

        groups = jax.tree.map(lambda x: x.reshape(size // rows, rows, *x.shape[1:]), batch)
        return jax.vmap(one)(groups).mean()

    @jax.jit
    def step(p, state, batch):
        value, grads = jax.value_and_grad(loss)(p, batch)
        norm = optax.global_norm(grads)
        grads = jax.tree.map(lambda g: g * jax.numpy.minimum(1.0, CLIP / (norm + 1e-6)), grads)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state, value, norm

    p = params(cfg)
    state, out = tx.init(p), []
    for b in batches(size):
        p, state, value, norm = step(p, state, b)
        out.append((float(value), float(norm)))
    return out, jax.device_get(p)


EXPERT_TP_PLAN = gpt.EXPERT_TP_PLAN


def trained(axes, stage, directory, tp_plan=None):
    """The layout's engine after :data:`STEPS` steps, its checkpoints written to ``directory``,
    and its losses and gradient norms; ``tp_plan``: AutoTP's rules to add."""
    cfg = model_config(axes)
    settings = {**config(axes, stage), "checkpoint": {"directory": directory}}
    if tp_plan:
        settings["tensor_parallel"] = {**settings["tensor_parallel"], "tp_plan": tp_plan}
    engine = jzero.initialize(
        params(cfg), lambda p, b: gpt.loss_fn(p, b, cfg), optax.adamw(LR), settings
    )
    metrics = [engine.train_step(b) for b in batches()]
    return engine, [(float(m["loss"]), float(m["grad_norm"])) for m in metrics]


def _specs_name(tree, axis):
    return any(axis in jax.tree.leaves(tuple(s.spec)) for s in jax.tree.leaves(tree))


def assert_every_axis_splits_something(engine, axes):
    plan = engine.plan
    assert {a: engine.mesh.shape[a] for a in axes} == dict.fromkeys(axes, 2)
    batch = jax.tree.leaves(tuple(plan.batch.spec))
    for axis in axes:
        if axis in ("model", "pipe", "expert"):  # a parameter split over it
            assert _specs_name(plan.params, axis), axis
        elif axis == "seq":  # each device computes its own tokens of its rows
            assert plan.options.parallel.seq_axis == "seq", plan.options.parallel
            assert "seq" in plan.batch_axes, plan.batch_axes
        elif axis == "context":  # each ring member its own zig-zag tokens of its rows
            assert plan.options.parallel.context_axis == "context", plan.options.parallel
            assert "context" in plan.batch_axes, plan.batch_axes
        else:  # replica: each device its own rows
            assert axis in batch, (axis, plan.batch.spec)
    if "expert" in axes:
        found = jzero.moe.expert_leaves(plan.abstract_params)
        experts = [s for s, e in zip(jax.tree.leaves(plan.params), found, strict=True) if e]
        assert experts and all("expert" in jax.tree.leaves(tuple(s.spec)) for s in experts)


ZERO_OPS = ("reduce_scatter", "all_gather", "psum_scatter")


def collective_axes(compiled, mesh):
    """``(kind, axes spanned, ZeRO's own)`` for each collective instruction of the program."""
    names, sizes = list(mesh.shape), list(mesh.shape.values())
    kinds = ("all-gather", "reduce-scatter", "all-to-all", "collective-permute", "all-reduce")
    out = []
    for line in compiled.as_text().splitlines():
        kind = next((k for k in kinds if f" {k}(" in line or f" {k}-start(" in line), None)
        if kind is None:
            continue
        groups = (source_target_pairs(line) if kind == "collective-permute"
                  else replica_groups(line, mesh.size))  # fmt: skip
        spanned = set()
        for g in groups:
            coords = np.array(np.unravel_index(np.asarray(g), sizes)).T
            spanned |= {names[i] for i in range(len(names)) if len(set(coords[:, i])) > 1}
        origin = re.search(r'op_name="([^"]*)"', line)
        zero = bool(origin and origin.group(1).endswith(ZERO_OPS))
        out.append((kind, frozenset(spanned), zero))
    return out


def assert_collectives_stay_on_their_axes(engine, axes):
    compiled = engine.lower(batches()[0]).compile()
    found = collective_axes(compiled, engine.mesh)
    state_axes = set(engine.plan.state_axes)
    for kind, spanned, zero in found:
        if zero and kind in ("all-gather", "reduce-scatter"):
            assert spanned <= state_axes, (kind, sorted(spanned), "ZeRO's axes", state_axes)
        if kind == "collective-permute":  # the pipeline's transfers, the ring's keys
            assert spanned in ({"pipe"}, {"context"}), sorted(spanned)
        if kind == "all-to-all":
            assert spanned in ({"seq"}, {"expert"}), sorted(spanned)
    seen = {(kind, spanned) for kind, spanned, _ in found}
    expect = {
        "model": ("all-reduce", {"model"}),  # Megatron's after each row-parallel layer
        "seq": ("all-to-all", {"seq"}),  # Ulysses' around each attention
        "pipe": ("collective-permute", {"pipe"}),
        "expert": ("all-to-all", {"expert"}),  # tokens to their experts and back
        "replica": ("all-reduce", {"replica"}),  # the gradient shards across replicas
        "context": ("collective-permute", {"context"}),  # the ring's keys and values
    }
    for axis in axes:
        kind, spanned = expect[axis]
        assert (kind, frozenset(spanned)) in seen, (axis, kind)


def assert_trains_like_the_single_device_loop(engine, metrics, axes):
    rows = BATCH // (engine.plan.data_parallel_size * engine.accumulation_steps)
    cfg = model_config(axes)
    # Only the load-balancing loss depends on the grouping (with capacity for every token, no
    # group drops one): the dense GPT's and an MoE GPT's without it have one reference each
    # for every layout.
    grouped = cfg.moe and cfg.moe_aux_loss_coef
    want, want_params = reference(cfg, rows if grouped else BATCH)
    for (loss, norm), (ref_loss, ref_norm) in zip(metrics, want, strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-10)
        assert norm == pytest.approx(ref_norm, rel=1e-10)
    assert max_rel_error(jax.device_get(engine.params), want_params) < 1e-9


def assert_restores_into_data_parallelism(engine, axes, directory):
    """The layout's checkpoint read at ``data: 8``, stage 1: every parameter and optimizer
    state bit for bit."""
    engine.save()
    engine.wait_until_finished()
    cfg = model_config(axes)
    plain = jzero.initialize(
        params(cfg),
        lambda p, b: gpt.loss_fn(p, b, cfg),
        optax.adamw(LR),
        {
            "train_batch_size": BATCH,
            "zero_optimization": {"stage": 1},
            "checkpoint": {"directory": directory},
        },  # fmt: skip
    )
    try:
        plain.restore()
        assert dict(plain.mesh.shape) == {"data": 8}
        got = jax.device_get((plain.params, plain.opt_state))
        want = jax.device_get((engine.params, engine.opt_state))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)
    finally:
        plain.close()


def check_layout(axes, stage, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("x".join(axes) + f"-{stage}") / "ckpt")
    engine, metrics = trained(axes, stage, directory)
    assert_trains_like_the_single_device_loop(engine, metrics, axes)
    assert_every_axis_splits_something(engine, axes)
    assert_collectives_stay_on_their_axes(engine, axes)
    if stage == 3:  # each layout's checkpoint once, from the stage whose state is most split
        assert_restores_into_data_parallelism(engine, axes, directory)
