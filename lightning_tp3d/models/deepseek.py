"""DeepSeek-V3 from `transformers` (`DeepseekV3ForCausalLM`): multi-head latent attention (MLA) and
mixture-of-experts (MoE) layers, held as transformers builds them.

Pipelining and data parallelism (replicate, ZeRO-1, FSDP2) take the model as any Hugging Face causal LM
(`models.huggingface`: the stages run the model's own forward over their blocks, dense and MoE blocks
alike), its routed experts as any fused-expert MoE model's (`models.moe`). What differs is the
tensor-parallel plan, which follows MLA's shapes (h hidden, a heads, r_q and r_kv the query and key-value
latent ranks, d_n / d_r / d_v a head's non-rotary, rotary and value dims):

* `q_a_proj` (h -> r_q) with `q_a_layernorm`, and `kv_a_proj_with_mqa` (h -> r_kv + d_r) with
  `kv_a_layernorm`, stay replicated: the latents are low rank and every head reads them whole, and the
  rotary key d_r is one head shared by all (MQA). Each tp rank computes them on the replicated input.
  The rotary key's gradient on a rank is the sum over its own heads only: it is all-reduced over tp
  (`parallel.tensor.SharedAcrossHeads` on `kv_a_proj_with_mqa`'s last d_r columns).
* `q_b_proj` (r_q -> a (d_n + d_r)), or `q_proj` (h -> a (d_n + d_r)) without a query latent, and
  `kv_b_proj` (r_kv -> a (d_n + d_v)) are column parallel over heads: rank r computes its a / t heads'
  queries, keys and values from the whole latents; attention runs on local heads (the model views with
  -1 heads). Their input gradients are partial sums over the heads, all-reduced over tp where the
  latents were made replicated (`ColwiseParallel`'s input), once per projection.
* `o_proj` is row parallel: the heads' outputs summed over tp.
* The dense blocks' MLP (the first `first_k_dense_replace` layers) and each MoE block's shared experts:
  gate and up column parallel, down row parallel (Megatron's MLP).
* A MoE block's router (`mlp.gate`, with DeepSeek-V3's per-expert score-correction bias) and its routed
  experts (the fused `mlp.experts.gate_up_proj` [E, 2 I, h] and `down_proj` [E, h, I]) stay replicated:
  every tp rank routes the same tokens the same way and computes every expert, so the result is one
  process's. With `expert_parallel_size` E > 1 the routed experts are split over E dp ranks instead
  (`routed_experts`, `parallel.experts`).
* The embedding is vocab parallel, the head column parallel over the vocabulary (the vocab-parallel
  loss), the norms replicated.

The plan's entries follow the model's config (`DeepseekV3Adapter.for_network`): a `q_proj` or a query
latent, and per block its dense MLP or its shared experts. The defaults are DeepSeek-V3's (61 blocks, 3
dense, rotary dim 64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_tp3d.models.huggingface import is_huggingface_causal_lm
from lightning_tp3d.models.moe import HuggingFaceMoEAdapter
from lightning_tp3d.parallel.tensor import SharedAcrossHeads, TensorParallelPlan
from lightning_tp3d.parallel.vocab_parallel import VocabParallelHead

__all__ = ["DeepseekV3Adapter", "deepseek_v3_tp_plan"]

_MODEL_TYPE = "deepseek_v3"
_MLP = {"gate_proj": ColwiseParallel, "up_proj": ColwiseParallel, "down_proj": RowwiseParallel}


def deepseek_v3_tp_plan(rotary_dim: int, num_layers: int, dense_layers: int, query_latent: bool = True
                        ) -> TensorParallelPlan:
    """MLA's and the MoE blocks' split over tp (see the module docstring), relative to the
    `DeepseekV3ForCausalLM` root, for `num_layers` blocks of which the first `dense_layers` are dense."""
    attention = "model.layers.*.self_attn"
    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": VocabParallelHead(),
        f"{attention}.{'q_b_proj' if query_latent else 'q_proj'}": ColwiseParallel(),
        f"{attention}.kv_a_proj_with_mqa": SharedAcrossHeads(rotary_dim),
        f"{attention}.kv_b_proj": ColwiseParallel(),
        f"{attention}.o_proj": RowwiseParallel(),
    }
    for layer in range(num_layers):  # per block: a dense MLP, or a MoE block's shared experts
        mlp = f"model.layers.{layer}.mlp" + ("" if layer < dense_layers else ".shared_experts")
        plan |= {f"{mlp}.{name}": style() for name, style in _MLP.items()}
    return plan


@dataclass(frozen=True)
class DeepseekV3Adapter(HuggingFaceMoEAdapter):
    """`transformers.DeepseekV3ForCausalLM` (see the module docstring): a fused-expert MoE model
    (`models.moe`: its routed experts, the features it refuses) with MLA's plan, whose shape fields are
    read from the network's config by `for_network`."""

    rotary_dim: int = 64
    num_layers: int = 61
    dense_layers: int = 3
    query_latent: bool = True

    @classmethod
    def matches(cls, network: nn.Module) -> bool:
        return (is_huggingface_causal_lm(network)
                and getattr(getattr(network, "config", None), "model_type", None) == _MODEL_TYPE)

    @classmethod
    def for_network(cls, network: nn.Module) -> DeepseekV3Adapter:
        config = network.config
        return cls(rotary_dim=config.qk_rope_head_dim, num_layers=config.num_hidden_layers,
                   dense_layers=config.first_k_dense_replace, query_latent=config.q_lora_rank is not None)

    @property
    def name(self) -> str:
        return "Hugging Face DeepSeek-V3"

    def default_tp_plan(self) -> TensorParallelPlan:
        return deepseek_v3_tp_plan(self.rotary_dim, self.num_layers, self.dense_layers, self.query_latent)
