"""Pictures of the planner's figures (`tp3d plan --plot FILE.png`), drawn with matplotlib (an optional extra).

* The memory ledger: per pipeline stage, one rank's bytes stacked by kind (weights, FSDP's gathered
  weights, gradients, optimizer state, activations) against the GPU's memory and the 90% the advisor
  allows; beside them, per deploy tensor-parallel size, a serving GPU's weights and KV cache.
* The pipeline schedule's timeline (under the ledger, with pp > 1): each rank's forwards, backwards and
  weight-gradient passes over one step as `plan.timeline` simulates torch's order of them, the bubble
  left white.
* The advisor: every candidate layout's predicted step time against its peak memory, the ones that fit
  apart from those that do not, the best one marked.

Figures are drawn on a `matplotlib.figure.Figure` (no pyplot, no display, no global state) and written as
PNG at `DPI`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_tp3d.plan.advisor import LayoutCandidate
from lightning_tp3d.plan.ledger import TrainingLedger
from lightning_tp3d.plan.schedules import PIPELINE_SCHEDULES, plan_pipeline
from lightning_tp3d.plan.serving import ServingLedger
from lightning_tp3d.plan.timeline import TimedAction, idle_fractions, simulate, single_stage_orders

__all__ = ["DPI", "FIGURE_INCHES", "TIMELINE_INCHES", "plot_advisor", "plot_memory", "schedule_timeline"]

DPI = 100
FIGURE_INCHES = (10.0, 5.0)
TIMELINE_INCHES = (10.0, 8.0)  # the memory figure with a timeline under it
_ACTION_COLOURS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:red", "W": "tab:green"}
_ACTION_NAMES = {"F": "forward", "B": "backward (input and weight gradients)", "I": "input gradient",
                 "W": "weight gradient"}
_GIB = 1024**3
_TRAINING_PARTS = (("weights", "weight_bytes"), ("gathered weights (FSDP)", "gathered_weight_bytes"),
                   ("gradients", "gradient_bytes"), ("optimizer state", "optimizer_bytes"),
                   ("activations", "activation_bytes"))


def _figure(inches: tuple[float, float] = FIGURE_INCHES) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ValueError("--plot draws with matplotlib: pip install 'lightning-tp3d[plot]'.") from error
    return Figure(figsize=inches, dpi=DPI, layout="constrained")


def schedule_timeline(schedule: str, pp_size: int, num_microbatches: int, stages_per_rank: int
                      ) -> list[TimedAction]:
    """One step of `schedule` simulated (`plan.timeline`): GPipe and 1F1B in their rule's order, the
    multi-stage schedules in torch's (imported here only)."""
    if schedule in ("gpipe", "1f1b"):
        return simulate(single_stage_orders(schedule, pp_size, num_microbatches), pp_size)
    from lightning_tp3d._compat.torch import pipeline_orders

    plans = [plan_pipeline(schedule, pp_size, rank, num_microbatches, stages_per_rank,
                           lambda stages: [range(stage, stage + 1) for stage in range(stages)])
             for rank in range(pp_size)]
    orders = pipeline_orders(PIPELINE_SCHEDULES[schedule], pp_size, num_microbatches,
                             [plan.stage_indices for plan in plans])
    return simulate(orders, plans[0].num_stages)


def _memory_lines(axes: Any, gpu_memory_bytes: int, usable_fraction: float) -> None:
    axes.axhline(gpu_memory_bytes / _GIB, color="black", linewidth=1, label="GPU memory")
    axes.axhline(usable_fraction * gpu_memory_bytes / _GIB, color="black", linestyle="--", linewidth=1,
                 label=f"{usable_fraction:.0%} of it")


