"""A guard on torch.distributed: every tensor given to a collective or send/recv must be on one device.

NCCL groups refuse CPU tensors, gloo groups refuse CUDA ones, and a CPU-only machine cannot run NCCL. The
guard makes the same mistake visible on any machine: run the code with its device set to something other
than the CPU (the meta device: shapes without data, accepted by the "fake" process group) and the guard
raises on every tensor that was created on the CPU by default, naming the call. `calls` records what was
checked, so a test can assert that the guarded path ran at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

__all__ = ["GUARDED_CALLS", "DeviceMismatch", "collectives_on"]

GUARDED_CALLS = ("send", "recv", "isend", "irecv", "broadcast", "all_reduce", "reduce", "all_gather",
                 "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "batch_isend_irecv")


class DeviceMismatch(AssertionError):
    """A tensor on the wrong device reached a collective."""


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dist.P2POp):
        yield value.tensor
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


@contextmanager
def collectives_on(device: torch.device) -> Iterator[list[tuple[str, torch.device]]]:
    """Inside the block, `torch.distributed` calls raise `DeviceMismatch` for a tensor not on `device`;
    yields the list of (call, device) of every tensor checked."""
    calls: list[tuple[str, torch.device]] = []

    def guarded(name: str, function: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            for tensor in _tensors([*args, *kwargs.values()]):
                calls.append((name, tensor.device))
                if tensor.device.type != device.type:
                    raise DeviceMismatch(
                        f"torch.distributed.{name} got a tensor of shape {list(tensor.shape)} on {tensor.device},"
                        f" but the group communicates on {device}: create it with device=..."
                    )
            return function(*args, **kwargs)

        return call

    with mock.patch.multiple(dist, **{name: guarded(name, getattr(dist, name)) for name in GUARDED_CALLS}):
        yield calls
