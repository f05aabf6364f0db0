"""FP8 training: the transformer blocks' linear layers as torchao's `Float8Linear`.

Each `nn.Linear` inside a block whose both dimensions are multiples of 16 (what `torch._scaled_mm`
takes) becomes a `Float8Linear` (torchao's `convert_to_float8_training`), after the pipeline split and
before tensor parallelism: its three matmuls (forward, input gradient, weight gradient) run in FP8 with
the recipe's scaling, every other operation in the precision the Trainer chose. The parameters stay
plain high-precision tensors under their own names, so the tp plan shards them as before (the scale of a
DTensor is the amax of the whole tensor, all-reduced over tp), FSDP2 gathers them in their own dtype
(the FP8 all-gather is not used yet) and checkpoints and exports see the weights they always saw.

Recipes (`Float8LinearConfig.from_recipe_name`):

* `"tensorwise"`: one scale per tensor, E4M3 forward and E5M2 gradients; at any (tp, pp, dp).
* `"rowwise"`: one scale per row of each operand, E4M3 throughout, more accurate; refused under tensor
  parallelism (a row's scale would need the row whole: torchao's tp styles assume tensorwise).

Precision: fp32 master weights, in `32-true` or under `bf16-mixed` autocast; `16-mixed` and the `-true`
half precisions are refused (`check_float8_precision`).

Scales are dynamic: the amax of each micro-batch's activations, so a run with another split of the batch
(dp, micro-batches) rounds differently from one process on the whole batch; the parity tests compare
with one process running the same splits.

Devices: on CUDA FP8 matmuls need compute capability 8.9 (Ada, Hopper) or newer, refused below with the
reason. On the CPU torch 2.13 runs `_scaled_mm` with the same FP8 rounding and no speed-up: the numerics
can be tested there.

The blocks of a PEFT model are left out (refused): LoRA wraps the base layer, whose weight is frozen.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["FLOAT8_PRECISIONS", "FLOAT8_RECIPES", "check_float8", "check_float8_device", "check_float8_precision",
           "convert_blocks_to_float8"]

FLOAT8_RECIPES = ("tensorwise", "rowwise")
_MIN_CAPABILITY = (8, 9)


def check_float8(recipe: str | None, tensor_parallel_size: int) -> None:
    """The option's own constraints, before anything is launched."""
    if recipe is None:
        return
    if recipe not in FLOAT8_RECIPES:
        raise ValueError(f"float8={recipe!r} is not one of {list(FLOAT8_RECIPES)} (or None for no FP8).")
    if recipe == "rowwise" and tensor_parallel_size > 1:
        raise ValueError(
            "float8='rowwise' cannot run with tensor_parallel_size > 1: a row's scale needs the whole row, and"
            " torchao's tensor-parallel FP8 assumes one scale per tensor. Use float8='tensorwise' with tp, or"
            " rowwise with tensor_parallel_size=1.")


FLOAT8_PRECISIONS = ("32-true", "bf16-mixed")


def check_float8_precision(recipe: str | None, precision: str) -> None:
    """FP8 runs with fp32 master weights, in fp32 or under bf16 autocast (how torchtitan and Megatron train
    it, and what the parity tests cover); fp16 autocast's loss scaling and bf16 weights are refused."""
    if recipe is None or precision in FLOAT8_PRECISIONS:
        return
    raise ValueError(
        f"float8={recipe!r} with precision={precision!r} is not supported: FP8 training keeps fp32 master weights"
        f" and runs under bf16 autocast (or fp32); FP8's own per-tensor scales already give the range fp16's loss"
        f" scaling would. Use precision in {list(FLOAT8_PRECISIONS)} with float8, or float8=None.")


def check_float8_device(recipe: str | None, device: torch.device) -> None:
    """Refuse a CUDA device without FP8 matmuls (compute capability below 8.9)."""
    if recipe is None or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < _MIN_CAPABILITY:
        raise RuntimeError(
            f"float8={recipe!r} needs FP8 matmuls, which {torch.cuda.get_device_name(device)} (compute capability"
            f" {capability[0]}.{capability[1]}) lacks: they need 8.9 or newer (Ada, Hopper, Blackwell). Use"
            " float8=None with bf16-mixed on this GPU.")


def convert_blocks_to_float8(blocks: Iterable[nn.Module], recipe: str) -> None:
    """Swap each block's eligible `nn.Linear` for a `Float8Linear` in place (see the module docstring)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    for block in blocks:
        _refuse_peft_layers(block)
        convert_to_float8_training(block, module_filter_fn=_takes_float8, config=config)


def _takes_float8(module: nn.Module, name: str) -> bool:
    return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def _refuse_peft_layers(block: nn.Module) -> None:
    peft_layer: Any = next((module for module in block.modules() if hasattr(module, "base_layer")), None)
    if peft_layer is not None:
        raise ValueError(
            f"float8 with a PEFT model is not supported ({type(peft_layer).__name__} in a block): LoRA wraps a frozen"
            " base layer, which FP8 training would not convert. Train LoRA with float8=None.")
