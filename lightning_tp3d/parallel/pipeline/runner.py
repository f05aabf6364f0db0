"""Running whole batches through this rank's pipeline stages in a `torch.distributed.pipelining` schedule's order.

A step at a new input shape runs torch's schedule (`schedule.step`), which infers the stages' shapes and
allocates their receive buffers; every later step on gloo runs the same order with the package's
executor (`executor`: receives posted when the step starts, each action waiting only for its own input).
On NCCL every step runs torch's schedule (`PipelineRunner.own_executor`).

Loss: each micro-batch's loss is the mean over its tokens and the schedule divides gradients by the
number of micro-batches, so gradients equal those of the whole batch's mean loss when micro-batches
hold equally many target tokens (always, without ignored labels).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from lightning_tp3d._compat.torch import AsyncCollectiveTensor, compute_order, timed_schedule_waits
from lightning_tp3d.parallel.labels import PIPELINE_COMPUTE, PIPELINE_SCHEDULE, label
from lightning_tp3d.parallel.pipeline.executor import ActionExecutor
from lightning_tp3d.parallel.timing import DeviceInterval
from lightning_tp3d.parallel.vocab_parallel import loss_takes_sharded_logits, sharded_logits
from lightning_tp3d.plan.schedules import PIPELINE_SCHEDULES, PipelinePlan
from lightning_tp3d.plan.timeline import single_stage_orders

__all__ = ["PipelineRunner", "StageTiming"]

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.long]
_MAX_DIMS = 8  # dims of a tensor sent between stages in forward-only runs


class StageTiming:
    """Time of the last training step on this rank, the time its stages spent computing and, under the
    package's executor, the time it waited for another rank's data.

    busy = time inside this rank's stages' forward, backward and weight-gradient chunks (the last stage's
    loss and communication between stages excluded), idle = step - busy. The step's timer starts before
    and stops after the profiler's schedule label, each chunk's timer runs inside its compute label, so
    idle is never less than the trace's pipeline idle (`StepProfiler`), whatever the host's scheduling.
    Theory for GPipe / 1F1B with p stages and m micro-batches: idle fraction (p - 1) / (m + p - 1).
    wait = time blocked on point-to-point communication (the executor's waits for received activations
    and gradients; torch's schedule's waits for its batched sends and receives); step - busy - wait is the
    runner's own host work. `actions` = compute chunks of the step.
    Measured on the device's clock (`DeviceInterval`: CUDA events on a GPU), resolved when read, so an
    unread timing costs the step no synchronisation.
    """

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type
        self._step: DeviceInterval | None = None
        self._chunks: list[DeviceInterval] = []
        self._waits: list[DeviceInterval] = []

    def start_step(self) -> None:
        self._chunks, self._waits = [], []
        self._step = DeviceInterval(self.device_type)

    def stop_step(self) -> None:
        if self._step is not None:
            self._step.stop()

    def chunk(self) -> DeviceInterval:
        interval = DeviceInterval(self.device_type)
        self._chunks.append(interval)
        return interval

    def wait(self) -> DeviceInterval:
        interval = DeviceInterval(self.device_type)
        self._waits.append(interval)
        return interval

    @property
    def actions(self) -> int:
        return len(self._chunks)

    @property
    def wait_seconds(self) -> float:
        return sum(interval.seconds for interval in self._waits)

    @property
    def step_seconds(self) -> float:
        return self._step.seconds if self._step is not None else 0.0

    @property
    def busy_seconds(self) -> float:
        return sum(interval.seconds for interval in self._chunks)

    @property
    def idle_fraction(self) -> float:
        step = self.step_seconds
        return max(0.0, 1.0 - self.busy_seconds / step) if step else 0.0


def _time_compute(stage: PipelineStage, timing: StageTiming) -> None:
    """Time the stage's forward / backward / weight-gradient chunks into `timing`."""
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        setattr(stage, name, _timed(getattr(stage, name), timing))


def _timed(compute: Callable[..., object], timing: StageTiming) -> Callable[..., object]:
    """`compute` as a chunk of `timing`, labelled as the pipeline's compute on the profiler's timeline."""

    def timed(*args: object, **kwargs: object) -> object:
        with label(PIPELINE_COMPUTE):  # the timer inside the label, the step's timer around the schedule's
            interval = timing.chunk()
            try:
                return compute(*args, **kwargs)
            finally:
                interval.stop()

    return timed


