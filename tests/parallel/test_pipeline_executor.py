"""The pipeline executor's message tags (its runs are checked against one process by test_pipeline,
test_matrix and the conformance suite, whose steps after the first run on it)."""

import itertools

import pytest

from lightning_tp3d.parallel.pipeline.executor import message_tag


def test_every_message_of_a_step_has_its_own_nonzero_tag():
    stages, microbatches, positions = 4, 8, 3
    tags = [message_tag(direction, stage, microbatch, position, stages, microbatches)
            for direction, stage, microbatch, position
            in itertools.product((0, 1), range(stages), range(microbatches), range(positions))]
    assert len(set(tags)) == len(tags)
    assert min(tags) > 0


def test_a_stage_sending_too_many_tensors_is_refused():
    with pytest.raises(ValueError, match="at most 16"):
        message_tag(0, 1, 0, 16, 2, 4)
