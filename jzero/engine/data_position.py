"""The data position a checkpoint carries: ``engine.data_iterator``'s state, written in the
same atomic save as the model, and put back into it by a restore.

Decisions:

* Two protocols: jzero's own (``state()`` / ``restore(state)``, a JSON value) and Grain's
  (``get_state()`` / ``set_state(state)``: a ``DataLoader``'s iterator gives JSON bytes, a
  ``DatasetIterator`` a dict). An iterator with both is saved by jzero's.
* The checkpoint's meta (JSON, the save's own item) holds it: ``data`` for jzero's protocol,
  ``data_grain`` for Grain's (bytes as text, or base64 where they are no UTF-8), so a restore
  knows which call puts it back, and ``jzero checkpoint inspect`` shows either.
* A restore into an iterator of the other protocol, or of none, is a clear error: training on
  would silently read the data from its beginning again.
"""

from __future__ import annotations

import base64
from typing import Any

__all__ = ["protocol", "restore_position", "saved_position"]


def protocol(iterator: Any) -> str | None:
    """``"jzero"`` (``state``/``restore``), ``"grain"`` (``get_state``/``set_state``) or
    ``None`` (no position can be saved: a generator, a list's iterator)."""
    if callable(getattr(iterator, "state", None)) and callable(getattr(iterator, "restore", None)):
        return "jzero"
    if callable(getattr(iterator, "get_state", None)) and callable(
        getattr(iterator, "set_state", None)
    ):
        return "grain"
    return None


def saved_position(iterator: Any) -> dict[str, Any]:
    """The meta entries that hold ``iterator``'s position (none without an iterator)."""
    kind = protocol(iterator)
    if kind == "jzero":
        return {"data": iterator.state()}
    if kind == "grain":
        state = iterator.get_state()
        if isinstance(state, bytes):
            try:
                return {"data_grain": {"text": state.decode("utf-8")}}
            except UnicodeDecodeError:
                return {"data_grain": {"base64": base64.b64encode(state).decode("ascii")}}
        return {"data_grain": {"value": state}}
    return {}


def restore_position(iterator: Any, meta: dict[str, Any]) -> bool:
    """Puts the position saved in ``meta`` back into ``iterator``; whether one was restored.

    Raises:
      ValueError: the checkpoint holds a position of the other protocol than ``iterator``'s.
    """
    kind = protocol(iterator)
    saved = "jzero" if meta.get("data") is not None else None
    saved = "grain" if meta.get("data_grain") is not None else saved
    if iterator is None or saved is None:
        return False
    if kind != saved:
        have = {"jzero": "state()/restore()", "grain": "get_state()/set_state() (Grain)"}
        raise ValueError(
            f"The checkpoint holds a data position saved through {have[saved]}, but "
            f"engine.data_iterator ({type(iterator).__name__}) has "
            f"{have[kind] if kind else 'neither protocol'}: the run would read its data from "
            "the beginning again. Set engine.data_iterator to an iterator of the kind the run "
            "saved (the same pipeline), or to None to restore without a data position."
        )
    if kind == "jzero":
        iterator.restore(meta["data"])
        return True
    entry = meta["data_grain"]
    if "text" in entry:
        iterator.set_state(entry["text"].encode("utf-8"))
    elif "base64" in entry:
        iterator.set_state(base64.b64decode(entry["base64"]))
    else:
        iterator.set_state(entry["value"])
    return True
