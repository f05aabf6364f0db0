"""`ResumableDistributedSampler` and `SamplePosition`: what a resumed epoch yields at any data-parallel size."""

from __future__ import annotations

import pytest
from torch.utils.data import DistributedSampler

from lightning_tp3d.data.sampler import ResumableDistributedSampler, SamplePosition

DATASET = list(range(23))


def _per_rank(sampler_class, replicas: int, **options) -> list[list[int]]:
    return [list(sampler_class(DATASET, num_replicas=replicas, rank=rank, **options)) for rank in range(replicas)]


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_without_resume_it_is_distributed_sampler(replicas, shuffle, drop_last):
    options = dict(shuffle=shuffle, drop_last=drop_last, seed=5)
    assert _per_rank(ResumableDistributedSampler, replicas, **options) == _per_rank(DistributedSampler, replicas,
                                                                                     **options)


@pytest.mark.parametrize(("saved_replicas", "resumed_replicas"), [(2, 2), (2, 4), (4, 1), (1, 2)])
def test_resume_continues_the_global_order_at_any_replica_count(saved_replicas, resumed_replicas):
    """Steps of 4 global samples: the union over ranks of each step equals the uninterrupted run's."""
    global_batch, consumed = 4, 8
    order = list(ResumableDistributedSampler(DATASET, num_replicas=1, rank=0, seed=3))
    per_rank = []
    for rank in range(resumed_replicas):
        sampler = ResumableDistributedSampler(DATASET, num_replicas=resumed_replicas, rank=rank, seed=3)
        sampler.resume(epoch=0, consumed_in_epoch=consumed)
        per_rank.append(list(sampler))
    assert len({len(samples) for samples in per_rank}) == 1  # equal shares: no rank waits in a collective
    local = global_batch // resumed_replicas
    for step in range(3):
        got = sorted(index for samples in per_rank for index in samples[step * local : (step + 1) * local])
        start = consumed + step * global_batch
        assert got == sorted(order[start : start + global_batch])


def test_resume_applies_to_its_epoch_once():
    sampler = ResumableDistributedSampler(DATASET, num_replicas=1, rank=0, seed=3)
    full = list(sampler)
    sampler.resume(epoch=0, consumed_in_epoch=20)
    assert list(sampler) == full[20:]
    assert list(sampler) == full  # the next iteration of the epoch is whole again
    sampler.resume(epoch=0, consumed_in_epoch=20)
    sampler.set_epoch(1)  # the saved epoch was finished: the next one is not shortened
    assert len(list(sampler)) == len(DATASET)
    assert len(sampler) == len(DATASET)


def test_sample_position_counts_per_epoch():
    position = SamplePosition()
    for epoch, samples in [(0, 8), (0, 8), (1, 8), (1, 4)]:
        position.advance(epoch, samples)
    assert (position.epoch, position.consumed_in_epoch, position.consumed) == (1, 12, 28)
