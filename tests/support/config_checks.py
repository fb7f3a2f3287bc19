"""Loading a config in a test: its warnings collected, or its error's text."""

import warnings

import pytest

from jzero.config import ConfigError, JzeroConfigWarning, load_config


def load_quietly(source, overrides=()):
    """Loads a config; returns it with the messages of the warnings it gave, every one of them
    a JzeroConfigWarning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(source, overrides)
    for w in caught:
        assert issubclass(w.category, JzeroConfigWarning), w  # warnings only of jzero's own
    return cfg, [str(w.message) for w in caught]


def error_of(source, overrides=()):
    """The text of the ConfigError loading ``source`` raises (its warnings ignored)."""
    with pytest.raises(ConfigError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_config(source, overrides)
    return str(info.value)
