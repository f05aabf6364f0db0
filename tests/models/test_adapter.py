"""Model adapters (`models/adapter.py`, `models/families.py`): the family chosen once from the network, in
one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_tp3d.models.adapter import ModelAdapter, llama_tp_plan
from lightning_tp3d.models.families import MODEL_FAMILIES, resolve_model_adapter
from lightning_tp3d.models.huggingface import HuggingFaceCausalLMAdapter, HuggingFaceStages
from lightning_tp3d.models.llama import LlamaForCausalLM, causal_lm_loss
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
