"""The one split table agrees with the reference decoder, the tensor-parallel plan and the ledger."""

import math

import pytest
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_tp3d.models import LlamaForCausalLM
from lightning_tp3d.models.adapter import llama_tp_plan
from lightning_tp3d.parallel.tensor import ReplicateBlockInput
from lightning_tp3d.plan.config import MODEL_PRESETS, ModelConfig
from lightning_tp3d.plan.sharding import (
    LAYER_WEIGHTS,
    hf_tensor_names,
    layer_parameters_per_rank,
    split_dim,
)

CONFIG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)


def test_table_names_and_shapes_are_the_reference_decoders() -> None:
    parameters = dict(LlamaForCausalLM(CONFIG).named_parameters())
    assert hf_tensor_names(CONFIG) == list(parameters)
    for weight in LAYER_WEIGHTS:
        assert tuple(parameters[f"model.layers.1.{weight.module}.weight"].shape) == weight.shape(CONFIG)


def test_tp_plan_styles_follow_the_split_dims() -> None:
    expected_dim = {ColwiseParallel: 0, RowwiseParallel: 1}
    plan = llama_tp_plan()
    for pattern, style in plan.items():
        if pattern.startswith("model.layers.") and not isinstance(style, ReplicateBlockInput):
            assert split_dim(pattern.replace("*", "0") + ".weight") == expected_dim[type(style)], pattern
    # The sub-blocks whose column-parallel projections share one input get it replicated once.
    assert {pattern for pattern, style in plan.items() if isinstance(style, ReplicateBlockInput)} == {
        "model.layers.*.self_attn", "model.layers.*.mlp"}
    assert split_dim("model.embed_tokens.weight") == 0 and split_dim("lm_head.weight") == 0
    assert split_dim("model.layers.5.input_layernorm.weight") is None and split_dim("model.norm.weight") is None


@pytest.mark.parametrize("tp", [1, 2])
def test_layer_parameters_per_rank_is_the_shards_numel(tp: int) -> None:
    block = dict(LlamaForCausalLM(CONFIG).model.layers["0"].named_parameters())
    expected = sum(math.prod(p.shape) // (tp if split_dim(f"model.layers.0.{name}") is not None else 1)
                   for name, p in block.items())
    assert layer_parameters_per_rank(CONFIG, tp) == expected
    assert layer_parameters_per_rank(MODEL_PRESETS["deepseek-llm-7b"], 1) == 202_383_360


def test_biases_follow_their_weights_split():
    assert split_dim("model.layers.0.self_attn.q_proj.bias") == 0  # Qwen2: column parallel, split with the rows
    assert split_dim("model.layers.0.self_attn.v_proj.bias") == 0
    assert split_dim("model.layers.0.self_attn.o_proj.bias") is None  # row parallel: added once, replicated
    assert split_dim("model.layers.0.mlp.down_proj.weight") == 1
