"""`DataParallel`: the few steps every data-parallel mode takes part in, in the order a step calls them.

    wrap(roots, blocks)            parallelize, after tensor parallel and recompute (FSDP2 wraps here)
    before_backward(params, last)  before each backward (the overlapped all-reduce arms its hooks)
    reduce_gradients(params)       after the last backward of a step: the dp average, returns the
                                   parameters that hold it (the optimizer's parts under ZeRO-1)
    shard_optimizers(module, opts) once the optimizers exist (ZeRO-1 hands them its parts)
    after_optimizer_step()         after the update (ZeRO-1 all-gathers the parts)
    optimizer_owner(module)        the module whose parameters the optimizers hold (checkpoints)

This base class is the mode with nothing to reduce (dp = 1); each mode (`replicate`, `zero1`, `fsdp`)
overrides the steps it needs. Which class runs is decided once, from `plan.data_parallel`'s plan
(`build_data_parallel`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp3d.parallel.tensor import shard_gradients_like_parameters
from lightning_tp3d.plan.data_parallel import DataParallelPlan

__all__ = ["DataParallel"]


class DataParallel:
    """One data-parallel mode over the ("pp", "dp", "tp") `mesh`, as `plan` says."""

    shards_optimizers = False  # whether `shard_optimizers` hands the optimizers parts of the parameters

    def __init__(self, plan: DataParallelPlan, mesh: DeviceMesh) -> None:
        self.plan = plan
        self.mesh = mesh

    def wrap(self, roots: Sequence[nn.Module], blocks: Iterable[nn.Module]) -> None:
        """Wrap the network's `roots` (the network, or each pipeline stage module) and its `blocks`."""

    def before_backward(self, parameters: Iterable[nn.Parameter], completes_gradients: bool) -> None:
        """Before a backward; `completes_gradients`: the last one before the optimizer step."""

    def reduce_gradients(self, parameters: list[nn.Parameter]) -> list[nn.Parameter]:
        """Cut each DTensor gradient to its parameter's placement (`shard_gradients_like_parameters`), then
        (in the modes that reduce) average it over dp; returns the parameters holding the result."""
        shard_gradients_like_parameters(parameters)
        return parameters

    def shard_optimizers(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Hand `optimizers` what they update of `module` (before their first step)."""

    def after_optimizer_step(self) -> None:
        """After the optimizers' update."""

    def release(self) -> None:
        """Remove what the mode registered on the parameters, at the end of a run. A gradient hook holds its
        parameter and the dp group, and lives in autograd's C++ state, where Python's collector cannot see
        the cycle: left in place, every finished run would keep its network and its gloo threads."""

    def optimizer_owner(self, module: nn.Module) -> nn.Module:
        """The module whose parameters the optimizers hold, keyed by the same names as `module`'s."""
        return module
