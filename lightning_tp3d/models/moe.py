"""Hugging Face causal LMs whose mixture-of-experts blocks hold their routed experts fused, as transformers
(5.x) writes Qwen3-MoE, Mixtral and DeepSeek-V3: `mlp.experts.gate_up_proj` [N, 2 I, h] and `down_proj`
[N, h, I], called as `experts(hidden [T, h], top_k_index [T, K], top_k_weights [T, K])` after the
router `mlp.gate`.

The tensor-parallel plan is Llama's for attention (q, k, v column parallel, o row parallel; Qwen3's per-head
q / k norms replicated, their gradients summed over tp: `models.huggingface.head_norm_plan`) and for the
dense blocks' MLP (Qwen3-MoE's `mlp_only_layers`). A MoE block's router and routed experts stay replicated
over tp: every tp rank routes the same replicated tokens the same way and computes every expert, so the
block's output and its input gradient are whole on every rank, one process's, with no all-reduce (and so no
`ReplicateBlockInput` on the block). With `expert_parallel_size` E > 1 the routed experts are split over E
dp ranks instead (`routed_experts`, `parallel.experts`). Pipelining and data parallelism take the model as
any Hugging Face causal LM (`models.huggingface`).

Recompute, regional compilation, FP8 and PEFT are not yet tested with these blocks and are refused
(`check_features`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from lightning_tp3d.models.adapter import llama_tp_plan
from lightning_tp3d.models.huggingface import (
    HuggingFaceCausalLMAdapter,
    has_head_norms,
    head_norm_plan,
    is_huggingface_causal_lm,
)
from lightning_tp3d.parallel.tensor import TensorParallelPlan

__all__ = ["HuggingFaceMoEAdapter", "has_fused_experts", "moe_tp_plan"]

_MLP_PATTERN = "model.layers.*.mlp"


def has_fused_experts(block: nn.Module) -> bool:
    """Whether `block`'s MLP is a mixture of experts with fused 3-D routed experts (module docstring)."""
    experts = getattr(getattr(block, "mlp", None), "experts", None)
    return experts is not None and all(getattr(getattr(experts, name, None), "ndim", None) == 3
                                       for name in ("gate_up_proj", "down_proj"))


def moe_tp_plan(dense_layers: Iterable[int]) -> TensorParallelPlan:
    """Llama's plan without the MLP entries, which only the blocks `dense_layers` (by index) get: the MoE
    blocks' router and experts stay replicated (module docstring)."""
    llama = llama_tp_plan()
    plan = {pattern: style for pattern, style in llama.items() if not pattern.startswith(_MLP_PATTERN)}
    for layer in dense_layers:
        plan |= {pattern.replace("*", str(layer), 1): type(style)() for pattern, style in llama.items()
                 if pattern.startswith(_MLP_PATTERN)}
    return plan


@dataclass(frozen=True)
class HuggingFaceMoEAdapter(HuggingFaceCausalLMAdapter):
    """A `transformers` causal LM with fused-expert MoE blocks (module docstring); `dense_layers`, the
    blocks with a dense MLP, is read from the network by `for_network`."""

    dense_layers: tuple[int, ...] = ()

    @classmethod
    def matches(cls, network: nn.Module) -> bool:
        return is_huggingface_causal_lm(network) and any(map(has_fused_experts, network.model.layers))

    @classmethod
    def for_network(cls, network: nn.Module) -> HuggingFaceMoEAdapter:
        return cls(head_norms=has_head_norms(network),
                   dense_layers=tuple(index for index, block in enumerate(network.model.layers)
                                      if not has_fused_experts(block)))

    @property
    def name(self) -> str:
        return "Hugging Face mixture-of-experts causal LM"

    def default_tp_plan(self) -> TensorParallelPlan:
        return moe_tp_plan(self.dense_layers) | (head_norm_plan() if self.head_norms else {})

    def check_features(self, *, recompute: str = "none", compiled: bool = False, float8: str | None = None,
                       peft: bool = False) -> None:
        """Regional compilation and FP8 are not yet tested with mixture-of-experts blocks: refused. (Recompute
        and PEFT LoRA are tested: full and selective recompute with the experts split or not, LoRA on the
        attention and dense projections with the experts split.)"""
        asked = {"compile": compiled, "float8": float8 is not None}
        refused = [feature for feature, wanted in asked.items() if wanted]
        if refused:
            raise ValueError(
                f"{', '.join(refused)} with the {self.name} (mixture-of-experts blocks) is not supported yet; train"
                " it with compile=None and float8=None.")

    def routed_experts(self, blocks: Iterable[nn.Module]) -> list[tuple[nn.Module, str]]:
        """Each MoE block's `mlp.experts` (the dense blocks have none)."""
        return [(block.mlp, "experts") for block in blocks if has_fused_experts(block)]
