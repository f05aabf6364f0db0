"""`data_parallel_mode="replicate"` overlapped with backward: the all-reduce in buckets, as DDP does.

Parameters are grouped, in the reverse of their registration order (about the order backward produces
their gradients), into buckets of at most `bucket_bytes` of one dtype. A post-accumulate-grad hook
marks a parameter ready; when every parameter of a bucket is ready in the backward that ends the step,
the bucket's local gradients (DTensor gradients first given their parameter's placement, see
`shard_gradients_like_parameters`) are copied into one flat buffer and all-reduced asynchronously over
dp while backward goes on with the earlier layers. `finish` waits for what is still in flight and
writes back g <- (1 / dp) sum_d g_d. At most `max_in_flight` buckets are pending at once (the oldest is
completed before another starts), so the extra memory is a few buckets, not a second copy of every
gradient. A bucket whose parameters did not all receive a gradient (unused parameters) is reduced in
`finish`, synchronously.

Only for a backward whose gradients are complete when it ends: without pipelining (a pipeline schedule
runs several backwards per step; its gradients are reduced after the schedule) and, when accumulating,
only in the last backward (`sync`). A gradient that arrives after its bucket was launched is an error.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp3d._compat.torch import flatten_dense_tensors, unflatten_dense_tensors
from lightning_tp3d.parallel.data_parallel.protocol import DataParallel
from lightning_tp3d.parallel.data_parallel.replicate import ReplicateAfterBackward, reduce_expert_gradients
from lightning_tp3d.parallel.experts import is_expert_parameter
from lightning_tp3d.parallel.tensor import local_part, shard_gradients_like_parameters
from lightning_tp3d.plan.communication import BUCKET_BYTES
from lightning_tp3d.plan.data_parallel import DataParallelPlan

__all__ = ["OverlappedGradientReduction", "ReplicateOverlapped"]


@dataclass
class _Bucket:
    parameters: list[nn.Parameter]
    ready: set[int] = field(default_factory=set)
    launched: bool = False


def _local_bytes(parameter: nn.Parameter) -> int:
    return local_part(parameter.detach()).numel() * parameter.element_size()


class OverlappedGradientReduction:
    """Hooks on `parameters` that all-reduce their gradients over `dp_group` in buckets during backward."""

    def __init__(self, parameters: Iterable[nn.Parameter], dp_group: dist.ProcessGroup, dp_size: int,
                 bucket_bytes: int = BUCKET_BYTES, max_in_flight: int = 2) -> None:
        self.dp_group, self.dp_size, self.max_in_flight = dp_group, dp_size, max_in_flight
        self.sync = True
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self._in_flight: list[tuple[dist.Work, torch.Tensor, list[torch.Tensor]]] = []
        open_buckets: dict[torch.dtype, tuple[_Bucket, int]] = {}
        for parameter in reversed([parameter for parameter in parameters if parameter.requires_grad]):
            bucket, size = open_buckets.get(parameter.dtype, (None, 0))
            added = _local_bytes(parameter)
            if bucket is None or size + added > bucket_bytes and bucket.parameters:
                bucket, size = _Bucket([]), 0
                self.buckets.append(bucket)
            bucket.parameters.append(parameter)
            open_buckets[parameter.dtype] = (bucket, size + added)
            self._bucket_of[id(parameter)] = bucket
        self._hooks = [parameter.register_post_accumulate_grad_hook(self._gradient_ready)
                       for bucket in self.buckets for parameter in bucket.parameters]

    def _gradient_ready(self, parameter: nn.Parameter) -> None:
        if not self.sync:
            return
        bucket = self._bucket_of[id(parameter)]
        if bucket.launched:
            raise RuntimeError(
                "A gradient arrived after its bucket was all-reduced over dp: call backward once per optimizer step"
                " (Fabric: wrap the earlier backwards in fabric.no_backward_sync(model)), or turn the overlap off"
                " with overlap_gradient_reduction=False."
            )
        bucket.ready.add(id(parameter))
        if len(bucket.ready) == len(bucket.parameters):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.launched = True
        with_gradients = [parameter for parameter in bucket.parameters if parameter.grad is not None]
        if not with_gradients:
            return
        shard_gradients_like_parameters(with_gradients)
        grads = [local_part(parameter.grad) for parameter in with_gradients]
        if len(self._in_flight) >= self.max_in_flight:
            self._complete(self._in_flight.pop(0))
        flat = flatten_dense_tensors(grads)
        self._in_flight.append((dist.all_reduce(flat, group=self.dp_group, async_op=True), flat, grads))

    def _complete(self, pending: tuple[dist.Work, torch.Tensor, list[torch.Tensor]]) -> None:
        work, flat, grads = pending
        work.wait()
        flat.div_(self.dp_size)
        for grad, reduced in zip(grads, unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)

    @torch.no_grad()
    def finish(self) -> None:
        """Reduce what backward did not launch, wait for everything in flight, reset for the next step."""
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        while self._in_flight:
            self._complete(self._in_flight.pop(0))
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.launched = False

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class ReplicateOverlapped(ReplicateAfterBackward):
    """`OverlappedGradientReduction` on the parameters of the coming backward (rebuilt when they change);
    gradients of a backward it was not armed for are all-reduced after it."""

    def __init__(self, plan: DataParallelPlan, mesh: DeviceMesh) -> None:
        super().__init__(plan, mesh)
        self._reduction: OverlappedGradientReduction | None = None
        self._parameter_ids: list[int] = []

    def before_backward(self, parameters: Iterable[nn.Parameter], completes_gradients: bool) -> None:
        parameters = [parameter for parameter in parameters
                      if parameter.requires_grad and not is_expert_parameter(parameter)]
        parameter_ids = [id(parameter) for parameter in parameters]
        if self._reduction is None or self._parameter_ids != parameter_ids:
            if self._reduction is not None:
                self._reduction.remove()
            self._reduction = OverlappedGradientReduction(parameters, self.mesh["dp"].get_group(),
                                                          self.plan.data_parallel_size)
            self._parameter_ids = parameter_ids
        self._reduction.sync = completes_gradients

    def release(self) -> None:
        if self._reduction is not None:
            self._reduction.remove()
        self._reduction, self._parameter_ids = None, []

    def reduce_gradients(self, parameters: list[nn.Parameter]) -> list[nn.Parameter]:
        if self._reduction is None:
            return super().reduce_gradients(parameters)
        self._reduction.finish()
        parameters = DataParallel.reduce_gradients(self, parameters)
        reduce_expert_gradients(parameters, self.plan.data_parallel_size)
        return parameters
