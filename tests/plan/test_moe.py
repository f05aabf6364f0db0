"""Parameters of DeepSeek's mixture-of-experts decoders (`plan.moe`): the formula against transformers'
own `DeepseekV3ForCausalLM` (exact counts, three tiny shapes), and the presets against sums made by hand
from the published config.json files and against the published totals.
"""

from __future__ import annotations

import fnmatch
import json

import pytest

from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.moe import (
    MOE_PRESETS,
    MoEModelConfig,
    expert_ledger,
    expert_model_memory,
    planner_config,
    resolve_moe_config,
)

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=16,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, tie_word_embeddings=False)


@pytest.mark.parametrize("changes", [{}, dict(q_lora_rank=None, first_k_dense_replace=0, n_shared_experts=2),
                                     dict(tie_word_embeddings=True, first_k_dense_replace=4)])
def test_the_formula_counts_transformers_parameters(changes):
    config = transformers.DeepseekV3Config(**(TINY | changes))
    model = transformers.DeepseekV3ForCausalLM(config)
    shape = MoEModelConfig.from_dict(config.to_dict())
    assert shape.num_parameters() == sum(parameter.numel() for parameter in model.parameters())
    experts = sum(parameter.numel() for name, parameter in model.named_parameters() if ".mlp.experts." in name)
    assert shape.routed_expert_parameters() == experts


def test_deepseek_v3_has_671b_parameters_and_37b_active():
    """By hand, per block: attention 7168 x 1536 + 1536 + 1536 x 128 x 192 + 7168 x 576 + 512 + 512 x 128 x 256
    + 128 x 128 x 7168 = 187,107,328, norms 14,336; dense MLP 3 x 7168 x 18432 = 396,361,728; one expert
    3 x 7168 x 2048 = 44,040,192, the MoE MLP 257 experts + the router 256 x 7168 = 11,320,164,352. Total
    3 x 583,483,392 + 58 x 11,507,286,016 + 2 x 129280 x 7168 + 7168 = 671,026,404,352; active: 8 routed
    experts instead of 256 and no input embedding, 36,625,603,584."""
    v3 = MOE_PRESETS["deepseek-v3"]
    assert v3.num_parameters() == 671_026_404_352
    assert v3.active_parameters() == 36_625_603_584
    assert round(v3.num_parameters() / 1e9) == 671 and round(v3.active_parameters() / 1e9) == 37  # the report's
    assert v3.routed_expert_parameters() == 58 * 256 * 44_040_192


def test_deepseek_v2_lite_has_15_7b_parameters_and_2_4b_active():
    """By hand: attention 2048 x 3072 (q_proj) + 2048 x 576 + 512 + 512 x 16 x 256 + 2048 x 2048 = 13,763,072,
    norms 4,096; dense MLP 3 x 2048 x 10944 = 67,239,936; one expert 3 x 2048 x 1408 = 8,650,752, the MoE MLP
    66 experts + the router 64 x 2048 = 571,080,704. Total 81,007,104 + 26 x 584,847,872 + 2 x 102400 x 2048
    + 2048 = 15,706,484,224; active (6 routed experts, no input embedding) 2,451,435,008."""
    lite = MOE_PRESETS["deepseek-v2-lite"]
    assert lite.num_parameters() == 15_706_484_224
    assert lite.active_parameters() == 2_451_435_008
    assert round(lite.num_parameters() / 1e8) == 157 and int(lite.active_parameters() / 1e8) == 24  # '2.4B'


def test_shapes_out_of_range_are_refused():
    with pytest.raises(ValueError, match="first_k_dense_replace=5 must be between 0 and num_hidden_layers=4"):
        MoEModelConfig.from_dict(TINY | dict(first_k_dense_replace=5))
    with pytest.raises(ValueError, match="num_experts_per_tok=5 must be between 1 and n_routed_experts=4"):
        MoEModelConfig.from_dict(TINY | dict(num_experts_per_tok=5))


def test_expert_parallelism_per_rank_and_its_all_to_all_payloads():
    """DeepSeek-V3 at E = 64 (its training's expert parallelism), by hand: 58 x 256 x 44,040,192 / 64 =
    10,217,324,544 routed-expert parameters per rank; a micro-batch of 4096 tokens dispatches 4096 x 8 x 7168
    = 234,881,024 elements per rank and MoE block, and the group gets back 64 times that."""
    v3 = MOE_PRESETS["deepseek-v3"]
    assert v3.routed_expert_parameters_per_rank(64) == 10_217_324_544
    exchange = v3.expert_exchange(tokens=4096, expert_parallel_size=64)
    assert (exchange.counts, exchange.dispatch, exchange.returned_in_group) == (256, 234_881_024, 15_032_385_536)
    with pytest.raises(ValueError, match="expert_parallel_size=3 does not divide the 256 routed experts"):
        v3.routed_expert_parameters_per_rank(3)


