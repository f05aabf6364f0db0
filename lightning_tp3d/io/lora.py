"""LoRA factors of a checkpoint, for its exports: merged into the weights they adapt (`LoraMerge`), or as
the PEFT adapter folder `PeftModel.from_pretrained` reads (`adapter_entries`, `adapter_config`).

A checkpoint of a PEFT LoRA model (`models.lora`) holds, under the PEFT prefix (`base_model.model.`), each
adapted layer's original weight as `<layer>.base_layer.weight` and its factors `<layer>.lora_A.<adapter>.weight`
(r x in) and `<layer>.lora_B.<adapter>.weight` (out x r); `meta.json` records the prefix and each layer's
scaling s = alpha / r per adapter (`CheckpointMeta.lora`). The merged model is the adapted model with

    W = W_0 + sum over adapters of s (B A)           (a linear layer; its bias b = b_0 + s b_B with lora_bias)
    E = E_0 + sum over adapters of s (B A)^T         (an embedding: A is r x vocab, B is hidden x r)

computed in fp32 from the whole tensors (`ModelTensorReader` merges the shards), one layer at a time, and
named as the adapted model names it (`<layer>.weight`), which is what transformers and vLLM load.

The adapter folder holds the factors alone, named as PEFT saves them (the adapter's name left out:
`base_model.model.<layer>.lora_A.weight`), and the adapter's recorded `LoraConfig` as `adapter_config.json`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_tp3d.io.checkpoint_format import CheckpointError

__all__ = ["LoraMerge", "adapter_config", "adapter_entries"]

ReadTensors = Callable[[list[str]], dict[str, torch.Tensor]]


class LoraMerge:
    """The merged model's tensor names and shapes, from the checkpoint's (`shapes`, network prefix removed)
    and the recorded `lora` entry of `meta.json`; `load(name, read)` computes one merged tensor."""

    def __init__(self, record: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> None:
        _check_record(record)
        self.prefix = record["prefix"]
        self.scaling: dict[str, dict[str, float]] = record["scaling"]
        outside = [name for name in shapes if not name.startswith(self.prefix)]
        if outside:
            raise CheckpointError(f"the checkpoint records LoRA under {self.prefix!r} but holds {outside[0]!r}"
                                  " outside it; it was not saved from one PEFT model.")
        self._names = set(shapes)
        self._sources: dict[str, str] = {}  # merged name -> the checkpoint's name of its base tensor
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in shapes.items():
            inner = name.removeprefix(self.prefix)
            layer, base, parameter = inner.rpartition(".base_layer.")
            if base and layer in self.scaling:
                self._add(f"{layer}.{parameter}", name, shape)
            elif not any(inner.startswith(f"{layer}.lora_") for layer in self.scaling):
                self._add(inner, name, shape)

    def _add(self, merged: str, source: str, shape: tuple[int, ...]) -> None:
        self._sources[merged] = source
        self.shapes[merged] = shape

    def load(self, name: str, read: ReadTensors) -> torch.Tensor:
        """The merged tensor `name` (see the module docstring), read through `read(names)`."""
        source = self._sources[name]
        layer, _, parameter = name.rpartition(".")
        tensor = read([source])[source]
        if layer not in self.scaling or not source.endswith(f".base_layer.{parameter}"):
            return tensor
        merged = tensor.float()
        for adapter, scaling in self.scaling[layer].items():
            delta = self._delta(layer, adapter, parameter, read)
            if delta is not None:
                merged += scaling * delta
        return merged.to(tensor.dtype)

    def _delta(self, layer: str, adapter: str, parameter: str, read: ReadTensors) -> torch.Tensor | None:
        """B A (or (B A)^T for an embedding, B's bias for a bias) of one adapter in fp32; None: no such term."""
        prefix = self.prefix + layer
        linear_a, linear_b = f"{prefix}.lora_A.{adapter}.weight", f"{prefix}.lora_B.{adapter}.weight"
        embedding_a, embedding_b = f"{prefix}.lora_embedding_A.{adapter}", f"{prefix}.lora_embedding_B.{adapter}"
        if parameter == "bias":
            bias = f"{prefix}.lora_B.{adapter}.bias"
            return read([bias])[bias].float() if bias in self._names else None
        if linear_a in self._names:
            factors = read([linear_a, linear_b])
            return factors[linear_b].float() @ factors[linear_a].float()
        if embedding_a in self._names:
            factors = read([embedding_a, embedding_b])
            return (factors[embedding_b].float() @ factors[embedding_a].float()).T
        raise CheckpointError(f"the checkpoint records LoRA adapter {adapter!r} on {layer} but holds no factors"
                              f" for it ({linear_a!r}).")


def _check_record(record: Any) -> None:
    """`meta.json` is read from disk: its LoRA entry must have the recorded shape before anything uses it."""
    def numbers(adapters: Any) -> bool:
        return isinstance(adapters, Mapping) and all(
            isinstance(name, str) and isinstance(value, (int, float)) for name, value in adapters.items())

    scaling = record.get("scaling") if isinstance(record, Mapping) else None
    if not (isinstance(record, Mapping) and isinstance(record.get("prefix"), str) and isinstance(scaling, Mapping)
            and all(isinstance(layer, str) and numbers(adapters) for layer, adapters in scaling.items())):
        raise CheckpointError("meta.json's 'lora' entry is not {'prefix': str, 'scaling': {layer: {adapter: number}}};"
                              " the checkpoint is damaged.")


def _single_adapter(record: Mapping[str, Any]) -> str:
    _check_record(record)
    adapters = sorted(record.get("configs") or {})
    if len(adapters) != 1:
        raise CheckpointError(f"the checkpoint holds the LoRA adapters {adapters}; an adapter folder holds one (PEFT"
                              " writes one folder per adapter): export the merged model instead.")
    return adapters[0]


def adapter_entries(record: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """PEFT's saved name -> the checkpoint's name (network prefix removed) of each LoRA factor."""
    adapter = _single_adapter(record)
    entries = {}
    for name in shapes:
        inner = name.removeprefix(record["prefix"])
        if any(inner.startswith(f"{layer}.lora_") for layer in record["scaling"]):
            entries[name.replace(f".{adapter}.", ".").removesuffix(f".{adapter}")] = name
    return entries


def adapter_config(record: Mapping[str, Any]) -> dict[str, Any]:
    """The adapter's `adapter_config.json`: its recorded `LoraConfig` (without PEFT's run-time settings)."""
    config = dict(record["configs"][_single_adapter(record)])
    config.pop("runtime_config", None)
    return config
