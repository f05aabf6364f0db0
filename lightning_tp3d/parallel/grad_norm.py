"""Gradient norm and clipping over the whole model, whatever its layout.

A rank holds gradients of three kinds: plain tensors (replicated over tp), DTensors sharded over tp
and/or dp, and only its own pipeline stage's parameters. The global 2-norm is

    ||g|| = sqrt( sum over pp stages of sum over parameter groups of ||g_group||^2 )

where each group (same mesh and placements) is normed with `get_total_norm`, DTensor norms are made
whole with `full_tensor()` (a reduction over their mesh), and the squares are summed over the pp
group. Groups are needed because `_foreach_norm` refuses to mix plain tensors and DTensors.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import get_total_norm

__all__ = ["clip_grad_norm_", "clip_grad_value_", "global_grad_norm"]


def _group_gradients(parameters: Iterable[nn.Parameter]) -> dict[object, list[nn.Parameter]]:
    groups: dict[object, list[nn.Parameter]] = {}
    for parameter in parameters:
        grad = parameter.grad
        if grad is None:
            continue
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else ("local", grad.device)
        groups.setdefault(key, []).append(parameter)
    return groups


@torch.no_grad()
def global_grad_norm(
    parameters: Iterable[nn.Parameter], pp_group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu", norm_type: float = 2.0,
) -> torch.Tensor:
    """The 2-norm of all gradients of the model across tp, dp shards and pp stages (a float32 scalar on
    `device`, the pp group's device: a rank without gradients still all-reduces a tensor NCCL accepts)."""
    if norm_type != 2.0:
        raise ValueError(f"only the 2-norm is supported across pipeline stages, got norm_type={norm_type}.")
    groups = _group_gradients(parameters)
    squared = torch.zeros((), dtype=torch.float32, device=device)
    for members in groups.values():
        norm = get_total_norm([parameter.grad for parameter in members], norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared = squared + norm.float().to(squared.device) ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(squared, group=pp_group)
    return squared.sqrt()


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / (||g|| + 1e-6)) with the global norm; returns ||g||."""
    parameters = list(parameters)
    total_norm = global_grad_norm(parameters, pp_group, device)
    clip_coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for parameter in parameters:
        grad = parameter.grad
        if grad is not None:
            # Scaling commutes with every placement (shard, replicate, partial): scale the local part.
            (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(clip_coefficient.to(grad.device))
    return total_norm


@torch.no_grad()
def clip_grad_value_(parameters: Iterable[nn.Parameter], clip_value: float) -> None:
    """Clamp every gradient entry to [-clip_value, clip_value] (elementwise: each rank clamps its local part)."""
    for parameter in parameters:
        grad = parameter.grad
        if grad is not None:
            (grad.to_local() if isinstance(grad, DTensor) else grad).clamp_(-clip_value, clip_value)
