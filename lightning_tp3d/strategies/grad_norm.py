"""`grad_norm`: Lightning's per-parameter gradient norms, right for a model sharded by `TP3DStrategy`.

Lightning's `lightning.pytorch.utilities.grad_norm(module, norm_type)`, as Lightning wrote it, norms each
local gradient: under tensor parallelism it fails (a DTensor norm mixed with plain ones) or norms a
shard, and under pipeline parallelism it sees one stage. This one returns what one process would, and
Lightning's own is routed to it once the package is connected (`_connect`), so the documented Lightning
idiom `self.log_dict(grad_norm(self, norm_type=2))` logs it unchanged: the same keys
(`grad_{p}_norm/<name>` and `grad_{p}_norm_total`) with the norm of each whole gradient (a DTensor's norm
reduced over its mesh) and the names and norms of every pipeline stage, on every rank. In
`data_parallel_mode="zero1"` the reduced gradients live on the optimizer's parts of the parameters,
under the same names, and are normed there.

Example usage (every rank calls it, as with any collective)::

    from lightning.pytorch.utilities import grad_norm   # or lightning_tp3d.grad_norm: the same

    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self, norm_type=2))
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_tp3d._compat.lightning import attached_trainer, lightning_grad_norm

__all__ = ["grad_norm"]


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, torch.Tensor]:
    """The p-norm of each parameter's gradient and of all of them together, as one process computes them."""
    strategy = getattr(attached_trainer(module), "strategy", None)
    core = getattr(strategy, "core", None)
    if core is None:  # not under TP3DStrategy: Lightning's own
        return lightning_grad_norm()(module, norm_type, group_separator)
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    norms: dict[str, float] = {}
    for name, parameter in core.data_parallel.optimizer_owner(module).named_parameters():
        if parameter.grad is not None:
            norm = torch.linalg.vector_norm(parameter.grad.detach(), norm_type)
            norms[name] = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if core.layout.pipeline_parallel_size > 1:
        stages: list[Any] = [None] * core.layout.pipeline_parallel_size
        dist.all_gather_object(stages, norms, group=core.group("pp"))
        norms = {name: norm for stage in stages for name, norm in stage.items()}
    result = {f"grad_{norm_type}_norm{group_separator}{name}": torch.tensor(norm) for name, norm in norms.items()}
    if result:
        result[f"grad_{norm_type}_norm_total"] = torch.tensor(list(norms.values())).norm(norm_type)
    return result
