"""The memory ledger and the training FLOPs of a DeepSeek mixture-of-experts model (`plan.moe_training`),
against sums made by hand for DeepSeek-V2-Lite (h 2048, 16 heads of 128 + 64 / 128, kv latent 512, no query
latent, 64 routed experts of 1408 with 6 per token, 2 shared, dense MLP 10944, 27 blocks of which 1 dense,
vocabulary 102400). The activation count per block is measured against one V2-Lite block in
benchmarks/moe_activation_census_cpu.json; the step's traffic in tests/models/test_deepseek.py."""

from __future__ import annotations

import math

import pytest

from lightning_tp3d.plan.layout import LayoutError, ParallelLayout
from lightning_tp3d.plan.ledger import TrainingOptions
from lightning_tp3d.plan.loss import loss_activation_bytes
from lightning_tp3d.plan.moe import MOE_PRESETS, expert_model_memory
from lightning_tp3d.plan.moe_training import (
    block_activations,
    check_moe_options,
    moe_training_flops_per_token,
    moe_training_ledger,
)

LITE = MOE_PRESETS["deepseek-v2-lite"]


def test_a_blocks_activations_by_hand():
    """Per token, bytes: norms 4 h in the residual stream's dtype, under autocast 4 h of 16-bit casts, latents
    2 r_kv + 2 d_r, heads a (4 d_n + 3 d_r + 4 d_v + 1) / t, the float32 router 2 N + 2 K (+ h under bf16-true),
    routed K (2 h + 4 I) in the weights' dtype, shared 4 n_s I / t; a dense block 4 f / t instead."""
    assert block_activations(LITE, 1, 1, "32-true") == {
        "norms": 4 * 2048 * 4, "casts": 0, "latents": (1024 + 128) * 4, "heads": 16 * (512 + 192 + 512 + 1) * 4,
        "router": 4 * (128 + 12), "routed": 6 * (4096 + 4 * 1408) * 4, "shared": 4 * 2 * 1408 * 4}
    mixed = block_activations(LITE, 1, 2, "bf16-mixed")  # the experts compute in the fp32 master weights' dtype
    assert mixed["norms"] == 4 * 2048 * 4 and mixed["casts"] == 4 * 2048 * 2
    assert mixed["routed"] == 6 * (4096 + 4 * 1408) * 4 and mixed["router"] == 4 * (128 + 12)
    assert mixed["heads"] == 16 * 1217 / 2 * 2 and mixed["shared"] == 4 * 2 * 1408 / 2 * 2
    assert block_activations(LITE, 0, 2, "bf16-true") == {
        "norms": 4 * 2048 * 2, "casts": 0, "latents": 1152 * 2, "heads": 16 * 1217 / 2 * 2, "mlp": 4 * 10944 / 2 * 2}
    assert block_activations(LITE, 1, 1, "bf16-true")["router"] == 4 * (128 + 12 + 2048)
    assert sum(block_activations(LITE, 1, 1, "32-true").values()) == 394_352


def test_flops_per_token_by_hand():
    """6 x the matmul parameters a token uses + 3 x the attention core's forward (s = 4096), recompute adding a
    forward of the blocks (full) or of the MLA (selective)."""
    attention = 2048 * 16 * 192 + 2048 * 576 + 512 * 16 * 256 + 16 * 128 * 2048  # q, kv_a, kv_b, o
    assert attention == 13_762_560
    blocks = 27 * attention + 3 * 2048 * 10944 + 26 * ((6 + 2) * 3 * 2048 * 1408 + 64 * 2048)
    core = 2 * 4096 * 16 * (192 + 128) * 27
    assert moe_training_flops_per_token(LITE, 4096) == 6 * (blocks + 102400 * 2048) + 3 * core == 18_105_237_504
    assert moe_training_flops_per_token(LITE, 4096, "full") == 18_105_237_504 + 2 * blocks + core
    assert moe_training_flops_per_token(LITE, 4096, "selective") == 18_105_237_504 + 2 * 27 * attention + core


