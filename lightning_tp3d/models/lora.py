"""PEFT LoRA models held as they are (`get_peft_model(model, LoraConfig(...))`): the `ModelAdapter` around the
adapter of the model PEFT wraps.

A `PeftModel` keeps the model it adapts at `base_model.model` (`PeftModel -> LoraModel -> XForCausalLM`), so
its parts are the inner family's under the prefix `base_model.model.`; a pipeline stage, the loss and the
config are the inner family's, run on the inner model. Each targeted `nn.Linear` becomes a `lora.Linear`
holding the original layer as `base_layer` and the factors `lora_A.<adapter>` (r x in) and
`lora_B.<adapter>` (out x r): y = W x + (alpha / r) B A dropout(x).

Under tensor parallelism the factors are sharded with their base layer, so the LoRA term is computed where
the base's shard is, with no other communication:

* a column-parallel base, W = [W_1; ...; W_t] split along its output rows: A stays whole (replicated, a
  DTensor over tp, its input the base's replicated input), B = [B_1; ...; B_t] is split like W, so rank r
  adds (alpha / r) B_r A x to its own rows W_r x. The gradient of A is a partial sum over tp, completed
  with the block's other replicated parameters (`parallel.tensor.shard_gradients_like_parameters`, FSDP2).
* a row-parallel base, W = [W_1, ..., W_t] split along its input columns (x arrives as the rank's slice
  x_r): A = [A_1, ..., A_t] is split like W, so A x = sum_r A_r x_r (an all-reduce of b x s x r values,
  r << h), and B stays whole (a plain tensor, identical on every tp rank) on that replicated product.

Refused under tensor parallelism, with the reason: LoRA on a vocab-parallel embedding, DoRA (its magnitude
needs the norm of the whole merged weight), and `modules_to_save` (a trainable copy of a sharded module).
LoRA on the head (column parallel, logits gathered) gathers its B's output like the head's.
LoRA dropout > 0: masks on a column-parallel base's replicated input are equal on the tp ranks (their random
streams are in step); on a row-parallel base each rank draws the mask of its own slice, the same dropout
in distribution but not the one-process mask.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_tp3d.models.adapter import ModelAdapter
from lightning_tp3d.models.qlora import quantization_record
from lightning_tp3d.parallel.attributes import find_attribute
from lightning_tp3d.parallel.materialize import has_meta_tensors
from lightning_tp3d.parallel.pipeline import PipelineStages, StageLoss
from lightning_tp3d.parallel.tensor import TensorParallelPlan

__all__ = ["PEFT_PREFIX", "PeftLoraAdapter", "PrefixedStages", "ReplicateParameters", "check_peft_construction",
           "is_peft_model", "lora_shape"]

PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel (`base_model`) -> the adapted model (`model`)


def is_peft_model(network: nn.Module) -> bool:
    """A `peft.PeftModel` (which it can only be if `peft` is already imported)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(network, peft.PeftModel)


def check_peft_construction(network: nn.Module, pretrained: Any | None) -> None:
    """Refuse the two ways of building a PEFT model that would start it from the wrong weights: on the meta
    device (materialising re-initialises every `nn.Linear` by its own rule, B included, where PEFT starts B
    at 0 so that the model starts as its base), and with the strategy's `pretrained=` (which fills Hugging
    Face names; a PEFT model's base comes from `from_pretrained` before `get_peft_model`)."""
    if not is_peft_model(network):
        return
    how = ("build the base with transformers.AutoModelForCausalLM.from_pretrained(folder) and wrap it with"
           " get_peft_model (in __init__ or configure_model, as lightning_tp3d.models.lora_module."
           "LoraCausalLMModule does)")
    if has_meta_tensors(network):
        raise ValueError(f"The PEFT model was built on the meta device, where its LoRA factors would be re-initialised"
                         f" without PEFT's rule (B = 0): {how}, outside the meta device (empty_init=False).")
    if pretrained is not None:
        raise ValueError(f"pretrained={str(pretrained)!r} fills a network that uses Hugging Face names, not a PEFT"
                         f" model: {how}, and drop pretrained=.")


def lora_shape(network: nn.Module) -> tuple[int, tuple[str, ...]]:
    """(rank, targets) of the LoRA layers this rank holds, for the FLOPs formula (`plan.ledger`): the largest
    r and the layers' own names (`q_proj`, ...), or (0, ()) without LoRA. A DTensor factor keeps r in its
    global shape whatever tp splits."""
    ranks, targets = set(), set()
    for name, module in network.named_modules():
        factors = getattr(module, "lora_A", None)
        if isinstance(factors, nn.ModuleDict) and len(factors):
            ranks.update(factor.weight.shape[0] for factor in factors.values())
            targets.add(name.rpartition(".")[2])
    return max(ranks, default=0), tuple(sorted(targets))


