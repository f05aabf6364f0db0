"""Skip an optimizer step whose loss or gradient norm is not finite, on every rank at once.

A NaN or inf appears on one rank first: one tp rank's slice of a layer overflows, one dp replica meets
a bad sample, the last pipeline stage computes the loss. Each rank therefore reduces one flag,

    bad = 1 if (loss is not finite) or (||g_local|| is not finite for some local gradient g) else 0

with a MAX all-reduce over every process (the default group, so tp, pp and dp ranks all agree), kept
on the device until that reduced flag is read (the step's one host synchronisation), and
when it is 1 no rank updates its parameters: the optimizer's `step` is not called (Adam's moments and
step count stay as they were), the step-interval LR schedulers do not advance, and the gradients are
dropped by the next `zero_grad`. A local norm is non-finite exactly when the global norm would be, so
one scalar collective replaces a global-norm reduction. After `max_consecutive_skips` skipped steps in
a row training stops with `NonFiniteStepsError` naming the steps.

Under an fp16 loss scaler the scaler owns this: it finds the inf in the unscaled gradients (on every
rank, see `precision.ModelParallelGradScaler`), skips the step and lowers its scale, and its first
steps are expected to overflow; the guard is then off.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_tp3d._compat.torch import foreach_norm
from lightning_tp3d.parallel.tensor import local_part

__all__ = ["NonFiniteStepGuard", "NonFiniteStepsError", "hold_schedulers_on_skipped_steps", "release_schedulers"]


class NonFiniteStepsError(RuntimeError):
    """Raised on every rank after `max_consecutive_skips` non-finite steps in a row."""


class NonFiniteStepGuard:
    """Decides, identically on every rank, whether this step's update is skipped.

    `skipped_steps` counts all skipped steps of the run, `last_step_skipped` tells the step just checked.
    """

    def __init__(self, max_consecutive_skips: int) -> None:
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped_steps = 0
        self.last_step_skipped = False
        self._consecutive_steps: list[int] = []

    @torch.no_grad()
    def check(self, loss: torch.Tensor | None, parameters: Iterable[nn.Parameter], step: int,
              device: torch.device) -> bool:
        """All-reduce this rank's flag; True when any rank's loss or gradients are not finite.

        Raises `NonFiniteStepsError` on every rank when that makes `max_consecutive_skips` in a row.
        """
        # the flag stays on the device until the all-reduced value is read: one host synchronisation a step
        bad = torch.zeros((), dtype=torch.float32, device=device)
        if loss is not None:
            bad = torch.maximum(bad, (~torch.isfinite(loss.detach().float())).any().to(bad))
        local_gradients = [local_part(parameter.grad) for parameter in parameters if parameter.grad is not None]
        if local_gradients:
            norms = torch.stack([norm.float() for norm in foreach_norm(local_gradients)])
            bad = torch.maximum(bad, (~torch.isfinite(norms)).any().to(bad))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        self.last_step_skipped = bool(bad.item())
        if not self.last_step_skipped:
            self._consecutive_steps.clear()
            return False
        self.skipped_steps += 1
        self._consecutive_steps.append(step)
        if len(self._consecutive_steps) >= self.max_consecutive_skips:
            first, last = self._consecutive_steps[0], self._consecutive_steps[-1]
            raise NonFiniteStepsError(
                f"The loss or gradient norm was not finite at {len(self._consecutive_steps)} steps in a row"
                f" (global_step {first} to {last}; {self.skipped_steps} skipped in all), so training stopped at"
                f" global_step {last}."
                " Lower the learning rate, check the data of these batches, or raise max_consecutive_skips."
            )
        return True

    def describe_skip(self, step: int) -> str:
        return (f"global_step {step}: the loss or gradient norm is not finite on some rank; every rank skips this"
                f" update ({self.skipped_steps} skipped so far, {len(self._consecutive_steps)} in a row, training"
                f" stops at {self.max_consecutive_skips}).")


def hold_schedulers_on_skipped_steps(module: Any, scheduler_configs: Sequence[Any], guard: NonFiniteStepGuard) -> None:
    """Lightning steps the step-interval LR schedulers after every optimizer step, skipped or not: route the
    LightningModule's `lr_scheduler_step` hook through a check that drops the call after a skipped step.
    The hook is set on the instance (`functools.wraps` keeps Lightning's `is_overridden` answer) and
    removed by `release_schedulers`; epoch-interval and plateau schedulers are left alone."""
    hook = type(module).lr_scheduler_step
    held = {id(config.scheduler) for config in scheduler_configs
            if config.interval == "step" and not config.reduce_on_plateau}

    @functools.wraps(hook)
    def lr_scheduler_step(scheduler: Any, metric: Any | None) -> None:
        if guard.last_step_skipped and id(scheduler) in held:
            return
        hook(module, scheduler, metric)

    module.lr_scheduler_step = lr_scheduler_step


def release_schedulers(module: Any) -> None:
    """Undo `hold_schedulers_on_skipped_steps`: the module's own hook again."""
    module.__dict__.pop("lr_scheduler_step", None)
