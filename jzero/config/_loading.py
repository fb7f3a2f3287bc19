"""Loading: YAML, JSON or a mapping in, ``--set`` overrides applied, a validated ``Config`` out.

Decisions:

* **One wall.** PyYAML and json5 are imported here and nowhere else in jzero. YAML floats such
  as ``3e-4`` (which PyYAML would read as strings) are read as floats.
* ``.json`` files are read as DeepSpeed reads them (``hjson``): comments and trailing commas
  are allowed. A file that is strict JSON is read with ``json`` (so a repeated key is reported
  with both lines); any other goes to ``json5`` (a repeated key is reported with its path, a
  syntax error with its line).
* Overrides are ``dotted.key=value`` strings whose value is read as a YAML scalar or flow
  mapping (``--set mesh.model=2``, ``--set 'model={d_model: 64}'``); they create the sections
  they go into. An unknown key set by an override is an error (a file's is ignored with a
  warning at the top level and in the sections DeepSpeed reads key by key, as DeepSpeed
  ignores it).
* **A key written twice is an error**, in YAML and JSON files alike, at any depth (DeepSpeed
  refuses them too); the message names the dotted path, the file and both lines. YAML merge
  keys (``<<: *base``) may still be overridden by a key of the mapping itself.
* DeepSpeed's old top-level name ``bfloat16`` is read as ``bf16``.
* A leading ``~`` in ``checkpoint.directory``, ``train.log_dir`` and ``data.path`` is expanded
  when the config is validated (``jzero.config._validate``), so the resolved config holds the
  absolute path.
* The no-effect keys found by validation are listed in one ``JzeroConfigWarning``, the other
  spellings read as jzero's keys in one ``JzeroConfigDeprecationWarning``, and the unknown
  keys that were ignored (see ``jzero.config._validate``) in one more ``JzeroConfigWarning``
  of one line.
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import json5
import yaml

from jzero.config._common import (
    ConfigError,
    JzeroConfigDeprecationWarning,
    JzeroConfigWarning,
    show,
    thaw,
)
from jzero.config._schema import Config
from jzero.config._validate import build_config

__all__ = ["load_config"]


class _DuplicateKey(Exception):  # noqa: N818 - internal, turned into a ConfigError
    """A key written twice in one mapping: its dotted path and the lines of both (or None)."""

    def __init__(self, path: str, first: int | None, again: int | None) -> None:
        super().__init__(path)
        self.path, self.first, self.again = path, first, again


def _duplicate_message(err: _DuplicateKey, where: str) -> str:
    lines = f" (lines {err.first} and {err.again})" if err.first and err.again else ""
    return (
        f"{err.path} is set twice in {where}{lines}; jzero refuses a repeated key (as DeepSpeed "
        "does) instead of silently keeping the last value. Delete one of them."
    )


_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``3e-4`` and ``1E5`` as floats (YAML 1.2), not as strings, and
    refuses a key repeated in one mapping at any depth (``_DuplicateKey``)."""

    def construct_document(self, node: yaml.Node) -> Any:
        self._check_keys(node, "", set())
        return super().construct_document(node)

    def _check_keys(self, node: yaml.Node, path: str, seen: set[int]) -> None:
        """Walks the node graph top-down (so the dotted path is known) before construction."""
        if id(node) in seen:  # an alias: already checked where its anchor is
            return
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._check_keys(item, f"{path}[{i}]", seen)
            return
        if not isinstance(node, yaml.MappingNode):
            return
        first_line: dict[Any, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                continue  # `<<: *base` may be overridden; complex keys fail in construction
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            sub = f"{path}.{key}" if path else str(key)
            try:
                repeated = key in first_line
            except TypeError:  # an unhashable key: construction reports it
                continue
            if repeated:
                raise _DuplicateKey(sub, first_line[key], line)
            first_line[key] = line
            self._check_keys(value_node, sub, seen)


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


class _JsonObject:
    """A JSON object as written: its (key, value) pairs in order and the line of each key."""

    def __init__(self, pairs: list[tuple[str, Any]], lines: list[int]) -> None:
        self.pairs, self.lines = pairs, lines


class _JsonDecoder(json.JSONDecoder):
    """``json`` with every object kept as a ``_JsonObject``, so a repeated key is seen.

    The pure-Python scanner is used so that each object's parser sees where each of its
    values starts; the key ends at the ``:`` just before it, which gives the key's line.
    """

    def __init__(self) -> None:
        super().__init__()
        self.parse_object = self._parse_object
        self.scan_once = json.scanner.py_make_scanner(self)

    @staticmethod
    def _parse_object(
        s_and_end: tuple[str, int],
        strict: bool,
        scan_once: Any,
        hook: Any,
        pairs_hook: Any,
        memo: Any,
    ) -> tuple[_JsonObject, int]:
        text = s_and_end[0]
        starts: list[int] = []

        def scan_value(string: str, idx: int) -> Any:
            starts.append(idx)
            return scan_once(string, idx)

        pairs, end = json.decoder.JSONObject(s_and_end, strict, scan_value, None, list, memo)
        return _JsonObject(pairs, [_key_line(text, i) for i in starts]), end


def _key_line(text: str, value_start: int) -> int:
    """The line of the key whose value starts at ``value_start`` (only blanks and ``:`` lie
    between the key's closing quote and its value)."""
    i = text.rfind(":", 0, value_start) - 1
    while i > 0 and text[i] in " \t\r\n":
        i -= 1
    return text.count("\n", 0, i) + 1


def _json_tree(node: Any, path: str) -> Any:
    """Plain dicts and lists from ``_JsonDecoder``'s output; a repeated key raises."""
    if isinstance(node, list):
        return [_json_tree(v, f"{path}[{i}]") for i, v in enumerate(node)]
    if not isinstance(node, _JsonObject):
        return node
    out: dict[str, Any] = {}
    first_line: dict[str, int] = {}
    for (key, value), line in zip(node.pairs, node.lines, strict=True):
        sub = f"{path}.{key}" if path else key
        if key in out:
            raise _DuplicateKey(sub, first_line[key], line)
        first_line[key] = line
        out[key] = _json_tree(value, sub)
    return out


def _read_json(text: str) -> Any:
    """Strict JSON with each key's line; else JSON5 (comments, trailing commas), as hjson."""
    try:
        return _json_tree(_JsonDecoder().decode(text), "")
    except json.JSONDecodeError:
        pass

    def pairs(items: list[tuple[str, Any]]) -> _JsonObject:
        return _JsonObject(list(items), [0] * len(items))  # json5 gives no key positions

    return _json_tree(json5.loads(text, object_pairs_hook=pairs), "")


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
            return _read_json(text)
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except (ValueError, yaml.YAMLError) as err:  # json5's syntax errors are ValueErrors
        message = str(err).replace("<string>:", "line ", 1)
        raise ConfigError(
            f"The config file {text_path!r} is not valid YAML/JSON: {message}. Fix the syntax "
            "there."
        ) from None
    except _DuplicateKey as err:
        raise ConfigError(_duplicate_message(err, f"the config file {text_path!r}")) from None


def _parse_scalar(text: str, key: str, override: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError:
        return text
    except _DuplicateKey as err:
        err.path = f"{key}.{err.path}"
        err.first = err.again = None  # one line: the override itself
        raise ConfigError(_duplicate_message(err, f"the override {override!r}")) from None


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
                f"The override {override!r} goes into {where}, which is {show(child)}, not a "
                "mapping; override that key itself instead."
            )
        node = child
    node[parts[-1]] = _parse_scalar(text.strip(), key, override)


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
      JzeroConfigWarning: once, listing every DeepSpeed key present that has no effect in jzero;
        once more, naming the unknown keys that were ignored (top-level ones, and those of the
        sections DeepSpeed reads key by key: ``fp16.opt_level``).

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
        raw = thaw(source)
    elif isinstance(source, str | os.PathLike):
        raw = _read_file(source)
        raw = {} if raw is None else raw
    else:
        raise ConfigError(
            f"load_config got a {type(source).__name__}; pass a file path, a mapping or a Config."
        )
    if not isinstance(raw, dict):
        raise ConfigError(
            f"The config must be a mapping of keys at the top level, not {show(raw)}; write "
            "it as `key: value` lines (YAML) or a JSON object."
        )
    if "bfloat16" in raw:  # DeepSpeed's old name for bf16
        if "bf16" in raw:
            raise ConfigError("Both bf16 and bfloat16 (its old name) are set; keep only bf16.")
        raw["bf16"] = raw.pop("bfloat16")
    for override in overrides:
        _apply_override(raw, override)
    cfg, noted, renamed, ignored = build_config(raw)
    for override in overrides:  # a key set on purpose: unknown is an error, not ignored
        key = override.partition("=")[0].strip()
        if key in ignored or key.split(".")[0] in ignored:
            raise ConfigError(
                f"{key} is not a known key; fix its name in the override {override!r}, or "
                "remove it."
            )
    if ignored:
        warnings.warn(
            f"jzero does not know these keys and ignores them, as DeepSpeed ignores the keys it "
            f"does not read: {', '.join(ignored)}. Remove them to silence this warning.",
            JzeroConfigWarning,
            stacklevel=2,
        )
    if renamed:
        lines = "\n".join(f"  - {path}: write {new}" for path, new in renamed)
        warnings.warn(
            "These DeepSpeed keys are other spellings of jzero's keys and were read as those:\n"
            f"{lines}\nRename them to silence this warning.",
            JzeroConfigDeprecationWarning,
            stacklevel=2,
        )
    if noted:
        lines = "\n".join(f"  - {path}: {reason}." for path, reason in noted)
        warnings.warn(
            "These DeepSpeed settings have no effect in jzero and are ignored:\n"
            f"{lines}\nRemove them to silence this warning.",
            JzeroConfigWarning,
            stacklevel=2,
        )
    return cfg
