"""ParallelLayout: batch arithmetic, rank coordinates, stage split, JSON, and clear errors."""

from __future__ import annotations

import pytest

from lightning_tp3d import LayoutError, ModelConfig, ParallelLayout
from lightning_tp3d.plan.config import MODEL_PRESETS


def test_resolve_derives_dp_and_accumulation():
    layout = ParallelLayout.resolve(8, tensor_parallel_size=2, pipeline_parallel_size=2, micro_batch_size=2,
                                    num_microbatches=2, global_batch_size=32)
    assert layout.data_parallel_size == 2
    assert layout.gradient_accumulation_steps == 4  # 32 = 2 x 2 x 2 x 4
    assert layout.global_batch_size == 32
    assert layout.batch_size_per_rank == 4


def test_rank_coordinates_round_trip_with_tp_innermost():
    layout = ParallelLayout(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2)
    assert [tuple(layout.coordinates(rank)) for rank in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert tuple(layout.coordinates(5)) == (1, 0, 1)
    for rank in range(8):
        assert layout.rank(*layout.coordinates(rank)) == rank


def test_json_round_trip():
    layout = ParallelLayout(2, 3, 4, micro_batch_size=2, num_microbatches=6, layers_per_stage=(1, 2, 1))
    assert ParallelLayout.from_json(layout.to_json()) == layout


@pytest.mark.parametrize(
    ("pp", "layers", "expected"),
    [(1, 4, (4,)), (2, 4, (2, 2)), (4, 30, (7, 8, 8, 7)), (4, 4, (1, 1, 1, 1)), (3, 5, (1, 2, 2))],
)
def test_balanced_stage_split_counts_embedding_and_head(pp, layers, expected):
    assert ParallelLayout(pipeline_parallel_size=pp).stage_layer_counts(layers) == expected


def test_reference_presets_validate_at_their_intended_layouts():
    ParallelLayout(tensor_parallel_size=8, pipeline_parallel_size=4, data_parallel_size=2).validate_model(
        MODEL_PRESETS["deepseek-llm-7b"])
    ParallelLayout(tensor_parallel_size=8, pipeline_parallel_size=5).validate_model(MODEL_PRESETS["deepseek-llm-67b"])


BAD_LAYOUTS = [
    (lambda: ParallelLayout.resolve(6, tensor_parallel_size=4),
     r"world size 6 is not divisible by tensor_parallel_size x pipeline_parallel_size = 4 x 1 = 4"),
    (lambda: ParallelLayout.resolve(8, tensor_parallel_size=2, data_parallel_size=2),
     r"= 4, but the world size is 8; launch 4 processes or set data_parallel_size='auto'"),
    (lambda: ParallelLayout.resolve(4, tensor_parallel_size=2, micro_batch_size=3, global_batch_size=16),
     r"global_batch_size=16 is not a multiple of .* = 3 x 1 x 2 = 6"),
    (lambda: ParallelLayout.resolve(4, micro_batch_size=2, global_batch_size=16, gradient_accumulation_steps=3),
     r"set gradient_accumulation_steps=2 or drop one of the two"),
    (lambda: ParallelLayout(tensor_parallel_size=0), r"tensor_parallel_size must be a positive integer, got 0"),
    (lambda: ParallelLayout.resolve(4, data_parallel_size="many"),
     r"data_parallel_size must be a positive integer or 'auto', got 'many'"),
    (lambda: ParallelLayout(tensor_parallel_size=3).validate_model(ModelConfig(num_attention_heads=8,
                                                                               hidden_size=96)),
     r"tensor_parallel_size=3 does not divide num_attention_heads=8"),
    (lambda: ParallelLayout(tensor_parallel_size=4).validate_model(ModelConfig(num_key_value_heads=2)),
     r"tensor_parallel_size=4 does not divide num_key_value_heads=2"),
    (lambda: ParallelLayout(tensor_parallel_size=2).validate_model(ModelConfig(intermediate_size=129)),
     r"tensor_parallel_size=2 does not divide intermediate_size=129"),
    (lambda: ParallelLayout(tensor_parallel_size=2).validate_model(ModelConfig(vocab_size=255)),
     r"does not divide vocab_size=255; .* pad vocab_size to 256"),
    (lambda: ParallelLayout(pipeline_parallel_size=8).validate_model(ModelConfig(num_hidden_layers=4)),
     r"the pipeline has 8 stages \(pipeline_parallel_size=8\) but the model has only 4 layers"),
    (lambda: ParallelLayout(pipeline_parallel_size=2, layers_per_stage=(1, 2)).stage_layer_counts(4),
     r"layers_per_stage=\[1, 2\] sums to 3 but the model has 4 layers"),
    (lambda: ParallelLayout(pipeline_parallel_size=2, layers_per_stage=(4,)),
     r"layers_per_stage has 1 entries, not a multiple of pipeline_parallel_size=2"),
    (lambda: ParallelLayout(pipeline_parallel_size=2, layers_per_stage=(1, 1, 1, 1)).stage_layer_counts(4, 2),
     r"layers_per_stage has 4 entries but the pipeline has 2 stages"),
    (lambda: ParallelLayout.from_dict({"tensor_parallel_size": 2, "tp": 2}), r"unknown layout fields \['tp'\]"),
    (lambda: ModelConfig(hidden_size=65), r"hidden_size=65 is not divisible by num_attention_heads=4"),
    (lambda: ModelConfig(num_key_value_heads=3), r"num_key_value_heads=3 does not divide num_attention_heads=4"),
]


@pytest.mark.parametrize(("make", "message"), BAD_LAYOUTS, ids=[f"bad-{i}" for i in range(len(BAD_LAYOUTS))])
def test_bad_layouts_raise_one_clear_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_layout_errors_are_value_errors_of_their_own_type():
    with pytest.raises(LayoutError):
        ParallelLayout.resolve(6, tensor_parallel_size=4)
