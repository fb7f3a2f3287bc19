"""What every part of the config package shares: the error types, frozen mappings, messages.

Decisions:

* Every user-input error raises ``ConfigError`` (a ``ValueError``) with a full sentence that
  ends with the fix; DeepSpeed keys that are accepted but ignored raise no error but one
  ``JzeroConfigWarning``.
* Mappings inside a ``Config`` are ``FrozenMap`` and lists are tuples, so a ``Config`` is
  hashable and can be a static argument of ``jax.jit``.
* Values are shown in messages as the user wrote them in YAML/JSON (``true``, ``null``).
* ``checked_field`` makes a dataclass field whose metadata carries the validation rules
  (``min``, ``max``, ``nonzero``, ``no_effect``, ``refuse``, ``auto``, the YAML ``key`` when it
  differs from the field name, ``rest`` for a mapping that takes every other key of its
  section, ``loose`` for a section read as DeepSpeed reads it: unknown keys ignored).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import field
from typing import Any

__all__ = ["ConfigError", "FrozenMap", "JzeroConfigDeprecationWarning", "JzeroConfigWarning"]


class ConfigError(ValueError):
    """A config value, key or combination that jzero cannot run; the message says the fix."""


class JzeroConfigWarning(UserWarning):
    """DeepSpeed settings that were accepted but have no effect in jzero."""


class JzeroMeshWarning(UserWarning):
    """A ZeRO stage above 0 whose data axis has one device: the stage splits nothing."""


class JzeroConfigDeprecationWarning(JzeroConfigWarning, FutureWarning):
    """DeepSpeed keys written with another (often deprecated) spelling, read as jzero's key.

    A ``FutureWarning``, so Python shows it by default (a ``DeprecationWarning`` is hidden
    outside ``__main__``).
    """


class FrozenMap(Mapping):
    """An immutable, hashable mapping (nested dicts and lists become FrozenMaps and tuples)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self._data = {k: _freeze(v) for k, v in (data or {}).items()}

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._data.items(), key=lambda kv: kv[0])))

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return value if isinstance(value, FrozenMap) else FrozenMap(value)
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [thaw(v) for v in value]
    return value


def checked_field(default: Any = dataclasses.MISSING, *, factory: Any = None, **meta: Any) -> Any:
    """A dataclass field whose metadata carries the validation rules."""
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def show(value: Any) -> str:
    """Renders a value as the user wrote it in YAML/JSON."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, tuple):  # a frozen YAML/JSON list
        return repr(list(value))
    return repr(value)


_BRITISH = re.compile(r"(?<=[a-z])is(ation|ations|e|ed|es|ing|er|ers)$|(?<=[a-z])ys(e|ed|es|ing)$")


def _words(key: str) -> list[str]:
    """The words of ``key``: lower case, split at separators (``_``, ``-``, ``.``, blanks),
    each in American spelling (``optimisation`` -> ``optimization``)."""
    return [
        _BRITISH.sub(lambda m: ("iz" if m.group(1) else "yz") + (m.group(1) or m.group(2)), w)
        for w in re.split(r"[\s_.\-]+", str(key).lower())
        if w
    ]


def _normalise(key: str) -> str:
    """``key`` compared as a name: its :func:`_words` joined."""
    return "".join(_words(key))


def _abbreviates(key: str, known: str) -> bool:
    """Whether ``key`` shortens ``known`` word by word: as many words, each the start of the
    known one and at least half of it (``gradient_clip``, ``grad_clip`` for
    ``gradient_clipping``; not ``auto`` for ``autotuning``)."""
    short, full = _words(key), _words(known)
    return (
        len(short) == len(full)
        and short != full
        and all(f.startswith(s) and 2 * len(s) >= len(f) for s, f in zip(short, full, strict=True))
    )


def _edit_distance(a: str, b: str) -> int:
    """Insertions, deletions, substitutions and swaps of two neighbours that turn ``a`` into
    ``b`` (optimal string alignment)."""
    before: list[int] = []
    row = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        two_back, before, row = before, row, [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            row[j] = min(before[j] + 1, row[j - 1] + 1, before[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], two_back[j - 2] + 1)
    return row[len(b)]


def close_match(key: str, known: Sequence[str] | Mapping[str, Any]) -> str | None:
    """The known key that ``key`` is a near miss of, or None.

    A near miss is equal after :func:`_normalise`, or within one edit of it (two for names of
    more than five letters), or an abbreviation of it (:func:`_abbreviates`):
    ``zero_optimisation``, ``Zero-Optimization``, ``gradient_cliping``, ``gradient_clip`` are
    near misses; ``_comment`` is not one of ``comet``, nor ``train_iters`` of ``train``, nor
    ``auto`` of ``autotuning``.
    """
    name = _normalise(key)
    best, best_distance = None, None
    for candidate in known:
        target = _normalise(candidate)
        allowed = 1 if min(len(name), len(target)) <= 5 else 2
        distance = _edit_distance(name, target)
        if distance <= allowed and (best_distance is None or distance < best_distance):
            best, best_distance = candidate, distance
    if best is None:
        best = next((candidate for candidate in known if _abbreviates(key, candidate)), None)
    return best


def suggest(key: str, known: Sequence[str] | Mapping[str, Any]) -> str:
    close = close_match(key, known)
    return f" (did you mean '{close}'?)" if close is not None else ""


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else str(key)
