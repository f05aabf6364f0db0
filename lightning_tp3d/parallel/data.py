"""Data parallelism over the mesh's "dp" dimension, after tensor parallelism has been applied.

Two modes:

* `"replicate"` (DDP semantics): every dp rank holds the whole (tp-local) model; after backward the
  gradients are averaged, g = (1 / dp) sum_d g_d, with one all-reduce per dtype bucket over the dp
  group. Only public collectives are used, so it composes with DTensor parameters (their local shards
  are reduced) and with pipeline stages (each stage reduces its own parameters).
* `"fsdp"` (ZeRO-3): FSDP2 `fully_shard` on each block and then on the root; parameters, gradients
  and optimizer state are split along dim 0 across dp ranks and the gradients reduce-scattered.
  Under pipelining a stage's parameters stay gathered for the whole step (gathered once per step,
  not once per micro-batch, as torchtitan does; see `apply_fsdp`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from lightning_tp3d.parallel.tensor import local_part
from lightning_tp3d.plan.ledger import DATA_PARALLEL_MODES

__all__ = ["DataParallelMode", "DATA_PARALLEL_MODES", "all_reduce_gradients", "apply_fsdp"]

DataParallelMode = Literal["replicate", "fsdp", "zero1"]


def apply_fsdp(roots: Iterable[nn.Module], dp_mesh: DeviceMesh, blocks: Iterable[nn.Module],
               reshard_after_forward: bool = True) -> None:
    """FSDP2 over `dp_mesh`: one unit per block (so only one block is gathered at a time), then each root
    (the model, or every pipeline stage module), which takes the parameters outside the blocks.

    `reshard_after_forward=False` keeps a unit's parameters gathered from its first forward until the
    end of the step's backward. Pipelining needs it: a schedule runs the forwards of several
    micro-batches between a unit's forward and its backward, and the zero-bubble schedules compute the
    weight gradients in a separate pass after the input gradients. Resharding in between regathers the
    parameters once per micro-batch and, with the split backward (torch 2.13), leaves the weight
    gradients on parameters FSDP has already swapped out: they come back wrong or missing.
    """
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    for root in roots:
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)


def _local_gradient(parameter: nn.Parameter) -> torch.Tensor | None:
    grad = parameter.grad
    if grad is None:
        return None
    return local_part(grad)


@torch.no_grad()
def all_reduce_gradients(parameters: Iterable[nn.Parameter], dp_group: dist.ProcessGroup, dp_size: int) -> None:
    """Average gradients over the dp group in place: g <- (1 / dp) sum over dp ranks of g."""
    if dp_size == 1:
        return
    buckets: dict[torch.dtype, list[torch.Tensor]] = {}
    for parameter in parameters:
        grad = _local_gradient(parameter)
        if grad is not None:
            buckets.setdefault(grad.dtype, []).append(grad)
    for grads in buckets.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=dp_group)
        flat.div_(dp_size)
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)
