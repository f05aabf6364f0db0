"""Hugging Face causal LMs (`transformers` Llama, Mistral, Qwen2, ... written the usual way) as pipeline
stages, with their own rotary embeddings, causal masks and loss.

A Hugging Face `XForCausalLM` holds `model` (embedding `model.embed_tokens`, blocks `model.layers`,
final norm `model.norm`, rotary table `model.rotary_emb`) and the head `lm_head`; its blocks need the
rotary (cos, sin) tables and the attention mask that `model.forward` computes once, and its loss shifts
the labels inside (labels = input_ids). A stage therefore runs the model's own `model.forward` over the
stage's blocks only: with `input_ids` on stage 0 (the embedding), with `inputs_embeds` = the received
hidden states after; the rotary tables and the mask (causal, or sliding-window for Mistral) are computed
by that forward from the stage input's shape, identically on every stage; the final norm runs only on the
last stage, which then applies `lm_head`. The loss is the model's `loss_function` (shift inside, mean over
the micro-batch's tokens), and `network(input_ids=..., labels=...)` returns a `CausalLMOutputWithPast`
whose `.loss` is the batch loss (logits are only returned by calls without labels).

Attention masks with padding are refused under pipelining (every micro-batch must be full causal
sequences); per-layer attention types (Qwen2's sliding-window layers) are refused when they differ.

`HuggingFaceCausalLMAdapter` is the family's `ModelAdapter`: Llama's names and tensor-parallel plan (Llama,
Mistral, Qwen2 share them; Qwen3's per-head query and key norms added, `head_norm_plan`), these stages,
and the model's own config (with its architecture) recorded for the export's `config.json`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import SequenceParallel

from lightning_tp3d.models.adapter import ModelAdapter
from lightning_tp3d.models.cross_entropy import chunked_cross_entropy
from lightning_tp3d.models.llama import IGNORE_INDEX
from lightning_tp3d.parallel.pipeline.stages import PipelineStages, StageLoss
from lightning_tp3d.parallel.tensor import TensorParallelPlan
from lightning_tp3d.parallel.vocab_parallel import takes_sharded_logits

__all__ = ["HuggingFaceCausalLMAdapter", "HuggingFaceStages", "has_head_norms", "head_norm_plan",
           "is_huggingface_causal_lm"]


def is_huggingface_causal_lm(network: nn.Module) -> bool:
    """A `transformers.PreTrainedModel` of the `XForCausalLM` shape (decoder under `model` with its rotary
    table, head `lm_head`). A network can only be one once transformers' modelling module is imported, so
    asking imports nothing (`transformers.PreTrainedModel` would load it, and with it every quantisation
    library installed, each printing its own loading messages, for a network that is not one)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return (modeling is not None and isinstance(network, modeling.PreTrainedModel)
            and hasattr(network, "lm_head") and hasattr(getattr(network, "model", None), "rotary_emb"))


class _HuggingFaceStage(nn.Module):
    """One stage over the decoder's own forward (see the module docstring). The decoder itself is not a
    child (a stage owns only its blocks, embedding, final norm and head): it is borrowed for each call,
    its `layers` (and `norm` before the last stage) swapped for this stage's."""

    def __init__(self, decoder: nn.Module, blocks: Sequence[nn.Module], first: bool, last: bool,
                 head: nn.Module | None) -> None:
        super().__init__()
        self.__dict__["_decoder"] = decoder  # not a child module: its parameters belong to the network
        self.blocks = nn.ModuleList(blocks)
        self.first, self.last = first, last
        self.embed_tokens = decoder.embed_tokens if first else None
        self.norm = decoder.norm if last else None
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        decoder = self._decoder
        layers, norm = decoder.layers, decoder.norm
        decoder.layers, decoder.norm = self.blocks, self.norm if self.last else nn.Identity()
        try:
            inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
            hidden = decoder(**inputs, use_cache=False).last_hidden_state
        finally:
            decoder.layers, decoder.norm = layers, norm
        return self.head(hidden) if self.last else hidden


