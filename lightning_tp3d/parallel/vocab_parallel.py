"""The head's logits kept split over the vocabulary where the package's own loss consumes them.

Under tensor parallelism the head is column parallel over the vocabulary: tp rank r computes the logits
of its V / t vocabulary entries, `Z_r = X W_r^T`. Gathering them gives every rank the whole `b s V`
logits (and their gradient, and the loss's float32 chunks) where `1 / t` of them would do: the cross
entropy needs, per token row i, only

    logsumexp(z_i) = logsumexp_r(logsumexp(z_i,r))   and   z_i[y_i], held by the rank owning y_i,

two float32 numbers per row and rank, gathered over tp once (`models.cross_entropy`); its gradient,
softmax(z_i) - onehot(y_i), is computed on each rank for its own columns with no communication
(Megatron's vocab-parallel cross entropy, torchtitan's loss parallel).

`VocabParallelHead` is the head's style: its logits are gathered (a plain whole tensor, as
`ColwiseParallel(output_layouts=Replicate())` returns them) unless it runs inside `sharded_logits()`,
where it returns them as a DTensor `Shard(-1)` for a loss that takes them so. The package enters that
context where its own loss consumes the head's output right away and nobody else sees the logits: the
reference decoder's `forward(input_ids, labels)` and the pipeline's loss on the last stage, when the loss
function is marked with `takes_sharded_logits`. Anywhere else (`forward(input_ids)`, a Hugging Face
model's forward, which returns the logits beside the loss, a user's own loss) the logits are whole.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel

__all__ = ["VocabParallelHead", "gather_shard_statistics", "loss_takes_sharded_logits", "sharded_logits",
           "takes_sharded_logits", "vocab_shard"]

_MODE = threading.local()
_LOSS = TypeVar("_LOSS", bound=Callable[..., Any])


@contextlib.contextmanager
def sharded_logits() -> Iterator[None]:
    """Within this context a `VocabParallelHead` returns its logits split over the vocabulary."""
    previous = getattr(_MODE, "sharded", False)
    _MODE.sharded = True
    try:
        yield
    finally:
        _MODE.sharded = previous


def takes_sharded_logits(loss: _LOSS) -> _LOSS:
    """Mark `loss(logits, labels)` as taking logits split over the vocabulary (a DTensor `Shard(-1)`) as well
    as whole ones; the pipeline then runs its last stage inside `sharded_logits()`."""
    loss.takes_sharded_logits = True
    return loss


def loss_takes_sharded_logits(loss: Callable[..., Any]) -> bool:
    """Whether `loss` was marked with `takes_sharded_logits`."""
    return getattr(loss, "takes_sharded_logits", False)


def vocab_shard(logits: DTensor) -> tuple[torch.Tensor, dist.ProcessGroup, int]:
    """This rank's columns of logits split over the vocabulary on a 1-D mesh, the mesh's group and the
    index of the rank's first vocabulary entry (`torch.chunk`'s split, which `Shard` uses)."""
    if logits.device_mesh.ndim != 1 or tuple(logits.placements) != (Shard(logits.ndim - 1),):
        raise ValueError(
            f"the loss takes logits whole or split over the vocabulary on a 1-D mesh (Shard(-1)); these are"
            f" {tuple(logits.placements)} on a {logits.device_mesh.ndim}-D mesh. Redistribute them first."
        )
    local = logits.to_local()
    vocab, parts = logits.shape[-1], logits.device_mesh.size()
    start = min(-(-vocab // parts) * logits.device_mesh.get_local_rank(), vocab)
    return local, logits.device_mesh.get_group(), start


def gather_shard_statistics(statistics: list[torch.Tensor], group: dist.ProcessGroup) -> torch.Tensor:
    """Every vocabulary shard's per-row statistics (k float32 vectors of N rows each, this rank's first) as
    one `[shards, k, N]` tensor: the one all-gather of k N numbers a vocab-parallel loss needs."""
    local = torch.stack(statistics)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.stack(parts)


class VocabParallelHead(ColwiseParallel):
    """The head column parallel over the vocabulary; its logits whole outside `sharded_logits()` (see the
    module docstring)."""

    def __init__(self) -> None:
        super().__init__(output_layouts=Shard(-1), use_local_output=False)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.register_forward_hook(_whole_unless_sharded)
        return module


def _whole_unless_sharded(module: nn.Module, inputs: Any, logits: DTensor) -> torch.Tensor | DTensor:
    if getattr(_MODE, "sharded", False):
        return logits
    return logits.redistribute(placements=[Replicate()], async_op=True).to_local()
