"""The pipelined forward: `network(input_ids, labels=...)` runs the schedule, and the gradients it
computed are handed over to the loop's backward.

A schedule computes the gradients inside the forward call, but a Trainer zeroes gradients between
`training_step` and `backward`, and a Fabric loop scales the loss before its backward (`loss / k` when
accumulating k batches, a scaler's `scale(loss)`). So the forward keeps the schedule's gradients aside
and returns loss + a zero leaf: a loop's `.backward()` on any function of the loss delivers
c = d(objective) / d(loss) to the leaf; the schedule computed its gradients for `schedule_scale x loss`,
so `GradientHandOver.take` adds them scaled by c / schedule_scale. (The Trainer calls no `.backward()`:
its schedule scale already holds the accumulation and loss-scale factors, and the gradients are handed
over as they are.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_tp3d.parallel.pipeline.runner import PipelineRunner
from lightning_tp3d.parallel.pipeline.stages import PipelineStages

__all__ = ["GradientHandOver", "install_pipelined_forward"]


class GradientHandOver:
    """The gradients of the last pipelined training forward, waiting for the loop's backward."""

    def __init__(self) -> None:
        self._pending: list[tuple[nn.Parameter, torch.Tensor | None]] = []
        self._factor: torch.Tensor | None = None

    def keep(self, parameters: list[nn.Parameter]) -> None:
        """Move the parameters' gradients aside (the schedule's), leaving the ones they had before."""
        self._pending = [(parameter, parameter.grad) for parameter in parameters]

    def loss_with_anchor(self, loss: torch.Tensor, schedule_scale: torch.Tensor | float) -> torch.Tensor:
        """`loss` plus a zero leaf whose gradient fixes the factor of `take` (see the module docstring)."""
        anchor = torch.zeros((), dtype=loss.dtype, device=loss.device, requires_grad=True)

        def receive(gradient: torch.Tensor) -> None:
            self._factor = gradient.detach() / schedule_scale

        anchor.register_hook(receive)
        return loss + anchor

    def take(self) -> None:
        """Add the kept gradients to the parameters, scaled by the factor the loop's backward asked for."""
        factor, self._factor = self._factor, None
        for parameter, grad in self._pending:
            if grad is None:
                continue
            if factor is not None:  # scaling commutes with every placement: scale the local part
                (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(factor.to(grad.device))
            parameter.grad = grad if parameter.grad is None else parameter.grad.add_(grad)
        self._pending = []


def install_pipelined_forward(network: nn.Module, runner: PipelineRunner,
                              loss_scale: Callable[[], torch.Tensor | float],
                              stages: PipelineStages) -> GradientHandOver:
    """Route `network(input_ids, labels=...)` through `runner` (the LightningModule contract): a training
    call (grad enabled and labels given, whatever the modules' train/eval mode: a `from_pretrained` model
    is in eval mode) runs forward and backward through the schedule
    with the loss multiplied by `loss_scale()` (fp16 scale / accumulation); other calls run forward only.
    `stages` checks the call's arguments and shapes what it returns (the loss, or without labels the
    logits; a Hugging Face output object for Hugging Face models)."""
    handover = GradientHandOver()

    def pipelined_forward(*args: Any, **kwargs: Any) -> Any:
        input_ids, labels = stages.call_arguments(*args, **kwargs)
        if not (torch.is_grad_enabled() and labels is not None):
            result = runner(input_ids, labels, train=False)
            return stages.output(network, result, None) if labels is not None else stages.output(network, None, result)
        runner.loss_scale = loss_scale()
        parameters = list(network.parameters())
        previous = [parameter.grad for parameter in parameters]
        for parameter in parameters:
            parameter.grad = None
        loss = runner(input_ids, labels, train=True)
        handover.keep(parameters)
        for parameter, grad in zip(parameters, previous):
            parameter.grad = grad
        return stages.output(network, handover.loss_with_anchor(loss, runner.loss_scale), None)

    network.forward = pipelined_forward
    return handover
