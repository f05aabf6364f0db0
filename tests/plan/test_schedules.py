"""The schedules' theory (`plan.schedules`): bubble, activations in flight and sends, hand-computed at
p = 4 ranks, m = 8 micro-batches, v = 2 stages per rank, for every schedule the strategy trains."""

from __future__ import annotations

import pytest

from lightning_tp3d import TP3DStrategy
from lightning_tp3d.cli import main
from lightning_tp3d.plan.config import MODEL_PRESETS
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.ledger import TrainingOptions, training_ledger
from lightning_tp3d.plan.schedules import (
    PIPELINE_SCHEDULES,
    activations_in_flight,
    pipeline_sends,
    plan_pipeline,
    schedule_bubble_fraction,
)

P, M, V = 4, 8, 2
# schedule -> (bubble, in flight per rank, sends per micro-batch per rank), by hand:
# fill and drain (p - 1) over v m + p - 1 stage times (3 v m for the split backward's thirds); interleaved warm-up
# (v - 1) p + 2 (p - 1 - r) chunks and one more, over v; a V's turn (stages 3 and 4 on rank 3) is local
EXPECTED = {
    "gpipe": (3 / 11, [8, 8, 8, 8], [1, 2, 2, 1]),
    "1f1b": (3 / 11, [4, 3, 2, 1], [1, 2, 2, 1]),
    "interleaved_1f1b": (3 / 19, [11 / 2, 9 / 2, 7 / 2, 5 / 2], [3, 4, 4, 3]),
    "looped_bfs": (3 / 19, [8, 8, 8, 8], [3, 4, 4, 3]),
    "interleaved_zero_bubble": (3 / 51, [11 / 2, 9 / 2, 7 / 2, 5 / 2], [3, 4, 4, 3]),
    "zbv_zero_bubble": (3 / 51, [4, 4, 4, 4], [2, 4, 4, 2]),
    "dualpipev": (3 / 51, [5, 5, 5, 5], [2, 4, 4, 2]),
}


def test_every_schedule_has_its_theory():
    assert set(EXPECTED) == set(PIPELINE_SCHEDULES)


@pytest.mark.parametrize("schedule", list(PIPELINE_SCHEDULES))
def test_bubble_in_flight_and_sends_are_the_hand_computed_ones(schedule):
    bubble, in_flight, sends = EXPECTED[schedule]
    assert schedule_bubble_fraction(schedule, P, M, V) == pytest.approx(bubble, rel=1e-12)
    assert [activations_in_flight(schedule, P, rank, M, V) for rank in range(P)] == in_flight
    layers = lambda stages: [range(stage, stage + 1) for stage in range(stages)]  # noqa: E731
    assert [pipeline_sends(plan_pipeline(schedule, P, rank, M, V, layers)) for rank in range(P)] == sends


def test_the_ledger_follows_the_schedule():
    config, layout = MODEL_PRESETS["tiny"], ParallelLayout(pipeline_parallel_size=2, num_microbatches=4)
    ledgers = {schedule: training_ledger(config, layout, TrainingOptions(seq_len=32, schedule=schedule))
               for schedule in ("1f1b", "interleaved_1f1b", "zbv_zero_bubble")}
    one_f_one_b, interleaved, v_shaped = (ledgers[name].stages for name in ledgers)
    assert [stage.layer_spans for stage in one_f_one_b] == [((0, 2),), ((2, 4),)]
    assert [stage.layer_spans for stage in interleaved] == [((0, 1), (2, 3)), ((1, 2), (3, 4))]
    assert [stage.layer_spans for stage in v_shaped] == [((0, 1), (3, 4)), ((1, 2), (2, 3))]
    # the head moves with the last stage: rank 1 in a loop, rank 0 in a V
    assert interleaved[1].parameters == one_f_one_b[1].parameters
    assert v_shaped[0].parameters == one_f_one_b[0].parameters + one_f_one_b[1].parameters - v_shaped[1].parameters
    assert [stage.in_flight_microbatches for stage in interleaved] == [(2 + 2 + 1) / 2, (2 + 0 + 1) / 2]


@pytest.mark.parametrize("schedule", list(PIPELINE_SCHEDULES))
def test_tp3d_plan_states_each_schedule_bubble(schedule, capsys):
    assert main(["plan", "tiny", "--pp", "2", "--num-microbatches", "4", "--schedule", schedule]) == 0
    out = capsys.readouterr().out
    bubble = schedule_bubble_fraction(schedule, 2, 4)
    assert f"pipeline bubble in theory ({schedule}): " in out and f"  = {bubble:.0%} of each step" in out
    assert max(map(len, out.splitlines())) <= 100


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "interleaved_zero_bubble"])
def test_micro_batches_that_do_not_fill_the_rounds_are_refused_before_launch(schedule):
    """torch refuses them in the schedule's constructor, after the processes started: refused here first."""
    with pytest.raises(ValueError, match=rf"pipeline_schedule='{schedule}' runs the micro-batches in rounds .*"
                                         r"num_microbatches=5 is not a multiple of its 2 rounds .* e.g. 4"):
        TP3DStrategy(pipeline_parallel_size=2, num_microbatches=5, pipeline_schedule=schedule)
    for accepted in (3, 4, 6):  # one round of 3; two of 2; three of 2
        TP3DStrategy(pipeline_parallel_size=2, num_microbatches=accepted, pipeline_schedule=schedule)