def test_the_expert_ledger_counts_five_all_to_alls_per_moe_block_and_micro_batch():
    """DeepSeek-V3 at tp 8, pp 16, dp 64, E = 8, 32 micro-batches of 4096 tokens, bf16-mixed, by hand: the
    63 units (61 blocks, embedding, head) split 3 + 4 x 14 + 3, so stage 0 holds 2 of the 3 dense blocks
    (no all-to-all) and stage 15 three MoE blocks: 32 x 3 x 5 calls; per block and micro-batch 256 int64 counts,
    234,881,024 elements dispatched and returned in fp32 (the residual stream) and combined and returned in
    fp32 (the experts' outputs: transformers' grouped_mm experts compute in the master weights' dtype); 7/8 of
    each crosses a link with uniform routing; under bf16-true all four in bf16."""
    layout = ParallelLayout(tensor_parallel_size=8, pipeline_parallel_size=16, data_parallel_size=64,
                            num_microbatches=32, expert_parallel_size=8)
    ledger = expert_ledger(MOE_PRESETS["deepseek-v3"], layout, 4096, "bf16-mixed")
    assert ledger.totals(0)["ep"]["calls"] == 0 and ledger.group_sizes == {"ep": 8}
    last = ledger.totals(15)["ep"]
    per_block = 256 * 8 + 234_881_024 * (4 + 4 + 4 + 4)
    assert last["calls"] == 32 * 3 * 5 and last["payload_bytes"] == 32 * 3 * per_block
    assert last["sent_bytes"] == pytest.approx(7 / 8 * last["payload_bytes"])
    sixteen = expert_ledger(MOE_PRESETS["deepseek-v3"], layout, 4096, "bf16-true").totals(15)["ep"]
    assert sixteen["payload_bytes"] == 32 * 3 * (256 * 8 + 234_881_024 * (2 + 2 + 2 + 2))
    assert expert_ledger(MOE_PRESETS["deepseek-v3"], layout.__class__(data_parallel_size=64), 4096,
                         "32-true").totals(0)["ep"]["calls"] == 0  # E = 1: no exchange


def test_under_an_interleaved_schedule_each_rank_counts_the_moe_blocks_of_all_its_stages():
    """DeepSeek-V2-Lite (27 blocks, the first dense) at pp 2 with interleaved 1F1B (2 stages per rank: 29 units
    over 4 stages of 6, 7, 7, 7 blocks): rank 0 holds blocks 0-5 and 13-19 (12 MoE blocks, the embedding),
    rank 1 blocks 6-12 and 20-26 (14 MoE blocks, the head); 8 micro-batches: 8 x 12 x 5 and 8 x 14 x 5
    all-to-alls; each rank's memory is its stages' blocks' (the same per-block split as one stage per rank)."""
    lite = MOE_PRESETS["deepseek-v2-lite"]
    layout = ParallelLayout(pipeline_parallel_size=2, data_parallel_size=8, num_microbatches=8,
                            expert_parallel_size=4)
    ledger = expert_ledger(lite, layout, 4096, "bf16-mixed", "interleaved_1f1b", 2)
    assert [ledger.totals(rank)["ep"]["calls"] for rank in (0, 1)] == [8 * 12 * 5, 8 * 14 * 5]
    memory = expert_model_memory(lite, layout, "bf16-mixed", "replicate", "interleaved_1f1b", 2)
    assert [stage.layers for stage in memory] == [(range(0, 6), range(13, 20)), (range(6, 13), range(20, 27))]
    blocks = [lite.block_parameters_per_rank(layer, 1, 4) for layer in range(27)]
    vocab = lite.vocab_size * lite.hidden_size
    for stage, extra in zip(memory, (vocab, vocab + lite.hidden_size)):
        held = [blocks[layer] for layers in stage.layers for layer in layers]
        assert stage.parameters == sum(dense for dense, _ in held) + extra
        assert stage.expert_parameters == sum(routed for _, routed in held)
    one_stage = expert_model_memory(lite, layout, "bf16-mixed", "replicate")
    assert [stage.layers for stage in one_stage] == [(range(0, 13),), (range(13, 27),)]


def test_a_deepseek_config_json_is_read_as_a_mixture_of_experts_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY | {"model_type": "deepseek_v3", "rope_theta": 1e4}))
    assert resolve_moe_config(tmp_path) == MoEModelConfig.from_dict(TINY)
    assert resolve_moe_config("deepseek-v2-lite") is MOE_PRESETS["deepseek-v2-lite"]
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 256, "hidden_size": 64}))
    assert resolve_moe_config(tmp_path) is None and resolve_moe_config("deepseek-llm-7b") is None


