"""The process mesh: a `DeviceMesh` of shape (pp, dp, tp) built from a validated layout.

tp is the innermost dimension, so a tensor-parallel group is a run of consecutive ranks and sits
inside one node under the usual one-process-per-GPU launch; pp is outermost. The mesh's rank order
is the layout's: `rank = (pp x dp_size + dp) x tp_size + tp`.

With expert parallelism (E = `expert_parallel_size`) a second mesh splits the dp dimension in two,
(pp, dp / E, E, tp) named ("pp", "edp", "ep", "tp"), over the same rank order (dp = edp x E + ep); the
experts live on its ("edp", "ep") part (`parallel.experts`).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_tp3d.parallel.collectives import mesh_group_options
from lightning_tp3d.plan.layout import LayoutError, ParallelLayout

__all__ = ["build_device_mesh", "build_expert_mesh", "mesh_device"]


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
    options = None
    if timeout is not None:
        options = mesh_group_options(dist.get_backend(), timeout, layout.mesh_dim_names)
    mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=layout.mesh_dim_names,
                            backend_override=options)
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
    names = ("pp", "edp", "ep", "tp")
    options = mesh_group_options(dist.get_backend(), timeout, names) if timeout is not None else None
    shape = (layout.pipeline_parallel_size, layout.data_parallel_size // experts, experts, layout.tensor_parallel_size)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=options)
    return mesh["edp", "ep"]
