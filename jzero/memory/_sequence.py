"""Long sequences: a transformer's activations per device with each long-context technique
added in turn, and the longest sequence that fits the device beside the model states.

Decisions:

* The rows add one technique each to the one above (:func:`sequence_report`): plain attention;
  blockwise attention (no ``[s, s]`` scores); the tiled loss and MLP (one chunk of the logits
  and of the MLP's intermediate); ring attention over the layout's ``context`` axis C (only
  when C > 1); activation offload (the checkpointed layer inputs in host memory, so only with
  checkpointing). The rows before the ring's run on the layout with ``context`` 1 (each device
  keeps its ``b`` rows of the whole sequence); dropout, the Ulysses split S, the model axis and
  the pipeline are the layout's in every row.
* Each row's bytes come from :func:`jzero.costs.activation_bytes`, without checkpointing and
  with ``full``; the totals add the model states of one ZeRO stage without offload (3 by
  default, the least of them), which do not change with the sequence length.
* The longest sequence that fits (with a device memory): the largest multiple of the layout's
  step (:func:`jzero.costs.sequence_step`: S, times 2C under the ring's zig-zag) whose total
  is within the usable memory, by bisection (:func:`jzero.costs.longest_sequence`); the next
  step does not fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jzero import costs
from jzero.costs import ModelShape, ParallelDims, Techniques
from jzero.memory._format import GIB, render_columns

__all__ = ["SequenceReport", "SequenceRow", "sequence_report"]

_CHUNK = 1024
"""The tiled loss's and MLP's chunk of tokens when the model's techniques name none (the built-in
GPT's ``loss_chunk`` default)."""
_DASH = "-"


@dataclass(frozen=True)
class SequenceRow:
    """One row of :class:`SequenceReport`: a set of techniques and what it keeps."""

    label: str
    """What the row adds, e.g. ``+ blockwise attention``."""
    model: ModelShape
    """The model with the row's :class:`~jzero.costs.Techniques`."""
    layout: ParallelDims
    """The layout of the row (``context`` 1 before the ring's row)."""
    activations: float | None
    """Device bytes without checkpointing; ``None`` where the row needs it (offload)."""
    activations_checkpointed: float
    """Device bytes with full activation checkpointing."""
    host: float
    """Host bytes a device's offloaded layer inputs take (with checkpointing)."""
    longest: int | None = None
    """The longest sequence that fits without checkpointing (``None``: no device memory, or
    the row needs checkpointing)."""
    longest_checkpointed: int | None = None
    """The longest sequence that fits with full checkpointing."""


@dataclass(frozen=True)
class SequenceReport:
    """The result of :func:`sequence_report`; ``table()`` prints it."""

    rows: tuple[SequenceRow, ...]
    model: ModelShape
    layout: ParallelDims
    dtype: str
    stage: int
    states: float
    """Model-state bytes a device holds at :attr:`stage` without offload."""
    usable: float | None = None
    """Device bytes usable (device memory less the margin); ``None``: not given."""

    def row(self, label_start: str) -> SequenceRow:
        """The first row whose label starts with ``label_start`` (e.g. ``"+ ring"``)."""
        for r in self.rows:
            if r.label.startswith(label_start):
                return r
        raise KeyError(
            f"No row starts with {label_start!r}; the rows are "
            f"{', '.join(repr(r.label) for r in self.rows)}."
        )

    def table(self) -> str:
        """The rows as text, with what each counts."""
        m, lay = self.model, self.layout
        fits = self.usable is not None

        def gb(value: float | None, add: float = 0.0) -> str:
            return _DASH if value is None else f"{(value + add) / GIB:.2f}"

        def length(value: int | None) -> str:
            return _DASH if value is None else (f"{value:,}" if value else "none")

        header = ["technique", "act GiB", "act AC GiB", "host AC GiB", "total GiB", "total AC GiB"]
        header += ["longest s", "longest s AC"] if fits else []
        rows = []
        for r in self.rows:
            cells = [r.label, gb(r.activations), gb(r.activations_checkpointed), gb(r.host)]
            cells += [gb(r.activations, self.states), gb(r.activations_checkpointed, self.states)]
            if fits:
                cells += [length(r.longest), length(r.longest_checkpointed)]
            rows.append(cells)
        vocab = f"V = {m.vocab}" if m.vocab else "V not given (logits not counted)"
        split = f"T = {lay.model}, S = {lay.seq}" + (f", P = {lay.pipe}" if lay.pipe > 1 else "")
        lines = [
            f"Long sequences, activations per device by technique: s = {m.seq_len:,}, "
            f"b = {lay.micro_batch}, h = {m.hidden}, L = {m.layers}, a = {m.heads}, {vocab}, "
            f"{self.dtype}, {split}, dropout {'on' if m.techniques.dropout else 'off'}; "
            "GiB = 2^30 bytes",
            *render_columns(header, rows, (0,)),
            f"total: + the model states of ZeRO stage {self.stage} without offload, "
            f"{self.states / GIB:.2f} GiB a device; AC: full activation checkpointing (each "
            "layer's input kept, one layer rebuilt in the backward pass).",
            "plain: the softmax's [s, s] scores a head kept (Korthikanti et al. 2022); "
            "blockwise: none, a float32 log-sum-exp a head and token;",
            "  tiled loss: one chunk of the float32 [s, V] logits; tiled MLP: the [s, 4h] "
            "intermediate recomputed chunk by chunk (one chunk live);",
            "  ring: every term's tokens / C (the context axis), blockwise by construction; "
            "offload (cpu_checkpointing): the layer inputs in host memory, one on the device.",
        ]
        if fits:
            step = costs.sequence_step(self.rows[-1].layout)
            lines.append(
                f"longest s: the largest multiple of the layout's step (S, x 2C with the ring: "
                f"{step} for the last row) whose total fits in {self.usable / GIB:.2f} GiB "
                "usable; the next step does not (the host's memory is not bounded)."
            )
        return "\n".join(lines)


