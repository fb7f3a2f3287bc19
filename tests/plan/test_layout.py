"""Step time: every leaf is sharded on its leading dimension (contiguous shards), padded where
the data axis does not divide it, never on the stacked-layer dimension a stage-3 scan consumes;
the compiled stage 1-2 steps have no layout copies around their collectives (the built-in GPT
of ``configs/zero2.yaml`` on 8 devices included, whose 4-layer stacks 8 does not divide); a
checkpoint written under the former rule (largest dimension, last on a tie) restores
bit-identically."""

import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy
from repo import FIXTURES, ROOT

import jzero
from jzero import config as config_lib
from jzero.checkpoint import Checkpointer, abstract_target
from jzero.demo import gpt
from jzero.hlo import layout_copies
from jzero.parallel.zero import is_contiguous, shard_dim
from jzero.plan import PlanOptions, describe, make_plan, model_state_bytes
from jzero.rewrite import layer_dims
from jzero.step import (
    from_logical,
    init_train_state,
    logical_shardings,
    logical_state,
    logical_view,
)

FIXTURE = FIXTURES / "old_layout"
N = 8


def first_dim(shape, skip=()):
    """The leading dimension of more than one element (the rule, for the shapes used here:
    none of them is under half the shard count)."""
    return next((d for d, n in enumerate(shape) if d not in skip and n > 1), None)


@functools.cache
def stacked_params():
    """The toy model with 8 stacked layers, so that 8 devices divide the layer dimension too;
    plus leaves of odd shapes."""
    params = toy.make_params(num_layers=8)
    params["odd_lead"] = jax.numpy.zeros((6, 16), jax.numpy.float32)  # only dim 1 divides
    return params


def loss(params, batch):
    return toy.loss_fn(params, batch) + 0.0 * params["odd_lead"].sum()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_leaf_is_sharded_on_its_leading_dimension_padded_where_needed(stage):
    params = stacked_params()
    dims = layer_dims(loss, params, toy.make_batches(1, 8)[0])
    names = [
        jax.tree_util.keystr(p, simple=True, separator=".")
        for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    ]
    assert dict(zip(names, dims, strict=True)) == {
        "blocks.b": 0, "blocks.w": 0, "embed": None, "head.b": None, "head.w": None,
        "odd": None, "odd_lead": None,
    }  # fmt: skip
    mesh = jzero.make_mesh(N)
    plan = make_plan(
        params,
        optax.adam(1e-3),
        mesh,
        stage,
        PlanOptions().replace(persistence_threshold=0),
        layer_dims=dims,
    )
    by_name = {leaf.path: leaf for leaf in plan.leaves}
    for leaf in plan.leaves:
        layer = (leaf.layer_dim,) if leaf.layer_dim is not None and stage == 3 else ()
        assert leaf.state_dim == first_dim(leaf.shape, layer), leaf
        assert is_contiguous(leaf.shape, leaf.state_dim, layer), leaf
        # Padded to the next multiple of the shard count, and no further.
        assert leaf.padded % N == 0 and 0 <= leaf.padding < N, leaf
        assert leaf.padded == leaf.shape[leaf.state_dim] + leaf.padding
    # 3-D and 2-D stacked leaves: the layer dimension itself at stages 1-2 (one contiguous
    # block each), the dimension beside it at stage 3, where the scan gathers layer by layer.
    expected = 1 if stage == 3 else 0
    assert by_name["blocks.w"].state_dim == by_name["blocks.b"].state_dim == expected
    if stage == 3:
        assert by_name["blocks.w"].param_dim == 1 != by_name["blocks.w"].layer_dim
    # Odd shapes: (12, 64), (6, 16), (5, 3) and (5,) shard on dim 0, padded to 16, 8, 8, 8.
    assert {p: by_name[p].padded for p in ("embed", "odd_lead", "odd", "head.b")} == {
        "embed": 16, "odd_lead": 8, "odd": 8, "head.b": 8,
    }  # fmt: skip
    text = describe(plan)
    assert "12x64 (+4 on dim 0)" in text and "5 (+3 on dim 0)" in text
    assert "padded with zeros to a multiple of the shard count" in text
    assert "leaves ZeRO left whole" not in text


def test_a_leading_dimension_padded_by_over_half_gives_way_to_one_that_divides():
    # Padding 4 rows to 8 would double the leaf; its second dimension divides.
    assert shard_dim((4, 64), 8) == 1 and shard_dim((2, 64), 8) == 1
    assert shard_dim((12, 64), 8) == 0  # 12 rows padded to 16: the leading dimension still
    assert shard_dim((2, 5), 8) == 0  # nothing divides: the leading one, padded
    assert shard_dim((1, 1), 8) is None and shard_dim((), 8) is None
    assert shard_dim((1, 50257), 8) == 1  # a dimension of one element is not split


