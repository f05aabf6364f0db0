"""Model adapters (`models/adapter.py`, `models/families.py`): the family chosen once from the network, in
one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_tp3d.models.adapter import ModelAdapter, llama_tp_plan
from lightning_tp3d.models.families import MODEL_FAMILIES, resolve_model_adapter
from lightning_tp3d.models.huggingface import HuggingFaceCausalLMAdapter, HuggingFaceStages
from lightning_tp3d.models.llama import LlamaForCausalLM, causal_lm_loss
from lightning_tp3d.models.lora import PeftLoraAdapter, PrefixedStages, ReplicateParameters
from lightning_tp3d.parallel.pipeline import PipelineStages
from lightning_tp3d.plan.config import ModelConfig

SMALL = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)


class TorchtitanStyle(ModelAdapter):
    """An adapter given by import path in the test below."""


def test_the_reference_decoder_and_other_networks_get_llama_names():
    for network in (LlamaForCausalLM(ModelConfig(**SMALL)), nn.Linear(2, 2)):
        adapter = resolve_model_adapter(network)
        assert type(adapter) is ModelAdapter and adapter.layers_attribute == "model.layers"
        assert (adapter.first_modules, adapter.last_modules) == (("model.embed_tokens",), ("model.norm", "lm_head"))
        assert type(adapter.pipeline_stages()) is PipelineStages and set(adapter.tp_plan()) == set(llama_tp_plan())
    reference = LlamaForCausalLM(ModelConfig(**SMALL))
    assert resolve_model_adapter(reference).config_record(reference) == ModelConfig(**SMALL).to_dict()
    assert resolve_model_adapter(nn.Linear(2, 2)).config_record(nn.Linear(2, 2)) is None
    assert resolve_model_adapter(nn.Linear(2, 2)).loss_function(nn.Linear(2, 2)) is causal_lm_loss
    assert MODEL_FAMILIES[-1] is ModelAdapter  # the catch-all comes last


def test_hugging_face_models_get_their_family_with_its_stages_loss_and_config():
    transformers = pytest.importorskip("transformers")
    network = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL))
    adapter = resolve_model_adapter(network)
    assert isinstance(adapter, HuggingFaceCausalLMAdapter) and isinstance(adapter.pipeline_stages(), HuggingFaceStages)
    assert adapter.config_record(network)["architectures"] == ["Qwen2ForCausalLM"]
    logits, labels = torch.randn(1, 4, SMALL["vocab_size"]), torch.randint(0, SMALL["vocab_size"], (1, 4))
    expected = network.loss_function(logits=logits, labels=labels, vocab_size=SMALL["vocab_size"])
    assert torch.equal(adapter.loss_function(network)(logits, labels), expected)


def test_an_adapter_is_given_as_an_instance_a_class_or_an_import_path():
    network = nn.Linear(2, 2)
    given = TorchtitanStyle(layers_attribute="layers")
    assert resolve_model_adapter(network, given) is given
    assert type(resolve_model_adapter(network, TorchtitanStyle)) is TorchtitanStyle
    assert type(resolve_model_adapter(network, f"{__name__}:TorchtitanStyle")) is TorchtitanStyle
    with pytest.raises(ValueError, match="model_adapter='nothing' must look like 'package.module:name'"):
        resolve_model_adapter(network, "nothing")


def _peft_llama(**lora_options: object) -> nn.Module:
    transformers, peft = pytest.importorskip("transformers"), pytest.importorskip("peft")
    network = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    options = dict(r=2, target_modules=["q_proj", "o_proj"]) | lora_options
    return peft.get_peft_model(network, peft.LoraConfig(**options))


def test_a_peft_model_gets_the_inner_familys_parts_under_its_prefix_and_its_factors_sharded_with_the_base():
    network = _peft_llama()
    adapter = resolve_model_adapter(network)
    assert isinstance(adapter, PeftLoraAdapter) and isinstance(adapter.inner, HuggingFaceCausalLMAdapter)
    assert adapter.layers_attribute == "base_model.model.model.layers"
    assert adapter.last_modules == ("base_model.model.model.norm", "base_model.model.lm_head")
    plan = adapter.tp_plan()
    attention = "base_model.model.model.layers.*.self_attn"
    q_proj, o_proj = f"{attention}.q_proj", f"{attention}.o_proj"
    assert type(plan[f"{q_proj}.base_layer"]) is ColwiseParallel and type(plan[f"{q_proj}.lora_B.*"]) is ColwiseParallel
    assert type(plan[f"{q_proj}.lora_A.*"]) is ReplicateParameters and q_proj not in plan
    assert type(plan[f"{o_proj}.base_layer"]) is RowwiseParallel and type(plan[f"{o_proj}.lora_A.*"]) is RowwiseParallel
    assert f"{o_proj}.lora_B.*" not in plan  # B stays whole on the all-reduced A x
    assert type(plan[f"{attention}.k_proj"]) is ColwiseParallel  # not a LoRA target
    assert isinstance(adapter.pipeline_stages(), PrefixedStages)
    assert adapter.config_record(network)["architectures"] == ["LlamaForCausalLM"]  # the merged export's config


@pytest.mark.parametrize(("options", "refusal"), [
    (dict(use_dora=True), "DoRA's magnitude needs the norm of the whole merged weight"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save keeps a trainable copy"),
    (dict(target_modules=["embed_tokens"]), "LoRA on base_model.model.model.embed_tokens .* cannot be tensor parallel"),
])
def test_what_lora_cannot_shard_over_tp_is_refused_with_the_fix(options: dict, refusal: str):
    adapter = resolve_model_adapter(_peft_llama(**options))
    with pytest.raises(ValueError, match=refusal):
        adapter.tp_plan()


def test_a_peft_method_other_than_lora_is_refused():
    transformers, peft = pytest.importorskip("transformers"), pytest.importorskip("peft")
    network = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    ia3 = peft.get_peft_model(network, peft.IA3Config(target_modules=["k_proj"], feedforward_modules=[]))
    with pytest.raises(TypeError, match="PEFT adapter 'default' is IA3; the strategy trains LoRA adapters"):
        resolve_model_adapter(ia3)
