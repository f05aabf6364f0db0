"""QLoRA: a frozen base whose linear weights are held in 4-bit NormalFloat (NF4, torchao's `NF4Tensor`), the
LoRA factors in the training precision.

`quantize_base(network)` replaces the weight of every frozen `nn.Linear` inside the decoder blocks (the
model adapter's layers: attention and MLP projections; embeddings, norms and the head stay as they are,
as in the QLoRA paper) by an NF4 parameter. Per block of `block_size` consecutive weights w_i (row-major),
with absmax a = max |w_i|, each weight is stored as the index of the nearest of 16 NormalFloat levels q_k
to w_i / a (4 bits); the scales a are themselves quantised to int8 per `scaler_block_size` blocks around
their mean (double quantisation), so a weight costs 1/2 + 1/block_size + e/(block_size x scaler_block_size)
bytes, e the base's element size (`plan.qlora.nf4_bytes`). The layer computes y = x dequant(W)^T + b,
dequantised to x's dtype on the fly (torchao's `linear_nf4`); the backward gives dx = dy dequant(W) and no
weight gradient. Two processes quantising the same weights get the same bytes, so a one-process QLoRA run
is the parity reference of a parallel one. Which layouts hold NF4 weights: `parallel.nf4` (FSDP2 shards
them, tensor parallelism is refused).

A checkpoint never holds NF4 weights (they are the base's, quantised again on resume): with a quantised
base the strategy saves what trains, as with `save_frozen_weights=False`, and fingerprints the frozen
weights by their dequantised values. `meta.json` records the format and the quantised weights
(`quantization_record`, under the LoRA entry), so a merged export from the base folder (`tp3d export
--base`, `io.frozen_base`) quantises and dequantises the base as training saw it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_tp3d.parallel.nf4 import is_quantized, nf4_format_of, quantized_parameters, to_nf4
from lightning_tp3d.plan.qlora import NF4_FORMAT, NF4Format

__all__ = ["quantization_record", "quantize_base"]


def quantize_base(network: nn.Module, nf4_format: NF4Format = NF4_FORMAT) -> int:
    """Hold the weight of every frozen `nn.Linear` in `network`'s decoder blocks in NF4 (the module docstring),
    in place; returns how many were quantised. Call it after `get_peft_model` (which freezes the base), on
    the same seeded or loaded weights wherever a run is compared or resumed."""
    from lightning_tp3d.models.families import resolve_model_adapter  # families -> lora -> this module

    adapter = resolve_model_adapter(network)
    layers = adapter.layers_attribute
    count = 0
    for name, module in network.named_modules():
        if (isinstance(module, nn.Linear) and name.startswith(layers + ".") and not module.weight.requires_grad
                and not is_quantized(module.weight)):
            try:
                quantized = to_nf4(module.weight, nf4_format)
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
            module.weight = nn.Parameter(quantized, requires_grad=False)
            count += 1
    if count == 0:
        raise ValueError(f"{type(network).__name__} has no frozen nn.Linear under {layers!r} to quantise: freeze the"
                         " base first (get_peft_model does) and quantise the model that holds the decoder blocks.")
    return count


def quantization_record(module: nn.Module) -> dict[str, Any] | None:
    """What `meta.json` records of `module`'s NF4 weights: the format and their names; None without any."""
    quantized = quantized_parameters(module)
    if not quantized:
        return None
    nf4_format = nf4_format_of(next(iter(quantized.values())))
    return {"format": "nf4", **nf4_format.to_dict(), "names": sorted(quantized)}