@pytest.mark.parametrize("changes", [{}, dict(q_lora_rank=None, n_shared_experts=2)])
def test_each_blocks_share_per_rank_follows_the_deepseek_tp_plan(changes):
    """Every parameter of a transformers DeepseekV3ForCausalLM, divided by tp where `models.deepseek`'s plan
    splits its module (column, row parallel; `SharedAcrossHeads` keeps it whole) and by E for the routed
    experts: per block, the formula's split at tp 2, E 2."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from lightning_tp3d.models.families import resolve_model_adapter

    config = transformers.DeepseekV3Config(**(TINY | changes))
    network = transformers.DeepseekV3ForCausalLM(config)
    plan = resolve_model_adapter(network).tp_plan()
    shape = MoEModelConfig.from_dict(config.to_dict())
    for layer, block in enumerate(network.model.layers):
        held, experts = 0, 0
        for name, parameter in block.named_parameters():
            module = f"model.layers.{layer}.{name.rpartition('.')[0]}"
            styles = [style for pattern, style in plan.items() if fnmatch.fnmatchcase(module, pattern)]
            if ".experts." in f".{name}":
                experts += parameter.numel() // 2
            elif any(isinstance(style, ColwiseParallel | RowwiseParallel) for style in styles):
                held += parameter.numel() // 2
            else:
                held += parameter.numel()
        assert shape.block_parameters_per_rank(layer, 2, 2) == (held, experts), layer


def test_the_memory_per_rank_adds_up_to_the_model_and_shards_as_each_mode_says():
    """At tp 1, pp 1, dp 1 a rank holds the whole model; at dp 4 with E = 2 (two replicas of each expert
    group) FSDP2 cuts the non-expert parameters 4 ways and the experts 2 ways, ZeRO-1 only their optimizer
    state (fp32: 4 + 4 + 8 bytes per parameter)."""
    shape = MoEModelConfig.from_dict(TINY)
    (whole,) = expert_model_memory(shape, ParallelLayout(), "32-true", "replicate")
    assert whole.parameters + whole.expert_parameters == shape.num_parameters()
    assert (whole.weight_bytes, whole.gradient_bytes, whole.optimizer_bytes) == tuple(
        size * shape.num_parameters() for size in (4, 4, 8))
    layout = ParallelLayout(data_parallel_size=4, expert_parallel_size=2)
    (fsdp,) = expert_model_memory(shape, layout, "32-true", "fsdp")
    (zero1,) = expert_model_memory(shape, layout, "32-true", "zero1")
    assert fsdp.expert_parameters == shape.routed_expert_parameters() // 2
    cut = -(-fsdp.parameters // 4) + -(-fsdp.expert_parameters // 2)
    assert (fsdp.weight_bytes, fsdp.gradient_bytes, fsdp.optimizer_bytes) == (4 * cut, 4 * cut, 8 * cut)
    assert (zero1.weight_bytes, zero1.optimizer_bytes) == (4 * (zero1.parameters + zero1.expert_parameters), 8 * cut)


@pytest.mark.parametrize("changes", [{}, dict(q_lora_rank=None, first_k_dense_replace=0, n_shared_experts=2)])
def test_block_tensors_are_transformers_parameters_in_their_order(changes):
    """`block_tensors` at tp 1: each block's parameters but the routed experts, shapes in registration order
    (the order FSDP2, the replicate buckets and ZeRO-1's buckets take them in); at tp 2 the split dims halve."""
    config = transformers.DeepseekV3Config(**(TINY | changes))
    model = transformers.DeepseekV3ForCausalLM(config)
    shape = MoEModelConfig.from_dict(config.to_dict())
    for layer, block in enumerate(model.model.layers):
        expected = [tuple(parameter.shape) for name, parameter in block.named_parameters() if ".experts." not in name]
        assert [tensor for tensor, _ in shape.block_tensors(layer, 1)] == expected, layer
        for (whole, dim), (split, _) in zip(shape.block_tensors(layer, 1), shape.block_tensors(layer, 2)):
            assert split == (whole if dim is None else tuple(size // 2 if index == dim else size
                                                            for index, size in enumerate(whole)))


def test_the_planner_reads_a_records_shape_or_none():
    """A DeepSeek record is planned as a mixture of experts, a Llama record as a dense decoder; another MoE
    family (Mixtral, Qwen3-MoE), which the planner does not model, is None, not a dense decoder."""
    deepseek = transformers.DeepseekV3Config(**TINY).to_dict()
    assert planner_config(deepseek) == MoEModelConfig.from_dict(deepseek)
    llama = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256).to_dict()
    assert planner_config(llama).hidden_size == 64 and not isinstance(planner_config(llama), MoEModelConfig)
    for config in (transformers.MixtralConfig(num_local_experts=4), transformers.Qwen3MoeConfig(num_experts=4)):
        assert planner_config(config.to_dict()) is None