def test_state_of_a_stack_shorter_than_the_shard_count_rests_merged():
    """Where only the state is sharded, (4, 64, 64) on 8 devices rests as (256, 64): half a
    layer a device, exact and contiguous; stage 3's sharded parameter takes dimension 1."""
    params = {"w": jax.ShapeDtypeStruct((4, 64, 64), np.float32),
              "odd": jax.ShapeDtypeStruct((4, 5, 3), np.float32)}  # fmt: skip
    mesh = jzero.make_mesh(N)
    for stage in (1, 2, 3):
        plan = make_plan(
            params, optax.adam(1e-3), mesh, stage, PlanOptions().replace(persistence_threshold=0)
        )
        by_name = {leaf.path: leaf for leaf in plan.leaves}
        w, odd = by_name["w"], by_name["odd"]
        if stage < 3:
            assert (w.state_dim, w.merged, w.padding) == (0, 2, 0)
            assert w.stored_shape() == (256, 64)
            assert model_state_bytes(plan)["opt_state"] == 2 * 4 * 64 * 64 * 4 // N + 2 * 4 * (
                8 * 5 * 3 // N
            ) + 4  # fmt: skip
        else:
            assert (w.param_dim, w.state_dim, w.merged, w.padding) == (1, 1, 1, 0)
        # 4 x 5 rows do not tile 8 devices: the leading dimension is padded to 8.
        assert (odd.state_dim, odd.merged, odd.padded) == (0, 1, 8)


def test_contiguity_is_what_the_row_major_layout_says():
    assert is_contiguous((64, 5), 0) and is_contiguous((1, 64), 1)
    assert not is_contiguous((12, 64), 1) and not is_contiguous((8, 64, 64), 1)
    assert is_contiguous((8, 64, 64), 1, layer_dims=(0,))  # per layer slice


@functools.cache
def gpt_step(stage, devices, layers):
    cfg = gpt.GPTConfig(vocab_size=256, seq_len=16, num_layers=layers, num_heads=2, d_model=64,
                        d_ff=256)  # fmt: skip
    params = gpt.init_params(jax.random.key(0), cfg)
    config = {"train_batch_size": 2 * devices, "zero_optimization": {"stage": stage}}
    mesh = jzero.make_mesh(devices, devices=jax.devices()[:devices])
    engine = jzero.initialize(params, lambda p, b: gpt.loss_fn(p, b, cfg), optax.adamw(1e-3),
                              config, options=jzero.InitOptions(mesh=mesh))  # fmt: skip
    batch = {"tokens": np.zeros((2 * devices, cfg.seq_len + 1), np.int32)}
    return engine, engine.lower(batch).compile()


def test_the_compiled_step_has_no_layout_copies_around_its_collectives():
    """The built-in GPT on 2 devices at stage 1: every leaf's leading dimension divides, and not
    one byte is re-laid out around a reduce-scatter or all-gather (stage 2: the zero2 config's
    GPT on 8 devices, below)."""
    engine, compiled = gpt_step(1, devices=2, layers=2)
    assert all(leaf.state_dim == 0 for leaf in engine.plan.leaves)
    copies = layout_copies(compiled)
    assert copies == [], [c.line for c in copies]
    # The same reader does see re-layouts: a program that reduce-scatters along a minor
    # dimension gets copies of the gradient's size around the collective.
    mesh = jzero.make_mesh(N)
    x = jax.ShapeDtypeStruct((4, 64, 64), np.float32)

    def scatter_minor(g):
        return jax.lax.psum_scatter(g, "data", scatter_dimension=2, tiled=True)

    minor = jax.jit(
        jax.shard_map(scatter_minor, mesh=mesh, in_specs=jax.sharding.PartitionSpec(),
                      out_specs=jax.sharding.PartitionSpec(None, None, "data"))
    ).lower(x).compile()  # fmt: skip
    found = layout_copies(minor)
    assert found and max(c.bytes for c in found) == 4 * 64 * 64 * 4
    assert {c.collective for c in found} == {"reduce-scatter"}


def test_the_zero2_config_gpt_on_8_devices_has_no_layout_copies():
    """``configs/zero2.yaml`` as ``jzero train`` builds it, on 8 devices: the state of its
    4-layer stacks rests with the layer and row dimensions merged (the former rule sharded them
    on their second dimension and re-laid 28 copies, 6.4 MiB, out around the collectives each
    step)."""
    from flax import nnx

    cfg = config_lib.load_config(ROOT / "configs" / "zero2.yaml")
    model_cfg = gpt.config_for(cfg)
    engine = jzero.initialize(
        model=lambda: gpt.GPT(model_cfg, rngs=nnx.Rngs(0)), loss_fn=gpt.nnx_loss_fn, config=cfg
    )
    assert engine.plan.num_shards == N
    leaves = engine.plan.leaves
    assert all(leaf.state_dim is not None for leaf in leaves)
    stacked = [leaf for leaf in leaves if leaf.shape[0] == model_cfg.num_layers]
    # 4 layers x 128 rows rest as 512 rows: half a layer a device, exact and contiguous.
    assert stacked and all(leaf.state_dim == 0 and leaf.merged == 2 for leaf in stacked)
    assert not any(leaf.padding for leaf in stacked)
    batch = {"tokens": np.zeros((engine.train_batch_size, model_cfg.seq_len + 1), np.int32)}
    copies = layout_copies(engine.lower(batch).compile())
    assert copies == [], [c.line for c in copies]