def test_the_ledger_of_a_pipelined_expert_parallel_layout():
    """(2, 3, 4) E 4, 1F1B with 6 micro-batches of 2 x 1024 tokens, FSDP2, bf16-mixed: each rank's weights,
    gradients and optimizer state are `expert_model_memory`'s; its activations the blocks' per token x the
    tokens x the micro-batches in flight (3, 2, 1), the last stage's loss path on top; FSDP2 keeps the stage
    gathered through the step (the default under pipelining) or, resharding, two of its largest blocks."""
    layout = ParallelLayout(tensor_parallel_size=2, pipeline_parallel_size=3, data_parallel_size=4,
                            micro_batch_size=2, num_microbatches=6, expert_parallel_size=4)
    options = TrainingOptions(seq_len=1024, precision="bf16-mixed", data_parallel_mode="fsdp")
    ledger = moe_training_ledger(LITE, layout, options)
    held = expert_model_memory(LITE, layout, "bf16-mixed", "fsdp")
    tokens = 2 * 1024
    for stage, memory in zip(ledger.stages, held):
        layers = range(*stage.layer_spans[0])  # the layout's split of the 27 blocks
        per_token = sum(sum(block_activations(LITE, layer, 2, "bf16-mixed").values()) for layer in layers)
        loss = loss_activation_bytes(tokens, 102400 // 2, 2) if stage.stage == 2 else 0
        assert stage.in_flight_microbatches == 3 - stage.stage
        assert stage.activation_bytes == math.ceil((per_token * tokens + loss) * (3 - stage.stage))  # none recomputed
        assert (stage.weight_bytes, stage.gradient_bytes, stage.optimizer_bytes) == (
            memory.weight_bytes, memory.gradient_bytes, memory.optimizer_bytes)
        assert stage.parameters == memory.parameters + memory.expert_parameters
        assert stage.gathered_weight_bytes == 4 * stage.parameters
    resharded = moe_training_ledger(LITE, layout, TrainingOptions(seq_len=1024, precision="bf16-mixed",
                                                                  data_parallel_mode="fsdp",
                                                                  fsdp_reshard_after_forward=True))
    largest = sum(LITE.block_parameters_per_rank(1, 2, 4))  # an MoE block: its 16 experts and the rest over tp
    assert resharded.stages[1].gathered_weight_bytes == 2 * 4 * largest


def test_recompute_keeps_the_inputs_and_adds_back_one_block():
    """Full recompute: each block keeps its input (h per token), the peak adds back the most one recomputed
    block drops, or the loss path when larger; selective (the MLA) drops the latents and the heads."""
    layout = ParallelLayout(micro_batch_size=1)
    tokens, stage = 4096, {}
    for recompute in ("none", "full", "selective"):
        options = TrainingOptions(seq_len=tokens, precision="bf16-mixed", recompute=recompute)
        stage[recompute] = moe_training_ledger(LITE, layout, options).stages[0].activation_bytes
    moe = block_activations(LITE, 1, 1, "bf16-mixed")
    loss = loss_activation_bytes(tokens, 102400, 2)
    dropped = sum(moe.values()) - 2048 * 4  # a block keeps its float32 input
    assert stage["full"] == math.ceil(27 * 2048 * 4 * tokens + loss + max(0, dropped * tokens - loss))
    attention = moe["latents"] + moe["heads"] + 2048 * 2 * 2  # and q_proj's and kv_a's 16-bit inputs
    dense = block_activations(LITE, 0, 1, "bf16-mixed")
    kept = sum(dense.values()) - attention + 26 * (sum(moe.values()) - attention)
    assert stage["selective"] == math.ceil(kept * tokens + loss + max(0, attention * tokens - loss))
    assert stage["none"] > stage["selective"] > stage["full"]


@pytest.mark.parametrize(("layout", "options", "message"), [
    (ParallelLayout(tensor_parallel_size=3, data_parallel_size=1), TrainingOptions(),
     "tensor_parallel_size=3 does not divide num_attention_heads=16"),
    (ParallelLayout(data_parallel_size=6, expert_parallel_size=6), TrainingOptions(),
     "expert_parallel_size=6 does not divide the 64 routed experts"),
    (ParallelLayout(pipeline_parallel_size=28), TrainingOptions(), "28 pipeline stages for 27 blocks"),
    (ParallelLayout(), TrainingOptions(lora_rank=8), "counts full training only"),
])
def test_what_the_moe_plan_cannot_count_is_refused(layout, options, message):
    with pytest.raises(LayoutError, match=message):
        check_moe_options(LITE, layout, options)


def test_the_recomputed_block_is_added_back_once_whatever_the_micro_batches_in_flight():
    """Under 1F1B stage 0 of (1, 2, 1) holds 4 micro-batches' kept inputs, and once the block it recomputes."""
    layout = ParallelLayout(pipeline_parallel_size=2, micro_batch_size=1, num_microbatches=4)
    stage = moe_training_ledger(LITE, layout, TrainingOptions(seq_len=4096, precision="bf16-mixed",
                                                              recompute="full")).stages[0]
    blocks = range(*stage.layer_spans[0])
    dropped = max(sum(block_activations(LITE, layer, 1, "bf16-mixed").values()) - 2048 * 4 for layer in blocks)
    assert stage.in_flight_microbatches == 2
    assert stage.activation_bytes == math.ceil(2 * len(blocks) * 2048 * 4 * 4096 + dropped * 4096)
