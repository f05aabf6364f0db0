"""The reference decoder: same names and same logits as transformers' LlamaForCausalLM."""

from __future__ import annotations

import pytest
import torch

from lightning_tp3d import ModelConfig
from lightning_tp3d.models import IGNORE_INDEX, LlamaForCausalLM, causal_lm_loss

CONFIG = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                     num_attention_heads=8, num_key_value_heads=2, rope_theta=500.0, rms_norm_eps=1e-5)


def _transformers_twin(config: ModelConfig):
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_word_embeddings, attention_bias=False, mlp_bias=False,
    )
    return transformers.LlamaForCausalLM(hf_config).eval()


@pytest.mark.parametrize("tied", [False, True])
def test_logits_equal_transformers_llama(tied):
    config = ModelConfig(**{**CONFIG.to_dict(), "tie_word_embeddings": tied})
    torch.manual_seed(0)
    ours = LlamaForCausalLM(config).eval()
    theirs = _transformers_twin(config)
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in name for name in missing)
    input_ids = torch.randint(0, config.vocab_size, (2, 17))
    with torch.no_grad():
        expected = theirs(input_ids).logits
        found = ours(input_ids)
    assert (found - expected).abs().max().item() <= 1e-5


def test_hugging_face_parameter_names_and_global_layer_keys():
    names = set(LlamaForCausalLM(CONFIG).state_dict())
    assert {"model.embed_tokens.weight", "model.layers.2.self_attn.q_proj.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.layers.1.input_layernorm.weight",
            "model.layers.1.post_attention_layernorm.weight", "model.norm.weight", "lm_head.weight"} <= names
    assert sum(p.numel() for p in LlamaForCausalLM(CONFIG).parameters()) == CONFIG.num_parameters()


def test_stage_without_embedding_and_head_maps_hidden_states():
    model = LlamaForCausalLM(CONFIG)
    model.model.embed_tokens = None
    model.lm_head = None
    del model.model.layers["0"]
    hidden = torch.randn(2, 5, CONFIG.hidden_size)
    assert model(hidden).shape == (2, 5, CONFIG.hidden_size)


def test_loss_ignores_masked_labels():
    logits = torch.randn(2, 4, 10)
    labels = torch.tensor([[1, 2, IGNORE_INDEX, 3], [IGNORE_INDEX, 4, 5, 6]])
    kept = labels != IGNORE_INDEX
    expected = torch.nn.functional.cross_entropy(logits[kept], labels[kept])
    assert torch.allclose(causal_lm_loss(logits, labels), expected)


def test_dropout_is_active_only_in_training():
    model = LlamaForCausalLM(ModelConfig(hidden_dropout=0.5, attention_dropout=0.5))
    input_ids = torch.randint(0, 256, (1, 8))
    model.eval()
    assert torch.equal(model(input_ids), model(input_ids))
    model.train()
    assert not torch.equal(model(input_ids), model(input_ids))
