"""Processes agree before they train: each publishes a fingerprint of its run (the resolved
config, the mesh, the versions, the compiled step) through JAX's distributed key-value store,
and a mismatch stops every process at once with the processes and the first field that differs.

Decisions:

* The store is the distributed runtime's own (the coordinator's key-value service): nothing
  more is started, and one process (``process_count() == 1``) skips it all.
* Every call is a round: keys are ``jzero/<name>/<round>/<process>``, the round counted per
  process, so the rounds of several runs in one process never read each other's values (every
  process makes the same calls in the same order).
* Every process reads every fingerprint and compares them with process 0's, field by field in
  the order given, so all of them raise the same error, naming each field's value on process 0
  and on the first process that differs. A field may hold a mapping (the config): its first
  differing dotted key is named.
* A process that never publishes (it died, or it waits elsewhere) is waited for at most
  ``timeout`` seconds, then named.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from typing import Any

import jax

__all__ = ["ProcessesDisagree", "agree", "publish", "read_all", "store"]

_ROUNDS: dict[str, itertools.count] = {}


class ProcessesDisagree(ValueError):
    """Processes of one run would train different runs (configs, versions, programs)."""


def store() -> Any:
    """The distributed runtime's key-value client, or ``None`` (one process, or no runtime)."""
    if jax.process_count() == 1:
        return None
    from jax._src import distributed  # the runtime's client: JAX keeps no public handle

    return distributed.global_state.client


def publish(key: str, value: Any) -> None:
    """Sets ``key`` to ``value`` (JSON) in the store, overwriting; nothing for one process."""
    client = store()
    if client is not None:
        client.key_value_set(key, json.dumps(value), allow_overwrite=True)


def read_all(prefix: str) -> dict[str, Any]:
    """Every key under ``prefix`` (``prefix/...``) and its JSON value; ``{}`` for one process."""
    client = store()
    if client is None:
        return {}
    return {k: json.loads(v) for k, v in client.key_value_dir_get(prefix)}


def _flat(value: Any, path: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k in value:
            out.update(_flat(value[k], f"{path}.{k}" if path else str(k)))
        return out or {path: {}}
    return {path: value}


def _first_difference(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> tuple[str, Any] | None:
    """``(this field and its value here, its value there)`` of the first field that differs."""
    for field in mine:
        a, b = mine[field], theirs.get(field)
        if a == b:
            continue
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            fa, fb = _flat(a), _flat(b)
            for key in [*fa, *(k for k in fb if k not in fa)]:
                if fa.get(key, "(not set)") != fb.get(key, "(not set)"):
                    return f"{field} {key}: {fa.get(key, '(not set)')!r}", fb.get(key, "(not set)")
        return f"{field}: {a!r}", b
    return None


def agree(name: str, fields: Mapping[str, Any], *, timeout: float = 300.0) -> None:
    """Publishes this process's ``fields`` and checks every process's against process 0's.

    Args:
      name: what is compared (``"run"``), a part of the keys.
      fields: JSON values by name, compared in this order (a mapping's keys too).
      timeout: seconds to wait for a process's fingerprint.

    Raises:
      ProcessesDisagree: a process's fields differ from process 0's, or one never published.
    """
    client = store()
    if client is None:
        return
    rounds = _ROUNDS.setdefault(name, itertools.count())
    prefix = f"jzero/{name}/{next(rounds)}"
    me = jax.process_index()
    client.key_value_set(f"{prefix}/{me}", json.dumps(dict(fields)), allow_overwrite=True)
    prints = {}
    for p in range(jax.process_count()):
        try:
            prints[p] = json.loads(
                client.blocking_key_value_get(f"{prefix}/{p}", int(timeout * 1000))
            )
        except Exception as e:  # the runtime's timeout error: no JAX class to catch by name
            raise ProcessesDisagree(
                f"jzero: process {p} did not publish its {name} fingerprint within {timeout:g} s "
                f"(process {me} waited for it: {type(e).__name__}). It is not running this "
                "run's code, it died, or it is stuck before its first step; check its log."
            ) from e
    for p in range(1, jax.process_count()):
        diff = _first_difference(prints[0], prints[p])
        if diff is not None:
            what, theirs = diff
            raise ProcessesDisagree(
                f"jzero: the processes would not train the same {name}: {what} on process 0, "
                f"{theirs!r} on process {p}. Start every process with the same config, jzero "
                "and JAX versions and code; every process stopped before its first step."
            )