def _rows(model: ModelShape, layout: ParallelDims) -> list[tuple[str, Techniques, int]]:
    """(label, techniques, context) of each row, each adding one technique to the last."""
    t = model.techniques
    loss = t.loss_chunk or _CHUNK
    mlp = t.mlp_chunk or _CHUNK
    plain = Techniques("plain", dropout=t.dropout)
    blockwise = dataclasses.replace(plain, attention="blockwise")
    tiled = dataclasses.replace(blockwise, loss_chunk=loss, mlp_chunk=mlp)
    out = [
        ("plain attention", plain, 1),
        ("+ blockwise attention", blockwise, 1),
        (f"+ tiled loss ({loss}) and MLP ({mlp})", tiled, 1),
    ]
    c = layout.context
    if c > 1:
        out.append((f"+ ring attention over C = {c}", tiled, c))
    out.append(("+ activation offload", dataclasses.replace(tiled, offload=True), c))
    return out


def sequence_report(
    model: ModelShape,
    layout: ParallelDims,
    *,
    states: float,
    stage: int = 3,
    usable: float | None = None,
    dtype: str = "bf16",
    in_flight: float = 1.0,
) -> SequenceReport:
    """Activations per device with each long-context technique added in turn, and with
    ``usable`` the longest sequence that fits beside ``states`` bytes of model states.

    Args:
      model: the transformer (``seq_len``, ``hidden``, ``layers``, ``heads``, ``vocab``, its
        techniques' dropout and chunk sizes: 1024 tokens where they name none), checked by
        :func:`jzero.memory.estimate`.
      layout: its micro batch and axes (``model``, ``seq``, ``context``, ``pipe``).
      states: model-state bytes a device holds, added to every total.
      stage: the ZeRO stage those states are of (for the table).
      usable: device bytes usable; with it each row's longest sequence.
      dtype: the activations' dtype.
      in_flight: micro-batches a pipeline stage holds.

    Returns:
      A :class:`SequenceReport`; ``print(report.table())``.
    """
    rows = []
    for label, techniques, c in _rows(model, layout):
        at = dataclasses.replace(layout, context=c)
        row_model = dataclasses.replace(model, techniques=techniques)

        def need(s: int, ac: bool, m: ModelShape = row_model, lay: ParallelDims = at) -> float:
            ckpt = "full" if ac else "none"
            sized = dataclasses.replace(m, seq_len=s)
            out = costs.activation_bytes(
                sized, lay, checkpointing=ckpt, dtype=dtype, in_flight=in_flight
            )
            return out.device

        full = costs.activation_bytes(
            row_model, at, checkpointing="full", dtype=dtype, in_flight=in_flight
        )
        without = None if techniques.offload else need(model.seq_len, False)
        longest = longest_ac = None
        if usable is not None:
            budget, step = usable - states, costs.sequence_step(at)
            longest_ac = costs.longest_sequence(lambda s, n=need: n(s, True), budget, step)
            if without is not None:
                longest = costs.longest_sequence(lambda s, n=need: n(s, False), budget, step)
        rows.append(
            SequenceRow(label, row_model, at, without, full.device, full.host, longest, longest_ac)
        )
    return SequenceReport(tuple(rows), model, layout, dtype, stage, states, usable)
