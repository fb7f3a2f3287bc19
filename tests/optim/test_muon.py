"""Muon under ZeRO (``optimizer: {type: Muon}``, :func:`jzero.optim.muon`, and
``optax.contrib.muon`` passed in code, :func:`jzero.optim.from_optax_muon`): the update is
``optax.contrib.muon``'s at every stage and with a ``replica`` axis, and each matrix is
orthogonalised once, whole: the compiled step adds one all-to-all in and one out per group of
matrices to AdamW's collectives, none of them in a loop, where GSPMD left to itself needs
collectives in every Newton-Schulz iteration."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy

import jzero
from jzero.config import ConfigError, load_config
from jzero.hlo import collectives, loop_collectives
from jzero.optim import build_optimizer
from jzero.optim.muon_optimizer import default_dimension_numbers
from jzero.plan import host_state_bytes
from jzero.step import streamed_groups
from jzero.subgroups import check_leafwise

BATCH, STEPS = 16, 3
# Rates that float32 holds exactly: the config's learning rate is an injected float32
# hyperparameter, and the float64 comparison below must not see its rounding.
LR, ADAM_LR, WD = 2.0**-6, 2.0**-9, 2.0**-7
MUON = {"type": "Muon", "params": {"lr": LR, "adam_lr": ADAM_LR, "weight_decay": WD}}


def make_params(dtype=jnp.float64):
    # 8 layers: the stacked matrices deal out over 8 devices; `odd` (5, 3) is a matrix too.
    return toy.make_params(num_layers=8, d=16, dtype=dtype)


def config(stage, mesh=None, optimizer=MUON):
    cfg = {
        "train_batch_size": BATCH,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if optimizer is not None:
        cfg["optimizer"] = optimizer
    return {**cfg, "mesh": mesh} if mesh else cfg


def matrix_dims(params):
    """The dimension numbers jzero's default gives each leaf, in optax's tree form."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: default_dimension_numbers(jax.tree_util.keystr(p), tuple(x.shape)), params
    )


def optax_muon(params=None):
    """``optax.contrib.muon`` with the tests' rates: on jzero's matrices (``params`` given: its
    default dimension numbers), else on optax's (every 2-D leaf; here ``embed``, ``blocks.b``,
    ``head.w`` and ``odd``)."""
    dims = None if params is None else matrix_dims(params)
    return optax.contrib.muon(
        LR,
        adam_learning_rate=ADAM_LR,
        weight_decay=WD,
        adam_weight_decay=WD,
        muon_weight_dimension_numbers=dims,
    )


@functools.cache
def optax_reference(optax_dims=False):
    """The single-device ``optax.contrib.muon`` loop in float64, on jzero's matrices (or, with
    ``optax_dims``, on optax's default ones)."""
    with jax.enable_x64(True):
        params = make_params()
        tx = optax_muon(None if optax_dims else params)
        batches = toy.make_batches(STEPS, BATCH, dtype=np.float64)
        losses, final = toy.reference_run(params, batches, tx, clip=0.0)
        return losses, jax.device_get(final)


def assert_trains_like_optax(engine, optax_dims=False):
    """STEPS float64 steps of ``engine`` give the single-device optax loop's losses and params."""
    with jax.enable_x64(True):
        batches = toy.make_batches(STEPS, BATCH, dtype=np.float64)
        losses = [float(engine.train_step(b)["loss"]) for b in batches]
        final = jax.device_get(engine.params)
    want_losses, want = optax_reference(optax_dims)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-12)
    for got, ref in zip(jax.tree.leaves(final), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-10)


def step_collectives(cfg, optimizer=None):
    """Per kind, the executions of collectives in the compiled step (float64, as run below)."""
    with jax.enable_x64(True):
        e = jzero.initialize(make_params(), toy.loss_fn, optimizer=optimizer, config=cfg)
        compiled = e.lower(toy.make_batches(1, BATCH, dtype=np.float64)[0]).compile()
        return {k: v.count for k, v in collectives(compiled).items() if v.count}, compiled, e


