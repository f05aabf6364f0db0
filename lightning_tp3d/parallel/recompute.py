"""Activation recompute: keep fewer activations in the forward pass and recompute them in backward.

Granularity (Megatron's names):

* `full`: a block keeps only its input; the whole block runs again during backward.
* `selective`: only a part of each block is recomputed, by default the attention core
  (`self_attn.core_attention`: softmax(q k^T) v over grouped kv heads); its output and the attention
  kernel's saved intermediates are not kept.

Which blocks (`method`, `num_layers` = N):

* `uniform`: every N-th block by global layer index (N = 1: every block), as torchtitan's layer option;
* `block`: the first N blocks of each pipeline stage, as Megatron's block method (the earlier blocks of a
  stage hold their activations longest).

The block's (or the target's) `forward` is replaced on the instance by a non-reentrant
`torch.utils.checkpoint` call, so parameter names, tensor-parallel plans, FSDP units and checkpoint
keys are unchanged (no `_checkpoint_wrapped_module.` prefix). The random state is replayed, so
dropout masks in the recompute equal the forward's. A recomputed block gets no KV cache to write (a Hugging
Face model hands its blocks one during training too; the replay would append the keys twice), as under
transformers' own gradient checkpointing. Apply after tensor parallelism and before FSDP.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_tp3d.parallel.attributes import find_attribute, indexed_blocks
from lightning_tp3d.plan.recompute import (
    DEFAULT_SELECTIVE_TARGET,
    recomputed_layers,
)

__all__ = ["apply_recompute", "recompute_network_layers"]


def apply_recompute(blocks: Mapping[int, nn.Module], granularity: str,
                    selective_target: str = DEFAULT_SELECTIVE_TARGET) -> None:
    """Recompute `blocks` (global index -> block) at `granularity` (`full` or `selective`)."""
    for index, block in blocks.items():
        if granularity == "full":
            block.forward = _checkpointed(block.forward)
            continue
        owner_path, _, name = selective_target.rpartition(".")
        owner = find_attribute(block, owner_path)
        target = getattr(owner, name, None) if owner is not None else None
        if target is None:
            raise AttributeError(
                f"selective recompute: block {index} ({type(block).__name__}) has no {selective_target!r}; pass"
                " TP3DStrategy(recompute_target=...) naming the part of a block to recompute."
            )
        if isinstance(target, nn.Module):
            target.forward = _checkpointed(target.forward)
        else:
            setattr(owner, name, _checkpointed(target))


def recompute_network_layers(layers: nn.ModuleDict | nn.ModuleList, stage_layers: Sequence[Sequence[int]],
                             granularity: str, method: str, num_layers: int,
                             selective_target: str = DEFAULT_SELECTIVE_TARGET) -> list[int]:
    """Choose the blocks of `layers` to recompute (`recomputed_layers`: `method`, `num_layers`, over the
    global layer indices of each pipeline stage) and apply `granularity` to them; returns their indices."""
    blocks = indexed_blocks(layers)
    chosen = recomputed_layers(stage_layers, method, num_layers)
    apply_recompute({index: blocks[index] for index in chosen}, granularity, selective_target)
    return chosen


# A recomputed block must not write a KV cache: the recompute would write it a second time (a cache grown by
# the forward's keys makes the replayed attention see twice the sequence). In training the cache serves nothing,
# so it is dropped, as transformers' own `GradientCheckpointingLayer` drops it (its names for it vary by model).
_KV_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _checkpointed(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def recomputed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing to recompute: the block runs as it is, cache included
            return function(*args, **kwargs)
        kwargs.update({name: None for name in _KV_CACHE_ARGUMENTS if kwargs.get(name) is not None})
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)

    return recomputed
