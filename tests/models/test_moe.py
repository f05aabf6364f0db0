"""The fused-expert mixture-of-experts family (`models.moe`): which networks it takes, its tensor-parallel
plan and the features it refuses. Its parity with one process (Qwen3-MoE at (2, 1, 2), Mixtral at (1, 2, 2)
1F1B with FSDP2, both with their experts over 2 ranks) runs in `tests/models/test_huggingface.py`."""

from __future__ import annotations

import pytest
from torch.distributed.tensor.parallel import SequenceParallel

from lightning_tp3d.models.families import resolve_model_adapter
from lightning_tp3d.models.huggingface import HuggingFaceCausalLMAdapter
from lightning_tp3d.models.moe import HuggingFaceMoEAdapter
from lightning_tp3d.parallel.tensor import ReplicateBlockInput, check_plan_matches
from tests.models.test_huggingface import SHAPE, hf_network

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral"])
def test_fused_expert_models_get_the_moe_adapter_and_every_moe_block_its_experts(architecture):
    network = hf_network(architecture)
    adapter = resolve_model_adapter(network)
    assert type(adapter) is HuggingFaceMoEAdapter
    experts = adapter.routed_experts(network.model.layers)
    dense = (0,) if architecture == "qwen3_moe" else ()  # the test's Qwen3-MoE has mlp_only_layers=[0]
    assert adapter.dense_layers == dense
    assert [parent for parent, _ in experts] == [block.mlp for index, block in enumerate(network.model.layers)
                                                 if index not in dense]
    assert {attribute for _, attribute in experts} == {"experts"}


def test_the_plan_splits_attention_and_dense_mlps_and_leaves_routers_and_experts_whole():
    network = hf_network("qwen3_moe")
    plan = resolve_model_adapter(network).tp_plan()
    check_plan_matches(network, plan, "qwen3_moe")  # every entry names a module of the network
    assert {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj"} <= plan.keys()
    assert isinstance(plan["model.layers.0.mlp"], ReplicateBlockInput)
    assert not any(pattern.startswith(("model.layers.*.mlp", "model.layers.1.mlp")) for pattern in plan)
    assert isinstance(plan["model.layers.*.self_attn.q_norm"], SequenceParallel)  # per-head norms: grads summed
    assert "model.layers.*.self_attn.q_norm" not in resolve_model_adapter(hf_network("mixtral")).tp_plan()


def test_qwen3_dense_attention_norms_are_in_the_causal_lm_plan():
    config = transformers.Qwen3Config(**SHAPE)
    adapter = resolve_model_adapter(transformers.Qwen3ForCausalLM(config))
    assert type(adapter) is HuggingFaceCausalLMAdapter and adapter.head_norms
    assert {"model.layers.*.self_attn.q_norm", "model.layers.*.self_attn.k_norm"} <= adapter.tp_plan().keys()
    assert not resolve_model_adapter(hf_network("llama")).head_norms


@pytest.mark.parametrize(("features", "named"), [(dict(compiled=True), "compile"),
                                                  (dict(float8="tensorwise"), "float8")])
def test_features_not_yet_tested_with_moe_blocks_are_refused(features, named):
    adapter = resolve_model_adapter(hf_network("mixtral"))
    with pytest.raises(ValueError, match=f"{named}.*mixture-of-experts causal LM.*not supported yet; train it with"):
        adapter.check_features(**features)
    adapter.check_features(recompute="selective", peft=True)
