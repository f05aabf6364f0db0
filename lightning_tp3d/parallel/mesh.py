"""The process mesh: a `DeviceMesh` of shape (pp, dp, tp) built from a validated layout.

tp is the innermost dimension, so a tensor-parallel group is a run of consecutive ranks and sits
inside one node under the usual one-process-per-GPU launch; pp is outermost. The mesh's rank order
is the layout's: `rank = (pp x dp_size + dp) x tp_size + tp`.

With expert parallelism (E = `expert_parallel_size`) a second mesh splits the dp dimension in two,
(pp, dp / E, E, tp) named ("pp", "edp", "ep", "tp"), over the same rank order (dp = edp x E + ep); the
experts live on its ("edp", "ep") part (`parallel.experts`).

A process that builds the same mesh again (a second fit, a sweep, a notebook, a test session running many
fits in one process) gets the one it built before, with its process groups, as long as the default group
is the same: torch's `init_device_mesh` creates new groups at every call and keeps every group registered
until the default group is destroyed, and each gloo group keeps transport threads that wake every 10 ms
(measured: a 2-D mesh built 10 times left 60 threads per process; a process running 50 fits on 2 cores
spent most of its time in those wake-ups). A mesh of another default group (destroyed and initialised
again) is dropped when the next mesh is built, or at once by `forget_meshes()`.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_tp3d.parallel.collectives import mesh_group_options
from lightning_tp3d.plan.layout import LayoutError, ParallelLayout

__all__ = ["build_device_mesh", "build_expert_mesh", "forget_meshes", "mesh_device"]


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's mesh groups communicate on: tensors given to their collectives live there."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def build_device_mesh(layout: ParallelLayout, device_type: str, timeout: timedelta | None = None) -> DeviceMesh:
    """A 3-D mesh with dimensions named ("pp", "dp", "tp"); needs an initialised default process group.

    With `timeout`, every dimension's groups use it (torch otherwise gives mesh groups its 30-minute
    default, whatever the default group's timeout is)."""
    if not dist.is_initialized():
        raise RuntimeError("build_device_mesh needs torch.distributed to be initialised first.")
    layout.validate_world_size(dist.get_world_size())
    mesh = _mesh_of_this_process(device_type, layout.shape, layout.mesh_dim_names, timeout)
    expected = layout.coordinates(dist.get_rank())
    found = tuple(mesh.get_local_rank(name) for name in layout.mesh_dim_names)
    if found != tuple(expected):
        raise LayoutError(f"mesh coordinates {found} of rank {dist.get_rank()} differ from the layout's {expected}.")
    return mesh


def build_expert_mesh(layout: ParallelLayout, device_type: str, timeout: timedelta | None = None
                      ) -> DeviceMesh | None:
    """The ("edp", "ep") mesh of this rank's (pp, tp) (see the module docstring); None without expert
    parallelism (E = 1)."""
    experts = layout.expert_parallel_size
    if experts == 1:
        return None
    shape = (layout.pipeline_parallel_size, layout.data_parallel_size // experts, experts, layout.tensor_parallel_size)
    return _mesh_of_this_process(device_type, shape, ("pp", "edp", "ep", "tp"), timeout)["edp", "ep"]


# (device type, shape, names, timeout) -> (the default group it was built on, the mesh)
_MESHES: dict[tuple[str, tuple[int, ...], tuple[str, ...], timedelta | None], tuple[object, DeviceMesh]] = {}


def _mesh_of_this_process(device_type: str, shape: tuple[int, ...], names: tuple[str, ...],
                          timeout: timedelta | None) -> DeviceMesh:
    """`init_device_mesh(device_type, shape, names)` with `timeout` on its groups, built once per default
    group (see the module docstring)."""
    world = dist.group.WORLD
    for key in [key for key, (built_on, _) in _MESHES.items() if built_on is not world]:
        del _MESHES[key]  # its groups were destroyed with their default group
    key = (device_type, tuple(shape), tuple(names), timeout)
    if key not in _MESHES:
        options = mesh_group_options(dist.get_backend(), timeout, names) if timeout is not None else None
        _MESHES[key] = (world, init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=options))
    return _MESHES[key][1]


def forget_meshes() -> None:
    """Drop the meshes kept for reuse, so that their groups, once destroyed, are released now rather than
    when the next mesh is built (after `torch.distributed.destroy_process_group()`)."""
    _MESHES.clear()