class PipelineRunner:
    """Runs whole batches through this rank's stages; the loss is broadcast to every pp rank.

    Train: forward and backward through the schedule over `num_microbatches` micro-batches (gradients
    accumulate in the parameters); returns the batch's mean loss (detached). Eval and predict: the whole
    batch passes stage after stage without a schedule; returns the loss, or without labels the logits
    broadcast from the last stage. `own_executor` (True on gloo): steps after a shape's first run the
    schedule's order with `ActionExecutor`; False runs torch's `schedule.step` every step (NCCL).
    """

    def __init__(
        self, stage_modules: Sequence[nn.Module], plan: PipelinePlan, num_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], pp_group: dist.ProcessGroup,
        device: torch.device,
    ) -> None:
        self.stage_modules = list(stage_modules)
        self.plan = plan
        self.num_microbatches = num_microbatches
        self.loss_fn = loss_fn
        self.pp_group = pp_group
        self.device = device
        self.loss_scale: torch.Tensor | float = 1.0  # fp16 loss scale / gradient accumulation steps
        self._schedules: dict[tuple, tuple[object, ActionExecutor]] = {}
        self.own_executor = dist.get_backend(pp_group) == dist.Backend.GLOO
        self._last_stage_src = dist.get_global_rank(pp_group, plan.last_stage_pp_rank)
        self.has_first_stage = 0 in plan.stage_indices
        self.has_last_stage = plan.num_stages - 1 in plan.stage_indices
        self.timing = StageTiming(device.type)
        # the last stage's logits stay split over tp's vocabulary where the loss takes them so
        self._loss_logits = sharded_logits if loss_takes_sharded_logits(loss_fn) else contextlib.nullcontext

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) * self.loss_scale

    def _schedule(self, input_shape: torch.Size) -> tuple[object, ActionExecutor]:
        # Stages infer activation shapes on their first run, so one schedule per input shape.
        key = tuple(input_shape)
        if key not in self._schedules:
            stages = [PipelineStage(module, index, self.plan.num_stages, self.device, group=self.pp_group)
                      for module, index in zip(self.stage_modules, self.plan.stage_indices)]
            for stage in stages:
                _time_compute(stage, self.timing)
            schedule_class = get_schedule_class(PIPELINE_SCHEDULES[self.plan.schedule])
            target = stages[0] if len(stages) == 1 else stages
            # the last stage's loss (outside its forward chunk in torch's schedules) is its work too
            loss_fn = _timed(self._scaled_loss, self.timing)
            schedule = schedule_class(target, self.num_microbatches, loss_fn=loss_fn)
            executor = ActionExecutor(stages, self._order(schedule), self.num_microbatches, loss_fn, self.timing.wait)
            self._schedules[key] = schedule, executor
        return self._schedules[key]

    def _order(self, schedule: object) -> list[tuple[str, int, int]]:
        """This rank's actions as torch's schedule runs them: GPipe and 1F1B by their rule (their
        `pipeline_order` is only a picture), the multi-stage schedules by their `pipeline_order`."""
        pp_rank = dist.get_rank(self.pp_group)
        if self.plan.schedule in ("gpipe", "1f1b"):
            return single_stage_orders(self.plan.schedule, dist.get_world_size(self.pp_group),
                                       self.num_microbatches)[pp_rank]
        return compute_order(schedule, pp_rank)

    def _stage_owner(self, stage: int) -> int:
        pp_size = dist.get_world_size(self.pp_group)
        if self.plan.last_stage_pp_rank == 0:  # V-shaped placement
            return stage if stage < pp_size else self.plan.num_stages - 1 - stage
        return stage % pp_size

    @torch.no_grad()
    def _forward_only(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Stage after stage on the whole batch, hidden states sent point to point; the output on the rank
        of the last stage. Forward-only runs need no schedule (and zero-bubble schedules cannot run one)."""
        my_rank = dist.get_rank(self.pp_group)
        modules = dict(zip(self.plan.stage_indices, self.stage_modules))
        x: torch.Tensor | None = input_ids if self.has_first_stage else None
        for stage in range(self.plan.num_stages):
            owner = self._stage_owner(stage)
            previous_owner = self._stage_owner(stage - 1) if stage else owner
            if owner == my_rank:
                if previous_owner != my_rank:
                    x = self._receive(previous_owner)
                x = modules[stage](x)
            elif previous_owner == my_rank:
                self._send(x, owner)
        return x if self.has_last_stage else None

    def _send(self, tensor: torch.Tensor, pp_rank: int) -> None:
        """Header [ndim, dtype index, *shape] in a fixed-size message, then the tensor; every message is
        on the stage's device (a NCCL group refuses CPU tensors)."""
        destination = dist.get_global_rank(self.pp_group, pp_rank)
        if tensor.ndim > _MAX_DIMS:
            raise ValueError(f"a pipeline stage output has {tensor.ndim} dims; at most {_MAX_DIMS} can be sent.")
        header = torch.zeros(_MAX_DIMS + 2, dtype=torch.long, device=self.device)
        header[:tensor.ndim + 2] = torch.tensor([tensor.ndim, _DTYPES.index(tensor.dtype), *tensor.shape])
        dist.send(header, destination, group=self.pp_group)
        dist.send(tensor.contiguous(), destination, group=self.pp_group)

    def _receive(self, pp_rank: int) -> torch.Tensor:
        source = dist.get_global_rank(self.pp_group, pp_rank)
        header = torch.empty(_MAX_DIMS + 2, dtype=torch.long, device=self.device)
        dist.recv(header, source, group=self.pp_group)
        ndim, dtype_index, *shape = header.tolist()
        tensor = torch.empty(shape[:ndim], dtype=_DTYPES[dtype_index], device=self.device)
        dist.recv(tensor, source, group=self.pp_group)
        return tensor

    def _broadcast_from_last_stage(self, value: torch.Tensor | None, shape: Sequence[int]) -> torch.Tensor:
        if value is None:
            value = torch.empty(shape, dtype=torch.float32, device=self.device)
        if isinstance(value, AsyncCollectiveTensor):  # the tp-gathered logits: wait, return a plain tensor
            value = value.wait()
        value = value.detach().float().contiguous()
        dist.broadcast(value, src=self._last_stage_src, group=self.pp_group)
        return value

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *, train: bool) -> torch.Tensor:
        if labels is None or not train:
            with self._loss_logits() if labels is not None else contextlib.nullcontext():
                output = self._forward_only(input_ids)
            if labels is None:
                shape = torch.tensor(output.shape if self.has_last_stage else [0, 0, 0], device=self.device)
                dist.broadcast(shape, src=self._last_stage_src, group=self.pp_group)
                return self._broadcast_from_last_stage(output, shape.tolist())
            loss = self.loss_fn(output, labels) if self.has_last_stage else None
            return self._broadcast_from_last_stage(loss, ())
        batch = input_ids.shape[0]
        if batch % self.num_microbatches:
            raise ValueError(
                f"the batch of {batch} samples cannot be split into num_microbatches={self.num_microbatches}"
                f" equal micro-batches; use a per-rank batch size that is a multiple of {self.num_microbatches}."
            )
        first_step = tuple(input_ids.shape) not in self._schedules
        schedule, executor = self._schedule(input_ids.shape)
        args = (input_ids,) if self.has_first_stage else ()
        target = labels if self.has_last_stage else None
        losses: list[torch.Tensor] = []
        # A schedule's first step infers the stages' shapes by a backward through uninitialised tensors (torch
        # 2.13), which anomaly detection (`Trainer(detect_anomaly=True)`) takes for a NaN on the last stage only.
        self.timing.start_step()
        with label(PIPELINE_SCHEDULE):
            with (torch.autograd.set_detect_anomaly(False) if first_step else contextlib.nullcontext(),
                  self._loss_logits()):
                if first_step or not self.own_executor:
                    with timed_schedule_waits(self.timing.wait):
                        schedule.step(*args, target=target, losses=losses)
                else:
                    losses = executor.step(input_ids.tensor_split(self.num_microbatches) if args else None,
                                           target.tensor_split(self.num_microbatches) if target is not None else None)
        self.timing.stop_step()
        loss = None
        if self.has_last_stage:
            loss = torch.stack([value.detach() for value in losses]).mean() / self.loss_scale
        return self._broadcast_from_last_stage(loss, ())