# Muon's update reads the optimizer state's layout, which stages 1-3 share on one mesh; what the
# stage changes is whether the params rest sharded (gathered for the step). So: the config's
# Muon at stage 1 (params whole, 8-way data), and jzero.optim.muon in code at stage 3 (params
# sharded) over replica x data (the matrices dealt over 4 devices, not 8).
CASES = {
    "stage1": (1, None, False),
    "replica2-data4-stage3-in-code": (3, {"replica": 2, "data": 4}, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_muon_equals_optax_and_orthogonalises_each_matrix_once(case):
    stage, mesh, in_code = CASES[case]
    tx = (
        jzero.optim.muon(LR, adam_learning_rate=ADAM_LR, weight_decay=WD, adam_weight_decay=WD)
        if in_code
        else None
    )
    cfg = config(stage, mesh, optimizer=None if in_code else MUON)
    counts, compiled, engine = step_collectives(cfg, tx)
    adamw = {"type": "AdamW", "params": {"lr": LR}}
    baseline, _, _ = step_collectives(config(stage, mesh, optimizer=adamw))

    # Muon adds only all-to-alls: the matrices dealt out whole and their updates dealt back.
    extra = {k: counts.get(k, 0) - baseline.get(k, 0) for k in set(counts) | set(baseline)}
    extra = {k: v for k, v in extra.items() if v}
    # Two groups of equal shapes (the eight 16x16 layers, `odd`'s 3x5): at most one exchange
    # in and one out each. At stages 1-2 the layers rest one whole matrix per device already.
    assert set(extra) == {"all-to-all"}, (counts, baseline)
    assert extra["all-to-all"] <= 2 * 2, (counts, baseline)
    # None of them is inside a loop: the Newton-Schulz iterations run on local matrices.
    assert not [c for c in loop_collectives(compiled) if c.kind == "all-to-all"]

    assert_trains_like_optax(engine)


def test_optax_muon_passed_in_code_is_orthogonalised_once_and_equals_optax(caplog):
    """``optax.contrib.muon(...)`` passed to ``jzero.initialize`` at stage 3 (every leaf sharded)
    runs through the same exchange as jzero's Muon: at most one exchange in and one out per 2-D
    leaf (optax's matrices: embed, blocks.b, head.w, odd) beyond AdamW's collectives, loops
    included, no warning, and optax's single-device update in float64."""
    with caplog.at_level("WARNING", logger="jzero"):
        counts, compiled, engine = step_collectives(config(3, optimizer=None), optax_muon())
    assert not [r for r in caplog.records if "optax.contrib.muon" in r.getMessage()]
    assert jzero.optim.exchanges_once(engine.optimizer)
    adamw = {"type": "AdamW", "params": {"lr": LR}}
    baseline, adamw_compiled, _ = step_collectives(config(3, optimizer=adamw))
    extra = {k: counts.get(k, 0) - baseline.get(k, 0) for k in set(counts) | set(baseline)}
    matrices = sum(x.ndim == 2 for x in jax.tree.leaves(engine.plan.abstract_params))
    assert matrices == 4
    assert all(v >= 0 for v in extra.values()) and extra.get("all-reduce", 0) == 0, extra
    assert sum(extra.values()) <= 2 * matrices, (counts, baseline)
    # Nothing of Muon's in a loop: the loops' collectives are AdamW's (stage 3's layer gathers).
    in_loops = [c.kind for c in loop_collectives(compiled)]
    assert sorted(in_loops) == sorted(c.kind for c in loop_collectives(adamw_compiled))
    assert_trains_like_optax(engine, optax_dims=True)


class OpaqueTransform:
    """A transformation of the user's own class: jzero does not rewrite its methods."""

    def __init__(self, inner):
        self.inner = inner

    def init(self, params):
        return self.inner.init(params)

    def update(self, updates, state, params=None):
        return self.inner.update(updates, state, params)


def test_an_optax_muon_jzero_cannot_see_into_warns_and_pays_collectives_in_every_iteration(caplog):
    """The contrast the design answers: optax's own update of the sharded matrices (stage 3),
    hidden in a class jzero does not rewrite, needs all-reduces and all-gathers per
    Newton-Schulz iteration, and initialize says so, naming jzero's Muon."""
    opaque = OpaqueTransform(optax.contrib.muon(LR))
    tx = optax.GradientTransformation(opaque.init, opaque.update)
    with caplog.at_level("WARNING", logger="jzero"):
        counts, _, _ = step_collectives(config(3, optimizer=None), tx)
    notes = [r.getMessage() for r in caplog.records if "optax.contrib.muon" in r.getMessage()]
    assert len(notes) == 1 and "jzero.optim.muon(...) takes the same rates" in notes[0]
    adamw, _, _ = step_collectives(config(3, optimizer={"type": "AdamW", "params": {"lr": LR}}))
    # Five iterations on four matrices: more than one extra all-reduce per iteration.
    assert counts["all-reduce"] - adamw.get("all-reduce", 0) >= 5


MDN = optax.contrib.MuonDimensionNumbers
# Where optax keeps its Muon, and its options: each found by from_optax_muon.
OPTAX_FORMS = {
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.contrib.muon)(learning_rate=LR),
    "chain-nesterov-off-adaptive-aol": lambda: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.contrib.muon(LR, nesterov=False, adaptive=True, preconditioning="aol"),
    ),
    "dion-table-consistent-rms-decay-mask": lambda: optax.contrib.muon(
        LR, ns_coeffs="dion", consistent_rms=0.2, weight_decay=WD, weight_decay_mask=None
    ),
    "dims-tree-stacked": lambda: optax.contrib.muon(
        LR, muon_weight_dimension_numbers={"s": MDN(1, 2), "w": MDN(), "v": MDN(), "b": None}
    ),
    "masked-scale-by-muon": lambda: optax.masked(
        optax.chain(
            optax.contrib.scale_by_muon(
                beta=0.9,
                weight_dimension_numbers=lambda p: jax.tree.map(
                    lambda x: MDN(x.ndim - 2, x.ndim - 1), p
                ),
            ),
            optax.scale(-LR),
        ),
        {"s": False, "w": True, "v": True, "b": False},
    ),
}


