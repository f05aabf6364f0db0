"""`data_parallel_mode="replicate"` (DDP semantics), its after-backward form.

Every dp rank holds the whole (tp-local) model; after backward the gradients are averaged,
g = (1 / dp) sum_d g_d, with one all-reduce per dtype bucket over the dp group. Only public collectives
are used, so it composes with DTensor parameters (their local shards are reduced) and with pipeline
stages (each stage reduces its own parameters). Experts split over an expert-parallel group are averaged
over their own replicas instead (`reduce_expert_gradients`). Without pipelining the
overlapped form runs instead (`parallel.data_parallel.overlap`), unless `overlap_gradient_reduction=False`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from lightning_tp3d._compat.torch import flatten_dense_tensors, unflatten_dense_tensors
from lightning_tp3d.parallel.data_parallel.protocol import DataParallel
from lightning_tp3d.parallel.experts import is_expert_parameter
from lightning_tp3d.parallel.tensor import local_part

__all__ = ["ReplicateAfterBackward", "all_reduce_gradients", "reduce_expert_gradients"]


@torch.no_grad()
def all_reduce_gradients(parameters: Iterable[nn.Parameter], dp_group: dist.ProcessGroup, dp_size: int) -> None:
    """Average gradients over the dp group in place: g <- (1 / dp) sum over dp ranks of g."""
    if dp_size == 1:
        return
    buckets: dict[torch.dtype, list[torch.Tensor]] = {}
    for parameter in parameters:
        if parameter.grad is not None:
            grad = local_part(parameter.grad)
            buckets.setdefault(grad.dtype, []).append(grad)
    for grads in buckets.values():
        flat = flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=dp_group)
        flat.div_(dp_size)
        for grad, reduced in zip(grads, unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)


def reduce_expert_gradients(parameters: Iterable[nn.Parameter], dp_size: int) -> None:
    """g <- (1 / dp) sum over "edp" of g for the expert parameters among `parameters` (`parallel.experts`:
    each owner's gradient already sums its ep group's tokens); the others are left to the dp mode."""
    experts = [parameter for parameter in parameters if parameter.grad is not None and is_expert_parameter(parameter)]
    if experts:
        all_reduce_gradients(experts, experts[0].device_mesh.get_group("edp"), dp_size)


class ReplicateAfterBackward(DataParallel):
    """All gradients all-reduced over dp once the step's backward is done."""

    def reduce_gradients(self, parameters: list[nn.Parameter]) -> list[nn.Parameter]:
        parameters = super().reduce_gradients(parameters)
        all_reduce_gradients([parameter for parameter in parameters if not is_expert_parameter(parameter)],
                             self.mesh["dp"].get_group(), self.plan.data_parallel_size)
        reduce_expert_gradients(parameters, self.plan.data_parallel_size)
        return parameters
