"""The experts' optimizer state rests in the layout its update computes it in
(``expert_parallel.autoep_size: 2``, ZeRO stages 1-3, :func:`jzero.plan.make_plan`): the MoE
toy's step compiles with no "Involuntary full rematerialization" from XLA, every expert state
leaf (Adam's moments, and 8-bit Adam's block scales, whose shape is not the parameter's) is split
over ``expert`` on its experts dimension, and 8-bit state adds no resharding of the experts'
state to the step: no all-to-all, no collective-permute and no gather within the expert groups
beyond plain Adam's. Training stays exact: tests/distributed/test_moe.py."""

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from moe_toy import batches, config, make_loss, make_params

import jzero
from jzero.hlo import collectives_by_axes
from jzero.hlo.parse import _persistent_cache_off

REMAT = "Involuntary full rematerialization"
ADAM = {"type": "AdamW", "params": {"lr": 0.01}}
ADAM8 = {"type": "AdamW", "params": {"lr": 0.01, "state_bits": 8}}

pytestmark = pytest.mark.usefixtures("x64")  # the toy is float64


# The persistent compilation cache off inside: a program loaded from it is not compiled, and
# XLA logs nothing for it.
compiled_here = _persistent_cache_off


def compile_step(stage, optimizer):
    engine = jzero.initialize(
        make_params(), make_loss(), config=config(stage, 2, optimizer=optimizer)
    )
    with compiled_here():
        return engine, engine.lower(batches(1)[0]).compile()


def test_the_capture_reads_xlas_rematerialization_warning(capfd):
    """The check below is not vacuous: XLA writes the warning to the process's stderr from C++,
    which capfd reads (a leaf resting split on one dimension and constrained to two others is
    rematerialised)."""
    mesh = jax.make_mesh((4, 2), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rest = NamedSharding(mesh, P(None, None, ("data", "expert")))
    there = NamedSharding(mesh, P("expert", "data"))

    def move(x):
        return jax.lax.with_sharding_constraint(x * 2, there) + 1

    x = jax.ShapeDtypeStruct((2, 8, 16, 24), "float32", sharding=rest)
    with compiled_here():
        jax.jit(move, out_shardings=rest).lower(x).compile()
    assert REMAT in capfd.readouterr().err


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_expert_state_rests_where_its_update_computes_it(stage, capfd):
    capfd.readouterr()
    _, plain = compile_step(stage, ADAM)
    engine, quantized = compile_step(stage, ADAM8)
    assert REMAT not in capfd.readouterr().err

    flat = jax.tree_util.tree_flatten_with_path(engine.plan.opt_state)[0]
    paths = {jax.tree_util.keystr(p): s.spec for p, s in flat}
    experts = {p: spec for p, spec in paths.items() if "['experts']" in p}
    assert len(experts) == 8  # w1, w2: mu and nu codes and scales
    assert all(spec[:1] == ("expert",) for spec in experts.values()), experts

    mesh = engine.plan.mesh
    got, want = collectives_by_axes(quantized, mesh), collectives_by_axes(plain, mesh)

    def count(table, kind, axes=None):
        rows = table.values() if axes is None else [table.get(axes, {})]
        return sum(row[kind].count for row in rows if kind in row)

    for kind in ("all-to-all", "collective-permute"):
        assert count(got, kind) == count(want, kind), (kind, got, want)
    # Within each expert group (over `data` alone) only the experts' own ZeRO collectives.
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert count(got, kind, ("data",)) == count(want, kind, ("data",)), (kind, got, want)