@pytest.mark.parametrize("form", list(OPTAX_FORMS))
def test_from_optax_muon_finds_it_wherever_optax_keeps_it(form):
    """Inside chains, masks, partitions and inject_hyperparams, with every option of its rule:
    found (the caller's transformation untouched), and optax's updates on one device, float64."""
    rng = np.random.default_rng(0)
    shapes = {"s": (3, 4, 7), "w": (6, 10), "v": (9, 4), "b": (10,)}
    with jax.enable_x64(True):
        params = {k: jnp.asarray(rng.normal(size=s)) for k, s in shapes.items()}
        tx = OPTAX_FORMS[form]()
        ours = jzero.optim.from_optax_muon(tx)
        assert jzero.optim.exchanges_once(ours) and not jzero.optim.exchanges_once(tx)
        states, got = [tx.init(params), ours.init(params)], [params, params]
        assert jax.tree.structure(states[0]) == jax.tree.structure(states[1])
        for _ in range(STEPS):
            grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), params)
            for i, t in enumerate((tx, ours)):
                updates, states[i] = jax.jit(t.update)(grads, states[i], got[i])
                got[i] = optax.apply_updates(got[i], updates)
        for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(got[0]), strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-10)


def test_the_default_leaves_embeddings_heads_biases_and_norms_to_adamw():
    from jzero.demo import gpt

    cfg = gpt.GPTConfig(vocab_size=64, seq_len=16, num_layers=2, d_model=32, d_ff=128, num_heads=2)
    params = jax.eval_shape(lambda: gpt.init_params(jax.random.key(0), cfg))
    dims = {
        jax.tree_util.keystr(p): d
        for p, d in jax.tree_util.tree_flatten_with_path(
            matrix_dims(params), is_leaf=lambda x: x is None or hasattr(x, "reduction_axis")
        )[0]
    }
    matrices = {k: (d.reduction_axis, tuple(d.output_axis)) for k, d in dims.items() if d}
    assert matrices == {  # the fused QKV [L, d, 3, d] is one d x 3d matrix per layer
        "['blocks']['attn_out']": (1, (2,)),
        "['blocks']['attn_qkv']": (1, (2, 3)),
        "['blocks']['mlp_in']": (1, (2,)),
        "['blocks']['mlp_out']": (1, (2,)),
    }
    experts = default_dimension_numbers("['blocks']['experts']['w_in']", (2, 4, 32, 64))
    assert (experts.reduction_axis, tuple(experts.output_axis)) == (2, (3,))


