"""Where a training step's time goes on one rank, from the ranges of its host timeline.

Each range of a profiled step that names a kind of work (`parallel.labels`, Lightning's profiler actions,
torch's optimizer ops) is a node of a tree, nested as the ranges are. A moment of the
step belongs to the innermost named range around it, so a component's seconds are its ranges' exclusive
time and the components add up to the step exactly:

    compute              training_step / backward (no pipeline), a pipeline stage's chunks
    tp collectives       waits for and calls of the tp group's collectives
    pipeline send/recv   the pp group's collectives outside the schedule: the loss broadcast from the
                         last stage, which waits for every stage to finish its last backward
    pipeline idle        the schedule's time outside its stages' chunks and other groups' collectives:
                         sending, receiving and waiting for a neighbour's activations or gradients (the
                         bubble). A host cannot tell a transfer from the wait for its peer: NCCL's sends
                         and receives are queued in microseconds and waited for later, gloo's may hold
                         the rank until the peer is ready; the pipeline's own timing counts both as idle
    dp communication     the dp group's collectives and the package's dp phases (the gradient reduction
                         after backward, ZeRO-1's gather after the update): what overlap did not hide
    data loading         fetching the next batch and moving it to the device
    optimizer            the optimizer's step and zero_grad
    rest                 everything else: the default group's scalars (the non-finite flag), callbacks,
                         logging, Lightning's loop

The advisor (`plan.advisor`) predicts compute, the bubble and each group's exposed communication for a
layout; `predicted_components` puts them beside the same components.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lightning_tp3d.parallel.labels import (
    COMMUNICATION_PREFIX,
    DP_PHASE,
    PIPELINE_COMPUTE,
    PIPELINE_SCHEDULE,
    STEP,
)
from lightning_tp3d.plan.advisor import LayoutCandidate

__all__ = ["COMPONENTS", "TimedRange", "component_of", "exclusive_segments", "predicted_components",
           "rules_of_thumb", "step_components"]

COMPONENTS = ("compute", "tp collectives", "pipeline send/recv", "pipeline idle", "dp communication",
              "data loading", "optimizer", "rest")
_GROUP_COMPONENTS = {"tp": "tp collectives", "pp": "pipeline send/recv", "dp": "dp communication"}
_FIXES = {
    "data loading": "more DataLoader workers (num_workers), pin_memory=True, or pre-tokenised data",
    "tp collectives": "keep tp inside a node (NVLink), or a smaller tensor_parallel_size",
    "pipeline send/recv": "fewer pipeline stages, or larger micro-batches to hide the transfers",
    "pipeline idle": "more micro-batches (about 4 x pp) or an interleaved / zero-bubble pipeline_schedule",
    "dp communication": "overlap_gradient_reduction=True, or data_parallel_mode='zero1' / 'fsdp' across nodes",
    "optimizer": "a fused or foreach optimizer (torch.optim.AdamW(fused=True) on GPUs)",
    "rest": "less work in callbacks and logging each step (a larger log_every_n_steps)",
}

_MODEL_FIXES = {  # what the advisor assumed for each part it predicts, and how to give it the real figure
    "compute": "it assumes peak_tflops x mfu: give the GPU's with --peak-tflops / --mfu",
    "pipeline idle": "it counts the 1F1B bubble, (pp - 1) / m x compute; idle beyond that is work between the"
                     " stages' chunks: transfers waited for and Python per micro-batch",
    **{name: "measure the links with `tp3d doctor` and give their bandwidth as link_gbps / --link-gbps"
       for name in ("tp collectives", "pipeline send/recv", "dp communication")},
}


@dataclass(frozen=True)
class TimedRange:
    """A named range of one thread's timeline, in seconds."""

    name: str
    start: float
    end: float


def component_of(name: str) -> str | None:
    """The component a range of this name is (see the module docstring); None: not one the breakdown
    counts, its time goes to the range around it."""
    if name == STEP:
        return "rest"
    if name.startswith(COMMUNICATION_PREFIX):
        return _GROUP_COMPONENTS.get(name[len(COMMUNICATION_PREFIX):].split("::")[0], "rest")
    if name.startswith(DP_PHASE):
        return "dp communication"
    if name == PIPELINE_COMPUTE:
        return "compute"
    if name == PIPELINE_SCHEDULE:
        return "pipeline idle"
    if name.endswith(".train_dataloader_next") or (name.startswith("[Strategy]") and name.endswith(".batch_to_device")):
        return "data loading"
    if name.startswith("[Strategy]") and name.endswith((".training_step", ".backward")):
        return "compute"
    if (name.startswith("[LightningModule]") and name.endswith((".optimizer_step", ".optimizer_zero_grad"))
            or name.startswith(("Optimizer.step#", "Optimizer.zero_grad#"))):
        return "optimizer"
    return None


