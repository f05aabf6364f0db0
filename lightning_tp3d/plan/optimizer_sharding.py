"""How `data_parallel_mode="zero1"` splits each parameter over dp, and how its buckets are packed (no torch).

A dp rank updates one part of every (tp-local) parameter W: W is cut along the first dim that tp does
not split (dim 0, or dim 1 for a column-parallel weight) into d parts with `torch.chunk`'s sizes,
ceil(n / d) each and the rest to the last ones (a part may be empty), which is `Shard(dim)`'s split in
DTensor, so the parts are a DTensor over dp. A 1-D parameter that tp splits (a column-parallel bias)
has no dim left: it is not cut (every dp rank updates it whole, after an all-reduce).

Buckets (the reduce-scatter of gradients and the all-gather of parameters use the same ones):
parameters in registration order; a bucket holds, for each dp rank r, the segment of its parts of the
bucket's parameters laid end to end, padded to the longest rank's segment S, so the reduce-scatter's
input is d x S elements; a bucket is closed when the next parameter would take d x S over
`bucket_bytes` (a parameter larger than that gets a bucket of its own).

The runtime (`parallel.data_parallel.zero`) and the communication ledger (`plan.communication`) both take their
buckets from `pack_buckets`, so the ledger counts the same calls and payloads the run makes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ShardBucket", "chunk_sizes", "dp_split_dim", "pack_buckets", "part_sizes"]


def dp_split_dim(shape: Sequence[int], tp_dim: int | None) -> int | None:
    """The dim of a tp-local parameter of `shape` that dp cuts: the first one tp does not split."""
    return next((dim for dim in range(len(shape)) if dim != tp_dim), None)


def chunk_sizes(length: int, parts: int) -> list[int]:
    """`torch.chunk(x, parts)`'s sizes along a dim of `length`, with empty parts to make `parts` of them."""
    size = -(-length // parts)
    return [max(0, min(size, length - rank * size)) for rank in range(parts)]


@functools.lru_cache(maxsize=4096)  # the planner asks for the same few shapes for every block and layout
def part_sizes(shape: tuple[int, ...], tp_dim: int | None, dp: int) -> tuple[int, ...]:
    """Elements of each dp rank's part of a tp-local parameter of `shape` (the whole for an uncut one)."""
    dim = dp_split_dim(shape, tp_dim)
    total = math.prod(shape)
    if dim is None:
        return (total,) * dp
    rest = total // shape[dim] if shape[dim] else 0
    return tuple(size * rest for size in chunk_sizes(shape[dim], dp))


@dataclass(frozen=True)
class ShardBucket:
    """Parameters `indices` (into the packed list) whose parts travel together; `segment` = S."""

    indices: tuple[int, ...]
    segment: int

    def payload(self, dp: int) -> int:
        """Elements of the reduce-scatter's input (the all-gather's output): d x S."""
        return dp * self.segment


def pack_buckets(parts: Sequence[Sequence[int]], dp: int, element_bytes: int, bucket_bytes: int) -> list[ShardBucket]:
    """Buckets of the parameters whose per-rank part sizes are `parts` (each a list of d sizes), in order."""
    buckets: list[ShardBucket] = []
    indices: list[int] = []
    totals = [0] * dp
    for index, sizes in enumerate(parts):
        grown = [total + size for total, size in zip(totals, sizes)]
        if indices and dp * max(grown) * element_bytes > bucket_bytes:
            buckets.append(ShardBucket(tuple(indices), max(totals)))
            indices, grown = [], list(sizes)
        indices.append(index)
        totals = grown
    if indices:
        buckets.append(ShardBucket(tuple(indices), max(totals)))
    return buckets
