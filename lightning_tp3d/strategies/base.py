"""What the Trainer and Fabric strategies do alike, over their `ParallelCore`.

`TP3DStrategyBase` comes first in each strategy's bases (before Lightning's `ModelParallelStrategy`):
the layout resolved before launch, the mesh built when the environment is set up, the dp-rank sampler,
the dp group as the default group of reductions, the strategy registration, and collectives inside
hooks that name the group they are stuck in.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning_tp3d.diagnostics.doctor import DoctorReport
from lightning_tp3d.parallel.collectives import enable_collective_recording, naming_stuck_collectives
from lightning_tp3d.parallel.pipeline import StageTiming
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.strategies.core import ParallelCore

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
        return self.core.data_parallel_mode

    @property
    def preflight_report(self) -> DoctorReport | None:
        return self.core.preflight_report

    @property
    def pipeline_timing(self) -> StageTiming | None:
        """This rank's busy and idle time in the last pipelined training step (None without pipelining)."""
        return None if self.core.pipeline is None else self.core.pipeline.timing

    def _configure_launcher(self) -> None:
        # Called once devices and nodes are known, before any process is launched.
        self.core.resolve_layout(self.num_nodes * self.num_processes)
        super()._configure_launcher()

    def _setup_distributed_mesh(self) -> None:
        """Process groups, then the ("pp", "dp", "tp") mesh; collective recording starts before any group
        exists so that a failed collective can be named."""
        enable_collective_recording()
        self._setup_distributed()
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

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls,
                                   description="Tensor x pipeline x data parallel strategy of lightning_tp3d")


def name_stuck_collectives_in(strategy: type, hooks: Iterable[str]) -> None:
    """A collective failing inside one of `hooks` raises `CollectiveTimeoutError` naming the group and the
    operation (see `parallel.collectives`)."""
    for hook in hooks:
        setattr(strategy, hook, naming_stuck_collectives(getattr(strategy, hook)))
