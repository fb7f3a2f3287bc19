"""Stage 3 holds about one layer of gathered parameters for any model: a Python loop over
layers (a pytree, Linen submodules, an NNX list) needs no more temporary memory than the same
layers as a scan, and trains exactly like a single-device optax loop; a tied embedding too.

Everything runs in float64 (tests/support/numerics.py): the point is that stage 3's gathers compute
what
the optax loop computes, so losses and grad norms are compared at 1e-10; the byte counts are of
float64 leaves (``ITEM``)."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from numerics import optax_loop

import jzero
from jzero.config import JzeroConfigWarning
from jzero.hlo import collectives
from jzero.parallel.zero import largest_gathered

L, D, B = 8, 256, 16
ITEM = 8  # bytes of a float64 element
CFG = {
    "train_batch_size": B,
    "gradient_clipping": 0.0,  # the loss scale reaches the update: no clipping hides it
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def weights(dtype=np.float32):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(L, D, D)) / np.sqrt(D)).astype(dtype)


def batches(n=3, dtype=np.float32):
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(size=(B, D)).astype(dtype)} for _ in range(n)]


def scan_loss(p, b):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), b["x"], p["w"])
    return jnp.mean(h**2)


def loop_loss(p, b):
    h = b["x"]
    for i in range(L):
        h = jnp.tanh(h @ p[f"w{i}"])
    return jnp.mean(h**2)


def temp_bytes(engine):
    return engine.lower(batches(1, np.float64)[0]).compile().memory_analysis().temp_size_in_bytes


pytestmark = pytest.mark.usefixtures("x64")  # conftest's float64


@functools.cache
def scan_temp():
    with jax.enable_x64(True):
        engine = jzero.initialize({"w": weights(np.float64)}, scan_loss, optax.adam(1e-3), CFG)
        return temp_bytes(engine)


def train(engine, data):
    """(losses, grad norms) of the engine's steps on ``data``."""
    metrics = [engine.train_step(b) for b in data]
    return [float(m["loss"]) for m in metrics], [float(m["grad_norm"]) for m in metrics]


def assert_matches(run, ref):
    """Losses and grad norms at float64's 1e-10: grad_norm shows a gradient's scale, which
    Adam hides from the losses."""
    np.testing.assert_allclose(run[0], ref[0], rtol=1e-10, atol=0)
    np.testing.assert_allclose(run[1], ref[1], rtol=1e-10, atol=0)


def loop_params():
    return {f"w{i}": w for i, w in enumerate(weights(np.float64))}


@functools.cache
def loop_sgd_reference():
    """The optax loop of the Python-loop model, SGD(0.1), 2 steps; the scan computes the same."""
    with jax.enable_x64(True):
        return optax_loop(loop_loss, loop_params(), optax.sgd(0.1), batches(2, np.float64))


def test_a_python_loop_of_layers_holds_one_layer_at_a_time_and_trains_exactly():
    params = loop_params()
    engine = jzero.initialize(params, loop_loss, optax.adam(1e-3), CFG)
    assert temp_bytes(engine) <= 1.25 * scan_temp(), (temp_bytes(engine), scan_temp())
    # All 8 gathered layers at once would be L * D * D * ITEM / 2 more than the scan's.
    assert temp_bytes(engine) < scan_temp() + L * D * D * ITEM // 2
    data = batches(dtype=np.float64)
    expected = optax_loop(loop_loss, params, optax.adam(1e-3), data)
    assert_matches(train(engine, data), expected)


class LinenLoop(linen.Module):
    param_dtype: jnp.dtype = jnp.float32

    @linen.compact
    def __call__(self, x):
        for _ in range(L):
            x = jnp.tanh(linen.Dense(D, use_bias=False, param_dtype=self.param_dtype)(x))
        return x


