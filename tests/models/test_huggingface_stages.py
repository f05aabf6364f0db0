"""The Hugging Face pipeline stages and exports, in one process: the errors and the config they write."""

from __future__ import annotations

import pytest
import torch

from lightning_tp3d.io.hf import hf_config_for
from lightning_tp3d.models.huggingface import HuggingFaceStages, is_huggingface_causal_lm
from lightning_tp3d.models.llama import LlamaForCausalLM
from lightning_tp3d.parallel.pipeline import PipelineStages
from lightning_tp3d.plan.config import ModelConfig

transformers = pytest.importorskip("transformers")
SMALL = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)


def test_hugging_face_models_are_recognised_and_the_reference_decoder_is_not():
    assert is_huggingface_causal_lm(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL)))
    assert not is_huggingface_causal_lm(LlamaForCausalLM(ModelConfig(**SMALL)))


def test_calls_the_pipeline_cannot_run_are_refused_with_the_fix():
    stages = HuggingFaceStages()
    ids = torch.zeros(2, 4, dtype=torch.long)
    assert stages.call_arguments(input_ids=ids, labels=ids, attention_mask=torch.ones(2, 4), use_cache=False)[0] is ids
    padded = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="attention_mask with padding cannot be pipelined"):
        stages.call_arguments(input_ids=ids, labels=ids, attention_mask=padded)
    with pytest.raises(TypeError, match=r"network\(input_ids, labels=labels\); got \['position_ids'\]"):
        PipelineStages().call_arguments(ids, position_ids=ids)
    mixed = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, use_sliding_window=True,
                                                                  max_window_layers=1, sliding_window=2))
    with pytest.raises(ValueError, match="mixes attention types across layers"):
        stages.stage_module(mixed, [], dict(enumerate(mixed.model.layers)), [])


def test_an_export_writes_the_models_own_config():
    config = transformers.Qwen2Config(**SMALL).to_dict() | {"architectures": ["Qwen2ForCausalLM"]}
    written = hf_config_for(config, torch.bfloat16)
    assert written["architectures"] == ["Qwen2ForCausalLM"] and written["model_type"] == "qwen2"
    assert {written.get("dtype"), written.get("torch_dtype")} >= {"bfloat16"}
    reference = hf_config_for(ModelConfig(**SMALL).to_dict(), torch.float32)
    assert reference["architectures"] == ["LlamaForCausalLM"] and reference["torch_dtype"] == "float32"
