"""What the Trainer and Fabric strategies do alike, over their `ParallelCore`.

`TP3DStrategyBase` comes first in each strategy's bases (before Lightning's `ModelParallelStrategy`):
the layout resolved before launch, the mesh built when the environment is set up, the dp-rank sampler,
the groups of Lightning's collectives, the skip of non-finite steps, the strategy registration, and
collectives inside hooks that name the group they are stuck in.

Which group each of Lightning's collectives needs (every call site is listed in docs/lightning.md):

* values (`reduce` / `all_reduce` of logged metrics, `all_gather`): the dp group. The tp x pp ranks of
  one replica hold the same batch and the same loss, so over the world each sample would count tp x pp
  times; over dp every replica counts once, which is what DDP's processes are.
* decisions (`reduce_boolean_decision`: stop early, save a top-k checkpoint, a file exists, a spike):
  the whole world. Lightning sums the votes and compares the sum with `world_size`, so a sum over dp
  could never reach it when tp x pp > 1, and every rank must leave with the same answer.
* `broadcast` and `barrier`: the whole world, as Lightning's (paths, `should_stop`, the tuner's results).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_tp3d._compat.lightning import setup_process_groups
from lightning_tp3d.diagnostics.doctor import DoctorReport
from lightning_tp3d.parallel.collectives import (
    destroy_gloo_groups_at_exit,
    enable_collective_recording,
    naming_stuck_collectives,
)
from lightning_tp3d.parallel.mesh import mesh_device
from lightning_tp3d.parallel.pipeline import StageTiming
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.strategies.core import ParallelCore
from lightning_tp3d.strategies.non_finite import NonFiniteStepGuard

__all__ = ["TP3DStrategyBase", "name_stuck_collectives_in"]


class TP3DStrategyBase:
    """Mixin over Lightning's `ModelParallelStrategy` (Trainer's or Fabric's); the subclass sets `core`."""

    strategy_name = "tp3d"
    core: ParallelCore

    @property
    def layout(self) -> ParallelLayout:
        return self.core.layout

    @property
    def data_parallel_mode(self) -> str:
        return self.core.options.data_parallel_mode

    @property
    def preflight_report(self) -> DoctorReport | None:
        return self.core.preflight_report

    @property
    def pipeline_timing(self) -> StageTiming | None:
        """This rank's busy and idle time in the last pipelined training step (None without pipelining)."""
        return None if self.core.pipeline is None else self.core.pipeline.timing

    @property
    def step_guard(self) -> NonFiniteStepGuard:
        """Decides and counts the skipped non-finite steps (`skipped_steps`, `last_step_skipped`)."""
        if getattr(self, "_step_guard", None) is None:
            self._step_guard = NonFiniteStepGuard(self.core.options.max_consecutive_skips)
        return self._step_guard

    def _skips_non_finite_step(self, loss: torch.Tensor | None, parameters: Iterable[nn.Parameter], step: int,
                               scaler: Any) -> bool:
        """True (on every rank) when this step's update must be skipped, see `strategies.non_finite`; off
        with `skip_non_finite_steps=False` and under an fp16 loss scaler, which skips steps itself."""
        if not self.core.options.skip_non_finite_steps or (scaler is not None and scaler.is_enabled()):
            return False
        if not self.step_guard.check(loss, parameters, step, mesh_device(self.core.mesh)):
            return False
        rank_zero_warn(self.step_guard.describe_skip(step))
        return True

    def _configure_launcher(self) -> None:
        # Called once devices and nodes are known, before any process is launched.
        self.core.resolve_layout(self.num_nodes * self.num_processes)
        super()._configure_launcher()

    def _setup_distributed_mesh(self) -> None:
        """Process groups, then the ("pp", "dp", "tp") mesh; collective recording starts before any group
        exists so that a failed collective can be named."""
        enable_collective_recording()
        warn_if_restarts_cannot_recover()
        setup_process_groups(self)
        destroy_gloo_groups_at_exit()
        self._device_mesh = self.core.setup_mesh(self.num_nodes * self.num_processes, self.root_device.type,
                                                 self._timeout)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.core.sampler_kwargs(self.global_rank)

    def _reduction_group(self, group: Any | None) -> Any | None:
        """The dp group unless a group is given: logged values are replicated over the tp and pp ranks of
        a replica, so a reduction over the whole world would count each sample tp x pp times under sum."""
        if group is None and self._device_mesh is not None:
            return self.core.group("dp")
        return group

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """True on every rank when every rank (`all=True`) or any rank (`all=False`) decided True: the votes
        of the whole world, not of the dp group that `reduce` defaults to."""
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return bool(decision)
        votes = torch.tensor(int(bool(decision)), dtype=torch.int32, device=self.root_device)
        torch.distributed.all_reduce(votes, op=torch.distributed.ReduceOp.SUM)
        return int(votes) == torch.distributed.get_world_size() if all else int(votes) > 0

    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        """`tensor` of every dp replica, stacked: shape [dp, ...], as DDP's processes give (the dp group by
        default, see `_reduction_group`). `LightningModule.all_gather` and `Fabric.all_gather` pass the
        world's group when given none, so that group means the default here too."""
        if group is torch.distributed.group.WORLD:
            group = None
        return super().all_gather(tensor, group=self._reduction_group(group), sync_grads=sync_grads)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls,
                                   description="Tensor x pipeline x data parallel strategy of lightning_tp3d")


def warn_if_restarts_cannot_recover() -> None:
    """Under torchrun with restarts, warn when the workers share the agent's rendezvous store: torch 2.5 to
    2.13 then re-read the previous attempt's addresses on a restart after a lost rank, and the new process
    group never forms (pytorch/pytorch#135712); `tp3d run` (torchrun with the store unshared) avoids it."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(
            os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        rank_zero_warn(
            "torchrun shares its rendezvous store with the workers, so a restart after a lost rank or node fails to"
            " form the new process group (pytorch/pytorch#135712): launch with `tp3d run` (torchrun's arguments;"
            " it unshares the store) or set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for --max-restarts to recover"
            " (docs/operating.md)."
        )


def name_stuck_collectives_in(strategy: type, hooks: Iterable[str]) -> None:
    """A collective failing inside one of `hooks` raises `CollectiveTimeoutError` naming the group and the
    operation (see `parallel.collectives`)."""
    for hook in hooks:
        setattr(strategy, hook, naming_stuck_collectives(getattr(strategy, hook)))
