"""A pipeline schedule's timeline: when each rank runs each action, for the planner's picture.

Each pp rank runs its actions in the schedule's order, one at a time: F (a stage's forward of one
micro-batch), B (its whole backward), or, in the schedules that split the backward, I (the input
gradient) and W (the weight gradient). An action starts when its rank is free and its inputs exist:

    F(s, i)   after F(s - 1, i)                       (the previous stage's output)
    B(s, i)   after B or I of (s + 1, i), and F(s, i)  (the next stage's input gradient)
    I(s, i)   as B(s, i)
    W(s, i)   after I(s, i)

with durations in units of one stage's forward (`DURATIONS`: F = I = W = 1, B = I + W = 2, the zero-bubble
papers' assumption) and communication free. A rank's idle share is 1 - its busy time / the step (the
last action's end), the bubble the closed forms of `plan.schedules.schedule_bubble_fraction` give where
they hold exactly (GPipe, 1F1B, and the looped schedules with m a multiple of p).

The orders: GPipe and 1F1B by their rule (`single_stage_orders`: 1F1B is torch's, p - r forwards, then a
backward and a forward in turn); the multi-stage schedules' are torch's own
(`_compat.torch.pipeline_orders`), read by `tp3d plan --plot`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["DURATIONS", "Action", "TimedAction", "idle_fractions", "simulate", "single_stage_orders"]

DURATIONS = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
Action = tuple[str, int, int]  # (kind, stage, micro-batch)


@dataclass(frozen=True)
class TimedAction:
    rank: int
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float


def single_stage_orders(schedule: str, pp_size: int, num_microbatches: int) -> dict[int, list[Action]]:
    """Rank r's actions under GPipe (every forward, then every backward) or 1F1B (torch's `Schedule1F1B`:
    min(m, p - r) forwards, then a backward and a forward in turn, then the remaining backwards)."""
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"{schedule!r} runs several stages per rank: its order comes from torch's schedule.")
    m = num_microbatches
    orders: dict[int, list[Action]] = {}
    for rank in range(pp_size):
        forwards = [("F", rank, index) for index in range(m)]
        backwards = [("B", rank, index) for index in range(m)]
        if schedule == "gpipe":
            orders[rank] = forwards + backwards
            continue
        warmup = min(m, pp_size - rank)
        order = forwards[:warmup]
        for index in range(m):
            order.append(backwards[index])
            if warmup + index < m:
                order.append(forwards[warmup + index])
        orders[rank] = order
    return orders


def simulate(orders: Mapping[int, Sequence[Action]], num_stages: int,
             durations: Mapping[str, float] = DURATIONS) -> list[TimedAction]:
    """Every action's start and end (see the module docstring); an order that cannot finish is refused."""
    ends: dict[Action, float] = {}
    clocks = dict.fromkeys(orders, 0.0)
    positions = dict.fromkeys(orders, 0)
    timed: list[TimedAction] = []
    total = sum(map(len, orders.values()))
    while len(timed) < total:
        progressed = False
        for rank, order in orders.items():
            while positions[rank] < len(order):
                kind, stage, index = order[positions[rank]]
                needed = _dependencies(kind, stage, index, num_stages)
                if any(dependency not in ends for dependency in needed):
                    break
                start = max([clocks[rank], *(ends[dependency] for dependency in needed)])
                end = start + durations[kind]
                ends[kind, stage, index] = end
                if kind == "I":  # a later stage's B waits for this input gradient as for a B
                    ends["B", stage, index] = end
                clocks[rank] = end
                positions[rank] += 1
                timed.append(TimedAction(rank, kind, stage, index, start, end))
                progressed = True
        if not progressed:
            stuck = {rank: order[positions[rank]] for rank, order in orders.items() if positions[rank] < len(order)}
            raise ValueError(f"the pipeline order cannot finish: each rank waits on another ({stuck}).")
    return timed


def _dependencies(kind: str, stage: int, index: int, num_stages: int) -> list[Action]:
    if kind == "F":
        return [("F", stage - 1, index)] if stage > 0 else []
    if kind == "W":
        return [("I", stage, index)]
    needed: list[Action] = [("F", stage, index)]
    if stage < num_stages - 1:
        needed.append(("B", stage + 1, index))
    return needed


def idle_fractions(actions: Sequence[TimedAction], pp_size: int) -> list[float]:
    """Per rank: 1 - its busy time / the step (the last action's end)."""
    step = max(action.end for action in actions)
    busy = [0.0] * pp_size
    for action in actions:
        busy[action.rank] += action.end - action.start
    return [1 - seconds / step for seconds in busy]
