"""The data-parallel modes and what each does at a layout, decided once (no torch).

A user names a mode (`data_parallel_mode`) and two switches; `choose_data_parallel` turns them and the
layout's dp and pp sizes into a `DataParallelPlan`: how the step's gradients are reduced over dp
(`GradientReduction`), by how much parameters and optimizer state are divided, and whether FSDP2
reshards after forward. The runtime (`parallel.data_parallel.build_data_parallel`), the memory ledger
(`plan.ledger`), the communication ledger (`plan.communication`) and the advisor all read this plan,
so no rule about a mode is written twice and every plan comes from option values a user can pass.

* `"replicate"` (DDP semantics): whole (tp-local) parameters, gradients averaged over dp,
  g = (1 / d) sum_j g_j. Without pipelining and with `overlap_gradient_reduction` the all-reduce runs
  in buckets during backward (`OVERLAPPED_ALL_REDUCE`); otherwise after it (`ALL_REDUCE`).
* `"zero1"`: whole parameters and gradients; each dp rank updates its 1/d part of every parameter
  (optimizer state / d): a reduce-scatter of the gradients after backward, an all-gather of the
  updated parts after the step (`REDUCE_SCATTER`).
* `"fsdp"` (FSDP2, ZeRO-3): parameters, gradients and optimizer state / d, gathered per unit for
  compute, gradients reduce-scattered by FSDP2 itself (`FULLY_SHARDED`).

At dp = 1 there is nothing to reduce: `replicate` and `zero1` train alike (`NONE`); `fsdp` still wraps
the network (over a mesh of one rank), so its parameters are the same DTensors at every dp.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from lightning_tp3d.plan.schedules import fsdp_reshards_after_forward

__all__ = ["DATA_PARALLEL_MODES", "DataParallelPlan", "GradientReduction", "check_data_parallel_mode",
           "check_expert_parallel", "choose_data_parallel"]

DATA_PARALLEL_MODES: tuple[str, ...] = ("replicate", "fsdp", "zero1")


class GradientReduction(enum.Enum):
    """How a step's gradients are made the dp average."""

    NONE = "nothing to reduce (dp = 1)"
    ALL_REDUCE = "one all-reduce after backward"
    OVERLAPPED_ALL_REDUCE = "all-reduces in buckets during backward"
    REDUCE_SCATTER = "reduce-scatter to the optimizer's parts after backward, all-gather after the step"
    FULLY_SHARDED = "FSDP2: all-gathers per unit, reduce-scatter of its gradients"


@dataclass(frozen=True)
class DataParallelPlan:
    """What the data-parallel mode `mode` does at `data_parallel_size` (see the module docstring)."""

    mode: str
    data_parallel_size: int
    reduction: GradientReduction
    reshard_after_forward: bool = False  # FSDP2 frees a unit's gathered parameters after its forward

    @property
    def parameter_shards(self) -> int:
        """Parameters and gradients of a rank are 1 / this of the tp-local ones."""
        return self.data_parallel_size if self.reduction is GradientReduction.FULLY_SHARDED else 1

    @property
    def optimizer_shards(self) -> int:
        """The optimizer state of a rank is 1 / this of the tp-local parameters' state."""
        sharded = (GradientReduction.FULLY_SHARDED, GradientReduction.REDUCE_SCATTER)
        return self.data_parallel_size if self.reduction in sharded else 1


def check_data_parallel_mode(mode: str) -> None:
    if mode not in DATA_PARALLEL_MODES:
        raise ValueError(f"data_parallel_mode={mode!r} is not one of {list(DATA_PARALLEL_MODES)}.")


def choose_data_parallel(mode: str, data_parallel_size: int, pipeline_parallel_size: int = 1,
                         overlap_gradient_reduction: bool = True, fsdp_reshard_after_forward: bool | None = None,
                         pipeline_schedule: str = "1f1b") -> DataParallelPlan:
    """The plan for `mode` at dp `data_parallel_size` and pp `pipeline_parallel_size`. The overlapped
    all-reduce needs the gradients complete when backward ends, which a pipeline schedule's several
    backwards per step do not give; FSDP2's resharding default and its refusal for the split-backward
    schedules are `plan.schedules.fsdp_reshards_after_forward`'s."""
    check_data_parallel_mode(mode)
    if mode == "fsdp":
        reshard = fsdp_reshards_after_forward(fsdp_reshard_after_forward, pipeline_schedule, pipeline_parallel_size)
        return DataParallelPlan(mode, data_parallel_size, GradientReduction.FULLY_SHARDED, reshard)
    if data_parallel_size == 1:
        reduction = GradientReduction.NONE
    elif mode == "zero1":
        reduction = GradientReduction.REDUCE_SCATTER
    elif overlap_gradient_reduction and pipeline_parallel_size == 1:
        reduction = GradientReduction.OVERLAPPED_ALL_REDUCE
    else:
        reduction = GradientReduction.ALL_REDUCE
    return DataParallelPlan(mode, data_parallel_size, reduction)


def check_expert_parallel(expert_parallel_size: int) -> None:
    """`expert_parallel_size` is a positive integer (every data-parallel mode and pipeline schedule carries
    experts: the ranks of an expert-parallel group hold the same stages and run the same schedule, so they
    issue their all-to-alls in the same order)."""
    if isinstance(expert_parallel_size, bool) or not isinstance(expert_parallel_size, int) or expert_parallel_size < 1:
        raise ValueError(f"expert_parallel_size must be a positive integer, got {expert_parallel_size!r}.")