def plot_memory(training: TrainingLedger, serving: ServingLedger, gpu_memory_bytes: int, path: str | Path,
                title: str, usable_fraction: float = 0.9, timeline: Sequence[TimedAction] = (),
                schedule: str = "") -> Path:
    """The training ledger per stage and the serving ledger per deploy tp size, as stacked bars (GiB), and
    under them `timeline`, one step of `schedule`, when given."""
    figure = _figure(TIMELINE_INCHES if timeline else FIGURE_INCHES)
    ratios = (max(len(training.stages), 2), 2)
    if timeline:
        top, bottom_figure = figure.subfigures(2, 1, height_ratios=(1, 1))
        train_axes, serve_axes = top.subplots(1, 2, width_ratios=ratios)
        _draw_timeline(bottom_figure.subplots(), timeline, len(training.stages), schedule)
    else:
        train_axes, serve_axes = figure.subplots(1, 2, width_ratios=ratios)
    stages = [f"stage {stage.stage}\nlayers {stage.layers_text}" for stage in training.stages]
    bottom = [0.0] * len(stages)
    for label, field in _TRAINING_PARTS:
        heights = [getattr(stage, field) / _GIB for stage in training.stages]
        if any(heights):
            train_axes.bar(stages, heights, bottom=bottom, label=label)
            bottom = [low + height for low, height in zip(bottom, heights)]
    _memory_lines(train_axes, gpu_memory_bytes, usable_fraction)
    train_axes.set_ylabel("GiB per rank")
    train_axes.set_title("training: one rank of each stage")
    train_axes.legend(fontsize="small")
    options = [option for option in serving.options if option.valid]
    names = [f"tp {option.tensor_parallel_size}" for option in options]
    weights = [option.weight_bytes_per_gpu / _GIB for option in options]
    cache = [option.kv_bytes_per_token_per_gpu * serving.seq_len * serving.num_seqs / _GIB for option in options]
    serve_axes.bar(names, weights, label="weights")
    serve_axes.bar(names, cache, bottom=weights, label=f"KV cache, {serving.num_seqs} x {serving.seq_len} tokens")
    _memory_lines(serve_axes, gpu_memory_bytes, usable_fraction)
    serve_axes.set_title(f"serving ({serving.dtype}): one GPU")
    serve_axes.legend(fontsize="small")
    figure.suptitle(title)
    return _save(figure, path)


def _draw_timeline(axes: Any, timeline: Sequence[TimedAction], pp_size: int, schedule: str) -> None:
    """Each rank's actions as bars along time, coloured by kind and labelled with the micro-batch."""
    from matplotlib.patches import Patch

    labelled = len(timeline) <= 400  # micro-batch numbers only where they can be read
    for action in timeline:
        axes.barh(action.rank, action.end - action.start, left=action.start, height=0.8,
                  color=_ACTION_COLOURS[action.kind], edgecolor="white", linewidth=0.5)
        if labelled:
            axes.text((action.start + action.end) / 2, action.rank, str(action.microbatch), ha="center",
                      va="center", fontsize="x-small", color="white")
    idle = idle_fractions(timeline, pp_size)
    axes.set_yticks(range(pp_size), [f"rank {rank}\nidle {share:.0%}" for rank, share in enumerate(idle)])
    axes.invert_yaxis()
    axes.set_xlabel("time, in one stage's forward (F = I = W = 1, backward B = 2; communication free)")
    kinds = sorted({action.kind for action in timeline}, key="FBIW".index)
    axes.legend(handles=[Patch(color=_ACTION_COLOURS[kind], label=_ACTION_NAMES[kind]) for kind in kinds],
                fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=len(kinds))
    axes.set_title(f"{schedule}: one step, each bar one micro-batch (white: the bubble)")


def plot_advisor(candidates: Sequence[LayoutCandidate], gpu_memory_bytes: int, path: str | Path, title: str,
                 usable_fraction: float = 0.9) -> Path:
    """Predicted step time against peak memory for every candidate; the fitting ones, the others, the best."""
    figure = _figure()
    axes = figure.subplots()
    fitting = [candidate for candidate in candidates if candidate.fits]
    for group, label, marker in ((fitting, "fits", "o"), ([c for c in candidates if not c.fits], "does not fit", "x")):
        if group:
            axes.scatter([c.peak_bytes / _GIB for c in group], [c.step_seconds for c in group], label=label,
                         marker=marker, alpha=0.7)
    if fitting:
        best = fitting[0]
        axes.scatter([best.peak_bytes / _GIB], [best.step_seconds], marker="*", s=300, color="red", zorder=3,
                     label=f"best: {best.name}")
    axes.axvline(usable_fraction * gpu_memory_bytes / _GIB, color="black", linestyle="--", linewidth=1,
                 label=f"{usable_fraction:.0%} of the GPU's memory")
    axes.set_xlabel("peak memory of the fullest rank (GiB)")
    axes.set_ylabel("predicted step time (s, log scale)")
    axes.set_yscale("log")
    axes.legend(fontsize="small")
    axes.set_title(title)
    return _save(figure, path)


def _save(figure: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI)
    return path
