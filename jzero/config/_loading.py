"""Loading: YAML, JSON or a mapping in, ``--set`` overrides applied, a validated ``Config`` out.

Decisions:

* **One wall.** PyYAML is imported here and nowhere else in jzero. YAML floats such as ``3e-4``
  (which PyYAML would read as strings) are read as floats; ``.json`` files are read with
  ``json``, so a DeepSpeed ``ds_config.json`` loads unchanged.
* Overrides are ``dotted.key=value`` strings whose value is read as a YAML scalar or flow
  mapping (``--set mesh.model=2``, ``--set 'model={d_model: 64}'``); they create the sections
  they go into.
* DeepSpeed's old top-level name ``bfloat16`` is read as ``bf16``.
* The no-effect keys found by validation are listed in one ``JzeroConfigWarning``.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from jzero.config._common import ConfigError, JzeroConfigWarning, _show, _thaw
from jzero.config._schema import Config
from jzero.config._validate import build_config

__all__ = ["load_config"]


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``3e-4`` and ``1E5`` as floats (YAML 1.2), not as strings."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _read_file(path: str | os.PathLike) -> Any:
    text_path = os.fspath(path)
    if not os.path.isfile(text_path):
        raise ConfigError(
            f"The config file {text_path!r} does not exist; pass the path of a YAML or JSON "
            "config, e.g. configs/zero2.yaml."
        )
    with open(text_path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        if text_path.endswith(".json"):
            return json.loads(text)
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ConfigError(
            f"The config file {text_path!r} is not valid YAML/JSON: {err}. Fix the syntax there."
        ) from None


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError:
        return text


def _apply_override(raw: dict, override: str) -> None:
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(
            f"The override {override!r} is not of the form dotted.key=value; write it like "
            "zero_optimization.stage=3."
        )
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(
                f"The override {override!r} goes into {where}, which is {_show(child)}, not a "
                "mapping; override that key itself instead."
            )
        node = child
    node[parts[-1]] = _parse_scalar(text.strip())


def load_config(
    source: str | os.PathLike | Mapping[str, Any] | Config | None = None,
    overrides: Sequence[str] = (),
) -> Config:
    """Loads, validates and freezes a config.

    Args:
      source: a YAML or JSON file, a mapping with DeepSpeed's keys, a ``Config``, or None
        (all defaults).
      overrides: ``"dotted.key=value"`` strings applied on top, the value read as a YAML
        scalar (as ``jzero train CONFIG --set key=value`` passes them).

    Returns:
      The validated ``Config``.

    Raises:
      ConfigError: for an unknown key, a wrong value or an impossible combination.

    Warns:
      JzeroConfigWarning: once, listing every DeepSpeed key present that has no effect in jzero.

    Example:
      >>> cfg = load_config({"train_micro_batch_size_per_gpu": 4}, ["zero_optimization.stage=2"])
      >>> cfg.zero_optimization.stage
      2
    """
    if isinstance(source, Config) and not overrides:
        return source
    if isinstance(source, Config):
        raw: Any = source.to_dict()
    elif source is None:
        raw = {}
    elif isinstance(source, Mapping):
        raw = _thaw(source)
    elif isinstance(source, str | os.PathLike):
        raw = _read_file(source)
        raw = {} if raw is None else raw
    else:
        raise ConfigError(
            f"load_config got a {type(source).__name__}; pass a file path, a mapping or a Config."
        )
    if not isinstance(raw, dict):
        raise ConfigError(
            f"The config must be a mapping of keys at the top level, not {_show(raw)}; write "
            "it as `key: value` lines (YAML) or a JSON object."
        )
    if "bfloat16" in raw:  # DeepSpeed's old name for bf16
        if "bf16" in raw:
            raise ConfigError("Both bf16 and bfloat16 (its old name) are set; keep only bf16.")
        raw["bf16"] = raw.pop("bfloat16")
    for override in overrides:
        _apply_override(raw, override)
    cfg, noted = build_config(raw)
    if noted:
        lines = "\n".join(f"  - {path}: {reason}." for path, reason in noted)
        warnings.warn(
            "These DeepSpeed settings have no effect in jzero and are ignored:\n"
            f"{lines}\nRemove them to silence this warning.",
            JzeroConfigWarning,
            stacklevel=2,
        )
    return cfg
