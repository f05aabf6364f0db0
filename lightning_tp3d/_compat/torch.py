"""torch's private names used by the package (read from torch 2.13), and the public ones whose name
changed between the versions the package supports (`torch>=2.6`).

* `flatten_dense_tensors` / `unflatten_dense_tensors` (`torch._utils`): one flat buffer per bucket of
  gradients, as DDP packs them.
* `foreach_norm` (`torch._foreach_norm`) and `non_finite_check_and_unscale_`
  (`torch._amp_foreach_non_finite_check_and_unscale_`): the fused kernels `clip_grad_norm_` and
  `GradScaler.unscale_` use; no public function takes a list.
* `loss_scale_tensor` (`GradScaler._get_scale_async`): the scale as a tensor, without the host
  synchronisation of `get_scale()`.
* `local_shape_and_global_offset` (`torch.distributed.tensor._utils`): where a DTensor's shard sits in
  the global tensor.
* `AsyncCollectiveTensor` (`torch.distributed._functional_collectives`): what a functional collective
  returns before it is waited for.
* `process_group_options` (`torch._C._distributed_c10d.Backend.Options`, the NCCL options' `_timeout`):
  a timeout for every group of a device mesh.
* `dynamo_counters` (`torch._dynamo.utils.counters`): what dynamo compiled (`stats.unique_graphs`) and
  where it broke a graph (`graph_break`), which `TP3DStrategy(compile=True)` is checked with.
* `recorded_collectives` (`torch._C._distributed_c10d._dump_*_trace_json`): the flight recorder's
  entries, NCCL's or the generic one's (gloo).
* `fsspec_dcp_filesystem` (`torch.distributed.checkpoint._fsspec_filesystem.FileSystem`): DCP's
  filesystem over fsspec, which `FsspecReader` / `FsspecWriter` use, for the package's own reader and
  hashing writer on remote storage.
* `default_store` (`distributed_c10d._get_default_store`): the key-value store the default group was
  created with, which answers while collectives hang (the stalled-rank monitor's heartbeats).
* `functional_collectives` (`torch.distributed._functional_collectives`): the module DTensor's collectives
  go through (looked up on it at each call), and `group_name_of` (its `_resolve_group_name`): which
  process group a functional collective's `group` argument means. The step profiler labels them; expert
  parallelism's token exchange is its `all_to_all_single_autograd` (`torch.distributed.nn.functional`'s
  autograd all-to-all is deprecated in favour of it).
* `pipeline_orders` / `compute_order` (a multi-stage schedule's `pipeline_order` and its `_Action`s, the
  former from stand-in stages): the order in which each rank runs its stages' actions, for the planner's
  timeline and the pipeline's own executor; `timed_schedule_waits` (`schedules._wait_batch_p2p`): the time
  torch's schedule spends waiting for its sends and receives, reported beside the executor's.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from importlib.metadata import version
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional_collectives
from torch import nn
from torch._utils import _flatten_dense_tensors as flatten_dense_tensors
from torch._utils import _unflatten_dense_tensors as unflatten_dense_tensors
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as local_shape_and_global_offset

__all__ = [
    "FLIGHT_RECORDER_VARIABLES",
    "TORCH_VERSION",
    "AsyncCollectiveTensor",
    "all_gather_single",
    "compute_order",
    "default_store",
    "dynamo_counters",
    "flatten_dense_tensors",
    "foreach_norm",
    "fsspec_dcp_filesystem",
    "functional_collectives",
    "group_name_of",
    "is_compiled",
    "local_shape_and_global_offset",
    "loss_scale_tensor",
    "non_finite_check_and_unscale_",
    "pipeline_orders",
    "process_group_options",
    "recorded_collectives",
    "reduce_scatter_single",
    "timed_schedule_waits",
    "unflatten_dense_tensors",
]

TORCH_VERSION = version("torch")

# The flight recorders' buffer size: torch 2.13 reads TORCH_FR_BUFFER_SIZE for gloo and NCCL alike and warns
# that NCCL's older name, TORCH_NCCL_TRACE_BUFFER_SIZE, is deprecated; before 2.13 NCCL reads only that name.
FLIGHT_RECORDER_VARIABLES = (("TORCH_FR_BUFFER_SIZE",) if tuple(map(int, TORCH_VERSION.split(".")[:2])) >= (2, 13)
                             else ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"))

# torch 2.13 names them `*_single` (the `*_tensor` names warn there); older versions only have those.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
foreach_norm = torch._foreach_norm
non_finite_check_and_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_


def is_compiled(module: nn.Module) -> bool:
    """`torch.compile(module)` (an `OptimizedModule` holding `_orig_mod`) or `module.compile()` (in place)."""
    return hasattr(module, "_orig_mod") or getattr(module, "_compiled_call_impl", None) is not None


def dynamo_counters() -> Any:
    """dynamo's counters (a mapping of `collections.Counter`s by kind), imported on first use."""
    from torch._dynamo.utils import counters

    return counters


