"""Expert parallelism: a mixture-of-experts block's routed experts split over an expert-parallel group.

The group is carved out of data parallelism, as Megatron and torchtitan do: with dp = d x E, a dp index
is d_e x E + e; the E ranks of one d_e (same pp and tp) form an expert-parallel group "ep", and the d ranks
of one e an expert data-parallel group "edp" (`parallel.mesh.build_expert_mesh`). Rank e of "ep" holds
experts [e N / E, (e + 1) N / E) of each block's N routed experts: the fused `gate_up_proj` [N, 2 I, h]
and `down_proj` [N, h, I] become DTensors over the ("edp", "ep") mesh, (Replicate, Shard(0)), so
checkpoints hold whole experts and reshard to any E (torch's DCP). Attention, the router, the shared
experts and the dense blocks are untouched (replicated over "ep", split over tp as before).

A block's forward on each ep rank (dropless: every token goes to every expert it chose):

    pairs       the T x K (token, expert) choices of the rank's T tokens, sorted by expert
    dispatch    all-to-all over "ep": the pairs' hidden states to the ranks holding their experts, the
                split sizes from an all-to-all of the per-expert counts
    experts     each local expert on the rows it received (SwiGLU: down(act(gate) * up)), in the dtype the
                model's own experts compute in: transformers' default grouped_mm experts cast their input
                to the weights' dtype outside autocast (fp32 under bf16-mixed), eager ones follow autocast
    combine     all-to-all back, reversed splits; each token sums its K outputs weighted by the router

The all-to-alls are autograd functions (the backward is the reversed all-to-all), so an expert's gradient
on its owner is the sum over the ep group's tokens. Over "edp" the replicas of an expert are averaged with
the rest of the model: g = (1 / dp) sum over edp of the ep-summed gradient, which is the one-process
gradient of the mean loss over the dp ranks' batches (`parallel.data_parallel.replicate.reduce_expert_gradients`,
one bucketed all-reduce over "edp").
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_tp3d._compat.torch import functional_collectives
from lightning_tp3d._compat.transformers import experts_run_in_weight_dtype

__all__ = ["ExpertParallelExperts", "is_expert_parameter", "shard_experts"]

EXPERT_MESH_DIMS = ("edp", "ep")
EXPERT_DATA_PARALLEL_DIMS = "edp"  # the expert mesh's dimension over which an expert's replicas are averaged


class ExpertParallelExperts(nn.Module):
    """A block's routed experts (fused, as transformers' `DeepseekV3Experts` holds them) split over the
    expert mesh's "ep" dimension; `forward(hidden [T, h], top_k_index [T, K], top_k_weights [T, K])`
    returns the weighted sum of each token's experts [T, h], as the module it replaces."""

    def __init__(self, experts: nn.Module, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh
        self.num_experts = experts.gate_up_proj.shape[0]
        self.ep_size = mesh.size(1)
        if self.num_experts % self.ep_size:
            raise ValueError(
                f"expert_parallel_size={self.ep_size} does not divide the {self.num_experts} routed experts of a"
                f" block; use an expert_parallel_size that divides {self.num_experts}.")
        self.num_local = self.num_experts // self.ep_size
        self.first_local = mesh.get_local_rank("ep") * self.num_local
        self.act_fn = experts.act_fn
        self.in_weight_dtype = experts_run_in_weight_dtype(experts)
        self.group = mesh.get_group("ep")
        for name in ("gate_up_proj", "down_proj"):
            whole = getattr(experts, name)
            local = whole.detach()[self.first_local:self.first_local + self.num_local].clone()
            shard = DTensor.from_local(local, mesh, (Replicate(), Shard(0)), run_check=False,
                                       shape=whole.shape, stride=whole.stride())
            setattr(self, name, nn.Parameter(shard, requires_grad=whole.requires_grad))
        # DTensor may hand the parameters an equal mesh from its caches (an earlier one of the same layout);
        # what shards them later (FSDP2's SPMD form) wants the very object they hold
        self.mesh = self.gate_up_proj.device_mesh

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        top_k = top_k_index.shape[1]
        experts = top_k_index.reshape(-1)
        order = torch.argsort(experts, stable=True)  # pairs grouped by expert, then by token
        tokens = order // top_k
        per_expert = torch.bincount(experts, minlength=self.num_experts)
        received_per_expert = torch.empty_like(per_expert)
        dist.all_to_all_single(received_per_expert, per_expert, group=self.group)  # [E x local experts], by source
        counts = torch.stack([per_expert, received_per_expert]).view(2, self.ep_size, self.num_local)
        sent_counts, received_counts = counts.tolist()  # the block's one host synchronisation
        sent, received = [sum(row) for row in sent_counts], [sum(row) for row in received_counts]
        inputs = _exchange(hidden_states[tokens], received, sent, self.group)
        outputs = self._local_experts(inputs, counts[1], received_counts)
        returned = _exchange(outputs, sent, received, self.group)
        weights = top_k_weights.reshape(-1)[order].unsqueeze(-1)
        combined = torch.zeros_like(hidden_states)
        return combined.index_add(0, tokens, (returned * weights).to(hidden_states.dtype))

    def _local_experts(self, inputs: torch.Tensor, counts: torch.Tensor, host_counts: list[list[int]]
                       ) -> torch.Tensor:
        """Rows from each source rank, grouped by local expert within a source (`counts` [source, expert],
        `host_counts` the same on the host): each expert on its rows.

        Every expert runs, on zero rows if it got none, so that the backward always passes through both
        all-to-alls on every rank of the group (a rank whose outputs did not depend on its inputs would skip
        the dispatch's backward all-to-all, which the others wait in)."""
        gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
        expert_of_row = torch.arange(self.num_local, device=inputs.device).repeat(self.ep_size)
        expert_of_row = expert_of_row.repeat_interleave(counts.reshape(-1), output_size=inputs.shape[0])
        by_expert = torch.argsort(expert_of_row, stable=True)
        if self.in_weight_dtype:  # as the model's own experts: in the weights' dtype, outside autocast
            inputs = inputs.to(gate_up.dtype)
        chunks = inputs[by_expert].split([sum(column) for column in zip(*host_counts)])
        outputs = []
        with torch.autocast(inputs.device.type, enabled=False) if self.in_weight_dtype else nullcontext():
            for expert, rows in enumerate(chunks):
                gate, up = nn.functional.linear(rows, gate_up[expert]).chunk(2, dim=-1)
                outputs.append(nn.functional.linear(self.act_fn(gate) * up, down[expert]))
        return torch.cat(outputs)[torch.argsort(by_expert)]


def _exchange(rows: torch.Tensor, output_splits: list[int], input_splits: list[int],
              group: dist.ProcessGroup) -> torch.Tensor:
    """All-to-all of `rows` over `group` (its backward is the reversed all-to-all of the gradient)."""
    return functional_collectives.all_to_all_single_autograd(rows.contiguous(), output_splits, input_splits, group)


def shard_experts(experts: Iterable[tuple[nn.Module, str]], mesh: DeviceMesh) -> None:
    """Replace each `(parent, attribute)`'s routed experts by an `ExpertParallelExperts` over `mesh` (the
    ("edp", "ep") mesh); parameter names are unchanged."""
    for parent, attribute in experts:
        setattr(parent, attribute, ExpertParallelExperts(getattr(parent, attribute), mesh))


def is_expert_parameter(parameter: torch.Tensor) -> bool:
    """Whether `parameter` is split over an expert-parallel group (a DTensor over the expert mesh)."""
    return isinstance(parameter, DTensor) and parameter.device_mesh.mesh_dim_names == EXPERT_MESH_DIMS
