"""One training step of a pipeline schedule run from torch's order of its actions, with the package's
own point-to-point path.

torch's schedules decide what each rank runs and when (`order`): a list of (kind, stage, micro-batch),
kind F (a stage's forward of one micro-batch), B (its whole backward), I (its input gradient) or W (its
weight gradient), in the zero-bubble schedules that split the backward. The executor runs those actions
on torch's `PipelineStage`s (their forward, backward and weight-gradient chunks: the data-parallel and
FSDP handling inside them unchanged) and moves the tensors between ranks itself:

    F(s, i) needs the output of F(s - 1, i)    received from the rank of stage s - 1
    B/I(s, i) needs the input gradient of B/I(s + 1, i)    received from the rank of stage s + 1

unless that stage is on this rank (the V's turn), where the tensor is handed over without a message.
Every receive of the step is posted when the step starts, into the stage's own buffer for that
micro-batch (torch allocates one per micro-batch when its schedule first runs, and they are reused
every step), each message with its own tag; a send is posted as soon as its tensor exists and waited for
when the step ends. A rank therefore waits only for data its next action needs, never for a peer to
reach a matching send or receive, and each action's host path is: wait for its input, compute, post its
output. The step's time splits into its stages' compute, the waits for data (`StageTiming.wait_seconds`)
and the executor's own host work, the rest.

Posting receives ahead needs a backend whose point-to-point operations complete independently: gloo's
do (matched by tag). NCCL runs a pair's operations on one stream in the order they were posted, so a
receive posted early would hold back the sends behind it; there the runner keeps torch's schedule, which
batches each pair's sends and receives where it needs them (`PipelineRunner.own_executor`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from lightning_tp3d.parallel.timing import DeviceInterval

__all__ = ["ActionExecutor", "message_tag"]

Action = tuple[str, int, int]  # (kind, stage, micro-batch)
_ACTIVATION, _GRADIENT = 0, 1
_TENSORS_PER_MESSAGE = 16


def message_tag(direction: int, receiving_stage: int, microbatch: int, position: int, num_stages: int,
                num_microbatches: int) -> int:
    """The tag of the `position`-th tensor of the activation (direction 0) or input gradient (1) that
    stage `receiving_stage` receives for `microbatch`: distinct for every message of a step, the same on
    the sending and the receiving rank, and never 0 (the tag of torch's own sends)."""
    if position >= _TENSORS_PER_MESSAGE:
        raise ValueError(f"a pipeline stage sends {position + 1} tensors; at most {_TENSORS_PER_MESSAGE} are"
                         " supported.")
    message = (direction * num_stages + receiving_stage) * num_microbatches + microbatch
    return 1 + message * _TENSORS_PER_MESSAGE + position


class ActionExecutor:
    """Runs `order` (this rank's actions) on `stages`, which torch's schedule has already run once (their
    shapes inferred, their receive buffers allocated); `loss_fn(output, target)` is the last stage's loss
    of one micro-batch. Gradients are divided by the number of micro-batches, as torch's schedules do
    (`scale_grads=True`), so they are those of the mean of the micro-batches' losses."""

    def __init__(self, stages: Sequence[PipelineStage], order: Sequence[Action], num_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 wait_interval: Callable[[], DeviceInterval]) -> None:
        self.stages = {stage.stage_index: stage for stage in stages}
        self.order = list(order)
        self.num_microbatches = num_microbatches
        self.num_stages = stages[0].num_stages
        self.loss_fn = loss_fn
        self.wait_interval = wait_interval
        # what this rank receives, in the order of the actions that need it
        self.receives = [(kind, stage, microbatch) for kind, stage, microbatch in self.order
                         if self._receives_input(kind, stage)]

    def _receives_input(self, kind: str, stage: int) -> bool:
        if kind == "F":
            return stage > 0 and stage - 1 not in self.stages
        return kind in "BI" and stage < self.num_stages - 1 and stage + 1 not in self.stages

    def _tag(self, direction: int, receiving_stage: int, microbatch: int, position: int) -> int:
        return message_tag(direction, receiving_stage, microbatch, position, self.num_stages,
                           self.num_microbatches)

    def _post_receive(self, kind: str, stage_index: int, microbatch: int) -> list[dist.Work]:
        stage = self.stages[stage_index]
        if kind == "F":
            direction, operations = _ACTIVATION, stage.get_fwd_recv_ops(microbatch)
        else:
            direction, operations = _GRADIENT, stage.get_bwd_recv_ops(microbatch)
        return [dist.irecv(op.tensor, group=op.group, group_src=op.group_peer,
                           tag=self._tag(direction, stage_index, microbatch, position))
                for position, op in enumerate(operations)]

    def _post_sends(self, operations: Sequence[dist.P2POp], direction: int, receiving_stage: int,
                    microbatch: int) -> list[dist.Work]:
        return [dist.isend(op.tensor, group=op.group, group_dst=op.group_peer,
                           tag=self._tag(direction, receiving_stage, microbatch, position))
                for position, op in enumerate(operations)]

    def _wait(self, works: list[dist.Work]) -> None:
        interval = self.wait_interval()
        for work in works:
            work.wait()
        interval.stop()

    @staticmethod
    def _wait_for_sends(works: list[dist.Work]) -> None:
        for work in works:
            work.wait()

    def step(self, input_chunks: Sequence[torch.Tensor] | None, target_chunks: Sequence[torch.Tensor] | None
             ) -> list[torch.Tensor]:
        """One step over the micro-batches `input_chunks` (on the first stage's rank) and `target_chunks`
        (on the last stage's rank); returns the last stage's loss of each micro-batch (empty elsewhere)."""
        for stage in self.stages.values():
            stage.clear_runtime_states()
        received = {action: self._post_receive(*action) for action in self.receives}
        sends: list[dist.Work] = []
        losses: dict[int, torch.Tensor] = {}
        backwards: Counter[int] = Counter()  # B and W per stage: the last one completes its gradients
        for action in self.order:
            kind, index, microbatch = action
            stage = self.stages[index]
            if action in received:
                self._wait(received.pop(action))
            if kind == "F":
                args = (input_chunks[microbatch],) if stage.is_first else ()
                output = stage.forward_one_chunk(microbatch, args, None, save_forward_output=False)
                if stage.is_last:
                    losses[microbatch] = self.loss_fn(output, target_chunks[microbatch])
                elif index + 1 in self.stages:
                    self.stages[index + 1].set_local_fwd_input(output, microbatch)
                else:
                    sends += self._post_sends(stage.get_fwd_send_ops(microbatch), _ACTIVATION, index + 1, microbatch)
            elif kind in "BI":
                full = kind == "B"
                backwards[index] += full
                stage.backward_one_chunk(microbatch, loss=losses.get(microbatch) if stage.is_last else None,
                                         full_backward=full,
                                         last_backward=full and backwards[index] == self.num_microbatches)
                if index - 1 in self.stages:
                    self.stages[index - 1].set_local_bwd_input(stage.get_local_bwd_output(microbatch), microbatch)
                elif not stage.is_first:
                    sends += self._post_sends(stage.get_bwd_send_ops(microbatch), _GRADIENT, index - 1, microbatch)
            else:
                backwards[index] += 1
                stage.backward_weight_one_chunk(microbatch,
                                                last_backward=backwards[index] == self.num_microbatches)
        self._wait_for_sends(sends)
        for stage in self.stages.values():
            stage.perform_reduce_grad(self.num_microbatches)
        return [losses[microbatch] for microbatch in sorted(losses)]
