"""Where a run is in its data: consumed global samples, and a sampler that resumes from there.

Lightning restarts an epoch's dataloader from its first batch when it resumes mid-epoch (unless the
loader itself is stateful), so samples would be seen twice. The position is kept instead as the number
of global samples consumed, which does not depend on how many data-parallel ranks shared them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils.data import DistributedSampler

__all__ = ["ResumableDistributedSampler", "SamplePosition"]


@dataclass
class SamplePosition:
    """Global samples consumed: in the whole run and in the current `epoch`."""

    epoch: int = 0
    consumed_in_epoch: int = 0
    consumed: int = 0

    def advance(self, epoch: int, global_samples: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.consumed_in_epoch = epoch, 0
        self.consumed_in_epoch += global_samples
        self.consumed += global_samples


class ResumableDistributedSampler(DistributedSampler):
    """`DistributedSampler` whose epoch can begin after the samples a checkpoint already consumed.

    The epoch's global order is `DistributedSampler`'s: `randperm(n)` seeded with `seed + epoch` (or
    `0..n-1` without shuffling). Of the samples after the first `consumed`, padded (or, with `drop_last`,
    truncated) to a multiple of `num_replicas`, rank r takes every `num_replicas`-th from r on. A step
    with per-rank batch b on d ranks therefore consumes the next b x d samples of the global order for any
    d: a run resumed at another data-parallel size sees the same samples in the same steps. Without a
    resume it yields exactly what `DistributedSampler` yields.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._resume: tuple[int, int] | None = None

    @classmethod
    def like(cls, sampler: DistributedSampler) -> ResumableDistributedSampler:
        resumable = cls(sampler.dataset, num_replicas=sampler.num_replicas, rank=sampler.rank,
                        shuffle=sampler.shuffle, seed=sampler.seed, drop_last=sampler.drop_last)
        resumable.set_epoch(sampler.epoch)
        return resumable

    def resume(self, epoch: int, consumed_in_epoch: int) -> None:
        """Skip the first `consumed_in_epoch` global samples the next time `epoch` is iterated."""
        self._resume = (epoch, consumed_in_epoch)

    def __iter__(self) -> Iterator[int]:
        start = 0
        if self._resume is not None and self.epoch >= self._resume[0]:
            start = self._resume[1] if self.epoch == self._resume[0] else 0
            self._resume = None
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            order = list(range(len(self.dataset)))
        remaining = order[start:]
        if self.drop_last:
            remaining = remaining[: len(remaining) - len(remaining) % self.num_replicas]
        elif remaining:
            padding = -len(remaining) % self.num_replicas
            remaining += (remaining * (padding // len(remaining) + 1))[:padding]
        return iter(remaining[self.rank :: self.num_replicas])
