"""Deprecated names still work, and say where they went: the alias modules at jzero's root warn
when imported, the config readers that moved to ``jzero.engine.settings`` warn when used, and so do
the names of renamed modules (``jzero._util.renamed_module``) and renamed or unexported names.

The project's pytest settings ignore ``DeprecationWarning``, so each test records warnings
itself (``simplefilter("always")``) and imports the alias afresh (out of ``sys.modules``)."""

import importlib
import sys
import warnings

import pytest

import jzero
from jzero.engine import settings

ALIASES = {
    "jzero.data": ("jzero.demo.data", "BatchIterator"),
    "jzero.engine_init": ("jzero.engine", "initialize"),
    "jzero.export": ("jzero.weights", "load_exported"),
    "jzero.gather": ("jzero.replay", "gathered"),
    "jzero.models": ("jzero.demo.gpt", "GPT"),
    "jzero.models.gpt": ("jzero.demo.gpt", "config_for"),
    "jzero.overlap": ("jzero.comm", "compiler_options"),
    "jzero.train": ("jzero.demo.train", "run"),
}


def _import_fresh(name):
    parent = name.rpartition(".")[0]
    with warnings.catch_warnings():  # an alias package's own warning is its own test's
        warnings.simplefilter("ignore", DeprecationWarning)
        importlib.import_module(parent)
    sys.modules.pop(name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, [w for w in caught if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_an_alias_module_warns_with_the_new_import_and_still_works(name):
    new, attr = ALIASES[name]
    module, caught = _import_fresh(name)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert name in message and new in message and "deprecated" in message
    assert getattr(module, attr) is getattr(importlib.import_module(new), attr)


@pytest.mark.parametrize(
    ("module", "old", "new"),
    [
        ("jzero.plan.precision", "from_config", settings.precision),
        ("jzero.plan.memory_kinds", "memory_kinds_from_config", settings.memory_kinds),
        ("jzero.plan", "memory_kinds_from_config", settings.memory_kinds),
        ("jzero.replay.remat", "from_config", settings.remat_policy),
    ],
)
def test_a_moved_config_reader_warns_and_is_the_settings_function(module, old, new):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = getattr(importlib.import_module(module), old)
    assert found is new
    assert [w.category for w in caught] == [DeprecationWarning]
    assert f"jzero.engine.settings.{new.__name__}" in str(caught[0].message)
    with pytest.raises(AttributeError):
        _ = importlib.import_module(module).no_such_name


def test_zero_config_comm_options_warns_and_gives_the_settings_fields():
    zero = jzero.load_config({"zero_optimization": {"stage": 3, "overlap_comm": True}})
    zero = zero.zero_optimization
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        options = zero.comm_options()
    assert [w.category for w in caught] == [DeprecationWarning]
    assert "jzero.engine.settings.comm_options" in str(caught[0].message)
    assert options == vars(settings.comm_options(zero))


# (old module, a name read from it, the new module, the name there)
RENAMED_MODULES = [
    ("jzero.comm.quantize", "quantized_all_gather", "jzero.comm.quantization", None),
    ("jzero.nvme.first_version", "first_version", "jzero.nvme.initial_state", None),
    ("jzero.nvme.host_shards", "host_shards", "jzero.nvme.shards", None),
    ("jzero.optim.muon", "scale_by_muon", "jzero.optim.muon_optimizer", None),
    ("jzero.optim.muon", "update_layout", "jzero.optim.update_context", None),
    ("jzero.optim.schedules", "build_schedule", "jzero.optim.lr_schedules", "build_lr_schedule"),
    ("jzero.replay.overlapped_scan", "can_overlap", "jzero.replay.overlap", None),
    ("jzero.replay.param_gather", "all_gather", "jzero.replay.pending", None),
    ("jzero.groups", "leaf_groups", "jzero.subgroups", None),
    ("jzero.groups.ownership", "owned_state", "jzero.subgroups.ownership", None),
    ("jzero.groups.update", "update_group", "jzero.subgroups.update", None),
    ("jzero.groups.leafwise", "check_leafwise", "jzero.subgroups.leafwise", None),
    ("jzero.checkpoint.layout", "CheckpointError", "jzero.checkpoint.format", None),
    ("jzero.distributed.layout", "resolve_spec", "jzero.distributed.processes", None),
]


@pytest.mark.parametrize(("old", "name", "new", "new_name"), RENAMED_MODULES)
def test_a_renamed_module_imports_and_each_name_warns_with_its_new_home(old, name, new, new_name):
    module = importlib.import_module(old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = getattr(module, name)
    expected = getattr(importlib.import_module(new), new_name or name)
    assert found is expected
    assert [w.category for w in caught] == [DeprecationWarning]
    assert f"{old}.{name}" in str(caught[0].message)
    assert f"{new}.{new_name or name}" in str(caught[0].message)
    with pytest.raises(AttributeError):
        _ = module.no_such_name


def test_a_renamed_module_leaves_the_function_of_its_old_name_in_place():
    """``jzero.comm.quantize`` (and the others) is the function the package exports, even after
    the old module path is imported: the alias is no attribute of its package."""
    import jzero.comm.quantize  # noqa: F401
    import jzero.nvme.first_version  # noqa: F401
    import jzero.nvme.host_shards  # noqa: F401
    import jzero.optim.muon  # noqa: F401
    import jzero.replay.overlapped_scan  # noqa: F401

    from jzero.comm import quantization
    from jzero.nvme import initial_state, shards
    from jzero.optim import muon_optimizer
    from jzero.replay import overlap

    assert jzero.comm.quantize is quantization.quantize
    assert jzero.nvme.first_version is initial_state.first_version
    assert jzero.nvme.host_shards is shards.host_shards
    assert jzero.optim.muon is muon_optimizer.muon
    assert jzero.replay.overlapped_scan is overlap.overlapped_scan


@pytest.mark.parametrize(
    ("package", "old", "new"),
    [
        ("jzero", "groups", "jzero.groups"),
        ("jzero.optim", "schedules", "jzero.optim.schedules"),
        ("jzero.replay", "param_gather", "jzero.replay.param_gather"),
        ("jzero.checkpoint", "layout", "jzero.checkpoint.layout"),
        ("jzero.distributed", "layout", "jzero.distributed.layout"),
    ],
)
def test_a_renamed_module_is_still_its_package_attribute(package, old, new):
    assert getattr(importlib.import_module(package), old) is sys.modules[new]


@pytest.mark.parametrize(
    ("module", "old", "new"),
    [
        ("jzero.optim", "build_schedule", "jzero.optim.lr_schedules.build_lr_schedule"),
        ("jzero.replay", "Event", "jzero.replay.prefetch.GatherEvent"),
        ("jzero.replay.prefetch", "Event", "jzero.replay.prefetch.GatherEvent"),
        ("jzero.replay", "tie_to", "jzero.replay.trace.tie_to"),
        ("jzero.replay", "LayerSplit", "jzero.replay.layer_split.LayerSplit"),
        ("jzero.replay", "ACTIVATION", "jzero.replay.remat.ACTIVATION"),
        ("jzero.replay", "POLICIES", "jzero.choices.POLICIES"),
    ],
)
def test_a_renamed_or_unexported_name_warns_and_is_the_new_one(module, old, new):
    home, _, name = new.rpartition(".")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = getattr(importlib.import_module(module), old)
    assert found is getattr(importlib.import_module(home), name)
    assert [w.category for w in caught] == [DeprecationWarning]
    assert new in str(caught[0].message)
    assert old not in importlib.import_module(module).__all__
