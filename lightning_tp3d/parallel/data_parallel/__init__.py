"""Data parallelism over the mesh's "dp" dimension: one `DataParallel` per mode, chosen once.

`plan.data_parallel.choose_data_parallel` decides from the options and the layout how gradients are
reduced (`GradientReduction`); `build_data_parallel` gives the class that does it:

    NONE                   DataParallel             (dp = 1)
    ALL_REDUCE             ReplicateAfterBackward   (`replicate`, pipelined or overlap off)
    OVERLAPPED_ALL_REDUCE  ReplicateOverlapped      (`replicate` without pipelining)
    REDUCE_SCATTER         ShardedOptimizerState    (`zero1`)
    FULLY_SHARDED          FullyShard               (`fsdp`, FSDP2)
"""

from torch.distributed.device_mesh import DeviceMesh

from lightning_tp3d.parallel.data_parallel.fsdp import FullyShard, apply_fsdp
from lightning_tp3d.parallel.data_parallel.overlap import OverlappedGradientReduction, ReplicateOverlapped
from lightning_tp3d.parallel.data_parallel.protocol import DataParallel
from lightning_tp3d.parallel.data_parallel.replicate import ReplicateAfterBackward, all_reduce_gradients
from lightning_tp3d.parallel.data_parallel.zero import ShardedOptimizerState, ZeroOptimizerSharding
from lightning_tp3d.plan.data_parallel import DataParallelPlan, GradientReduction

__all__ = [
    "DataParallel",
    "FullyShard",
    "OverlappedGradientReduction",
    "ReplicateAfterBackward",
    "ReplicateOverlapped",
    "ShardedOptimizerState",
    "ZeroOptimizerSharding",
    "all_reduce_gradients",
    "apply_fsdp",
    "build_data_parallel",
]

_IMPLEMENTATIONS: dict[GradientReduction, type[DataParallel]] = {
    GradientReduction.NONE: DataParallel,
    GradientReduction.ALL_REDUCE: ReplicateAfterBackward,
    GradientReduction.OVERLAPPED_ALL_REDUCE: ReplicateOverlapped,
    GradientReduction.REDUCE_SCATTER: ShardedOptimizerState,
    GradientReduction.FULLY_SHARDED: FullyShard,
}


def build_data_parallel(plan: DataParallelPlan, mesh: DeviceMesh) -> DataParallel:
    """The `DataParallel` that carries out `plan` over the ("pp", "dp", "tp") `mesh`."""
    return _IMPLEMENTATIONS[plan.reduction](plan, mesh)
