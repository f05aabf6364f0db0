"""The simulated timeline of every schedule (`plan.timeline`, torch's orders for the multi-stage ones):
each stage runs each micro-batch's forward and backward exactly once, and each rank idles exactly the
closed form of `plan.schedules.schedule_bubble_fraction` (F = I = W = 1, B = 2)."""

from __future__ import annotations

from collections import Counter

import pytest

from lightning_tp3d.cli.plots import schedule_timeline
from lightning_tp3d.plan.schedules import PIPELINE_SCHEDULES, schedule_bubble_fraction
from lightning_tp3d.plan.timeline import idle_fractions, simulate, single_stage_orders

LAYOUTS = [(2, 4), (4, 8), (4, 12)]  # (p, m), v = 2


@pytest.mark.parametrize("schedule", list(PIPELINE_SCHEDULES))
@pytest.mark.parametrize(("pp", "microbatches"), LAYOUTS)
def test_each_rank_idles_the_closed_form(schedule, pp, microbatches):
    timeline = schedule_timeline(schedule, pp, microbatches, 2)
    expected = schedule_bubble_fraction(schedule, pp, microbatches, 2)
    assert idle_fractions(timeline, pp) == pytest.approx([expected] * pp, abs=1e-12)
    stages = {action.stage for action in timeline}
    work = Counter((action.stage, action.microbatch, action.kind) for action in timeline)
    for stage in stages:
        for index in range(microbatches):
            backward = {kind: work[stage, index, kind] for kind in "BIW"}
            assert work[stage, index, "F"] == 1
            assert backward in ({"B": 1, "I": 0, "W": 0}, {"B": 0, "I": 1, "W": 1}), (stage, index, backward)


def test_an_order_that_cannot_finish_is_refused():
    orders = single_stage_orders("1f1b", 2, 2)
    orders[1] = [("B", 1, 0), ("F", 1, 0), *orders[1][2:]]  # a backward before its forward
    with pytest.raises(ValueError, match="the pipeline order cannot finish: each rank waits on another"):
        simulate(orders, 2)