def loss_scale_tensor(scaler: Any) -> torch.Tensor | None:
    """`scaler`'s current scale on its device (None before its first `scale`)."""
    return scaler._get_scale_async()


def default_store() -> dist.Store:
    """The store of the default process group (a `TCPStore` under torchrun and Lightning)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def fsspec_dcp_filesystem(url: str) -> tuple[Any, str]:
    """DCP's fsspec filesystem and the path it writes under, for the folder at `url` (s3://..., gs://...)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

    files = FileSystem()
    return files, files.init_path(url)


def process_group_options(backend: str, timeout: timedelta) -> Any:
    """The options object `init_device_mesh(backend_override=...)` takes for `backend`, with `timeout`."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return options
    from torch._C._distributed_c10d import Backend

    return Backend.Options(backend, timeout)


def group_name_of(group: Any) -> str:
    """The name of the process group a functional collective's `group` argument (a group, a (mesh, dim)
    pair, ranks or a name) resolves to."""
    return str(functional_collectives._resolve_group_name(group))


def recorded_collectives() -> list[dict[str, Any]]:
    """The flight recorder's entries: NCCL's (GPU groups) where it holds any, else the generic one's (gloo);
    empty where recording is off or not built in."""
    import torch._C._distributed_c10d as c10d

    for dump_name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
        dump = getattr(c10d, dump_name, None)
        if dump is None:
            continue
        try:
            entries = json.loads(dump(True, True)).get("entries", [])
        except Exception:  # noqa: BLE001 - that recorder is not built in or holds nothing
            continue
        if entries:
            return entries
    return []


def pipeline_orders(schedule_class: str, pp_size: int, num_microbatches: int,
                    stage_indices: Sequence[Sequence[int]]) -> dict[int, list[tuple[str, int, int]]]:
    """Each rank's compute actions under torch's multi-stage schedule `schedule_class` (e.g.
    "Interleaved1F1B"), as (kind, stage, micro-batch) with kind F, B, I or W; an overlapped forward and
    backward (DualPipeV) is its forward then its backward. `stage_indices[r]`: the stages rank r runs.

    torch computes the orders for every rank in the schedule's constructor (`pipeline_order`), from its
    stages' indices and group size alone, so stand-ins carrying those build it without processes or
    modules (read from torch 2.13)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    num_stages = sum(map(len, stage_indices))
    stages = [_OrderOnlyStage(index, num_stages, pp_size) for index in stage_indices[0]]
    schedule = get_schedule_class(schedule_class)(stages, num_microbatches)
    return {rank: compute_order(schedule, rank) for rank in schedule.pipeline_order}


@contextlib.contextmanager
def timed_schedule_waits(interval: Callable[[], Any]) -> Iterator[None]:
    """Inside, each wait of torch's schedules for their sends and receives (`schedules._wait_batch_p2p`)
    is timed by `interval()` (an object with `stop()`, started when made): the time a rank spent blocked
    on point-to-point communication under torch's own schedule (read from torch 2.13)."""
    from torch.distributed.pipelining import schedules

    untimed = schedules._wait_batch_p2p

    def timed(works: Any) -> None:
        started = interval()
        try:
            untimed(works)
        finally:
            started.stop()

    schedules._wait_batch_p2p = timed
    try:
        yield
    finally:
        schedules._wait_batch_p2p = untimed


def compute_order(schedule: Any, rank: int) -> list[tuple[str, int, int]]:
    """Rank `rank`'s compute actions in a multi-stage torch schedule's `pipeline_order`, as (kind,
    stage, micro-batch) with kind F, B, I or W; an overlapped forward and backward (DualPipeV) is its
    forward then its backward, as torch runs them (read from torch 2.13)."""
    flat = [part for action in schedule.pipeline_order[rank] if action is not None
            for part in (action.sub_actions if action.sub_actions is not None else (action,))]
    return [(part.computation_type.value, part.stage_index, part.microbatch_index) for part in flat]


class _OrderOnlyStage:
    """What a torch schedule's constructor reads of its stages to compute the pipeline order."""

    def __init__(self, stage_index: int, num_stages: int, pp_size: int) -> None:
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_size, self.group_rank = pp_size, 0
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}
