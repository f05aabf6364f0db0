"""Names on a step's host timeline: which range of `torch.profiler`'s trace is which kind of work.

The package marks its own phases with `label(...)` (a `record_function` range, a few microseconds when
no profiler runs): a pipeline stage's compute chunks (`PIPELINE_COMPUTE`), the schedule around them
(`PIPELINE_SCHEDULE`), the data-parallel gradient reduction after backward and ZeRO-1's parameter
gather after the update (`DP_PHASE`). While profiling, `CommunicationLabels(mesh)` also names every
collective by the mesh group it runs on, `comm::<group>::<operation>`:

* `torch.distributed`'s collectives (FSDP2's gathers and reductions, the pipeline's loss broadcast,
  the non-finite flag): the whole blocking call;
* the functional collectives DTensor runs tensor parallelism with: the call that starts one, and the
  `wait_tensor` that waits for its result (matched by the result's buffer: autograd may hand the wait
  another tensor object over it), where a rank actually waits.

The functions are replaced on their modules while entered and restored on exit; code compiled by
`torch.compile` keeps the collectives it traced, unlabelled. Pipeline sends and receives stay the
schedule's own time (`diagnostics.breakdown`: a host cannot tell a transfer from the wait for its peer).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.autograd.profiler import record_function
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp3d._compat.torch import functional_collectives, group_name_of

__all__ = ["COMMUNICATION_PREFIX", "DP_PHASE", "PIPELINE_COMPUTE", "PIPELINE_SCHEDULE", "STEP", "CommunicationLabels",
           "label"]

PREFIX = "tp3d::"
STEP = PREFIX + "step"
PIPELINE_SCHEDULE = PREFIX + "pipeline::schedule"
PIPELINE_COMPUTE = PREFIX + "pipeline::compute"
DP_PHASE = PREFIX + "dp::"
COMMUNICATION_PREFIX = PREFIX + "comm::"

_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_gather",
                "reduce_scatter", "barrier", "all_to_all_single", "all_to_all", "reduce", "gather", "scatter")
_FUNCTIONAL = ("broadcast", "all_reduce", "all_gather_single", "all_gather_single_autograd",
               "reduce_scatter_single", "reduce_scatter_single_autograd", "all_gather_tensor",
               "all_gather_tensor_autograd", "reduce_scatter_tensor", "reduce_scatter_tensor_autograd",
               "all_reduce_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced",
               "all_to_all_single", "all_to_all_single_autograd")


def label(name: str) -> contextlib.AbstractContextManager[Any]:
    """A named range on the profiler's timeline (see the module docstring for the package's names)."""
    return record_function(name)


class CommunicationLabels:
    """While entered, every collective on `mesh`'s groups runs inside a `comm::<group>::<operation>` range
    (group "tp", "pp", "dp", "world" for the default group, "other" for any other)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        names = mesh.mesh_dim_names or ()
        self._by_group = {id(mesh.get_group(name)): name for name in names}
        self._by_name = {mesh.get_group(name).group_name: name for name in names}
        self._pending: dict[int, str] = {}  # the buffer of a functional collective's result -> its group
        self._restore: list[tuple[Any, str, Any]] = []

    def group(self, group: Any) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            return "world"
        if id(group) in self._by_group:
            return self._by_group[id(group)]
        try:
            return self._by_name.get(group_name_of(group), "other")
        except (ValueError, TypeError, RuntimeError):
            return "other"

    def __enter__(self) -> CommunicationLabels:
        for name in _COLLECTIVES:
            if hasattr(c10d, name):
                original = getattr(c10d, name)
                wrapped = self._labelled(original, name, awaited=False)
                self._restore += [(c10d, name, original), (dist, name, getattr(dist, name, original))]
                setattr(c10d, name, wrapped)
                setattr(dist, name, wrapped)
        for name in (*_FUNCTIONAL, "wait_tensor"):
            if hasattr(functional_collectives, name):
                original = getattr(functional_collectives, name)
                self._restore.append((functional_collectives, name, original))
                if name == "wait_tensor":
                    setattr(functional_collectives, name, self._waited(original))
                else:
                    setattr(functional_collectives, name, self._labelled(original, name, awaited=True))
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()
        self._pending.clear()

    def _group_argument(self, signature: inspect.Signature, args: tuple, kwargs: dict[str, Any]) -> Any:
        try:
            return signature.bind_partial(*args, **kwargs).arguments.get("group")
        except TypeError:
            return None

    def _labelled(self, original: Callable[..., Any], operation: str, *, awaited: bool) -> Callable[..., Any]:
        """`original` inside a range named by its group; `awaited`: a functional collective, whose result's
        buffer is remembered for the wait."""
        signature = inspect.signature(original)

        @functools.wraps(original)
        def labelled(*args: Any, **kwargs: Any) -> Any:
            group = self.group(self._group_argument(signature, args, kwargs))
            with record_function(f"{COMMUNICATION_PREFIX}{group}::{operation}"):
                result = original(*args, **kwargs)
            if awaited:
                for tensor in result if isinstance(result, (list, tuple)) else (result,):
                    self._pending[_buffer(getattr(tensor, "elem", tensor))] = group
            return result

        return labelled

    def _waited(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def labelled(tensor: Any) -> Any:
            group = self._pending.pop(_buffer(tensor), "other")
            with record_function(f"{COMMUNICATION_PREFIX}{group}::wait"):
                return original(tensor)

        return labelled


def _buffer(tensor: Any) -> int:
    """Where a tensor's data lives (its address), the same for every tensor object over that buffer."""
    try:
        return tensor.data_ptr()
    except (AttributeError, RuntimeError):
        return id(tensor)
