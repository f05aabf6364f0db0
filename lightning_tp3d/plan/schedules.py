"""Pipeline schedules and stage placement: which stages a pp rank runs and which layers each owns, the
micro-batches a schedule needs, and its bubble (pure arithmetic; `parallel.pipeline` runs the schedules).

Single-stage schedules (GPipe, 1F1B) put stage r on pp rank r; looped multi-stage schedules
(Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) put stages r, r + pp, r + 2 pp, ... on rank r;
V-shaped ones (ZBVZeroBubble, DualPipeV) put stages r and 2 pp - 1 - r on rank r.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["PIPELINE_SCHEDULES", "SPLIT_BACKWARD_SCHEDULES", "PipelinePlan",
           "bubble_fraction", "fsdp_reshards_after_forward", "plan_pipeline",
           "stages_per_rank_of"]

# user-facing name -> torch schedule class name
PIPELINE_SCHEDULES: dict[str, str] = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "Interleaved1F1B",
    "looped_bfs": "LoopedBFS",
    "interleaved_zero_bubble": "InterleavedZeroBubble",
    "zbv_zero_bubble": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
_LOOPED = {"interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble"}
_V_SHAPED = {"zbv_zero_bubble", "dualpipev"}
# Schedules that compute weight gradients in a pass of their own, after the input gradients.
SPLIT_BACKWARD_SCHEDULES = frozenset({"interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"})
# Schedules that run the first backward before all forwards are done need one micro-batch per stage.
_NEEDS_MICROBATCHES_PER_RANK = {"1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble",
                                "dualpipev"}


@dataclass(frozen=True)
class PipelinePlan:
    schedule: str
    num_stages: int
    stage_indices: tuple[int, ...]  # stages run by this rank
    layer_ranges: tuple[range, ...]  # this rank's stages' layers, same order
    last_stage_pp_rank: int


def stages_per_rank_of(schedule: str, pp_size: int, num_microbatches: int, stages_per_rank: int) -> int:
    """Stages each rank runs under `schedule`; errors name the constraint and the fix."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline_schedule={schedule!r} is not one of {sorted(PIPELINE_SCHEDULES)}.")
    if schedule in _NEEDS_MICROBATCHES_PER_RANK and num_microbatches < pp_size:
        raise ValueError(
            f"pipeline_schedule={schedule!r} needs num_microbatches >= pipeline_parallel_size, got"
            f" num_microbatches={num_microbatches} < {pp_size}; raise num_microbatches or use 'gpipe'."
        )
    if schedule == "dualpipev" and num_microbatches < 2 * pp_size:
        raise ValueError(
            f"pipeline_schedule='dualpipev' runs 2 stages per rank and needs num_microbatches >= 2 x"
            f" pipeline_parallel_size = {2 * pp_size}, got {num_microbatches}; raise num_microbatches."
        )
    if schedule in _V_SHAPED:
        return 2
    if schedule in _LOOPED:
        if stages_per_rank < 2:
            raise ValueError(
                f"pipeline_schedule={schedule!r} runs several stages per rank; set stages_per_rank >= 2"
                f" (got {stages_per_rank}) or choose 'gpipe' / '1f1b'."
            )
        return stages_per_rank
    return 1


def plan_pipeline(
    schedule: str, pp_size: int, pp_rank: int, num_microbatches: int, stages_per_rank: int,
    stage_ranges: Callable[[int], Sequence[range]],
) -> PipelinePlan:
    """Where each stage runs and which layers it owns (`stage_ranges(num_stages)` splits the layers)."""
    per_rank = stages_per_rank_of(schedule, pp_size, num_microbatches, stages_per_rank)
    num_stages = pp_size * per_rank
    if schedule in _V_SHAPED:
        indices = (pp_rank, num_stages - 1 - pp_rank)
        last_pp_rank = 0
    else:
        indices = tuple(pp_rank + k * pp_size for k in range(per_rank))
        last_pp_rank = pp_size - 1
    ranges = stage_ranges(num_stages)
    return PipelinePlan(schedule, num_stages, indices, tuple(ranges[i] for i in indices), last_pp_rank)


def bubble_fraction(pp_size: int, num_microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle share of a step for GPipe / 1F1B: (p - 1) / (m + p - 1); looped schedules with v stages per
    rank divide the fill and drain by v: (p - 1) / (v m + p - 1). 0 without pipelining."""
    if pp_size <= 1:
        return 0.0
    return (pp_size - 1) / (stages_per_rank * num_microbatches + pp_size - 1)


def fsdp_reshards_after_forward(choice: bool | None, schedule: str, pp_size: int) -> bool:
    """Whether FSDP2 frees a unit's gathered parameters after its forward (`reshard_after_forward`).

    None chooses: yes without pipelining (one unit gathered at a time, gathered again in backward); no
    under pipelining, where resharding would gather every unit again for every micro-batch's forward
    (m + 1 all-gathers per unit and step instead of 1) at the price of keeping the stage's parameters
    whole through the step. The split-backward schedules need them kept: their weight-gradient pass runs
    after FSDP2 would have resharded."""
    if choice is None:
        return pp_size == 1
    if choice and pp_size > 1 and schedule in SPLIT_BACKWARD_SCHEDULES:
        raise ValueError(
            f"fsdp_reshard_after_forward=True cannot run pipeline_schedule={schedule!r}: its weight gradients are"
            " computed after FSDP2 resharded the parameters, so they would come back wrong. Use 'gpipe', '1f1b',"
            " 'interleaved_1f1b' or 'looped_bfs', or leave fsdp_reshard_after_forward=None."
        )
    return choice
