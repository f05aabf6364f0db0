"""Collectives that fail instead of hanging, with an error that names the group and the operation.

Two torch facts (2.13) shape this module:

* `init_device_mesh` creates the mesh's groups with torch's default timeout (30 minutes), not the
  default group's; `mesh_group_options` gives each mesh dimension the run's timeout.
* The backend's timeout error says neither which group nor which collective ("Timed out waiting
  3000ms for recv operation to complete"). torch's flight recorder (`TORCH_FR_BUFFER_SIZE`, enabled by
  `enable_collective_recording` before the groups exist) keeps the last collectives of each rank with
  their group description (`mesh_tp`, ...) and operation, from which `CollectiveTimeoutError` is built.
* NCCL keeps its own recorder (`_dump_nccl_trace_json`), read first when it exists. A NCCL timeout
  usually never reaches Python: the watchdog aborts the process. `enable_collective_recording` therefore
  also asks the watchdog to dump every rank's recorder on a timeout (`TORCH_NCCL_DUMP_ON_TIMEOUT`, files
  `TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>`, default `/tmp/tp3d_nccl_trace_rank_<rank>`), which
  `python -m torch.distributed.flight_recorder.fr_trace /tmp -p tp3d_nccl_trace_rank_ -j` turns into the
  name of the stuck collective.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp3d._compat.torch import FLIGHT_RECORDER_VARIABLES, process_group_options, recorded_collectives

__all__ = [
    "CollectiveTimeoutError",
    "describe_failed_collective",
    "destroy_gloo_groups_at_exit",
    "enable_collective_recording",
    "mesh_group_options",
    "naming_stuck_collectives",
]

_FAILURE_PATTERNS = re.compile(
    r"timed out|timeout|connection closed by peer|connection reset|watchdog|DistBackendError", re.IGNORECASE
)
_PEER_GONE = re.compile(r"connection closed by peer|connection reset", re.IGNORECASE)
_RECORDED_COLLECTIVES = "2000"
Method = TypeVar("Method", bound=Callable[..., Any])


class CollectiveTimeoutError(RuntimeError):
    """A collective that did not complete: which group (tp / pp / dp), which operation, which ranks."""


def enable_collective_recording() -> None:
    """Turn on torch's flight recorders (gloo's and NCCL's) for the groups created afterwards, and NCCL's
    dump on a watchdog timeout, unless the user configured them (a buffer size under either name). Only the
    names this torch reads undeprecated are set (`FLIGHT_RECORDER_VARIABLES`)."""
    if not any(name in os.environ for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")):
        os.environ.update(dict.fromkeys(FLIGHT_RECORDER_VARIABLES, _RECORDED_COLLECTIVES))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/tmp/tp3d_nccl_trace_rank_")


def mesh_group_options(backend: str, timeout: timedelta, dim_names: tuple[str, ...]) -> dict[str, Any]:
    """`init_device_mesh(backend_override=...)` giving every mesh dimension's groups `timeout`."""
    options = process_group_options(backend, timeout)
    return {name: (backend, options) for name in dim_names}


def _last_recorded_collective() -> dict[str, Any] | None:
    """The newest entry of NCCL's recorder (GPU groups), else of the generic one (gloo groups)."""
    return max(recorded_collectives(), key=lambda entry: entry.get("record_id", 0), default=None)


def describe_failed_collective(error: BaseException, mesh: DeviceMesh | None, timeout: timedelta | None) -> str | None:
    """A sentence naming the group, operation and ranks of the collective `error` interrupted, or None
    when `error` does not look like a failed collective."""
    if not _FAILURE_PATTERNS.search(f"{type(error).__name__}: {error}"):
        return None
    entry = _last_recorded_collective()
    if entry is None:
        return None
    group_desc = (entry.get("process_group") or ["", ""])[-1]
    operation = entry.get("profiling_name", "a collective").split(":")[-1]
    dimension = group_desc.removeprefix("mesh_") if group_desc.startswith("mesh_") else None
    if dimension is not None and mesh is not None and dimension in (mesh.mesh_dim_names or ()):
        group = f"the {dimension} group (ranks {mesh[dimension].mesh.flatten().tolist()})"
    elif group_desc in ("default_pg", ""):
        group = "the default group (all ranks)"
    else:
        group = f"the process group {group_desc!r}"
    if _PEER_GONE.search(str(error)):
        return (
            f"{operation} on {group} failed on rank {dist.get_rank()}: a rank of that group closed its connection"
            " (its process died or was killed, e.g. with its node). Under torchrun with --max-restarts the job"
            " restarts from the last checkpoint (see docs/operating.md); otherwise look at that rank's log first."
        )
    within = f" within {timeout}" if timeout is not None else ""
    return (
        f"{operation} on {group} did not complete{within} on rank {dist.get_rank()}: another rank of that group"
        " never joined it (it is stuck in a different collective, much slower, or it died). The ranks' code"
        " paths diverged; run with TORCH_DISTRIBUTED_DEBUG=DETAIL to compare the collectives of every rank."
    )


def naming_stuck_collectives(method: Method) -> Method:
    """Wrap a strategy method so a failed collective inside it raises `CollectiveTimeoutError` naming it.

    The strategy provides `_device_mesh` and `_timeout`."""

    @functools.wraps(method)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except CollectiveTimeoutError:
            raise
        except (RuntimeError, dist.DistError) as error:
            description = describe_failed_collective(error, getattr(self, "_device_mesh", None),
                                                     getattr(self, "_timeout", None))
            if description is None:
                raise
            raise CollectiveTimeoutError(description) from error

    return wrapped  # type: ignore[return-value]


@functools.cache
def destroy_gloo_groups_at_exit() -> None:
    """Destroy the process groups before the interpreter finalises, when they are gloo's (registered with
    `atexit` once per process; the strategies call this when they create their groups).

    A process that exits with a live gloo group can abort at interpreter finalisation ("terminate called
    without an active exception", exit status -6, pytorch#190489) after its run succeeded: gloo's threads
    still hold work whose tensors need the interpreter. Lightning never destroys the default group. Gloo's
    destroy is local (a peer still waiting sees its connection close and fails instead of hanging); NCCL's
    is not, so a NCCL group is left to the script, as torchtitan leaves it."""
    atexit.register(_destroy_gloo_groups)


def _destroy_gloo_groups() -> None:
    if dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()
