"""The names of ``activation_checkpointing.policy`` and how a value is read.

The meaning of each policy, and the :class:`jzero.rewrite.RematPolicy` the replay acts on, are
in :mod:`jzero.rewrite.remat`; this module holds only the names, so the config validates a value
against the same table the replay reads.

Decisions:

* A value is one of :data:`POLICIES` (any case, surrounding spaces ignored) or ``names:a,b``,
  the ``checkpoint_name`` tags to save; anything else is an error that names the allowed
  values and, for a near miss, the closest one.
"""

from __future__ import annotations

import difflib

__all__ = ["ALLOWED", "NAMES", "POLICIES", "parse_policy_text"]

# policy name -> the attribute of ``jax.checkpoint_policies`` (None: no checkpoint at all).
POLICIES: dict[str, str | None] = {
    "none": None,
    "full": "nothing_saveable",
    "dots": "dots_saveable",
    "dots_no_batch": "dots_with_no_batch_dims_saveable",
}
NAMES = "names:"
ALLOWED = ", ".join(POLICIES) + ", or names:a,b (values the model named with checkpoint_name)"


def parse_policy_text(text: str | None) -> tuple[str, tuple[str, ...]] | None:
    """Reads an ``activation_checkpointing.policy`` value.

    Args:
      text: a policy name, ``names:a,b``, or ``None`` (jzero's default).

    Returns:
      ``(kind, names)``: ``kind`` one of :data:`POLICIES` or ``"names"``, ``names`` the tags
      of a ``names:`` policy (else empty); ``None`` for ``None``.

    Raises:
      ValueError: for an unknown policy, naming the allowed values.
    """
    if text is None:
        return None
    if not isinstance(text, str):
        raise ValueError(f"{text!r} is not a policy; it must be one of {ALLOWED}.")
    norm = text.strip()
    if norm.lower() in POLICIES:
        return norm.lower(), ()
    if norm.lower().startswith(NAMES):
        names = tuple(n.strip() for n in norm[len(NAMES) :].split(",") if n.strip())
        if not names:
            raise ValueError(
                f"{text!r} names no value; write names: followed by the checkpoint_name tags to "
                "save, e.g. names:attn_out,mlp_out."
            )
        return "names", names
    close = difflib.get_close_matches(norm.lower(), [*POLICIES, NAMES], n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ValueError(f"{text!r} is not a policy{hint}; it must be one of {ALLOWED}.")
