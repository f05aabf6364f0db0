"""Pictures of the step profiler's breakdown, drawn with matplotlib (an optional extra, `[plot]`).

* `timeline.png`: one row per rank, its activity over the last profiled step from the step's start,
  coloured by component (`diagnostics.breakdown.COMPONENTS`): where the bubble, the waits for the tp
  collectives and the dp reduction sit in the step.
* `breakdown.png`: per rank a bar of the mean step stacked by component, and the advisor's prediction
  as the last bar (its parts: compute, bubble, each group's exposed communication).

Figures are drawn on a `matplotlib.figure.Figure` (no pyplot, no display, no global state).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_tp3d.diagnostics.breakdown import COMPONENTS

__all__ = ["COMPONENT_COLOURS", "plot_breakdown", "plot_timeline"]

COMPONENT_COLOURS = {"compute": "tab:blue", "tp collectives": "tab:orange", "pipeline send/recv": "tab:purple",
                     "pipeline idle": "lightgrey", "dp communication": "tab:red", "data loading": "tab:green",
                     "optimizer": "tab:brown", "rest": "tab:olive"}
_DPI = 100


def _figure(rows: int) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("The profiler's pictures need matplotlib: pip install 'lightning-tp3d[plot]' (or pass"
                          " plots=False / --no-plots).") from None
    return Figure(figsize=(10.0, max(2.5, 1.0 + 0.45 * rows)), dpi=_DPI, layout="constrained")


def _rank_label(rank: int, coordinates: dict[str, int]) -> str:
    return f"rank {rank} (pp {coordinates['pp']}, dp {coordinates['dp']}, tp {coordinates['tp']})"


def _legend(axes: Any) -> None:
    from matplotlib.patches import Patch

    axes.legend(handles=[Patch(color=COMPONENT_COLOURS[name], label=name) for name in COMPONENTS],
                loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, fontsize="small", frameon=False)


def plot_timeline(timelines: Sequence[tuple[int, dict[str, int], Sequence[Sequence[Any]]]], path: Path) -> Path:
    """`timelines`: per rank (rank, coordinates, [[start, end, component], ...] in seconds from the step's
    start); rank 0 on top."""
    ordered = sorted(timelines, key=lambda item: item[0])
    figure = _figure(len(ordered))
    axes = figure.add_subplot()
    for row, (_, _, segments) in enumerate(ordered):
        for component in COMPONENTS:
            bars = [(start * 1e3, (end - start) * 1e3) for start, end, name in segments if name == component]
            if bars:
                axes.broken_barh(bars, (row - 0.4, 0.8), facecolors=COMPONENT_COLOURS[component])
    axes.set_yticks(range(len(ordered)), [_rank_label(rank, coordinates) for rank, coordinates, _ in ordered])
    axes.invert_yaxis()
    axes.set_xlabel("milliseconds from the start of the step (each rank's own clock)")
    axes.set_title("Each rank's activity over the last profiled step")
    _legend(axes)
    figure.savefig(path)
    return path


def plot_breakdown(report: dict[str, Any], path: Path) -> Path:
    """Stacked bars of each rank's mean step by component, and the advisor's prediction beside them."""
    ranks = report["ranks"]
    bars = [(_rank_label(rank["rank"], rank["coordinates"]).replace(" (", "\n("), rank["components"])
            for rank in ranks]
    prediction = (report.get("prediction") or {}).get("components")
    if prediction:
        bars.append(("advisor", prediction))
    figure = _figure(len(bars))
    axes = figure.add_subplot()
    for row, (_, components) in enumerate(bars):
        left = 0.0
        for name in COMPONENTS:
            seconds = components.get(name, 0.0) * 1e3
            if seconds > 0:
                axes.barh(row, seconds, left=left, color=COMPONENT_COLOURS[name],
                          hatch="//" if prediction and row == len(bars) - 1 else None)
                left += seconds
    axes.set_yticks(range(len(bars)), [label for label, _ in bars], fontsize="small")
    axes.invert_yaxis()
    axes.set_xlabel("milliseconds per step (mean over the profiled steps)")
    layout = report["layout"]
    axes.set_title(f"Step time by component at tp={layout['tp']} pp={layout['pp']} dp={layout['dp']}"
                   f" ({layout['schedule']}, m={layout['num_microbatches']}, {layout['data_parallel_mode']})")
    _legend(axes)
    figure.savefig(path)
    return path
