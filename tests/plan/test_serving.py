"""The serving ledger and plan (`plan.serving`) against figures computed by hand: dense models split by
tensor parallelism, and DeepSeek mixture-of-experts models served with vLLM's expert parallelism."""

from __future__ import annotations

import pytest

from lightning_tp3d import LayoutError, ModelConfig
from lightning_tp3d.plan.config import MODEL_PRESETS
from lightning_tp3d.plan.moe import MOE_PRESETS
from lightning_tp3d.plan.serving import serving_ledger, serving_plan

H, F, V, L = 4096, 11008, 102400, 30  # deepseek-llm-7b


def test_serving_kv_cache_and_deploy_alignment_by_hand():
    ledger = serving_ledger(MODEL_PRESETS["deepseek-llm-67b"], seq_len=4096, num_seqs=8, dtype="bf16")
    per_token = 2 * 95 * 8 * 128 * 2  # 2 x layers x kv_heads x head_dim x bytes
    assert ledger.kv_bytes_per_token == per_token == 389_120
    assert ledger.kv_bytes_total == per_token * 4096 * 8
    by_tp = {option.tensor_parallel_size: option for option in ledger.options}
    assert by_tp[8].kv_bytes_per_token_per_gpu == per_token // 8
    assert by_tp[16].valid and by_tp[16].kv_bytes_per_token_per_gpu == 2 * 95 * 1 * 128 * 2  # kv heads replicated
    odd = serving_ledger(ModelConfig(num_attention_heads=4, num_key_value_heads=4), seq_len=8)
    assert not {o.tensor_parallel_size: o for o in odd.options}[8].valid


def test_bad_serving_options():
    with pytest.raises(LayoutError, match=r"must be positive"):
        serving_ledger(ModelConfig(), seq_len=0)


GIB80 = 80 * 2**30
BUDGET = int(GIB80 * 0.9)  # gpu_memory_utilization 0.9


