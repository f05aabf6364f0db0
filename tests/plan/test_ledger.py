"""The memory ledger against figures computed by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_tp3d import LayoutError, ModelConfig, ParallelLayout
from lightning_tp3d.plan.config import MODEL_PRESETS
from lightning_tp3d.plan.ledger import TrainingOptions, training_ledger
from lightning_tp3d.plan.loss import loss_activation_bytes
from lightning_tp3d.plan.qlora import NF4_FORMAT

H, F, V, L = 4096, 11008, 102400, 30  # deepseek-llm-7b
LAYER_7B = 4 * H * H + 3 * H * F + 2 * H  # q, k, v, o; gate, up, down; two norms
LAYER_7B_TP8 = (4 * H * H + 3 * H * F) // 8 + 2 * H


def test_deepseek_7b_parameter_count():
    assert LAYER_7B == 202_383_360
    assert MODEL_PRESETS["deepseek-llm-7b"].num_parameters() == L * LAYER_7B + 2 * V * H + H == 6_910_365_696


def test_deepseek_7b_at_tp8_pp4_dp2_by_hand():
    layout = ParallelLayout(tensor_parallel_size=8, pipeline_parallel_size=4, data_parallel_size=2,
                            num_microbatches=8)
    ledger = training_ledger(MODEL_PRESETS["deepseek-llm-7b"], layout, TrainingOptions(precision="bf16-mixed"))
    assert [stage.num_layers for stage in ledger.stages] == [7, 8, 8, 7]
    expected = [7 * LAYER_7B_TP8 + V * H // 8, 8 * LAYER_7B_TP8, 8 * LAYER_7B_TP8, 7 * LAYER_7B_TP8 + H + V * H // 8]
    assert [stage.parameters for stage in ledger.stages] == expected == [229_564_416, 202_440_704, 202_440_704,
                                                                         229_568_512]
    last = ledger.stages[-1]
    assert (last.weight_bytes, last.gradient_bytes, last.optimizer_bytes) == (4 * expected[-1], 4 * expected[-1],
                                                                              8 * expected[-1])
    assert [stage.in_flight_microbatches for stage in ledger.stages] == [4, 3, 2, 1]
    # activations of stage 1: 8 layers x 3 micro-batches x s b [4h + (a + k) d / t + 5h / t + 4f / t] x 2 bytes
    per_layer = 4096 * (4 * H + (2 * H + 5 * H + 4 * F) // 8)
    assert ledger.stages[1].activation_bytes == 8 * 3 * per_layer * 2
    assert ledger.model_parameters == 6_910_365_696


def test_fsdp_divides_state_by_dp_and_recompute_keeps_layer_inputs():
    config = ModelConfig()
    layout = ParallelLayout(data_parallel_size=4)
    replicate = training_ledger(config, layout, TrainingOptions(seq_len=32, precision="32-true")).stages[0]
    fsdp = training_ledger(config, layout, TrainingOptions(seq_len=32, precision="32-true",
                                                            data_parallel_mode="fsdp")).stages[0]
    assert fsdp.weight_bytes * 4 == replicate.weight_bytes
    assert fsdp.optimizer_bytes * 4 == replicate.optimizer_bytes
    recompute = training_ledger(config, layout, TrainingOptions(seq_len=32, precision="32-true",
                                                                recompute="full")).stages[0]
    # the logits and their gradient in fp32, and two fp32 chunks of the loss (here the whole logits)
    logits = 2 * 32 * config.vocab_size * 4 + 2 * 32 * config.vocab_size * 4
    assert loss_activation_bytes(32, config.vocab_size, 4) == logits
    # bf16: the logits and their gradient in bf16; three chunks of at most 2^24 logits in fp32
    assert loss_activation_bytes(4096, 128_000, 2) == 2 * 4096 * 128_000 * 2 + 3 * (1 << 24) * 4
    layer = 32 * (4 * 64 + (6 * 16 + 5 * 64 + 4 * 128))
    assert replicate.activation_bytes == 4 * layer * 4 + logits
    # the logits are freed before the layers' backward; then one layer is recomputed at a time
    assert recompute.activation_bytes == 4 * 32 * 64 * 4 + max(logits, (layer - 32 * 64) * 4)
    selective = training_ledger(config, layout, TrainingOptions(seq_len=32, precision="32-true",
                                                                recompute="selective")).stages[0]
    kept = layer - 32 * (64 + 4)  # the attention core's output and softmax statistics are dropped
    assert selective.activation_bytes == 4 * kept * 4 + logits
    every_other = training_ledger(config, layout, TrainingOptions(
        seq_len=32, precision="32-true", recompute="full", recompute_num_layers=2)).stages[0]
    assert every_other.activation_bytes == (2 * layer + 2 * 32 * 64) * 4 + max(logits, (layer - 32 * 64) * 4)
    first_of_stage = training_ledger(config, ParallelLayout(pipeline_parallel_size=2), TrainingOptions(
        seq_len=32, precision="32-true", recompute="full", recompute_method="block", recompute_num_layers=1,
        schedule="gpipe"))  # one micro-batch: GPipe (1F1B needs one per stage)
    assert [stage.num_layers for stage in first_of_stage.stages] == [2, 2]
    assert first_of_stage.stages[0].activation_bytes == (layer + 32 * 64) * 4 + (layer - 32 * 64) * 4
    # with 4 micro-batches in flight (GPipe) each keeps its share; the recomputed layer comes back once
    in_flight = training_ledger(config, ParallelLayout(pipeline_parallel_size=2, num_microbatches=4), TrainingOptions(
        seq_len=32, precision="32-true", recompute="full", recompute_method="block", recompute_num_layers=1,
        schedule="gpipe"))
    assert in_flight.stages[0].activation_bytes == 4 * (layer + 32 * 64) * 4 + (layer - 32 * 64) * 4


def test_bad_training_options():
    with pytest.raises(ValueError, match=r"precision='fp8' is not one of"):
        TrainingOptions(precision="fp8")


def test_zero1_divides_only_the_optimizer_state_by_dp():
    config = ModelConfig()
    layout = ParallelLayout(data_parallel_size=4)
    replicate, zero1 = (training_ledger(config, layout, TrainingOptions(seq_len=32, precision="32-true",
                                                                        data_parallel_mode=mode)).stages[0]
                        for mode in ("replicate", "zero1"))
    assert zero1.weight_bytes == replicate.weight_bytes and zero1.gradient_bytes == replicate.gradient_bytes
    assert zero1.optimizer_bytes == -(-replicate.parameters // 4) * 8  # AdamW's two fp32 moments, a quarter
    assert zero1.activation_bytes == replicate.activation_bytes and zero1.gathered_weight_bytes == 0


QLORA_CONFIG = ModelConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                           num_key_value_heads=8, vocab_size=1000, max_position_embeddings=64)


def test_a_qlora_base_costs_its_nf4_bytes_by_hand():
    """QLoRA r 8 on q, v in bf16-true at the paper's blocks (64 x 256 = 16384 weights per factor). NF4 bytes
    of an n-weight tensor: n / 2 + n / 64 + (n / 16384 + 17) x 2. A 512 x 512 projection: 131072 + 4096 + 66
    = 135234, a 1024 x 512 one 270434; a block 4 x 135234 + 3 x 270434 = 1352238, its norms 2048 and factors
    (2 x 8 x 1024 elements) 32768; embedding and head 1024000 each, the final norm 1024."""
    options = TrainingOptions(seq_len=64, precision="bf16-true", lora_rank=8, lora_targets=("q_proj", "v_proj"),
                              qlora=NF4_FORMAT)
    stage = training_ledger(QLORA_CONFIG, ParallelLayout(), options).stages[0]
    assert stage.weight_bytes == 2 * (1352238 + 2048 + 32768) + 2 * 1024000 + 1024
    assert (stage.gradient_bytes, stage.optimizer_bytes) == (2 * 32768, 4 * 32768)
    # FSDP over 2: each projection's shard is an NF4 tensor of n / 2 (a 512 x 512 one 65536 + 2048 + 50 bytes,
    # a 1024 x 512 one 135234), the dense rest halved; each block gathered whole, two at a time
    fsdp = training_ledger(QLORA_CONFIG, ParallelLayout(data_parallel_size=2),
                           replace(options, data_parallel_mode="fsdp")).stages[0]
    dense = (6302208 - 2 * 2621440) // 2  # the stage's elements, less the NF4 projections', on one rank
    assert fsdp.weight_bytes == 2 * dense + 2 * (4 * 67634 + 3 * 135234)
    assert fsdp.gathered_weight_bytes == 2 * (2 * (2638848 - 2621440) + 1352238)
    assert (fsdp.gradient_bytes, fsdp.optimizer_bytes) == (32768, 2 * 32768)


def test_a_qlora_plan_refuses_what_training_refuses():
    options = TrainingOptions(seq_len=64, lora_rank=8, qlora=NF4_FORMAT)
    with pytest.raises(LayoutError, match="tensor parallelism cannot split a 4-bit NF4 weight"):
        training_ledger(QLORA_CONFIG, ParallelLayout(tensor_parallel_size=2), options)
    with pytest.raises(LayoutError, match=r"self_attn.q_proj \(512 x 512, NF4\) cannot be sharded by FSDP over dp=64"):
        training_ledger(QLORA_CONFIG, ParallelLayout(data_parallel_size=64),
                        replace(options, data_parallel_mode="fsdp"))
    with pytest.raises(ValueError, match="multiple of 16384 elements; pick smaller blocks"):
        training_ledger(ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=4, vocab_size=100), ParallelLayout(), options)
    with pytest.raises(ValueError, match="qlora needs lora_rank > 0"):
        TrainingOptions(qlora=NF4_FORMAT)
