"""`plan/lora.py`: the factors a LoRA fine-tune adds, per tp rank, and what they cost in FLOPs."""

from __future__ import annotations

import pytest

from lightning_tp3d.plan.config import MODEL_PRESETS
from lightning_tp3d.plan.ledger import TrainingOptions, training_flops_per_token
from lightning_tp3d.plan.lora import LORA_TARGETS, lora_layer_shapes


def test_factors_shard_with_their_base_layer():
    config = MODEL_PRESETS["tiny"]  # h 64, f 128, 4 heads of 16, 2 kv heads: q 64 x 64, k / v 32 x 64
    h, f, kv = 64, 128, 32
    assert lora_layer_shapes(config, 2, 8, ("q_proj", "k_proj", "o_proj", "down_proj")) == [
        ((8, h), None), ((h // 2, 8), 0),  # q: column parallel, A whole, B's rows split
        ((8, h), None), ((kv // 2, 8), 0),  # k
        ((8, h // 2), 1), ((h, 8), None),  # o: row parallel, A's columns split, B whole
        ((8, f // 2), 1), ((h, 8), None),  # down
    ]
    assert lora_layer_shapes(config, 2, 0, LORA_TARGETS) == []


def test_a_lora_fine_tune_computes_no_weight_gradient_for_the_frozen_matmuls():
    config, s, r = MODEL_PRESETS["tiny"], 64, 8
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    matmul = layers * (2 * h * h + 2 * h * 32 + 3 * h * config.intermediate_size)
    factors = layers * sum(rows * columns for (rows, columns), _ in lora_layer_shapes(config, 1, r, ("q_proj",)))
    assert factors == layers * r * (h + h)
    assert training_flops_per_token(config, s, lora_rank=r, lora_targets=("q_proj",)) == (
        4 * (matmul + vocab * h) + 6 * factors + 12 * layers * h * s)


@pytest.mark.parametrize(("rank", "targets", "message"), [
    (-1, ("q_proj",), "lora_rank=-1 must be >= 0"),
    (8, ("lm_head",), r"lora_targets \['lm_head'\] must be among"),
    (8, (), r"lora_targets \[\] must be among"),
])
def test_bad_lora_options_are_refused_naming_the_choices(rank, targets, message):
    with pytest.raises(ValueError, match=message):
        TrainingOptions(lora_rank=rank, lora_targets=targets)
