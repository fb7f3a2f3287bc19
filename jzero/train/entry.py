"""A user's model for ``jzero train``: an entry point, ``package.module:function`` or
``path/to/file.py:function``, that returns what :func:`jzero.initialize` takes.

Decisions:

* The function is called with the config's ``model`` section as keyword arguments (less
  ``entry``), so one config holds the model's sizes beside the run's: ``model: {entry:
  mymodel.py:make, vocab_size: 256, seq_len: 128, d_model: 64}``.
* It returns a mapping of :func:`jzero.initialize`'s arguments: ``model`` (a Flax NNX module,
  or a function that builds one, a Linen or an Equinox module) or ``params`` (a pytree, or a
  function of a key), with ``loss_fn``; optionally ``optimizer`` (optax; else the config's
  ``optimizer`` section) and ``options`` (:class:`jzero.InitOptions`). A pair ``(model,
  loss_fn)`` is read as ``model`` (a pytree of arrays as ``params``).
* A file is imported as a module of its own name (its folder first on ``sys.path`` while it is
  imported, so it may import its neighbours). Every way it can be wrong is one error naming the
  entry point and the fix: no ``:``, a module or file that isn't there or fails to import, a
  missing or non-callable function, a function that fails on the section's keys, a return value
  of another kind.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax

__all__ = ["INIT_KEYS", "EntryPointError", "load_entry", "model_from_entry"]

INIT_KEYS = ("model", "params", "loss_fn", "optimizer", "options")


class EntryPointError(ValueError):
    """A model entry point (``--model`` or ``model.entry``) that can't be used."""


def _module(spec: str, where: str) -> Any:
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where).expanduser()
        if not path.is_file():
            raise EntryPointError(
                f"model entry point {spec!r}: the file {str(path)!r} does not exist. Give a "
                "path to a Python file (relative to the working directory) or a module name, "
                "then ':' and the function, e.g. mymodel.py:make."
            )
        name = f"jzero_entry_{path.stem}"
        loader_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.path.insert(0, str(path.resolve().parent))
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:
            raise EntryPointError(
                f"model entry point {spec!r}: importing {str(path)!r} failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        finally:
            sys.path.remove(str(path.resolve().parent))
        return module
    try:
        return importlib.import_module(where)
    except ImportError as e:
        raise EntryPointError(
            f"model entry point {spec!r}: the module {where!r} can't be imported ({e}). Install "
            "the package that holds it, run from its folder, or name a file: path/to/file.py:fn."
        ) from e


def load_entry(spec: str) -> Callable[..., Any]:
    """The function an entry point names (``package.module:function`` or
    ``path/to/file.py:function``).

    Raises:
      EntryPointError: the entry point is malformed, or its module or function is missing.
    """
    where, sep, name = str(spec).rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise EntryPointError(
            f"model entry point {spec!r} is not 'module:function' or 'file.py:function'. "
            "Write it as, e.g., --model mymodel.py:make or model: {entry: mypackage.models:make}."
        )
    module = _module(spec, where)
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise EntryPointError(
            f"model entry point {spec!r}: {where!r} defines no {name!r}; its functions: "
            f"{', '.join(public) or 'none'}."
        )
    if not callable(fn):
        raise EntryPointError(
            f"model entry point {spec!r}: {name!r} is a {type(fn).__name__}, not a function."
        )
    return fn


def _is_params(value: Any) -> bool:
    """Whether ``value`` is a plain pytree of arrays (parameters), not a module."""
    if not isinstance(value, dict | list | tuple):
        return False
    leaves = jax.tree.leaves(value)
    return bool(leaves) and all(hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves)


def model_from_entry(spec: str, section: Mapping[str, Any]) -> dict[str, Any]:
    """Calls the entry point with ``section`` (the config's ``model`` keys less ``entry``)
    and returns :func:`jzero.initialize`'s keyword arguments from what it gave.

    Raises:
      EntryPointError: see the module's decisions.
    """
    fn = load_entry(spec)
    kwargs = {k: v for k, v in section.items() if k != "entry"}
    try:
        out = fn(**kwargs)
    except TypeError as e:
        raise EntryPointError(
            f"model entry point {spec!r} failed when called with the config's model keys "
            f"{sorted(kwargs)}: {e}. Its parameters take the model section's keys (less entry)."
        ) from e
    if isinstance(out, tuple) and len(out) == 2 and callable(out[1]):
        model, loss_fn = out
        out = {"params" if _is_params(model) else "model": model, "loss_fn": loss_fn}
    if not isinstance(out, Mapping):
        raise EntryPointError(
            f"model entry point {spec!r} returned a {type(out).__name__}; it returns a dict of "
            "jzero.initialize's arguments, e.g. {'model': MyModel(rngs=nnx.Rngs(0)), "
            "'loss_fn': loss_fn}, or a pair (model, loss_fn)."
        )
    unknown = sorted(set(out) - set(INIT_KEYS))
    missing = "loss_fn" not in out or not ({"model", "params"} & set(out))
    if unknown or missing or {"model", "params"} <= set(out):
        extra = f"; unknown: {', '.join(unknown)}" if unknown else ""
        raise EntryPointError(
            f"model entry point {spec!r} returned the keys {sorted(out)}; it returns loss_fn "
            f"and one of model or params (optionally optimizer and options){extra}."
        )
    return dict(out)
