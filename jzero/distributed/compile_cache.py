"""JAX's persistent compilation cache for jzero's programs, and counting compilations.

A run pays for its compilations at every start: every restart after preemption, every
resumed job. With the cache on, a second process running the same config loads each program
from disk instead of compiling it (``jzero train`` turns it on: ``train.compile_cache``).

Decisions:

* The directory is ``train.compile_cache``; ``"auto"`` (the default) is ``compile_cache``
  beside the checkpoint directory (``runs/ckpt`` -> ``runs/compile_cache``), or beside
  ``train.log_dir`` when there is no checkpoint directory; ``null`` turns it off. Beside, not
  inside: the checkpoint directory holds jzero's checkpoints only
  (:func:`jzero.checkpoint.dirs.check_ownership`). Runs that share a parent directory share
  the cache, which is keyed by the program's hash, so they only ever reuse identical programs.
* Every program is written, however fast it compiled and however small it is
  (``jax_persistent_cache_min_compile_time_secs = 0``, ``..._min_entry_size_bytes = -1``): JAX's
  defaults (1 s, and a file-system minimum) would skip jzero's init program and a small
  model's step, and a restart would then compile them again.
* jzero's programs are cacheable: their keys depend on the program, its shardings and the
  compile options only (no per-run constants: the seed's key is made inside the init
  program from the config's integer seed, and file names and line numbers are not in the key).
* :class:`CompileCounter` counts backend compilations and the cache's hits and misses from
  ``jax.monitoring`` events, for ``jzero train``'s summary, the tests and the benchmark.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["CompileCounter", "compile_cache_dir", "enable_compile_cache"]

logger = logging.getLogger(__name__)

AUTO = "auto"
_DIR_NAME = "compile_cache"
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"
CACHE_MISS = "/jax/compilation_cache/cache_misses"


def compile_cache_dir(
    setting: str | None, checkpoint_dir: str | None, log_dir: str | None
) -> Path | None:
    """The cache directory a config asks for (see the module's decisions), or ``None`` (off).

    Raises:
      ValueError: ``"auto"`` with neither a checkpoint nor a log directory to put it beside.
    """
    if setting is None:
        return None
    if setting != AUTO:
        return Path(os.path.expanduser(setting))
    beside = checkpoint_dir or log_dir
    if not beside:
        raise ValueError(
            "train.compile_cache is 'auto', which puts the cache beside checkpoint.directory "
            "(or train.log_dir), but neither is set. Set train.compile_cache to a directory, or "
            "to null to compile at every start."
        )
    return Path(os.path.expanduser(beside)).resolve().parent / _DIR_NAME


_SETTINGS = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


def enable_compile_cache(directory: str | os.PathLike) -> Callable[[], None]:
    """Turns JAX's persistent compilation cache on in ``directory`` (created if missing) for
    this process, every program cached, and returns the function that turns it back to what
    it was (``jzero train`` does, when its run ends).

    JAX decides once per process whether the cache is used, at its first compilation; the
    decision is reset here, and again by the function returned."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    before = {name: getattr(jax.config, name) for name in _SETTINGS}
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    compilation_cache.reset_cache()  # re-read the settings at the next compilation
    logger.info("jzero: compiled programs are cached in %s", path)

    def restore() -> None:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()

    return restore


class CompileCounter:
    """Counts, while it is open, the programs JAX's backend produced (``programs``: compiled,
    or loaded from the persistent cache), the cache's ``hits`` and ``misses``, and so the
    programs actually compiled (``compiles``).

    A program loaded from the cache is a hit and no compilation; one compiled with the cache on
    is a miss (it is written to the cache). Use it as ``with CompileCounter() as c: ...``.
    """

    def __init__(self) -> None:
        self.programs = 0
        self.hits = 0
        self.misses = 0
        self.names: list[str] = []  # the programs' names, in order
        self.seconds = 0.0  # spent compiling or loading them

    @property
    def compiles(self) -> int:
        """The programs compiled (not loaded from the cache)."""
        return self.programs - self.hits

    def _duration(self, event: str, seconds: float, **kw: Any) -> None:
        if event == BACKEND_COMPILE:  # recorded after the program came, from the cache or not
            self.programs += 1
            self.seconds += seconds
            self.names.append(str(kw.get("fun_name", "?")))

    def _event(self, event: str, **kw: Any) -> None:
        if event == CACHE_HIT:
            self.hits += 1
        elif event == CACHE_MISS:
            self.misses += 1

    def __enter__(self) -> CompileCounter:
        from jax import monitoring

        monitoring.register_event_duration_secs_listener(self._duration)
        monitoring.register_event_listener(self._event)
        return self

    def __exit__(self, *exc: object) -> None:
        from jax import monitoring

        monitoring.unregister_event_duration_listener(self._duration)
        monitoring.unregister_event_listener(self._event)

    def as_dict(self) -> dict[str, int]:
        """``{"compiles": ..., "cache_hits": ..., "cache_misses": ...}``."""
        return {"compiles": self.compiles, "cache_hits": self.hits, "cache_misses": self.misses}