def test_muon_is_leafwise_over_whole_leaves():
    """Grouped updates (sub_group_size, NVMe) never split a leaf, and Muon's update of a leaf
    reads only that leaf: the leafwise check passes it (the config's Muon: jzero.optim.muon
    under the injected learning rate), its data flow and its values."""
    params = toy.make_params(num_layers=2, d=16)
    assert check_leafwise(build_optimizer(load_config({"optimizer": MUON})), params) is True


@pytest.mark.parametrize(
    ("params", "message"),
    [({"momentum": 1.0}, "momentum"), ({"ns_steps": 0}, "ns_steps"), ({"adam_lr": -1}, "adam_lr")],
)
def test_bad_muon_parameters_say_what_is_allowed(params, message):
    with pytest.raises(ConfigError, match=message):
        build_optimizer(load_config({"optimizer": {"type": "Muon", "params": params}}))


def test_a_stack_of_fewer_layers_than_devices_is_gathered_once_per_leaf():
    """Two layers on 8 devices rest tiled (a quarter of a layer's matrix a device, jzero.plan's
    merged leading dimensions), so no device holds a whole matrix: each stacked leaf is gathered
    (GSPMD's all-gather and a few permutes), still with no all-reduce and nothing in a loop."""
    params = toy.make_params(num_layers=2, d=16)
    cfg = config(1, optimizer=None)
    counts, programs = {}, {}
    for name, tx in (("muon", jzero.optim.muon(LR)), ("adamw", optax.adamw(LR))):
        e = jzero.initialize(params, toy.loss_fn, optimizer=tx, config=cfg)
        programs[name] = e.lower(toy.make_batches(1, BATCH)[0]).compile()
        counts[name] = {k: v.count for k, v in collectives(programs[name]).items() if v.count}
    extra = {k: counts["muon"].get(k, 0) - counts["adamw"].get(k, 0) for k in counts["muon"]}
    assert extra.get("all-reduce", 0) == 0, counts
    assert 0 < sum(extra.values()) <= 3 * 2, counts  # two matrices: blocks.w and odd
    assert not loop_collectives(programs["muon"])  # the toy's stage-1 step has no loop collective


def test_muon_streamed_in_groups_smaller_than_its_matrices_keeps_each_leaf_whole():
    """DeepSpeed's sub_group_size splits a flat buffer, which would cut a matrix; jzero's groups
    are whole leaves (a leaf larger than sub_group_size is a group of its own), so Muon streamed
    from host memory in groups of 100 elements (each stacked matrix leaf is 2048) is still
    optax's update."""
    cfg = config(2)
    cfg["zero_optimization"] |= {"offload_optimizer": {"device": "cpu"}, "sub_group_size": 100}
    with jax.enable_x64(True):
        engine = jzero.initialize(make_params(), toy.loss_fn, config=cfg)
        assert host_state_bytes(engine.plan)["opt_state"] > 0
        groups = streamed_groups(engine.plan, 100, engine.optimizer)  # the step's own groups
        assert groups is not None and len(groups) >= 2
        assert_trains_like_optax(engine)
