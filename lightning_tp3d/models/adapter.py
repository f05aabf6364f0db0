"""`ModelAdapter`: what the strategy needs to know about a model family, in one object.

The parallel parts (`parallel.pipeline`, `parallel.tensor`, `parallel.recompute`, the data-parallel modes)
know no model family: they take attribute paths, a tensor-parallel plan and a `PipelineStages`. An adapter
supplies them for its family:

* where the parts live: the blocks (`layers_attribute`, FSDP units, pipeline stages, recompute), the
  modules run before them on the first pipeline stage (`first_modules`, the embedding) and after them on
  the last (`last_modules`, the final norm and the head);
* `tp_plan()`: module-name pattern -> `ParallelStyle`, relative to the network root;
* `pipeline_stages()`: how a stage computes from its modules, checks the network's call and shapes what
  it returns (`parallel.pipeline.stages`), and `loss_function(network)`, the loss of a micro-batch;
* `config_record(network)`: the network's config as a checkpoint's `meta.json` records it, from which an
  export writes `config.json` (`io.hf.hf_config_for`), and `lora_record(network)`, the LoRA factors an
  export merges into the weights (`io.lora`; None for a plain model).

This base class is the decoder with Hugging Face Llama names (`model.embed_tokens`, `model.layers.{i}`,
`model.norm`, `lm_head`): the reference decoder (`models.llama`) and any network written that way.
`models.huggingface.HuggingFaceCausalLMAdapter` is the `transformers` family. The strategy picks the
adapter once from the network (`models.families.resolve_model_adapter`); its options `layers_attribute`,
`pipeline_first_modules`, `pipeline_last_modules`, `tp_plan` and `pipeline_stages` override single
fields, `model_adapter=` replaces the whole object.

Example usage (a torchtitan-style network)::

    adapter = ModelAdapter(layers_attribute="layers", first_modules=("tok_embeddings",),
                           last_modules=("norm", "output"))
    TP3DStrategy(pipeline_parallel_size=2, model_adapter=adapter)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_tp3d.models.llama import causal_lm_loss
from lightning_tp3d.parallel.pipeline import PipelineStages, StageLoss
from lightning_tp3d.parallel.tensor import ReplicateBlockInput, TensorParallelPlan
from lightning_tp3d.parallel.vocab_parallel import VocabParallelHead
from lightning_tp3d.plan.sharding import EMBEDDING, HEAD, LAYER_WEIGHTS

__all__ = ["MODEL_SHAPE_FIELDS", "ModelAdapter", "llama_tp_plan", "shaped_config"]

# The fields a model config must have for the layout checks (heads and layers divisible, ...).
MODEL_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads")


def shaped_config(owner: object) -> Any | None:
    """`owner.config` when it has the decoder's shape fields, else None."""
    config = getattr(owner, "config", None)
    return config if config is not None and all(hasattr(config, field) for field in MODEL_SHAPE_FIELDS) else None


def llama_tp_plan() -> dict[str, ParallelStyle]:
    """Megatron's plan for Hugging Face Llama names, relative to the `LlamaForCausalLM` root, from the split
    table `plan.sharding` (the one the deploy shards and the ledger use): q/k/v and gate/up column parallel,
    o and down row parallel, the embedding vocab parallel, the head column parallel over the vocabulary
    (its logits left split for the package's loss: `parallel.vocab_parallel.VocabParallelHead`),
    norms replicated, each sub-block's input replicated once (`parallel.tensor.ReplicateBlockInput`)."""
    plan: dict[str, ParallelStyle] = {
        EMBEDDING.module: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        HEAD.module: VocabParallelHead(),
    }
    layer_styles = {"column": ColwiseParallel, "row": RowwiseParallel}
    for sub_block in sorted({weight.module.split(".")[0] for weight in LAYER_WEIGHTS if weight.split == "column"}):
        plan[f"model.layers.*.{sub_block}"] = ReplicateBlockInput()
    for weight in LAYER_WEIGHTS:
        if weight.split in layer_styles:
            plan[f"model.layers.*.{weight.module}"] = layer_styles[weight.split]()
    return plan


@dataclass(frozen=True)
class ModelAdapter:
    """A decoder with Hugging Face Llama names (see the module docstring). `tp_plan` / `stages`: None is
    this family's own (`llama_tp_plan()`, `PipelineStages()`)."""

    layers_attribute: str = "model.layers"
    first_modules: tuple[str, ...] = ("model.embed_tokens",)
    last_modules: tuple[str, ...] = ("model.norm", "lm_head")
    tp_plan_override: TensorParallelPlan | None = None
    stages_override: PipelineStages | None = None

    @classmethod
    def matches(cls, network: nn.Module) -> bool:
        """Whether `network` belongs to this family (the base class takes any network)."""
        return True

    @classmethod
    def for_network(cls, network: nn.Module) -> ModelAdapter:
        """This family's adapter for `network` (a family whose plan follows the network's config reads it)."""
        return cls()

    def check_features(self, *, recompute: str = "none", compiled: bool = False, float8: str | None = None,
                       peft: bool = False) -> None:
        """Refuse, with the reason, a training feature this family is not tested with (this one takes all)."""

    def routed_experts(self, blocks: Iterable[nn.Module]) -> list[tuple[nn.Module, str]]:
        """The (parent, attribute) of each mixture-of-experts block's routed experts among `blocks`, which
        expert parallelism splits (`parallel.experts`); none in this family."""
        return []

    @property
    def name(self) -> str:
        """The family, as error messages and logs name it."""
        return "decoder with Llama names"

    def tp_plan(self) -> TensorParallelPlan:
        return self.tp_plan_override if self.tp_plan_override is not None else self.default_tp_plan()

    def default_tp_plan(self) -> TensorParallelPlan:
        return llama_tp_plan()

    def pipeline_stages(self) -> PipelineStages:
        return self.stages_override if self.stages_override is not None else self.default_pipeline_stages()

    def default_pipeline_stages(self) -> PipelineStages:
        return PipelineStages()

    def loss_function(self, network: nn.Module) -> StageLoss:
        """The loss of a pipeline micro-batch: the stages' (`PipelineStages.loss_function`), else
        `models.llama.causal_lm_loss` (labels already shifted)."""
        return self.pipeline_stages().loss_function(network) or causal_lm_loss

    def config(self, network: nn.Module) -> Any | None:
        """The network's config when it has the decoder's shape fields (checked against the layout)."""
        return shaped_config(network)

    def config_record(self, network: nn.Module) -> dict[str, Any] | None:
        """What `meta.json` records of the config: its `to_dict()` (the reference `ModelConfig`'s fields)."""
        config = self.config(network)
        return config.to_dict() if hasattr(config, "to_dict") else None

    def lora_record(self, network: nn.Module) -> dict[str, Any] | None:
        """What an export merges into the weights (`CheckpointMeta.lora`): nothing for a plain model."""
        return None

    def overridden(self, layers_attribute: str | None = None, first_modules: tuple[str, ...] | None = None,
                   last_modules: tuple[str, ...] | None = None, tp_plan: Mapping[str, ParallelStyle] | None = None,
                   stages: PipelineStages | None = None) -> ModelAdapter:
        """This adapter with the fields the strategy's options set (None keeps the adapter's own)."""
        given = {"layers_attribute": layers_attribute, "first_modules": first_modules, "last_modules": last_modules,
                 "tp_plan_override": tp_plan, "stages_override": stages}
        return dataclasses.replace(self, **{name: value for name, value in given.items() if value is not None})
