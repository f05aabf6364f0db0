"""Sharded initialisation: a network built on the meta device becomes only this rank's shard.

The whole network is declared on the meta device (no memory), split into pipeline stages, sharded by
tensor parallel and FSDP2, and only then given storage: `materialize_network` allocates each parameter's
local shard on the rank's device and initialises it.

Layout-independent values: `seeded_normal_` draws W ~ Normal(0, std) as a function of (seed, global
parameter name) alone. W is generated in blocks of `ROWS_PER_BLOCK` rows along dim 0, block b from a
generator seeded with sha256("{seed}/{name}/{b}"); a rank whose shard holds rows [r0, r1) and columns
[c0, c1) of W (its tp slice, its FSDP rows, its pipeline stage's layers) generates the blocks covering
[r0, r1) one at a time and keeps columns [c0, c1). Every layout therefore starts from exactly the weights
of one process that built the whole network, and no rank ever holds more than its shard plus one block.
Values are drawn on the CPU, so a GPU run starts from the same weights as a CPU reference.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_tp3d._compat.torch import local_shape_and_global_offset

__all__ = [
    "ROWS_PER_BLOCK",
    "has_meta_tensors",
    "local_region",
    "materialize_network",
    "retie",
    "seeded_normal_",
    "tied_parameter_groups",
]

ROWS_PER_BLOCK = 64


def has_meta_tensors(module: nn.Module) -> bool:
    return any(tensor.is_meta for tensor in itertools.chain(module.parameters(), module.buffers()))


def local_region(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's part of `tensor` and where it sits in the global tensor (one slice per dim).

    A DTensor's local shard is one box of the global tensor for every placement our layouts produce
    (tp Shard, FSDP2 Shard on top of it, Replicate); a plain tensor is its own whole."""
    if isinstance(tensor, DTensor):
        shape, offset = local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tensor.to_local(), tuple(slice(start, start + size) for start, size in zip(offset, shape))
    return tensor, tuple(slice(0, size) for size in tensor.shape)


def _generator(seed: int, name: str, block: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


@torch.no_grad()
def seeded_normal_(tensor: torch.Tensor, name: str, seed: int, std: float) -> None:
    """Fill this rank's part of `tensor` (global name `name`) with its part of W ~ Normal(0, std), where W
    depends on (seed, name) only (see the module docstring)."""
    local, region = local_region(tensor)
    if local.numel() == 0 or local.is_meta:
        return
    shape = tuple(tensor.shape)
    rows = region[0]
    for block in range(rows.start // ROWS_PER_BLOCK, math.ceil(rows.stop / ROWS_PER_BLOCK)):
        first = block * ROWS_PER_BLOCK
        last = min(first + ROWS_PER_BLOCK, shape[0])
        # drawn on the CPU (where the generator lives) whatever default device a surrounding context sets
        values = torch.empty((last - first, *shape[1:]), dtype=torch.float32, device="cpu")
        values.normal_(0.0, std, generator=_generator(seed, name, block))
        start, stop = max(first, rows.start), min(last, rows.stop)
        kept = values[(slice(start - first, stop - first), *region[1:])]
        local[start - rows.start:stop - rows.start].copy_(kept)


def tied_parameter_groups(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(owner module, attribute) pairs of every parameter registered under more than one name."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for submodule in module.modules():
        for name, parameter in submodule.named_parameters(recurse=False):
            owners.setdefault(id(parameter), []).append((submodule, name))
    return [group for group in owners.values() if len(group) > 1]


def retie(groups: Sequence[Sequence[tuple[nn.Module, str]]]) -> None:
    """Make every (module, attribute) of each group hold its first member's parameter again (module
    transformations such as `to_empty` or a tp plan give each registration a parameter of its own)."""
    for (first_module, first_name), *others in groups:
        shared = getattr(first_module, first_name)
        for module, name in others:
            setattr(module, name, shared)


def materialize_network(network: nn.Module, device: torch.device) -> bool:
    """Give a (sharded, pruned) meta-device `network` storage on `device` and initial values: the network's
    own `init_weights()` if it has one (the reference decoder's is layout-independent, see
    `seeded_normal_`), else every module's `reset_parameters()`. Tied parameters stay tied. Returns False
    when nothing was on the meta device."""
    if not has_meta_tensors(network):
        return False
    tied = tied_parameter_groups(network)
    network.to_empty(device=device)
    retie(tied)
    init_weights = getattr(network, "init_weights", None)
    if callable(init_weights):
        init_weights()
        return True
    uninitialised = set()
    for module in network.modules():
        if callable(reset := getattr(module, "reset_parameters", None)):
            reset()
        elif any(True for _ in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))):
            uninitialised.add(type(module).__name__)
    if uninitialised:
        rank_zero_warn(
            f"{type(network).__name__} was built on the meta device, but {sorted(uninitialised)} define neither"
            " `reset_parameters()` nor a network-level `init_weights()`: their tensors hold uninitialised memory."
            " Define one of them, or build the network outside the meta device (empty_init=False)."
        )
    return True