def exclusive_segments(ranges: Iterable[TimedRange]) -> list[tuple[float, float, str]]:
    """(start, end, name) pieces of the timeline, each moment under the innermost range around it. Ranges
    of one thread nest; one that outlives its parent is cut at the parent's end."""
    segments: list[tuple[float, float, str]] = []
    stack: list[list] = []  # [range, the moment up to which its own time is emitted]

    def close_until(moment: float) -> None:
        while stack and stack[-1][0].end <= moment:
            closed, cursor = stack.pop()
            if closed.end > cursor:
                segments.append((cursor, closed.end, closed.name))
            if stack:
                stack[-1][1] = max(stack[-1][1], closed.end)

    for timed in sorted(ranges, key=lambda item: (item.start, -item.end)):
        close_until(timed.start)
        if stack:
            parent = stack[-1]
            if timed.start > parent[1]:
                segments.append((parent[1], timed.start, parent[0].name))
            parent[1] = timed.start
            if timed.end > parent[0].end:
                timed = TimedRange(timed.name, timed.start, parent[0].end)
        stack.append([timed, timed.start])
    close_until(math.inf)
    return segments


def step_components(segments: Sequence[tuple[float, float, str]], start: float, end: float) -> dict[str, float]:
    """Seconds of each component within the step [start, end) (segments named by `component_of`)."""
    totals = dict.fromkeys(COMPONENTS, 0.0)
    for first, last, name in segments:
        overlap = min(last, end) - max(first, start)
        if overlap > 0:
            totals[component_of(name) or "rest"] += overlap
    return totals


def predicted_components(candidate: LayoutCandidate) -> dict[str, float]:
    """The advisor's figures for a layout, by the component each predicts (an MoE model's expert gradient
    reduction, "edp", with the dp communication; its all-to-alls have no component of their own)."""
    exposed = candidate.exposed_seconds
    return {"compute": candidate.compute_seconds, "tp collectives": exposed.get("tp", 0.0),
            "pipeline send/recv": exposed.get("pp", 0.0), "pipeline idle": candidate.bubble_seconds,
            "dp communication": exposed.get("dp", 0.0) + exposed.get("edp", 0.0)}


def rules_of_thumb(components: dict[str, float], step_seconds: float, pipeline_idle_theory: float | None,
                   prediction: dict[str, float] | None) -> list[tuple[str, str]]:
    """(cause, warning) pairs for one rank's mean step, each naming the likely cause and what to change: the design
    documents' rules (compute under 60% of the step: data loading or communication holds it back; over
    90%: the kernels are the limit), pipeline idle beyond 1.25x its theory, and an advisor prediction
    off by more than half (and by more than 5% of the step)."""
    if step_seconds <= 0:
        return []
    share = {name: seconds / step_seconds for name, seconds in components.items()}
    warnings = []
    if share["compute"] < 0.6:
        largest = max((name for name in COMPONENTS if name != "compute"), key=lambda name: share[name])
        warnings.append((f"low compute: {largest}", f"compute is {share['compute']:.0%} of the step (under 60%:"
                         " data loading or communication holds the step back); the largest other part is"
                         f" {largest} ({share[largest]:.0%}): {_FIXES[largest]}."))
    elif share["compute"] > 0.9:
        warnings.append(("high compute", f"compute is {share['compute']:.0%} of the step (over 90%: the kernels"
                         " are the limit); bf16-mixed, compile=True or float8 make them faster."))
    if pipeline_idle_theory and share["pipeline idle"] > 1.25 * pipeline_idle_theory:
        warnings.append(("pipeline idle", f"pipeline idle is {share['pipeline idle']:.0%} of the step against"
                         f" {pipeline_idle_theory:.0%} in theory: work between the stages' chunks (transfers"
                         f" waited for, Python per micro-batch) adds to the bubble; {_FIXES['pipeline idle']}."))
    for name, predicted in (prediction or {}).items():
        measured = components[name]
        if abs(measured - predicted) > max(0.5 * predicted, 0.05 * step_seconds):
            warnings.append((f"prediction: {name}", f"the advisor predicts {predicted:.4f} s of {name}, measured"
                             f" {measured:.4f} s: its model of that part is off here ({_MODEL_FIXES[name]})."))
    return warnings