def test_serving_plan_deepseek_7b_by_hand():
    plans = {plan.tensor_parallel_size: plan for plan in serving_plan(
        MODEL_PRESETS["deepseek-llm-7b"], "deepseek-ai/deepseek-llm-7b-base", GIB80, 0.9, 4096, "bf16")}
    assert sorted(plans) == [1, 2, 4, 8, 16]
    one, eight = plans[1], plans[8]
    assert one.weight_bytes_per_gpu == 6_910_365_696 * 2
    assert one.kv_bytes_per_token_per_gpu == 2 * 30 * 32 * 128 * 2 == 491_520
    assert one.kv_bytes_per_sequence_per_gpu == 491_520 * 4096
    assert one.max_num_seqs == (BUDGET - 6_910_365_696 * 2) // (491_520 * 4096) == 31
    layer_tp8 = (2 * H * H + 3 * H * F) // 8 + 2 * H * (32 // 8) * 128 + 2 * H
    weights_tp8 = (L * layer_tp8 + 2 * V * H // 8 + H) * 2
    assert eight.weight_bytes_per_gpu == weights_tp8 == 1_728_028_672
    assert eight.kv_bytes_per_token_per_gpu == 491_520 // 8
    assert eight.max_num_seqs == (BUDGET - weights_tp8) // (491_520 // 8 * 4096) == 300
    assert eight.vllm_command == (
        "vllm serve deepseek-ai/deepseek-llm-7b-base --tensor-parallel-size 8 --dtype bfloat16"
        " --gpu-memory-utilization 0.9 --max-model-len 4096 --max-num-seqs 300")


def test_serving_plan_deepseek_67b_by_hand():
    h, f, layers, kv_heads = 8192, 22016, 95, 8
    plans = {plan.tensor_parallel_size: plan for plan in serving_plan(
        MODEL_PRESETS["deepseek-llm-67b"], "deepseek-llm-67b", GIB80, 0.9, 4096, "bf16", (1, 4, 8, 16))}
    layer_tp4 = (2 * h * h + 3 * h * f) // 4 + 2 * h * (kv_heads // 4) * 128 + 2 * h
    weights_tp4 = (layers * layer_tp4 + 2 * V * h // 4 + h) * 2
    assert plans[4].weight_bytes_per_gpu == weights_tp4 == 33_714_847_744
    assert plans[4].kv_bytes_per_token_per_gpu == 2 * layers * 2 * 128 * 2 == 97_280
    assert plans[4].max_num_seqs == (BUDGET - weights_tp4) // (97_280 * 4096) == 109
    assert plans[16].kv_bytes_per_token_per_gpu == 2 * layers * 1 * 128 * 2  # 8 kv heads replicated over 16 GPUs
    assert not plans[1].fits and plans[1].max_num_seqs == 0  # 125.6 GiB of bf16 weights on one 80 GiB GPU


def test_serving_plan_refuses_an_invalid_deploy_tp():
    with pytest.raises(LayoutError, match=r"deploy tensor_parallel_size=3 is not valid for this model: 3 does not"
                                          r" divide num_attention_heads=32"):
        serving_plan(MODEL_PRESETS["deepseek-llm-7b"], "m", GIB80, sizes=(3,))
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        serving_plan(MODEL_PRESETS["deepseek-llm-7b"], "m", GIB80, gpu_memory_utilization=1.5)


def test_serving_plan_deepseek_v2_lite_by_hand():
    """DeepSeek-V2-Lite (h 2048, 16 heads, no query latent, r_kv 512, d_r 64, d_n = d_v = 128, 27 blocks of which
    1 dense with f 10944, 26 MoE with 64 routed and 2 shared experts of f_e 1408) on 2 GPUs of 80 GiB, bf16,
    8192 tokens per sequence: attention's head-wise projections, the dense MLP, the shared experts, the
    embedding and the head split over tp; the latent projection, the norms and the router whole; the routed
    experts over the 2 GPUs either way."""
    h, experts, f_e = 2048, 64, 1408
    head_wise = h * 16 * (128 + 64) + 512 * 16 * (128 + 128) + 16 * 128 * h  # q_proj, kv_b_proj, o_proj
    whole = h * (512 + 64) + 512 + 2 * h  # kv_a_proj_with_mqa, kv_a_layernorm, the two norms
    dense_mlp, shared, router = 3 * h * 10944, 2 * 3 * h * f_e, experts * h
    routed = experts * 3 * h * f_e
    embedding = 102400 * h

    def weights(tp: int) -> int:
        dense_block = whole + (head_wise + dense_mlp) // tp
        moe_block = whole + router + (head_wise + shared) // tp + routed // 2
        return (dense_block + 26 * moe_block + 2 * embedding // tp + h) * 2

    budget = int(80 * 2**30 * 0.9)
    latent = 27 * (512 + 64) * 2  # one latent per layer and token, bf16
    plans = serving_plan(MOE_PRESETS["deepseek-v2-lite"], "deepseek-ai/DeepSeek-V2-Lite", 80 * 2**30, 0.9, 8192,
                             "bf16", (2,))
    assert [(plan.tensor_parallel_size, plan.data_parallel_size) for plan in plans] == [(2, 1), (1, 2)]
    for plan, tp in zip(plans, (2, 1)):
        assert plan.weight_bytes_per_gpu == weights(tp)
        assert plan.kv_bytes_per_token_per_gpu == latent == 31_104  # not split by tp
        assert plan.max_num_seqs == (budget - weights(tp)) // (latent * 8192)
    assert weights(2) == 15_741_869_056 and weights(1) == 17_018_117_120
    assert plans[0].vllm_command == (
        "vllm serve deepseek-ai/DeepSeek-V2-Lite --tensor-parallel-size 2 --enable-expert-parallel --dtype bfloat16"
        f" --gpu-memory-utilization 0.9 --max-model-len 8192 --max-num-seqs {plans[0].max_num_seqs}")
    assert plans[1].vllm_command.startswith(
        "vllm serve deepseek-ai/DeepSeek-V2-Lite --data-parallel-size 2 --enable-expert-parallel --dtype bfloat16")
    (one,) = serving_plan(MOE_PRESETS["deepseek-v2-lite"], "m", 80 * 2**30, sizes=(1,))
    assert one.weight_bytes_per_gpu == MOE_PRESETS["deepseek-v2-lite"].num_parameters() * 2
    assert not one.expert_parallel and "--enable-expert-parallel" not in one.vllm_command


def test_serving_plan_refuses_what_vllm_cannot_split():
    lite = MOE_PRESETS["deepseek-v2-lite"]
    # 32 GPUs: 16 heads cannot be split over 32, the 64 experts can: only the data-parallel server
    assert [(plan.tensor_parallel_size, plan.data_parallel_size) for plan in serving_plan(
        lite, "m", 80 * 2**30, sizes=(32,))] == [(1, 32)]
    with pytest.raises(LayoutError, match=r"3 GPUs cannot serve this model with expert parallelism: 3 does not divide"
                                          r" n_routed_experts=64"):
        serving_plan(lite, "m", 80 * 2**30, sizes=(3,))
    with pytest.raises(LayoutError, match=r"max_model_len=200000 exceeds the model's max_position_embeddings=163840"):
        serving_plan(lite, "m", 80 * 2**30, max_model_len=200000)
    v3_tp16 = serving_plan(MOE_PRESETS["deepseek-v3"], "m", 141 * 2**30, sizes=(16,))[0]
    assert v3_tp16.weight_bytes_per_gpu > MOE_PRESETS["deepseek-v3"].num_parameters() * 2 // 16  # latents whole