def test_a_checkpoint_in_the_former_layout_restores_bit_identically(tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(FIXTURE / "ckpt", directory)
    expected = np.load(FIXTURE / "expected.npz")
    params, tx = toy.make_params(d=16), optax.adamw(1e-2)
    for stage, n in ((3, 8), (1, 4)):
        mesh = jzero.make_mesh(n, devices=jax.devices()[:n])
        plan = make_plan(params, tx, mesh, stage, PlanOptions().replace(persistence_threshold=0))
        abstract = jax.eval_shape(functools.partial(init_train_state, plan, optimizer=tx), params)
        # Checkpoints hold logical shapes: read into layouts jit accepts for them, then pad.
        logical = logical_state(plan, abstract)
        state, meta = Checkpointer(directory).restore(
            abstract_target(logical, logical_shardings(plan, logical))
        )
        assert meta["layout"].startswith("largest dimension")
        flat = jax.tree_util.tree_flatten_with_path(state)[0]
        assert len(flat) == len(expected.files)
        for path, x in flat:
            np.testing.assert_array_equal(np.asarray(x), expected[jax.tree_util.keystr(path)])
        resting = from_logical(plan, state)
        assert jax.tree.map(lambda x: x.shape, resting) == jax.tree.map(lambda x: x.shape, abstract)
        back = logical_view(plan, resting)
        for (_, x), (_, y) in zip(flat, jax.tree_util.tree_flatten_with_path(back)[0], strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def reference_norms(params, batches, tx, clip):
    """The global norms of the gradients of toy.reference_run's loop (before clipping)."""

    @jax.jit  # one program, not one per eager operation
    def step(params, opt_state, b):
        grads = jax.grad(toy.loss_fn)(params, b)
        norm = optax.global_norm(grads)
        coef = jax.numpy.minimum(1.0, clip / (norm + 1e-6))
        grads = jax.tree.map(lambda g: g * coef, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, norm

    opt_state, norms = tx.init(params), []
    for b in batches:
        params, opt_state, norm = step(params, opt_state, b)
        norms.append(float(norm))
    return norms


def test_stage3_moves_scanned_leaves_off_their_layer_dimension_at_the_first_step():
    """8 stacked layers on 8 devices: before the loss is traced the leading (layer) dimension
    is the one 8 divides; the first step finds the scan and re-plans, with the same losses and
    grad norms as a single-device optax loop (in float64: the re-planned step must compute the
    loop's arithmetic, see tests/support/numerics.py)."""
    with jax.enable_x64(True):
        params, tx = toy.make_params(num_layers=8, dtype=np.float64), optax.adam(1e-2)
        cfg = {
            "train_batch_size": 16,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
        engine = jzero.initialize(params, toy.loss_fn, tx, cfg)
        w = lambda: {leaf.path: leaf for leaf in engine.plan.leaves}["blocks.w"]  # noqa: E731
        assert (w().param_dim, w().layer_dim) == (0, None)
        batches = toy.make_batches(3, 16, dtype=np.float64)
        metrics = [engine.train_step(b) for b in batches]
        assert (w().param_dim, w().layer_dim) == (1, 0)
        spec = engine.params["blocks"]["w"].sharding.spec
        assert spec == jax.sharding.PartitionSpec(None, "data")
        expected, _ = toy.reference_run(params, batches, tx, clip=1.0)  # DeepSpeed's default
        norms = reference_norms(params, batches, tx, clip=1.0)
    np.testing.assert_allclose([float(m["loss"]) for m in metrics], expected, rtol=1e-10, atol=0)
    # Clipping and Adam hide a gradient's scale from the losses; grad_norm shows it.
    np.testing.assert_allclose([float(m["grad_norm"]) for m in metrics], norms, rtol=1e-10, atol=0)


def test_persistent_stacked_leaves_keep_their_state_layout_through_the_refit():
    """Stage 3 with DeepSpeed's persistence threshold: 8 scanned layers whose leaves all stay
    whole at rest. Tracing the scan changes no parameter's layout, and the state of a whole
    parameter is never moved off the layer dimension, so the first step runs on the state as
    initialized (it once failed there with a sharding mismatch)."""
    params = {"w": np.ones((8, 16, 16), np.float32) / 16, "b": np.zeros((8, 16), np.float32)}

    def scan_loss(p, b):
        h, _ = jax.lax.scan(lambda h, wb: (jnp.tanh(h @ wb[0] + wb[1]), None), b["x"],
                            (p["w"], p["b"]))  # fmt: skip
        return jnp.mean(h**2)

    cfg = {"train_batch_size": 16, "zero_optimization": {"stage": 3}}
    engine = jzero.initialize(params, scan_loss, optax.adam(1e-3), cfg)
    before = [(leaf.param_dim, leaf.state_dim) for leaf in engine.plan.leaves]
    loss = engine.train_step({"x": np.ones((16, 16), np.float32)})["loss"]
    assert np.isfinite(float(loss))
    assert [(leaf.param_dim, leaf.state_dim) for leaf in engine.plan.leaves] == before
    assert before == [(None, 0), (None, 0)]
