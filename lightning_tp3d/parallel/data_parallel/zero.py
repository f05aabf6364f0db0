"""`data_parallel_mode="zero1"`: the optimizer's state and update split over dp, with DDP's traffic.

Every dp rank holds the whole (tp-local) parameters and computes whole gradients, as in `"replicate"`.
Each parameter W is cut over dp as `plan.optimizer_sharding` says (along the first dim tp does not split,
`torch.chunk` sizes), and dp rank r's part W_r is handed to the optimizer in W's place: a DTensor over
the (dp, tp) mesh with placements (Shard(dim), W's tp placement) whose local tensor is a view of W's
own storage. So the optimizer keeps state for 1/d of every parameter and updates W_r in place. A step:

1. after the last backward, the gradients are reduce-scattered over dp in buckets (`pack_buckets`): rank
   r receives sum_j g_j restricted to its parts, divided by d, as the parts' gradients; the whole
   gradients are freed;
2. clipping, the non-finite check and the fp16 unscale see the parts' gradients (DTensors: their norm is
   made whole over dp and tp);
3. the optimizer updates the parts; then the parts are all-gathered over dp in the same buckets, so every
   rank holds the updated W again.

Per step and dp rank: a reduce-scatter of the gradients ((d - 1) / d x d S per bucket) and an all-gather
of the parameters ((d - 1) x S): 2 (d - 1) / d x P in all, a ring all-reduce's, DDP's. Every backend runs
the same calls (gloo carries its reduce-scatter out as an all-reduce of the bucket, see
`plan.communication`). A parameter tp splits and dp cannot cut (a 1-D column-parallel bias) is
all-reduced whole and updated on every rank.

Routed experts split over an expert-parallel group (`parallel.experts`: DTensors (Replicate, Shard(0))
over the ("edp", "ep") mesh) are cut the same way over their own replicas, "edp", with their own buckets:
the reduce-scatter sums an expert's gradient over edp and divides by dp = d x E (the all-to-all's backward
has already summed it over ep), and the all-gather runs over edp.

Only optimizers that update each element on its own (`ELEMENTWISE_OPTIMIZERS`) give the same update on
parts as on the whole; others are refused. The optimizer's state dict is read and written through a
module tree holding every sharding's parts under the parameters' names (`optimizer_owner`), so a
checkpoint keys the state by parameter name with the parts' DTensor placements and loads at any layout
or dp mode (DCP).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from lightning_tp3d._compat.torch import all_gather_single, reduce_scatter_single
from lightning_tp3d.parallel.data_parallel.protocol import DataParallel
from lightning_tp3d.parallel.experts import is_expert_parameter
from lightning_tp3d.parallel.labels import DP_PHASE, label
from lightning_tp3d.parallel.tensor import local_part
from lightning_tp3d.plan.communication import BUCKET_BYTES
from lightning_tp3d.plan.data_parallel import DataParallelPlan
from lightning_tp3d.plan.optimizer_sharding import chunk_sizes, dp_split_dim, pack_buckets, part_sizes

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ShardedOptimizerState", "ZeroOptimizerSharding"]


ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
                          torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop,
                          torch.optim.Adadelta, torch.optim.Rprop, torch.optim.ASGD)


@dataclass
class _Part:
    """One parameter W and this rank's part of it (`shard`, the parameter the optimizer updates)."""

    name: str
    parameter: nn.Parameter
    local: torch.Tensor  # W's tp-local data
    tp_dim: int | None  # the dim tp splits W along
    dim: int | None  # the dim dp cuts; None: not cut
    sizes: list[int]  # each dp rank's length along `dim`
    shard: nn.Parameter

    def piece(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s part of a tensor shaped like `local` (a view)."""
        start = sum(self.sizes[:rank])
        return tensor.narrow(self.dim, start, self.sizes[rank])


class ZeroOptimizerSharding:
    """The parts of `named_parameters` (those given to an optimizer) over `mesh`'s first dimension: the
    (dp, tp) mesh, or the experts' own ("edp", "ep") mesh. Gradients are summed over that dimension and
    divided by `divisor` (its size by default; dp for experts, module docstring)."""

    def __init__(self, named_parameters: Sequence[tuple[str, nn.Parameter]], mesh: DeviceMesh,
                 bucket_bytes: int, divisor: int | None = None) -> None:
        self.mesh = mesh
        self.group = mesh.get_group(0)
        self.dp = mesh.size(0)
        self.rank = mesh.get_local_rank(0)
        self.divisor = divisor or self.dp
        parts = [self._part(name, parameter) for name, parameter in named_parameters]
        dtypes = {part.local.dtype for part in parts}
        if len(dtypes) > 1:
            raise TypeError(f"data_parallel_mode='zero1' packs gradients and parameters of one dtype; the optimizer"
                            f" holds {sorted(map(str, dtypes))}: give them one dtype or use 'replicate'.")
        self._cut = [part for part in parts if part.dim is not None]
        self._whole = [part for part in parts if part.dim is None]
        self._by_parameter = {id(part.parameter): part for part in parts}
        element_bytes = parts[0].local.element_size() if parts else 4
        sizes = [part_sizes(tuple(part.local.shape), part.tp_dim, self.dp) for part in self._cut]
        self._buckets = pack_buckets(sizes, self.dp, element_bytes, bucket_bytes)
        self.shards = {part.name: part.shard for part in parts}

    def _part(self, name: str, parameter: nn.Parameter) -> _Part:
        local = local_part(parameter).data
        tp_placement: Placement = parameter.placements[-1] if isinstance(parameter, DTensor) else Replicate()
        tp_dim = tp_placement.dim if isinstance(tp_placement, Shard) else None
        dim = dp_split_dim(tuple(local.shape), tp_dim)
        if dim is None:
            sizes, view, dp_placement = [], local, Replicate()
        else:
            sizes = chunk_sizes(local.shape[dim], self.dp)
            view = local.narrow(dim, sum(sizes[:self.rank]), sizes[self.rank])
            dp_placement = Shard(dim)
        whole = DTensor.from_local(view, self.mesh, (dp_placement, tp_placement), run_check=False,
                                   shape=parameter.shape, stride=_contiguous_stride(parameter.shape))
        shard = nn.Parameter(whole, requires_grad=parameter.requires_grad)
        return _Part(name, parameter, local, tp_dim, dim, sizes, shard)

    def shard_of(self, parameter: nn.Parameter) -> nn.Parameter | None:
        """The part the optimizer updates in `parameter`'s place; None if this sharding does not hold it."""
        part = self._by_parameter.get(id(parameter))
        return part.shard if part is not None else None

    # ------------------------------------------------------------------ optimizers
    @staticmethod
    def shard(shardings: Sequence[ZeroOptimizerSharding], optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Hand each optimizer the parts of `shardings` in place of the module's parameters (before its
        first step)."""
        for optimizer in optimizers:
            if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
                raise TypeError(
                    f"data_parallel_mode='zero1' updates each dp rank's part of every parameter, which equals the"
                    f" whole update only for an optimizer that treats each element on its own (torch.optim"
                    f" {', '.join(sorted(kind.__name__ for kind in ELEMENTWISE_OPTIMIZERS))}); got"
                    f" {type(optimizer).__name__}. Use data_parallel_mode='replicate' for it."
                )
            if optimizer.state:
                raise RuntimeError("data_parallel_mode='zero1' must shard an optimizer before its first step.")
            for group in optimizer.param_groups:  # a frozen parameter is never updated: it leaves the groups
                group["params"] = [_shard_among(shardings, parameter) for parameter in group["params"]
                                   if parameter.requires_grad]

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def reduce_scatter_gradients(self) -> list[nn.Parameter]:
        """Give each part the dp average of its gradient and free the whole gradients; returns the parts.
        A parameter without a gradient (unused, frozen) takes part as zeros and its part gets no gradient,
        so the optimizer skips it, as it does the parameter in `"replicate"` mode."""
        received = {id(part): part.parameter.grad is not None for part in self._cut + self._whole}
        for bucket in self._buckets:
            members = [self._cut[index] for index in bucket.indices]
            gradients = [self._take_gradient(part) for part in members]
            flat = torch.zeros(bucket.payload(self.dp), dtype=gradients[0].dtype, device=gradients[0].device)
            for rank in range(self.dp):
                self._pack(flat, bucket.segment * rank, rank, members, gradients)
            flat.div_(self.divisor)
            segment = flat.new_empty(bucket.segment)
            reduce_scatter_single(segment, flat, group=self.group)
            offset = 0
            for part in members:
                local = part.shard.to_local()
                gradient = segment.narrow(0, offset, local.numel()).view(local.shape)
                part.shard.grad = _like(part.shard, gradient) if received[id(part)] else None
                offset += local.numel()
        if self._whole:
            gradients = [self._take_gradient(part) for part in self._whole]
            flat = torch.cat([gradient.reshape(-1) for gradient in gradients]).div_(self.divisor)
            dist.all_reduce(flat, group=self.group)
            for part, gradient in zip(self._whole, flat.split([gradient.numel() for gradient in gradients])):
                part.shard.grad = _like(part.shard, gradient.view(part.local.shape)) if received[id(part)] else None
        return [part.shard for part in self._cut + self._whole if received[id(part)]]

    @staticmethod
    def _take_gradient(part: _Part) -> torch.Tensor:
        gradient = part.parameter.grad
        part.parameter.grad = None
        if gradient is None:
            return torch.zeros_like(part.local)
        return local_part(gradient)

    def _pack(self, flat: torch.Tensor, start: int, rank: int, members: list[_Part],
              tensors: list[torch.Tensor]) -> None:
        offset = start
        for part, tensor in zip(members, tensors):
            piece = part.piece(tensor, rank)
            flat.narrow(0, offset, piece.numel()).view(piece.shape).copy_(piece)
            offset += piece.numel()

    @torch.no_grad()
    def all_gather_parameters(self) -> None:
        """After the update: every rank's parts to every rank, so each holds the updated whole parameters."""
        for bucket in self._buckets:
            members = [self._cut[index] for index in bucket.indices]
            locals_ = [part.local for part in members]
            mine = locals_[0].new_zeros(bucket.segment)
            self._pack(mine, 0, self.rank, members, locals_)
            gathered = mine.new_empty(bucket.payload(self.dp))
            all_gather_single(gathered, mine, group=self.group)
            for rank in range(self.dp):
                if rank == self.rank:
                    continue
                offset = bucket.segment * rank
                for part in members:
                    piece = part.piece(part.local, rank)
                    piece.copy_(gathered.narrow(0, offset, piece.numel()).view(piece.shape))
                    offset += piece.numel()


class ShardedOptimizerState(DataParallel):
    """`data_parallel_mode="zero1"` at dp > 1: `ZeroOptimizerSharding` of the parameters the optimizers hold."""

    shards_optimizers = True

    def __init__(self, plan: DataParallelPlan, mesh: DeviceMesh) -> None:
        super().__init__(plan, mesh)
        self._shardings: list[ZeroOptimizerSharding] = []  # the model's, then the experts' (if split over ep)
        self._state_module: nn.Module | None = None

    def shard_optimizers(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        held = {id(parameter) for optimizer in optimizers for group in optimizer.param_groups
                for parameter in group["params"]}
        named = [(name, parameter) for name, parameter in module.named_parameters()
                 if id(parameter) in held and parameter.requires_grad]  # frozen weights have nothing to shard
        experts = [(name, parameter) for name, parameter in named if is_expert_parameter(parameter)]
        self._shardings = [ZeroOptimizerSharding([(name, parameter) for name, parameter in named
                                                  if not is_expert_parameter(parameter)],
                                                 self.mesh["dp", "tp"], BUCKET_BYTES)]
        if experts:
            self._shardings.append(ZeroOptimizerSharding(experts, experts[0][1].device_mesh, BUCKET_BYTES,
                                                         divisor=self.plan.data_parallel_size))
        ZeroOptimizerSharding.shard(self._shardings, optimizers)
        self._state_module = _module_tree({name: shard for sharding in self._shardings
                                           for name, shard in sharding.shards.items()})

    def reduce_gradients(self, parameters: list[nn.Parameter]) -> list[nn.Parameter]:
        parameters = super().reduce_gradients(parameters)
        if not self._shardings:
            return parameters
        return [shard for sharding in self._shardings for shard in sharding.reduce_scatter_gradients()]

    def after_optimizer_step(self) -> None:
        with label(DP_PHASE + "all_gather_parameters"):
            for sharding in self._shardings:
                sharding.all_gather_parameters()

    def optimizer_owner(self, module: nn.Module) -> nn.Module:
        return self._state_module if self._state_module is not None else module


def _shard_among(shardings: Sequence[ZeroOptimizerSharding], parameter: nn.Parameter) -> nn.Parameter:
    for sharding in shardings:
        shard = sharding.shard_of(parameter)
        if shard is not None:
            return shard
    raise ValueError("data_parallel_mode='zero1': an optimizer holds a tensor that is not a parameter of the"
                     " module being trained; build the optimizer from the module's parameters.")


def _like(shard: nn.Parameter, local: torch.Tensor) -> DTensor:
    return DTensor.from_local(local, shard.device_mesh, shard.placements, run_check=False, shape=shard.shape,
                              stride=shard.stride())


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= size
    return tuple(reversed(strides))


def _module_tree(parameters: dict[str, nn.Parameter]) -> nn.Module:
    """A module whose `named_parameters()` are `parameters` (dotted names become submodules)."""
    root = nn.Module()
    for name, parameter in parameters.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, parameter)
    return root
