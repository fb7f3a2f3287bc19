"""A memory report as a figure that answers "which option fits, and by how much" at a glance.

Decisions:

* matplotlib is an optional extra: it is imported only inside :func:`plot_bars`, and its
  absence is an ``ImportError`` that names the extra to install.
* The figure is drawn on an Agg canvas, never through pyplot, so plotting opens no window and
  keeps no global figure state.
* One horizontal bar per option (a stage, an offload variant, with or without activation
  checkpointing), top to bottom in the report's order, its device bytes stacked by category;
  every category keeps one colour across the bars.
* The scale is the bars' own, so that they are never a few pixels long: the usable device
  memory (device memory less the margin) is a dashed line only where it is within 3 times
  the longest bar. Either way, the text right of each bar says
  what it needs, whether that fits and by how much (the share of the usable memory, or how much
  is missing); host memory, which the device budget does not limit, is stated there too.
* The recommended option is marked (a star on its name, bold, a black outline); the title
  names the model and the device count, the line under it the usable memory, the legend sits
  below the plot, outside the bars.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from jzero._util import format_bytes
from jzero.memory._format import GIB

__all__ = ["plot_bars"]

_BUDGET_ON_SCALE = 3.0  # the budget line is drawn within this many times the longest bar
_FITS, _SHORT = "#1a7f37", "#b42318"  # green and red text, darker than the segment colours
_ROOM = 0.58  # the longest bar (or the budget line) ends here, as a fraction of the axis


def plot_bars(
    path: str,
    title: str,
    bars: Sequence[tuple[str, Mapping[str, float], Mapping[str, float]]],
    *,
    limit: float | None = None,
    unit: tuple[str, float] = ("GiB", GIB),
    recommended: int | None = None,
    host_label: str = "host per device",
) -> Any:
    """Draws one horizontal bar per option, its device bytes stacked by category, into a PNG.

    Args:
      path: the PNG file to write.
      title: the figure title (the model and the device count).
      bars: (label, device bytes by category, host bytes by category) per option; a label
        ``"2\\noptimizer\\n+AC"`` (stage, offload, activation checkpointing, as the reports'
        ``bars()`` give them) is shown as ``stage 2, offload optimizer +AC``.
      limit: usable device memory in bytes; each bar says whether it fits.
      unit: (name, bytes) of the sizes on the axis.
      recommended: the index in ``bars`` of the recommended option, marked.
      host_label: how the text right of a bar names its host bytes.

    Returns:
      The matplotlib ``Figure`` (on an Agg canvas), for a caller that reads it back.

    Raises:
      ImportError: when matplotlib is not installed.
    """
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError(
            "Plotting needs matplotlib, which is not installed. Install it with "
            "`pip install jzero[plot]` (or `pip install matplotlib`), or leave out --plot."
        ) from e
    categories = list(dict.fromkeys(k for _, d, _ in bars for k in d))
    cmap = matplotlib.colormaps["tab10"]
    colors = {c: cmap(i % 10) for i, c in enumerate(categories)}
    totals = [sum(d.values()) for _, d, _ in bars]
    longest = max([*totals, 1.0])
    budget_drawn = limit is not None and limit <= _BUDGET_ON_SCALE * longest
    end = max(longest, limit) if budget_drawn and limit is not None else longest
    scale = unit[1]

    fig = Figure(figsize=(10.0, 1.9 + 0.42 * len(bars)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, (_, device, _) in enumerate(bars):
        left = 0.0
        for c in categories:
            value = device.get(c, 0.0) / scale
            if value > 0:
                ax.barh(i, value, 0.62, left=left, color=colors[c], edgecolor="white", lw=0.6)
                left += value
        if i == recommended:
            ax.barh(i, left, 0.62, fill=False, edgecolor="black", lw=1.8, zorder=3)
    if budget_drawn and limit is not None:
        ax.axvline(limit / scale, color="black", ls="--", lw=1.1, zorder=1)
    notes = []
    for i, (total, (_, _, host)) in enumerate(zip(totals, bars, strict=True)):
        text, color = _verdict(total, limit, unit)
        if i == recommended:
            text = "recommended: " + text
        if sum(host.values()) > 0:
            text += f"\n{host_label}: {_size(sum(host.values()), unit)}"
        note = ax.annotate(
            text,
            (total / scale, i),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=8.5,
            linespacing=1.1,
            color=color,
            fontweight="bold" if i == recommended else "normal",
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5},
            zorder=4,
        )
        notes.append((total / scale, note))
    labels = [("\u2605 " if i == recommended else "") + _label(b[0]) for i, b in enumerate(bars)]
    ax.set_yticks(range(len(bars)), labels, fontsize=9)
    if recommended is not None:
        ax.get_yticklabels()[recommended].set_fontweight("bold")
    ax.set_ylim(len(bars) - 0.5, -0.5)  # the first option on top
    ax.set_xlabel(f"{unit[0]} per device")
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(axis="x", color="0.9", lw=0.6)
    ax.set_axisbelow(True)
    handles = [Patch(facecolor=colors[c], label=c) for c in categories]
    if budget_drawn:
        handles.append(Line2D([], [], color="black", ls="--", label="usable device memory"))
    fig.suptitle(title, fontsize=10, wrap=True)
    ax.set_title(_subtitle(bars, totals, limit, unit, budget_drawn), fontsize=8.5, color="0.3")
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8.5)
    _fit_notes(fig, ax, notes, end / scale / _ROOM)
    fig.savefig(path, dpi=110)
    return fig


def _fit_notes(fig: Any, ax: Any, notes: Sequence[tuple[float, Any]], right: float) -> None:
    """Sets the x axis to end at ``right``, or further where a note right of its bar would
    run past the axis: each note keeps its width in pixels while the bars shrink."""
    for _ in range(2):  # the layout moves a little once the axis changes
        ax.set_xlim(0, right)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        width = ax.get_window_extent(renderer).width
        for x, note in notes:
            room = width - note.get_window_extent(renderer).width - 8  # 4 pt offset, margin
            right = max(right, x * width / max(room, width * 0.2))


def _size(n: float, unit: tuple[str, float]) -> str:
    """``n`` in the plot's unit, or in a larger binary unit where it would need 4 digits."""
    if n < 1000 * unit[1] or not unit[0].endswith("iB"):
        return f"{n / unit[1]:,.2f} {unit[0]}"
    return format_bytes(n, 2)


