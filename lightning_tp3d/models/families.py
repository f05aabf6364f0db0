"""The model families the strategy recognises, and the choice of a network's `ModelAdapter`, made once.

`resolve_model_adapter(network, given)` returns `given` (the strategy's `model_adapter` option: an
adapter, or its class or import path `"package.module:name"`) or else the first family of
`MODEL_FAMILIES` whose `matches(network)` holds, a family's adapter built by `for_network(network)`;
the base `ModelAdapter` (Llama names) takes the rest.
A family added to the package goes into `MODEL_FAMILIES` before the families it specialises.

A wrapper (`WRAPPER_FAMILIES`: PEFT's `PeftModel`) holds another model: its adapter is built `around`
the adapter of the model it wraps, resolved the same way.
"""

from __future__ import annotations

from torch import nn

from lightning_tp3d.models.adapter import ModelAdapter
from lightning_tp3d.models.deepseek import DeepseekV3Adapter
from lightning_tp3d.models.huggingface import HuggingFaceCausalLMAdapter
from lightning_tp3d.models.lora import PeftLoraAdapter
from lightning_tp3d.models.moe import HuggingFaceMoEAdapter
from lightning_tp3d.parallel.attributes import import_object

__all__ = ["MODEL_FAMILIES", "ModelAdapterOption", "WRAPPER_FAMILIES", "check_model_adapter",
           "resolve_model_adapter"]

MODEL_FAMILIES: tuple[type[ModelAdapter], ...] = (DeepseekV3Adapter, HuggingFaceMoEAdapter, HuggingFaceCausalLMAdapter,
                                                  ModelAdapter)
WRAPPER_FAMILIES = (PeftLoraAdapter,)

ModelAdapterOption = ModelAdapter | type[ModelAdapter] | str | None


def check_model_adapter(given: ModelAdapterOption, network: nn.Module | None = None) -> ModelAdapter | None:
    """The `model_adapter` option as an instance (an import path imported, a class instantiated), or None."""
    if isinstance(given, str):
        given = import_object(given, "model_adapter")
    if isinstance(given, type) and issubclass(given, ModelAdapter):  # a family: built for `network` when known
        given = given.for_network(network) if network is not None else given()
    if given is not None and not isinstance(given, ModelAdapter):
        raise TypeError(
            f"model_adapter must be a lightning_tp3d.models.adapter.ModelAdapter (an instance, its class or"
            f" 'package.module:name'), got {type(given).__name__}."
        )
    return given


def resolve_model_adapter(network: nn.Module, given: ModelAdapterOption = None) -> ModelAdapter:
    """`given`, or the adapter of the first family in `MODEL_FAMILIES` that `network` belongs to."""
    adapter = check_model_adapter(given, network)
    if adapter is not None:
        return adapter
    for wrapper in WRAPPER_FAMILIES:
        if wrapper.matches(network):
            return wrapper.around(resolve_model_adapter(wrapper.inner_network(network)), network)
    return next(family.for_network(network) for family in MODEL_FAMILIES if family.matches(network))
