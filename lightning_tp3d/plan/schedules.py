"""Pipeline schedules and stage placement: which stages a pp rank runs and which layers each owns, the
micro-batches a schedule needs, and its bubble (pure arithmetic; `parallel.pipeline` runs the schedules).

Single-stage schedules (GPipe, 1F1B) put stage r on pp rank r; looped multi-stage schedules
(Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) put stages r, r + pp, r + 2 pp, ... on rank r;
V-shaped ones (ZBVZeroBubble, DualPipeV) put stages r and 2 pp - 1 - r on rank r.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BUBBLE_FORMULAS", "PIPELINE_SCHEDULES", "SPLIT_BACKWARD_SCHEDULES", "PipelinePlan", "RankStages",
           "activations_in_flight", "bubble_fraction", "fsdp_reshards_after_forward", "pipeline_sends",
           "plan_pipeline", "rank_stages", "schedule_bubble_fraction", "stages_per_rank_of"]

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
# torch's interleaved schedules split the micro-batches into max(1, m // p) equal rounds
_IN_ROUNDS = {"interleaved_1f1b", "interleaved_zero_bubble"}
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
    rounds = max(1, num_microbatches // pp_size)
    if schedule in _IN_ROUNDS and num_microbatches % rounds:
        raise ValueError(
            f"pipeline_schedule={schedule!r} runs the micro-batches in rounds of about pipeline_parallel_size:"
            f" num_microbatches={num_microbatches} is not a multiple of its {rounds} rounds"
            f" (num_microbatches // {pp_size}); use a multiple of {pp_size}, e.g. {rounds * pp_size}."
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


@dataclass(frozen=True)
class RankStages:
    """What one pp rank holds under a schedule (`rank_stages`)."""

    layer_ranges: tuple[range, ...]  # its stages' layers
    first: bool  # holds the first stage (the embedding)
    last: bool  # holds the last stage (the final norm and the head: rank 0 in a V)
    sends: int  # point-to-point sends per micro-batch (`pipeline_sends`)

    @property
    def num_layers(self) -> int:
        return sum(map(len, self.layer_ranges))


def rank_stages(schedule: str, layout: Any, stages_per_rank: int, num_layers: int) -> list[RankStages]:
    """Per pp rank of `layout` (a `ParallelLayout`), what it holds under `schedule`."""
    pp, m = layout.pipeline_parallel_size, layout.num_microbatches
    if pp == 1:
        return [RankStages(tuple(layout.stage_layer_ranges(num_layers)), True, True, 0)]
    plans = [plan_pipeline(schedule, pp, rank, m, stages_per_rank,
                           lambda stages: layout.stage_layer_ranges(num_layers, stages)) for rank in range(pp)]
    return [RankStages(plan.layer_ranges, 0 in plan.stage_indices, plan.num_stages - 1 in plan.stage_indices,
                       pipeline_sends(plan)) for plan in plans]


# `schedule_bubble_fraction` in words (v: stages per rank)
BUBBLE_FORMULAS = {"gpipe": "(pp - 1) / (m + pp - 1)", "1f1b": "(pp - 1) / (m + pp - 1)",
                   "interleaved_1f1b": "(pp - 1) / (v m + pp - 1)", "looped_bfs": "(pp - 1) / (v m + pp - 1)",
                   "interleaved_zero_bubble": "(pp - 1) / (3 v m + pp - 1)",
                   "zbv_zero_bubble": "(pp - 1) / (3 v m + pp - 1), v = 2",
                   "dualpipev": "(pp - 1) / (3 v m + pp - 1), v = 2"}


def schedule_bubble_fraction(schedule: str, pp_size: int, num_microbatches: int, stages_per_rank: int = 2) -> float:
    """The idle share of a step in theory, each stage's forward F, input gradient I and weight gradient W
    taking equal time (the zero-bubble papers' assumption; a whole backward B = I + W), p ranks, m
    micro-batches, v stages per rank (2 in a V):

        gpipe, 1f1b                (p - 1) / (m + p - 1)      fill and drain of (p - 1)(F + B)
        interleaved_1f1b,          (p - 1) / (v m + p - 1)    stages 1 / v as long (Narayanan et al.
        looped_bfs                                            2021; Lamy-Poirier 2023, breadth-first)
        interleaved_zero_bubble,   (p - 1) / (3 v m + p - 1)  the drain filled with W: (p - 1) F of idle
        zbv_zero_bubble, dualpipev                            (ZB-H1, Qi et al. 2024)

    These are exactly what torch's orders of the seven schedules give when simulated with those durations
    (`plan.timeline`, tested). ZB-V's and DualPipe's papers reach 0 by also moving W into the fill and
    overlapping a forward with a backward, which torch's orders (run one action at a time) do not; real F,
    I and W differ and each action has its overhead (measured on the CPU:
    `benchmarks/pipeline_idle_cpu.json`)."""
    if pp_size <= 1:
        return 0.0
    per_rank = stages_per_rank_of(schedule, pp_size, num_microbatches, stages_per_rank)
    chunk_units = 3 if schedule in SPLIT_BACKWARD_SCHEDULES else 1
    return bubble_fraction(pp_size, chunk_units * num_microbatches, per_rank)


def activations_in_flight(schedule: str, pp_size: int, pp_rank: int, num_microbatches: int,
                          stages_per_rank: int = 2) -> float:
    """The most micro-batches whose activations rank `pp_rank` holds at once, in units of one micro-batch
    through all of the rank's layers (a rank's v stages hold 1 / v of them each):

        gpipe, looped_bfs        m                            every forward before the first backward
        1f1b                     min(m, p - r)                the warm-up's forwards and one more
        interleaved_1f1b,        min(v m, (v - 1) p + 2 (p - 1 - r) + 1) / v   torch's warm-up chunks
        interleaved_zero_bubble                               and one more (Megatron's p (1 + (p-1)/(p v))
                                                              at rank 0)
        zbv_zero_bubble          min(m, p)                    ZB-V: 1F1B's peak, on every rank
        dualpipev                min(m, p + 1)                DualPipe's table: PP + 1 per device
    """
    if pp_size <= 1:
        return 1.0
    per_rank = stages_per_rank_of(schedule, pp_size, num_microbatches, stages_per_rank)
    m, p = num_microbatches, pp_size
    if schedule in ("gpipe", "looped_bfs"):
        return float(m)
    if schedule == "1f1b":
        return float(min(m, p - pp_rank))
    if schedule == "zbv_zero_bubble":
        return float(min(m, p))
    if schedule == "dualpipev":
        return float(min(m, p + 1))
    chunks = min(per_rank * m, (per_rank - 1) * p + 2 * (p - 1 - pp_rank) + 1)
    return chunks / per_rank


def pipeline_sends(plan: PipelinePlan) -> int:
    """Point-to-point sends of a rank per micro-batch: each of its stages sends its output forward unless
    it is the last stage and its input gradient back unless it is the first, except to a stage on the
    same rank (the V's turn, stages p - 1 and p on rank p - 1), which is handed over locally."""
    held = set(plan.stage_indices)
    forward = sum(stage + 1 < plan.num_stages and stage + 1 not in held for stage in held)
    backward = sum(stage > 0 and stage - 1 not in held for stage in held)
    return forward + backward


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
