"""A run's record: ``metrics.jsonl`` lines and ``summary.json`` as strict JSON, and the few
lines and the exit status ``jzero train`` ends with.

Decisions:

* Strict JSON: NaN and infinities are ``null`` (JSON has neither), in every line and the summary.
* The exit status says how the run ended as a shell would: 1 for failed checkpoints or inf/NaN
  gradients, 128 + the signal's number for a run a signal stopped (130 Ctrl-C, 143 SIGTERM).
"""

from __future__ import annotations

import json
import math
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jzero._util import format_bytes

__all__ = [
    "METRICS",
    "SUMMARY",
    "ending",
    "exit_code",
    "format_summary",
    "json_safe",
    "strict_json",
]

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as ``None`` (JSON has no NaN or Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def strict_json(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of ``value`` with NaN and infinities as ``null``, as the run writes them.

    Args:
      value: a JSON-serialisable value (a metrics record, the summary).
      **kwargs: passed to ``json.dumps`` (``indent``, ...).
    """
    return json.dumps(json_safe(value), allow_nan=False, **kwargs)


def ending(summary: Mapping[str, Any]) -> str:
    """How a run ended, the first word of ``jzero train``'s summary: ``failed`` (its
    checkpoints), ``interrupted`` (a signal), ``stopped`` (inf/NaN gradients) or ``done``."""
    if summary.get("checkpoint_error"):
        return "failed"
    if summary["interrupted"]:
        return "interrupted"
    return "stopped" if summary["stopped"] else "done"


def _format_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _loss(value: float | None) -> str:
    return "NaN" if value is None else f"{value:.4f}"


def format_summary(summary: Mapping[str, Any]) -> str:
    """The few lines ``jzero train`` ends with, on stdout: how the run ended, then its figures,
    each named (the full record is ``summary.json``).

    Args:
      summary: what :func:`jzero.fit` or :func:`jzero.train.run` returned.
    """
    last, resumed = summary["steps"], summary.get("resumed_from")
    first = (resumed or 0) + 1
    ran = last - first + 1
    where = f"ZeRO stage {summary['stage']}, {summary['devices']} devices"
    if ran <= 0:
        what = "nothing trained" + (
            f": checkpoint {resumed} is at or past the last step" if resumed is not None else ""
        )
    else:
        what = f"trained steps {first}-{last} in {_format_seconds(summary['seconds'])}"
        if resumed is not None:
            what += f", resumed from checkpoint {resumed}"
    head = ending(summary)
    if head == "interrupted":
        what = f"{summary.get('signal') or 'SIGINT'} after step {last}; {what}"
    lines = [f"{head}: {what} ({where})"]
    for reason in (summary["stopped"], summary.get("checkpoint_error")):
        if reason:
            lines.append(f"  why:        {reason}")
    if ran > 0:
        loss = f"{_loss(summary['final_loss'])} at step {last} (training batch)"
        if summary.get("eval_loss") is not None or summary.get("first_eval_loss") is not None:
            loss += f"; eval loss {_loss(summary['eval_loss'])}"
            loss += f" ({_loss(summary['first_eval_loss'])} at step {first - 1})"
        lines.append(f"  loss:       {loss}")
        rate = (  # tokens where the run knows them (engine.tokens_per_sample), else samples
            f"{summary['tokens_per_s']:,.0f} tokens/s"
            if summary.get("tokens_per_s") is not None
            else f"{summary.get('samples_per_s') or 0:,.1f} samples/s"
        )
        speed = f"{rate}, this run's average ({ran} step(s); evaluations and compiling included)"
        if summary.get("mfu") is not None:
            speed += f"; MFU {100 * summary['mfu']:.1f}% (mean after the first step)"
        lines.append(f"  throughput: {speed}")
        if summary.get("skipped_steps"):
            lines.append(
                f"  skipped:    {summary['skipped_steps']} update(s), for inf/NaN gradients"
            )
    lines.append(
        f"  memory:     peak {format_bytes(summary['peak_bytes_per_device'])} per device "
        f"(model state {format_bytes(summary['model_state_bytes_per_device'])})"
    )
    metrics = Path(summary["metrics"])
    lines.append(f"  logs:       {metrics} (a line per step), {metrics.parent / SUMMARY}")
    directory, step = summary.get("checkpoint_directory"), summary.get("last_checkpoint")
    if not directory:
        saved = "none (the config sets no checkpoint.directory)"
    elif step is None:
        saved = f"none committed in {directory}"
    else:
        saved = f"step {step} in {directory}"
    lines.append(f"  checkpoint: {saved}")
    return "\n".join(lines)


def exit_code(summary: Mapping[str, Any]) -> int:
    """The exit status ``jzero train`` ends with for a summary :func:`jzero.fit` returned.

    Returns:
      1 for a run whose checkpoints failed (``checkpoint_error``: its final save, or too many
      saves in a row); 128 + the signal's number for an interrupted run (130 for Ctrl-C, 143
      for SIGTERM), as a shell reports a process the signal ended; 1 for a run stopped by
      inf/NaN gradients; else 0.
    """
    if summary.get("checkpoint_error"):
        return 1
    if summary["interrupted"]:
        return 128 + int(signal.Signals[summary.get("signal") or "SIGINT"])
    return 1 if summary["stopped"] else 0
