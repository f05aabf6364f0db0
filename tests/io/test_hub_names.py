"""`io.hub_names`: a transformers mixture-of-experts model's held tensors (the experts fused) under the names,
shapes and values `save_pretrained` writes (the Hub's per-expert tensors, which vLLM reads), and back, a
region at a time, for DeepSeek-V3, Qwen3-MoE and Mixtral (whose block is also renamed); no process group,
tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_tp3d.io.hf import open_hf_folder
from lightning_tp3d.io.hub_names import HubNames

transformers = pytest.importorskip("transformers")

_COMMON = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=2, num_experts_per_tok=2)
NETWORKS = {
    "deepseek_v3": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **_COMMON, moe_intermediate_size=8, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
        n_group=1, topk_group=1, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
        v_head_dim=4)),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **_COMMON, moe_intermediate_size=8, num_experts=4, head_dim=8)),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(**_COMMON, num_local_experts=4)),
}


@pytest.mark.parametrize("family", list(NETWORKS))
def test_the_held_tensors_become_what_save_pretrained_writes(family, tmp_path: Path):
    torch.manual_seed(0)
    network = NETWORKS[family]()
    network.save_pretrained(tmp_path)
    written = load_file(tmp_path / "model.safetensors")
    held = network.state_dict()
    hub = HubNames.for_config(network.config.to_dict(), [(name, tuple(value.shape)) for name, value in held.items()])
    assert sorted(name for name, _ in hub.entries) == sorted(written)
    assert dict(hub.entries) == {name: tuple(value.shape) for name, value in written.items()}
    reads: list[str] = []

    def load_held(name: str) -> torch.Tensor:
        reads.append(name)
        return held[name]

    for name, _ in hub.entries:
        assert torch.equal(hub.load(name, load_held), written[name]), name
    assert sorted(reads) == sorted(held)  # each held tensor read once, in the entries' order
    fused = [name for name in held if name.endswith("experts.gate_up_proj")]
    assert fused and not any(name.endswith("experts.gate_up_proj") for name in written)


@pytest.mark.parametrize("family", list(NETWORKS))
def test_a_region_of_each_held_tensor_is_assembled_from_the_hub_tensors(family, tmp_path: Path):
    """What a rank holding experts 1 and 2 of 4 (and, as FSDP2 might, rows of the rest) reads is the held
    tensor's region, bitwise, reading only those experts' tensors."""
    torch.manual_seed(0)
    network = NETWORKS[family]()
    network.save_pretrained(tmp_path)
    held = network.state_dict()
    hub = HubNames(network, [(name, tuple(value.shape)) for name, value in held.items()])
    with open_hf_folder(tmp_path) as folder:
        for name, value in held.items():
            reads: list[str] = []

            def read(piece: str, reads: list[str] = reads) -> torch.Tensor:
                reads.append(piece)
                return folder.tensor(piece)

            region = (slice(1, 3), *(slice(None),) * (value.dim() - 1)) if value.dim() == 3 else (
                slice(1, value.shape[0]), *(slice(None),) * (value.dim() - 1))
            assert torch.equal(hub.held_region(name, tuple(value.shape), region, read), value[region]), name
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                assert {int(piece.split(".experts.")[1].split(".")[0]) for piece in reads} == {1, 2}, reads