def _verdict(total: float, limit: float | None, unit: tuple[str, float]) -> tuple[str, str]:
    """The text right of a bar, and its colour."""
    need = _size(total, unit)
    if limit is None:
        return need, "black"
    if total <= limit:
        share = total / limit
        percent = "<1%" if 0 < share < 0.005 else f"{share:.0%}"
        return f"fits: {need} of {_size(limit, unit)}, {percent}", _FITS
    over = _size(total - limit, unit)
    return f"does not fit: {need}, {over} over {_size(limit, unit)}", _SHORT


def _label(label: str) -> str:
    """``"2\\noptimizer\\n+AC"`` as ``stage 2, offload optimizer +AC``; other labels as given,
    one line."""
    first, *rest = label.split("\n")
    if not first.isdigit():
        return ", ".join(label.split("\n"))
    out = f"stage {first}"
    for part in rest:
        if part == "+AC":
            out += " +AC"
        elif part not in ("none", "no AC"):
            out += f", offload {part}"
    return out


def _subtitle(
    bars: Sequence[tuple[str, Mapping[str, float], Mapping[str, float]]],
    totals: Sequence[float],
    limit: float | None,
    unit: tuple[str, float],
    budget_drawn: bool,
) -> str:
    """The line under the title: the usable memory and where it is, whether anything fits,
    and what +AC means."""
    parts = []
    if limit is not None:
        usable = f"usable device memory {_size(limit, unit)} per device"
        if budget_drawn:
            parts.append(f"{usable} (dashed line)")
        else:
            parts.append(f"{usable}, {limit / max(totals):,.0f}x the longest bar: off this scale")
    if any("+AC" in b[0].split("\n") for b in bars):
        parts.append("+AC: with activation checkpointing")
    text = textwrap.fill("; ".join(parts), 100)
    if limit is not None and min(totals) > limit:
        text += f"\nno option fits: the smallest is {_size(min(totals) - limit, unit)} over"
    return text
