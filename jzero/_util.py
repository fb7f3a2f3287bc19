"""The helpers several packages share, written once: leaf paths, abstract trees, sizes, files.

Import direction: this module imports nothing of jzero's, and JAX only inside the functions
that need it (:mod:`jzero.weights.format` and the export writer stay free of JAX); every
package may import it. It holds only what has no better home: a helper that belongs to one
concern lives in that concern's package (the multi-process barrier is
:func:`jzero.distributed.barrier`, the safetensors checks :mod:`jzero.weights.format`'s).

Decisions:

* **Dotted leaf paths** (:func:`dotted`) are ``jax.tree_util.keystr(path, simple=True,
  separator=".")``: ``blocks.0.w`` for ``{"blocks": [{"w": ...}]}``, as checkpoints, exports,
  errors and log lines name a leaf. :func:`path_parts` keeps the parts (list indices as ints).
* **Abstract trees** (:func:`abstract_tree`): ``jax.ShapeDtypeStruct`` per leaf. ``weak_type`` is
  kept only when asked (the replay traces a loss with the weak types it was given; the engine
  plans concrete parameters, whose leaves are never weakly typed).
* **Traced, not run** (:func:`under_trace`): a helper that calls ``jnp`` eagerly (optax's
  ``tree_map_params`` initialises the optimizer on placeholders) runs under ``jax.make_jaxpr``,
  so its array operations join a trace that is thrown away instead of each compiling a
  program of its own (the first step's compilation count, :mod:`tests.test_compile_count`).
* **Creators are recognised by kind, never by** ``callable()`` (:func:`is_creator`): a
  function, a method, a ``functools.partial`` or a class makes parameters or a model; any
  other object, however callable (an Equinox module is a callable pytree), is a value.
* **Sizes in**: a number of bytes, or a number with a unit: ``B``, ``KB`` ... ``TB`` (powers of
  1000, as Hugging Face and DeepSpeed read ``5GB``) or ``KiB`` ... ``TiB`` (powers of 1024),
  any case, spaces allowed around the unit. :func:`read_size` returns ``None`` for anything
  else, so each caller keeps its own error message. **Sizes out** (:func:`format_bytes`):
  powers of 1024, ``123.4 GiB``.
* **Free space** (:func:`free_bytes`) is what an unprivileged writer may still use on the file
  system holding a path (``statvfs``'s ``f_bavail``, as ``df`` shows it), read at the nearest
  existing folder, so a directory not made yet is measured on the disk it will be made on. The
  NVMe tier checks it before it creates its files, a checkpoint before each save.
* **Files are replaced whole** (:func:`write_atomic`): written to a fresh file created
  exclusively beside the target (``.<name>.<random>.partial``; a pre-existing file or symlink
  there is never written through), with the permissions a plain ``open`` would give, then
  ``os.replace``-d onto the target; a failed write removes only its own file. The NVMe store
  keeps its own writer (its files are fsync'ed, kept out of the page cache and recognised
  by name when a run is cleaned up: :mod:`jzero.nvme.file_format`).
* **Packages load their names on first use** (:func:`lazy_exports`, PEP 562): ``import jzero``
  and the ``jzero`` command import no JAX, Flax, Optax or Orbax until a name that needs them
  is read. A package's ``__init__`` keeps its ``__all__`` and a table of where each public name
  lives; the same imports stand under ``if TYPE_CHECKING:`` for type checkers and for the
  house rules that read imports from the source (tests/project/test_house.py checks that the
  two agree). A submodule not in the table is imported when read as an attribute
  (``jzero.checkpoint`` after ``import jzero``).
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import shutil
import sys
import tempfile
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

__all__ = [
    "abstract_tree",
    "byte_unit",
    "dotted",
    "format_bytes",
    "free_bytes",
    "divisors",
    "is_creator",
    "lazy_exports",
    "path_parts",
    "read_size",
    "write_atomic",
]

# -- packages --------------------------------------------------------------------------------------


def lazy_exports(
    package: str, names: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's module-level ``__getattr__`` and ``__dir__`` (PEP 562) that import each
    public name the first time it is read, then keep it in the package's namespace.

    Args:
      package: the package's ``__name__``.
      names: each public name and where it lives, as the import it stands for:
        ``"jzero.engine.Engine"`` is ``from jzero.engine import Engine``; a module's own path
        (``"jzero.parallel.expert"``) gives the module.

    Returns:
      ``(__getattr__, __dir__)``: ``__getattr__`` raises ``AttributeError`` for a name that
      is neither in ``names`` nor a submodule of the package; ``__dir__`` lists the package's
      names with the ones not read yet.
    """

    def load(name: str) -> Any:
        target = names.get(name)
        if target is None:
            if name.startswith("__"):
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            return _submodule(package, name)
        module, _, attribute = target.rpartition(".")
        if module == package:  # the package's own submodule: no lookup on the package itself
            value = importlib.import_module(target)
        else:
            parent = importlib.import_module(module)
            try:
                value = getattr(parent, attribute)
            except AttributeError:  # a submodule its package has not imported
                value = importlib.import_module(target)
        setattr(sys.modules[package], name, value)
        return value

    def listing() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return load, listing


