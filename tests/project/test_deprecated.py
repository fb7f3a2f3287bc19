"""Deprecated names still work, and say where they went: the alias modules at jzero's root warn
when imported, and the config readers that moved to ``jzero.engine.settings`` warn when used.

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