class ReplicateParameters(ParallelStyle):
    """Every parameter of the module a DTensor replicated over tp, its input made one where it is a local
    tensor, its output left a DTensor (for a column-parallel layer after it): LoRA's A of a column-parallel
    base."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicated_input(_: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            first = inputs[0]
            if isinstance(first, torch.Tensor) and not isinstance(first, DTensor):
                first = DTensor.from_local(first, mesh, [Replicate()], run_check=False)
            return (first, *inputs[1:])

        return distribute_module(module, device_mesh, input_fn=replicated_input)


class PrefixedStages(PipelineStages):
    """The inner family's stages, run on the inner model at `path` of the network."""

    def __init__(self, inner: PipelineStages, path: str) -> None:
        self.inner, self.path = inner, path

    def _inner(self, network: nn.Module) -> nn.Module:
        return find_attribute(network, self.path.rstrip("."))

    def stage_module(self, network: nn.Module, first: Sequence[nn.Module], blocks: Mapping[int, nn.Module],
                     last: Sequence[nn.Module]) -> nn.Module:
        return self.inner.stage_module(self._inner(network), first, blocks, last)

    def loss_function(self, network: nn.Module) -> StageLoss | None:
        return self.inner.loss_function(self._inner(network))

    def call_arguments(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.inner.call_arguments(*args, **kwargs)

    def output(self, network: nn.Module, loss: torch.Tensor | None, logits: torch.Tensor | None) -> Any:
        return self.inner.output(self._inner(network), loss, logits)


@dataclass(frozen=True)
class PeftLoraAdapter(ModelAdapter):
    """A PEFT LoRA model: `inner` (the adapted model's adapter) under `PEFT_PREFIX`; see the module docstring.
    Built by `around(inner, network)`, which reads the LoRA layers the network holds."""

    inner: ModelAdapter = dataclasses.field(default_factory=ModelAdapter)
    # the LoRA-wrapped layers (names relative to the network) -> their scaling alpha / r per adapter, read
    # from the whole network (a pipeline stage holds only its own layers)
    lora_layers: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)
    refused_under_tp: str | None = None  # why this model cannot be tensor parallel, if it cannot
    # a QLoRA base: the NF4 format and the quantised weights' names (`models.qlora.quantization_record`)
    quantized_base: Mapping[str, Any] | None = None

    @classmethod
    def matches(cls, network: nn.Module) -> bool:
        return is_peft_model(network)

    @staticmethod
    def inner_network(network: nn.Module) -> nn.Module:
        return network.base_model.model

    @classmethod
    def around(cls, inner: ModelAdapter, network: nn.Module) -> PeftLoraAdapter:
        """The adapter of `network` (a PeftModel) whose adapted model has the adapter `inner`."""
        from peft.tuners.lora import LoraLayer

        inner.check_features(peft=True)
        from peft.utils.other import ModulesToSaveWrapper

        for name, config in network.peft_config.items():
            if str(config.peft_type.value) != "LORA":
                raise TypeError(f"PEFT adapter {name!r} is {config.peft_type.value}; the strategy trains LoRA adapters"
                                " (and QLoRA) only.")
        modules = dict(network.named_modules())
        lora_layers = {name: {adapter: float(value) for adapter, value in module.scaling.items()}
                       for name, module in modules.items() if isinstance(module, LoraLayer)}
        experts = [name for name in lora_layers if name.rpartition(".")[2] == "experts" or ".experts." in name]
        if experts:
            raise ValueError(
                f"LoRA on a mixture of experts' fused routed experts ({experts[0]}: PEFT wraps them when"
                " target_modules names gate_proj, up_proj or down_proj in a transformers MoE model) is not supported"
                " yet; name the attention's projections only, e.g. target_modules=['q_proj', 'k_proj', 'v_proj',"
                " 'o_proj'].")
        reasons = []
        if any(isinstance(module, ModulesToSaveWrapper) for module in modules.values()):
            reasons.append("modules_to_save keeps a trainable copy of a module the tp_plan shards; train it with"
                           " tensor_parallel_size=1 or leave modules_to_save out")
        if any(config.use_dora for config in network.peft_config.values()):
            reasons.append("DoRA's magnitude needs the norm of the whole merged weight; use plain LoRA or"
                           " tensor_parallel_size=1")
        return cls(layers_attribute=PEFT_PREFIX + inner.layers_attribute,
                   first_modules=tuple(PEFT_PREFIX + path for path in inner.first_modules),
                   last_modules=tuple(PEFT_PREFIX + path for path in inner.last_modules),
                   inner=inner, lora_layers=lora_layers, refused_under_tp="; ".join(reasons) or None,
                   quantized_base=quantization_record(network))

    @property
    def name(self) -> str:
        return f"PEFT LoRA over {self.inner.name}"

    def default_tp_plan(self) -> TensorParallelPlan:
        """The inner family's plan under the prefix, each LoRA-wrapped layer's entry split into its base layer
        and its factors (the module docstring's sharding)."""
        if self.refused_under_tp is not None:
            raise ValueError(f"{self.name} cannot be tensor parallel: {self.refused_under_tp}.")
        plan: dict[str, ParallelStyle] = {}
        for pattern, style in self.inner.tp_plan().items():
            pattern = PEFT_PREFIX + pattern
            wrapped = [name for name in self.lora_layers if fnmatch.fnmatchcase(name, pattern)]
            if not wrapped:
                plan[pattern] = style
                continue
            plan.update(_lora_entries(pattern, style, wrapped[0]))
        return plan

    def default_pipeline_stages(self) -> PipelineStages:
        return PrefixedStages(self.inner.pipeline_stages(), PEFT_PREFIX)

    def routed_experts(self, blocks: Iterable[nn.Module]) -> list[tuple[nn.Module, str]]:
        """The adapted model's routed experts (PEFT wraps linear layers, not the fused experts)."""
        return self.inner.routed_experts(blocks)

    def loss_function(self, network: nn.Module) -> StageLoss:
        return self.inner.loss_function(self.inner_network(network))

    def config(self, network: nn.Module) -> Any | None:
        return self.inner.config(self.inner_network(network))

    def config_record(self, network: nn.Module) -> dict[str, Any] | None:
        """The adapted model's config: an export of the merged weights is that model."""
        return self.inner.config_record(self.inner_network(network))

    def lora_record(self, network: nn.Module) -> dict[str, Any]:
        """The prefix, each LoRA layer's scaling alpha / r per adapter (relative to the adapted model) and the
        adapters' configs, as `meta.json` records them for the merged export (`io.lora`); with a QLoRA base,
        its NF4 format and the quantised weights (`quantized_base`)."""
        scaling = {name.removeprefix(PEFT_PREFIX): dict(adapters) for name, adapters in self.lora_layers.items()}
        record = {"prefix": PEFT_PREFIX, "scaling": scaling,
                  "configs": {adapter: _json_config(config) for adapter, config in network.peft_config.items()}}
        return record | ({"quantized_base": dict(self.quantized_base)} if self.quantized_base is not None else {})


