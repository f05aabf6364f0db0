"""NF4 weights (4-bit NormalFloat, torchao's `NF4Tensor`) as the parallel code meets them: telling them
apart, the values they stand for, quantising a tensor, and the layouts that can hold them.

A QLoRA base (`models.qlora`) holds its block projections in NF4. FSDP2 shards an NF4 weight along its
rows as packed blocks (torchao's FSDP2 all-gather extension): each dp rank holds 1/dp of the 4-bit data
and the all-gather moves 4-bit data; each shard must hold whole rows and whole scaler blocks, (out / dp) x
in divisible by block_size x scaler_block_size. Replicate and ZeRO-1 leave a frozen weight as it is (it
is neither reduced nor in the optimizer); pipeline stages hold their own blocks' weights. Tensor
parallelism is refused: an NF4 weight is a packed tensor of blocks along its flattened rows, which
torchao cannot split along the input columns (row parallel) nor DTensor distribute.

No NF4 tensor exists before torchao is imported, so telling them apart never imports it.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_tp3d.plan.layout import LayoutError, ParallelLayout
from lightning_tp3d.plan.qlora import NF4_FORMAT, TENSOR_PARALLEL_REASON, NF4Format

__all__ = ["check_quantized_base", "dequantized", "is_quantized", "nf4_format_of", "quantized_parameters",
           "round_trip", "to_nf4"]


def _torchao_nf4() -> type:
    try:
        from torchao.quantization import NF4Tensor
    except ImportError as error:
        raise ImportError("QLoRA needs torchao's NF4 tensor: pip install 'lightning-tp3d[qlora]'"
                          " (torchao>=0.18).") from error
    return NF4Tensor


def is_quantized(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (or a DTensor's local part) is an NF4 tensor."""
    module = sys.modules.get("torchao.quantization")
    if module is None or not hasattr(module, "NF4Tensor"):
        return False
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return isinstance(local, module.NF4Tensor)


def quantized_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """`module`'s NF4 parameters by name."""
    return {name: parameter for name, parameter in module.named_parameters() if is_quantized(parameter)}


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """The values an NF4 tensor (or a DTensor of NF4 parts) stands for, in its original dtype; a DTensor
    stays one, its local part dequantised. Any other tensor is returned as it is."""
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        if not is_quantized(local):
            return tensor
        return DTensor.from_local(local.get_original_weight(), tensor.device_mesh, tensor.placements,
                                  shape=tensor.shape, stride=tensor.stride())
    return tensor.get_original_weight() if is_quantized(tensor) else tensor


def to_nf4(weight: torch.Tensor, nf4_format: NF4Format = NF4_FORMAT) -> torch.Tensor:
    """`weight` quantised to NF4 in `nf4_format` (a plain tensor, refused with the reason if it cannot be)."""
    nf4_format.check(tuple(weight.shape), "a weight")
    return _torchao_nf4().from_tensor(weight.detach().contiguous(), nf4_format.block_size,
                                      nf4_format.scaler_block_size)


def round_trip(weight: torch.Tensor, nf4_format: NF4Format = NF4_FORMAT) -> torch.Tensor:
    """dequant(quant(weight)): the values a base weight has in QLoRA training (the merged export's base)."""
    return to_nf4(weight, nf4_format).get_original_weight()


def nf4_format_of(tensor: torch.Tensor) -> NF4Format:
    """The block sizes of an NF4 tensor (or a DTensor of NF4 parts)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return NF4Format(block_size=local.block_size, scaler_block_size=local.scaler_block_size)


def check_quantized_base(network: nn.Module, layout: ParallelLayout, sharded_over_dp: bool) -> None:
    """Refuse, before `network` is split, NF4 weights the layout cannot hold (the module docstring): tensor
    parallelism, or FSDP2 shards (`sharded_over_dp`) that cut a scaler block; and bitsandbytes' quantised
    weights at any layout (`_refuse_bitsandbytes`)."""
    _refuse_bitsandbytes(network)
    quantized = quantized_parameters(network)
    if not quantized:
        return
    if layout.tensor_parallel_size > 1:
        raise LayoutError(f"{len(quantized)} weights of the network are 4-bit NF4 (QLoRA; e.g."
                          f" {next(iter(quantized))}), and {TENSOR_PARALLEL_REASON}")
    if sharded_over_dp:
        for name, parameter in quantized.items():
            nf4_format_of(parameter).check_shard(tuple(parameter.shape), layout.data_parallel_size, name)


def _refuse_bitsandbytes(network: nn.Module) -> None:
    """A bitsandbytes 4- or 8-bit weight (`Params4bit`, `Int8Params`: what `from_pretrained(...,
    quantization_config=BitsAndBytesConfig(...))` loads) keeps its quantisation state outside the tensor:
    FSDP2 and DTensor would move the packed bytes without it, and a checkpoint would write bytes no resume
    can read. The same 4-bit NormalFloat base is torchao's NF4 (`models.qlora.quantize_base`)."""
    for name, parameter in network.named_parameters():
        kind = type(parameter)
        if kind.__module__.split(".")[0] == "bitsandbytes":
            raise ValueError(
                f"{name} is a bitsandbytes {kind.__name__}, which this strategy cannot shard, split or checkpoint"
                " (its quantisation state lives outside the tensor). Load the model unquantised (without"
                " quantization_config) and call lightning_tp3d.models.qlora.quantize_base(model) after"
                " get_peft_model: torchao's NF4, the QLoRA paper's 4-bit NormalFloat, trains under FSDP,"
                " replicate, ZeRO-1 and pipelining."
            )
