"""`data_parallel_mode="fsdp"` (ZeRO-3): FSDP2 `fully_shard` on each block and then on each root.

Parameters, gradients and optimizer state are split along dim 0 across dp ranks, the parameters
gathered per unit for compute and the gradients reduce-scattered by FSDP2 itself. FSDP2 must wrap
parameters that are already DTensors over tp, and its units must contain the recomputed code, so the
recompute runs on unsharded parameters (`parallel.parallelize`'s order). Under pipelining each stage
module is called directly, so each is an FSDP root of its own, and by default its parameters stay
gathered through the step's micro-batches (once per step, not once per micro-batch, as torchtitan
does; `plan.schedules.fsdp_reshards_after_forward`).

A tensor subclass with FSDP2's all-gather extension (`fsdp_pre_all_gather`: torchao's NF4 weights of a
QLoRA base, `models.qlora`) is sharded as the subclass defines when dp > 1. Over a single rank FSDP2
(torch 2.13) copies out only the first of a subclass's all-gather inputs, which breaks one with several
(NF4 has three); there is nothing to shard there, so at dp = 1 such parameters are left out of the units.

Routed experts split over an expert-parallel group (`parallel.experts`: DTensors (Replicate, Shard(0))
over the ("edp", "ep") mesh) are a unit of their own, sharded over "edp" only: FSDP2's SPMD-mesh form
(`dp_mesh_dims`), which keeps "ep" as the parameters' own split and cuts each rank's experts along dim 0
over their d replicas. Their gradients are reduce-scattered over "edp" and divided by dp = d x E, not d:
an expert's gradient is already summed over the E ranks of its group by the all-to-all's backward, so
(1 / dp) sum over edp is the one-process gradient of the mean loss, as for every other parameter. With a
single replica (d = 1, dp = E) there is nothing to shard, and FSDP2 (torch 2.13) would divide a one-rank
unit's gradient by its factor twice; those experts stay out of the units and are divided by dp after the
backward (`replicate.reduce_expert_gradients`, its all-reduce over one rank a no-op).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import DataParallelMeshDims, fully_shard

from lightning_tp3d.parallel.data_parallel.protocol import DataParallel
from lightning_tp3d.parallel.data_parallel.replicate import reduce_expert_gradients
from lightning_tp3d.parallel.experts import EXPERT_DATA_PARALLEL_DIMS, ExpertParallelExperts, is_expert_parameter

__all__ = ["FullyShard", "apply_fsdp"]


def apply_fsdp(roots: Iterable[nn.Module], dp_mesh: DeviceMesh, blocks: Iterable[nn.Module],
               reshard_after_forward: bool = True) -> None:
    """FSDP2 over `dp_mesh`: one unit per block (so only one block is gathered at a time), then each root
    (the model, or every pipeline stage module), which takes the parameters outside the blocks.

    `reshard_after_forward=False` keeps a unit's parameters gathered from its first forward until the
    end of the step's backward. Pipelining needs it: a schedule runs the forwards of several
    micro-batches between a unit's forward and its backward, and the zero-bubble schedules compute the
    weight gradients in a separate pass after the input gradients. Resharding in between regathers the
    parameters once per micro-batch and, with the split backward (torch 2.13), leaves the weight
    gradients on parameters FSDP has already swapped out: they come back wrong or missing.
    """
    roots = list(roots)
    ignored = _single_rank_extensions(roots) if dp_mesh.size() == 1 else set()
    for block in blocks:
        for experts in _expert_parallel_modules(block):
            if not _has_replicas(experts.mesh):
                ignored |= set(experts.parameters())
                continue
            fully_shard(experts, mesh=experts.mesh, reshard_after_forward=reshard_after_forward,
                        dp_mesh_dims=DataParallelMeshDims(shard=EXPERT_DATA_PARALLEL_DIMS))
            experts.set_gradient_divide_factor(float(dp_mesh.size()))
            experts.set_force_sum_reduction_for_comms(True)  # a sum, then the division (gloo has no PREMUL_SUM)
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored)
    for root in roots:
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored)


def _expert_parallel_modules(block: nn.Module) -> list[ExpertParallelExperts]:
    """The routed experts split over an expert-parallel group within `block` (module docstring)."""
    return [module for module in block.modules() if isinstance(module, ExpertParallelExperts)]


def _has_replicas(expert_mesh: DeviceMesh) -> bool:
    """Whether experts over the ("edp", "ep") `expert_mesh` have more than one replica, which FSDP2 shards
    them over (else they stay outside the units: module docstring)."""
    return expert_mesh.size(0) > 1


def _single_rank_extensions(roots: Iterable[nn.Module]) -> set[nn.Parameter]:
    """The parameters of `roots` whose tensor type has FSDP2's all-gather extension (module docstring)."""
    return {parameter for root in roots for parameter in root.parameters()
            if hasattr(type(parameter), "fsdp_pre_all_gather")}


class FullyShard(DataParallel):
    """FSDP2 units over the mesh's "dp" dimension; the reduction is FSDP2's own."""

    def wrap(self, roots: Sequence[nn.Module], blocks: Iterable[nn.Module]) -> None:
        apply_fsdp(roots, self.mesh["dp"], blocks, reshard_after_forward=self.plan.reshard_after_forward)

    def reduce_gradients(self, parameters: list[nn.Parameter]) -> list[nn.Parameter]:
        """FSDP2 has reduced every unit's gradients; experts over a single replica, outside the units, are
        divided by dp here."""
        parameters = super().reduce_gradients(parameters)
        reduce_expert_gradients([parameter for parameter in parameters
                                 if is_expert_parameter(parameter) and not _has_replicas(parameter.device_mesh)],
                                self.plan.data_parallel_size)
        return parameters