def _lora_entries(pattern: str, style: ParallelStyle, example: str) -> dict[str, ParallelStyle]:
    """The plan entries of a LoRA layer whose base layer the plan gives `style` (see the module docstring)."""
    if isinstance(style, ColwiseParallel):
        lora_b = ColwiseParallel(input_layouts=Replicate(), output_layouts=style.output_layouts[0],
                                 use_local_output=style.use_local_output)
        return {f"{pattern}.base_layer": style, f"{pattern}.lora_A.*": ReplicateParameters(),
                f"{pattern}.lora_B.*": lora_b}
    if isinstance(style, RowwiseParallel) and style.output_layouts[0] == Replicate():
        if style.input_layouts[0] == Replicate():  # a vocab-parallel embedding: rows of a lookup table
            raise ValueError(f"LoRA on {example} (an embedding split over the vocabulary) cannot be tensor parallel;"
                             " leave it out of target_modules or use tensor_parallel_size=1.")
        lora_a = RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=Replicate(),
                                 use_local_output=True)
        return {f"{pattern}.base_layer": style, f"{pattern}.lora_A.*": lora_a}
    raise ValueError(f"LoRA on {example}: its base layer's tp_plan style {type(style).__name__} has no LoRA"
                     " sharding; leave it out of target_modules or pass a tp_plan without it.")


def _json_config(config: Any) -> dict[str, Any]:
    """A PEFT config as JSON values (sets as sorted lists, enums as their values)."""
    def plain(value: Any) -> Any:
        if isinstance(value, (set, frozenset)):
            return sorted(plain(item) for item in value)
        if isinstance(value, (list, tuple)):
            return [plain(item) for item in value]
        if isinstance(value, dict):
            return {str(key): plain(item) for key, item in value.items()}
        if isinstance(value, (str, int, float, bool)) or value is None:
            return value
        return getattr(value, "value", str(value))

    return plain(config.to_dict())
