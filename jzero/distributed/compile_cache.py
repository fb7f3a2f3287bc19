"""JAX's persistent compilation cache for jzero's programs, and counting compilations.

A run pays for its compilations at every start: every restart after preemption, every
resumed job. With the cache on, a second process running the same config loads each program
from disk instead of compiling it (``jzero train`` turns it on: ``train.compile_cache``).

Decisions:

* The directory is ``train.compile_cache``; ``"auto"`` (the default) is a cache folder, never
  the checkpoint volume (often a network or quota'd file system, whose space the checkpoints
  need): ``$JAX_COMPILATION_CACHE_DIR`` when JAX's own variable is set, else
  ``$XDG_CACHE_HOME/jzero/compile_cache``, else ``~/.cache/jzero/compile_cache``; ``null``
  turns it off. Runs share it: it is keyed by the program's hash, so they only ever reuse
  identical programs.
* **The cache is an optimisation, never a failure.** A cache folder that can't be made, and
  entries JAX can't write or read (a full disk, a quota), are one jzero warning for the run;
  the run goes on compiling what it can't load. JAX reports each such entry as a warning of its
  own, which a ``-W error`` or pytest's ``filterwarnings = error`` would turn into an
  exception inside a compilation: while the cache is on, those warnings are always shown,
  and shown as that one line.
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
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["CompileCounter", "compile_cache_dir", "default_cache_dir", "enable_compile_cache"]

logger = logging.getLogger(__name__)

AUTO = "auto"
_DIR_NAME = "compile_cache"
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"
CACHE_MISS = "/jax/compilation_cache/cache_misses"
# The warnings JAX gives for a cache entry it could not read or write (it compiles instead).
_CACHE_TROUBLE = r"Error (reading|writing) persistent compilation cache entry"


def default_cache_dir() -> Path:
    """Where ``train.compile_cache: auto`` keeps compiled programs (see the decisions)."""
    jax_own = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if jax_own:
        return Path(os.path.expanduser(jax_own))
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path(os.path.expanduser("~")) / ".cache"
    return base / "jzero" / _DIR_NAME


def compile_cache_dir(setting: str | None) -> Path | None:
    """The cache directory ``train.compile_cache`` asks for (``"auto"``: :func:`default_cache_dir`;
    a path, ``~`` expanded), or ``None`` (off)."""
    if setting is None:
        return None
    if setting == AUTO:
        return default_cache_dir()
    return Path(os.path.expanduser(setting))


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
    decision is reset here, and again by the function returned. A folder that can't be made
    leaves the cache off, and entries JAX can't write or read are compiled as usual: each is
    one warning for the run, never an error (see the decisions)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        logger.warning(
            "jzero: the compile cache folder %s can't be made (%s); this run compiles every "
            "program. Set train.compile_cache to a folder you can write, or null.",
            path,
            e.strerror or e,
        )
        return lambda: None
    before = {name: getattr(jax.config, name) for name in _SETTINGS}
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    compilation_cache.reset_cache()  # re-read the settings at the next compilation
    logger.info("jzero: compiled programs are cached in %s", path)
    unquiet = _one_warning_for_cache_trouble(path)

    def restore() -> None:
        unquiet()
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()

    return restore


def _one_warning_for_cache_trouble(path: Path) -> Callable[[], None]:
    """Shows JAX's warnings about cache entries it could not write or read as one jzero warning
    (the first; the others at debug level), whatever the warning filters say; returns the
    function that puts the previous handling back."""
    previous = warnings.showwarning
    seen = []

    def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        text = str(message)
        if not re.match(_CACHE_TROUBLE, text):
            previous(message, category, *args, **kwargs)
            return
        if not seen:
            logger.warning(
                "jzero: the compile cache in %s can't be used (%s); the run goes on, compiling "
                "what it can't keep or load there (further cache errors are not shown). Free "
                "space there, or set train.compile_cache to another folder or null.",
                path,
                text.split(": ", 1)[-1][:300],
            )
        else:
            logger.debug("jzero: compile cache: %s", text)
        seen.append(text)

    warnings.showwarning = show
    warnings.filterwarnings("always", message=_CACHE_TROUBLE)  # ahead of any "error" filter
    entry = warnings.filters[0]

    def unquiet() -> None:
        if warnings.showwarning is show:
            warnings.showwarning = previous
        if entry in warnings.filters:
            warnings.filters.remove(entry)
            getattr(warnings, "_filters_mutated", lambda: None)()  # drop the filters' cache

    return unquiet


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