def _submodule(package: str, name: str) -> types.ModuleType:
    """``package.name`` imported, or ``AttributeError`` when there is no such module."""
    try:
        return importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{package}.{name}":
            raise  # the submodule exists and failed to import one of its own imports
        raise AttributeError(f"module {package!r} has no attribute {name!r}") from None


# -- leaf paths ----------------------------------------------------------------------------------


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending: the sizes an error can offer for an axis
    that must split ``n`` heads, tokens or rows evenly."""
    return [d for d in range(1, int(n) + 1) if n % d == 0]


def is_creator(x: Any) -> bool:
    """Whether ``x`` is something that *makes* a value when called (a function, method,
    ``functools.partial`` or class), not a value that happens to be callable (an Equinox
    module, a callable dataclass registered as a pytree)."""
    kinds = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)
    return isinstance(x, (*kinds, type))


def dotted(path: tuple[Any, ...]) -> str:
    """A ``jax.tree_util`` key path as dotted text: ``blocks.0.w`` (empty for the root)."""
    import jax

    return jax.tree_util.keystr(path, simple=True, separator=".")


def path_parts(path: tuple[Any, ...]) -> tuple[str | int, ...]:
    """A ``jax.tree_util`` key path as plain parts: list indices as ints, dict keys as strings,
    anything else (an attribute) as its dotted text."""
    import jax

    out: list[str | int] = []
    for k in path:
        if isinstance(k, jax.tree_util.SequenceKey):
            out.append(k.idx)
        elif isinstance(k, jax.tree_util.DictKey):
            out.append(str(k.key))
        else:
            out.append(jax.tree_util.keystr((k,), simple=True, separator="."))
    return tuple(out)


# -- abstract trees ------------------------------------------------------------------------------


def abstract_tree(tree: Any, *, weak_type: bool = False) -> Any:
    """``tree`` with each leaf as a ``jax.ShapeDtypeStruct`` of its shape and dtype (a Python
    scalar's dtype is numpy's); with ``weak_type`` each leaf's weak type is kept too."""
    import jax
    import numpy as np

    def one(x: Any) -> Any:
        dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
        if weak_type:
            return jax.ShapeDtypeStruct(
                tuple(np.shape(x)), dtype, weak_type=getattr(x, "weak_type", False)
            )
        return jax.ShapeDtypeStruct(tuple(np.shape(x)), dtype)

    return jax.tree.map(one, tree)


def under_trace(fn: Callable[[], Any]) -> Any:
    """``fn()``, run under a trace that is thrown away: eager ``jnp`` operations inside it
    compile nothing. What it returns must not hold the trace's values (shardings, shapes)."""
    import jax

    out: list[Any] = []
    jax.make_jaxpr(lambda: out.append(fn()) or ())()
    return out[0]


# -- sizes ---------------------------------------------------------------------------------------

SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def read_size(value: Any) -> float | None:
    """Bytes from a number or from text such as ``5GB``, ``500 MiB`` or ``8e10``; ``None`` when
    ``value`` is neither (the caller says what it expected). No check of sign or finiteness."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if hasattr(value, "dtype") and getattr(value, "shape", None) == ():  # a numpy scalar
        return float(value)
    if isinstance(value, str) and (m := _SIZE.fullmatch(value)):
        unit = SIZE_UNITS.get(m.group(2).lower())
        return None if unit is None else float(m.group(1)) * unit
    return None


def byte_unit(n: float) -> tuple[str, int]:
    """The largest of ``TiB``, ``GiB``, ``MiB``, ``KiB`` not above ``n`` (else ``B``), and its
    size."""
    for name, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return name, size
    return "B", 1


def format_bytes(n: float, digits: int | None = None, unit: tuple[str, int] | None = None) -> str:
    """Bytes for people: ``123.4 GiB``, ``512 B``; with ``digits``, that many decimals in every
    unit (``512.00 B``), and with ``unit`` (from :func:`byte_unit`) always that unit."""
    name, size = byte_unit(n) if unit is None else unit
    if digits is None:
        return f"{int(n)} B" if name == "B" else f"{n / size:.1f} {name}"
    return f"{n / size:.{digits}f} {name}"


# -- files ---------------------------------------------------------------------------------------


def free_bytes(path: str | os.PathLike) -> int:
    """The bytes this process may still write on the file system holding ``path`` (measured at
    its nearest existing folder when ``path`` does not exist yet; see the module's decisions)."""
    where = Path(path).expanduser().absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    return shutil.disk_usage(where).free


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def write_atomic(
    path: str | os.PathLike, write: Callable[[IO[Any]], None], *, text: bool = False
) -> Path:
    """Writes ``path`` whole or not at all: ``write(f)`` fills a fresh file beside it, which
    then replaces ``path`` (see the module's decisions). Returns ``path``."""
    out = Path(path)
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial")
    tmp = Path(name)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # the permissions a plain open() would give
        with os.fdopen(fd, "w" if text else "wb") as f:
            write(f)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