class HuggingFaceStages(PipelineStages):
    """`PipelineStages` for Hugging Face causal LMs (selected automatically for them)."""

    def stage_module(self, network: nn.Module, first: Sequence[nn.Module], blocks: Mapping[int, nn.Module],
                     last: Sequence[nn.Module]) -> nn.Module:
        layer_types = getattr(network.config, "layer_types", None)
        if layer_types is not None and len(set(layer_types)) > 1:
            raise ValueError(
                f"{type(network).__name__} mixes attention types across layers ({sorted(set(layer_types))}); a"
                " pipeline stage of it would mask its layers by their local index. Use one attention type (e.g."
                " use_sliding_window=False) or pipeline_parallel_size=1."
            )
        return _HuggingFaceStage(network.model, list(blocks.values()), bool(first), bool(last),
                                 network.lm_head if last else None)

    def loss_function(self, network: nn.Module) -> StageLoss:
        """The model's own loss; transformers' causal-LM loss also takes the head's logits split over tp's
        vocabulary, computed then by `models.cross_entropy` on the shifted labels (no gather)."""
        from transformers.loss.loss_utils import ForCausalLMLoss

        vocab_size = network.config.vocab_size

        def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return network.loss_function(logits=logits, labels=labels, vocab_size=vocab_size)

        def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            if isinstance(logits, DTensor):  # ForCausalLMLoss's shift: position s predicts label s + 1
                shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
                return chunked_cross_entropy(logits, shifted, ignore_index=IGNORE_INDEX)
            return loss(logits, labels)

        return takes_sharded_logits(causal_lm_loss) if network.loss_function is ForCausalLMLoss else loss

    def call_arguments(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                       attention_mask: torch.Tensor | None = None, **unexpected: Any
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                "an attention_mask with padding cannot be pipelined (micro-batches are full causal sequences);"
                " pack the batch into full sequences or drop the attention_mask."
            )
        unexpected = {name: value for name, value in unexpected.items()
                      if not (name in ("use_cache", "return_dict") or value is None)}
        return super().call_arguments(input_ids, labels, **unexpected)

    def output(self, network: nn.Module, loss: torch.Tensor | None, logits: torch.Tensor | None) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=loss, logits=logits)


def has_head_norms(network: nn.Module) -> bool:
    """Whether the blocks' attention normalises each head's query and key (`q_norm` / `k_norm` over one
    head's dims: Qwen3, Qwen3-MoE)."""
    attention = getattr(network.model.layers[0], "self_attn", None) if len(network.model.layers) else None
    norm = getattr(attention, "q_norm", None)
    return norm is not None and getattr(norm, "weight", None) is not None \
        and norm.weight.numel() == getattr(attention, "head_dim", None)


def head_norm_plan() -> TensorParallelPlan:
    """Per-head query / key norms under tp: each rank normalises its own heads with the whole (replicated)
    weight, so a rank's weight gradient is the sum over its heads only. torch's `SequenceParallel` over the
    heads dim of the [b, s, heads, d] view the norm sees (torchtitan's Qwen3 plan) makes the weight a
    replicated DTensor and the input Shard(2): the gradient comes out Partial and is summed over tp where
    gradients are cut to their parameters' placement."""
    return {f"model.layers.*.self_attn.{name}": SequenceParallel(sequence_dim=2, use_local_output=True)
            for name in ("q_norm", "k_norm")}


@dataclass(frozen=True)
class HuggingFaceCausalLMAdapter(ModelAdapter):
    """The `transformers` causal LMs of the Llama shape (see the module docstring); `head_norms`, read from
    the network by `for_network`: per-head query / key norms (`head_norm_plan`)."""

    head_norms: bool = False

    @classmethod
    def matches(cls, network: nn.Module) -> bool:
        return is_huggingface_causal_lm(network)

    @classmethod
    def for_network(cls, network: nn.Module) -> HuggingFaceCausalLMAdapter:
        return cls(head_norms=has_head_norms(network))

    def default_tp_plan(self) -> TensorParallelPlan:
        return super().default_tp_plan() | (head_norm_plan() if self.head_norms else {})

    @property
    def name(self) -> str:
        return "Hugging Face causal LM"

    def default_pipeline_stages(self) -> PipelineStages:
        return HuggingFaceStages()

    def config_record(self, network: nn.Module) -> dict[str, Any] | None:
        """The `transformers` config with the architecture filled in, so the export's `config.json` builds
        the same class."""
        config = self.config(network)
        if config is None:
            return None
        record = config.to_dict()
        if not record.get("architectures"):
            record["architectures"] = [type(network).__name__]
        return record
