"""Stacked bars of a memory report: one device bar (solid) and one host bar (hatched) per option.

Decisions:

* matplotlib is an optional extra: it is imported only inside :func:`plot_bars`, and its
  absence is an ``ImportError`` that names the extra to install.
* The figure is drawn on an Agg canvas, never through pyplot, so plotting opens no window and
  keeps no global figure state.
* Every category gets one colour across all bars; the usable device memory (device memory less
  the margin) is a dashed black line (red is a category's colour).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jzero.memory._format import GB

__all__ = ["plot_bars"]


def plot_bars(
    path: str,
    title: str,
    bars: Sequence[tuple[str, Mapping[str, float], Mapping[str, float]]],
    *,
    limit: float | None = None,
    unit: tuple[str, float] = ("GB", GB),
) -> None:
    """Draws one stacked device bar (solid) and one host bar (hatched) per option into a PNG.

    Args:
      path: the PNG file to write.
      title: the figure title.
      bars: (label, device bytes by category, host bytes by category) per option.
      limit: usable device memory in bytes, drawn as a dashed line.
      unit: (name, bytes) of the y axis unit.

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
    categories = list(dict.fromkeys(k for _, d, h in bars for k in (*d, *h)))
    cmap = matplotlib.colormaps["tab10"]
    colors = {c: cmap(i % 10) for i, c in enumerate(categories)}
    fig = Figure(figsize=(max(6.0, 1.2 * len(bars) + 3), 4.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.38
    for i, (_, device, host) in enumerate(bars):
        for offset, parts, hatch in ((-width / 2, device, ""), (width / 2, host, "//")):
            bottom = 0.0
            for c in categories:
                value = parts.get(c, 0.0) / unit[1]
                if value > 0:
                    ax.bar(
                        i + offset,
                        value,
                        width,
                        bottom=bottom,
                        color=colors[c],
                        hatch=hatch,
                        edgecolor="black",
                        linewidth=0.4,
                    )
                    bottom += value
    handles = [Patch(facecolor=colors[c], edgecolor="black", label=c) for c in categories]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="host memory"))
    if limit is not None:
        ax.axhline(limit / unit[1], color="black", linestyle="--")
        handles.append(Line2D([], [], color="black", linestyle="--", label="usable device memory"))
    ax.set_xticks(range(len(bars)), [label for label, _, _ in bars])
    ax.set_xlabel("ZeRO stage / offload (left bar: device, right bar: host)")
    ax.set_ylabel(f"{unit[0]} per device (host: as listed)")
    ax.set_title(title, fontsize=9)
    ax.legend(handles=handles, fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