class NNXLoop(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List(
            [nnx.Linear(D, D, use_bias=False, param_dtype=jnp.float64, rngs=rngs) for _ in range(L)]
        )

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


def test_a_linen_loop_of_submodules_holds_one_layer_at_a_time_and_trains_exactly():
    module = LinenLoop(param_dtype=jnp.float64)
    variables = jax.jit(module.init)(jax.random.key(0), jnp.zeros((2, D), jnp.float64))

    def loss(p, b):
        return jnp.mean(module.apply({"params": p}, b["x"]) ** 2)

    engine = jzero.initialize(variables["params"], loss, optax.adam(1e-3), CFG)
    assert temp_bytes(engine) <= 1.25 * scan_temp(), (temp_bytes(engine), scan_temp())
    data = batches(dtype=np.float64)
    expected = optax_loop(loss, variables["params"], optax.adam(1e-3), data)
    assert_matches(train(engine, data), expected)


def test_an_nnx_list_of_layers_holds_one_layer_at_a_time_and_trains_exactly():
    def loss(model, b):
        return jnp.mean(model(b["x"]) ** 2)

    engine = jzero.initialize(
        model=lambda: NNXLoop(nnx.Rngs(0)), loss_fn=loss, optimizer=optax.adam(1e-3), config=CFG
    )
    assert temp_bytes(engine) <= 1.25 * scan_temp(), (temp_bytes(engine), scan_temp())
    graphdef, state = nnx.split(NNXLoop(nnx.Rngs(0)))
    start = jax.tree.map(np.asarray, state)

    def ref_loss(s, b):
        return loss(nnx.merge(graphdef, s), b)

    assert {x.dtype for x in jax.tree.leaves(start)} == {np.dtype(np.float64)}
    data = batches(dtype=np.float64)
    expected = optax_loop(ref_loss, start, optax.adam(1e-3), data)
    assert_matches(train(engine, data), expected)


def test_max_live_parameters_below_the_largest_layer_warns_and_trains():
    """DeepSpeed's limit bounds what it keeps and prefetches, and it fetches a module whatever
    its size: such a config trains there, so here too, with a warning naming the numbers."""
    zero = {**CFG["zero_optimization"], "stage3_max_live_parameters": 1000}
    engine = jzero.initialize(
        {"w": weights(np.float64)}, scan_loss, optax.sgd(0.1), {**CFG, "zero_optimization": zero}
    )
    with pytest.warns(JzeroConfigWarning, match=r"stage3_max_live_parameters is 1,000, but stage "
                      r"3 gathers 65,536 elements at once for 'w'.*at least 65,536"):  # fmt: skip
        loss = float(engine.train_step(batches(1, np.float64)[0])["loss"])
    assert np.isfinite(loss) and largest_gathered(engine.plan) == (D * D, "w")
    # 0, as some published configs write it (DeepSpeed keeps nothing cached), and one layer of
    # the stack: no warning.
    for limit in (0, D * D):
        zero["stage3_max_live_parameters"] = limit
        engine = jzero.initialize(
            {"w": weights(np.float64)},
            scan_loss,
            optax.sgd(0.1),
            {**CFG, "zero_optimization": zero},
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error", JzeroConfigWarning)
            engine.resolve(batches(1, np.float64)[0])
        assert largest_gathered(engine.plan) == (D * D, "w")


@pytest.mark.parametrize("written", ["scan", "loop"])
def test_reshard_after_forward_false_gathers_once_and_trains_the_same(written):
    """FSDP2's trade: keeping the forward's gathered weights for the backward pass halves the
    all-gather traffic (one gather per weight instead of two) and costs their memory."""
    if written == "scan":
        params, loss = {"w": weights(np.float64)}, scan_loss
    else:
        params, loss = loop_params(), loop_loss
    out = {}
    for reshard in (True, False):
        zero = {**CFG["zero_optimization"], "reshard_after_forward": reshard}
        engine = jzero.initialize(params, loss, optax.sgd(0.1), {**CFG, "zero_optimization": zero})
        data = batches(2, np.float64)
        compiled = engine.lower(data[0]).compile()
        gathered = collectives(compiled)["all-gather"].bytes
        temp = compiled.memory_analysis().temp_size_in_bytes
        out[reshard] = (gathered, temp, train(engine, data))
    full, layer = L * D * D * ITEM, D * D * ITEM
    # Resharding gathers every layer twice (the last one's two gathers may meet as one: it is
    # used backward right after forward); keeping gathers each once.
    assert out[True][0] in (2 * full, 2 * full - layer) and out[False][0] == full
    assert out[False][1] > out[True][1] + full // 2  # the gathered weights are kept
    # Both train like the optax loop (the scan computes what the loop of layers computes).
    for reshard in (True, False):
        assert_matches(out[reshard][2], loop_sgd_reference())


V, E = 256, 256  # the tied-embedding model: a 256-token vocabulary, width 256, 4 layers


def tied_params():
    rng = np.random.default_rng(2)
    params = {"embed": (rng.normal(size=(V, E)) * 0.3).astype(np.float64)}
    for i in range(4):
        params[f"w{i}"] = (rng.normal(size=(E, E)) / np.sqrt(E)).astype(np.float64)
    return params


def tied_loss(p, b):
    h = p["embed"][b["tokens"][:, :-1]]
    for i in range(4):
        h = jnp.tanh(h @ p[f"w{i}"])
    logp = jax.nn.log_softmax(h @ p["embed"].T)  # the embedding again, 4 layers later
    return -jnp.mean(jnp.take_along_axis(logp, b["tokens"][:, 1:, None], -1))


def tied_data(n=2):
    rng = np.random.default_rng(3)
    return [{"tokens": rng.integers(0, V, (B, 9)).astype(np.int32)} for _ in range(n)]


def zero3(**keys):
    return {**CFG, "zero_optimization": {**CFG["zero_optimization"], **keys}}


def test_max_reuse_distance_keeps_what_is_reused_within_it():
    """DeepSpeed's ``stage3_max_reuse_distance``: a parameter whose next use (a later forward
    use, then its backward use) comes within that many elements of other gathered parameters
    is gathered once and kept; ``stage3_max_live_parameters`` caps what is kept. The default
    run is also the test that a tied embedding (gathered at both uses) trains like the optax
    loop."""
    unit = E * E * ITEM  # bytes of one gathered leaf (the embedding is V x E = E x E too)
    out = {}
    for name, keys in {
        "default": {},
        "everything": {"stage3_max_reuse_distance": 10**9},
        "capped": {"stage3_max_reuse_distance": 10**9, "stage3_max_live_parameters": 2 * E * E},
    }.items():
        engine = jzero.initialize(tied_params(), tied_loss, optax.sgd(0.5), zero3(**keys))
        compiled = engine.lower(tied_data(1)[0]).compile()
        out[name] = collectives(compiled)["all-gather"].bytes, train(engine, tied_data())
    assert out["everything"][0] == 5 * unit  # each of the 5 leaves gathered exactly once
    # By default every use gathers in forward and again in backward: the embedding 4 times.
    assert out["default"][0] >= 8 * unit
    # Room for the largest leaf and one kept leaf: one leaf's backward gather is saved.
    assert out["everything"][0] < out["capped"][0] < out["default"][0]
    expected = optax_loop(tied_loss, tied_params(), optax.sgd(0.5), tied_data())
    for _, run in out.values():
        assert_matches(run, expected)


def test_reuse_and_prefetch_read_the_traced_gather_order():
    from jzero.rewrite import GatherEvent, kept_leaves, prefetch_anchors

    # embed (100), two layers (10 each), then embed again: the tied embedding's reuse is 20
    # elements away; layer 1's backward use is 2 x 100 away, layer 2's too (the embed after it).
    events = [GatherEvent({0: 100}, "use", 100)]
    events += [GatherEvent({i: 10}, "use", 10) for i in (1, 2)]
    events += [GatherEvent({0: 100}, "use", 100)]
    assert kept_leaves(events, 20, 10**9) == {0}
    assert kept_leaves(events, 199, 10**9) == {0}
    assert kept_leaves(events, 220, 10**9) == {0, 1, 2}
    # The cap counts the kept elements plus the largest unit gathered (100); the leaves with
    # the shortest distance are kept first: the embedding (20), then layer 2 (200), while
    # they fit (199 leaves no room for the embedding, but for both layers).
    assert kept_leaves(events, 220, 199) == {1, 2}
    assert kept_leaves(events, 220, 100 + 100) == {0}
    assert kept_leaves(events, 220, 100 + 100 + 10) == {0, 2}
    # A use's gather may start at an earlier use while what is gathered in between, its own
    # included, fits the bucket.
    assert prefetch_anchors(events, 0) == [0, 1, 2, 3]
    assert prefetch_anchors(events, 10) == [0, 0, 1, 3]
    assert prefetch_anchors(events, 20) == [0, 0, 0, 3]
    assert prefetch_anchors(events, 110) == [0, 0, 0, 1]


def test_prefetch_bucket_lets_gathers_start_earlier():
    """DeepSpeed's ``stage3_prefetch_bucket_size``: each forward gather of a Python loop may
    start up to that many elements ahead of its use, so more layers are gathered at once (on
    CPU XLA issues them as early as allowed); the traffic and the losses do not change."""
    params = loop_params()
    out = {}
    for bucket in (None, 3 * D * D):
        keys = {} if bucket is None else {"stage3_prefetch_bucket_size": bucket}
        engine = jzero.initialize(params, loop_loss, optax.sgd(0.1), zero3(**keys))
        data = batches(2, np.float64)
        compiled = engine.lower(data[0]).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        out[bucket] = collectives(compiled)["all-gather"].bytes, temp, train(engine, data)
    layer = D * D * ITEM
    assert out[3 * D * D][0] == out[None][0]
    assert out[3 * D * D][1] > out[None][1] + layer  # more than one more layer gathered at once
    for bucket in out:  # the same arithmetic as the optax loop, with or without prefetching
        assert_matches(out[bucket][2], loop_sgd_reference())
