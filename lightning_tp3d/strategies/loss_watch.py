"""`ResumeLossWatch`: the training loss recorded in each checkpoint, and a warning when a resumed run's
loss jumps (the design documents' rule: a jump after resuming means the optimizer, the scheduler or the
data position was not restored).

The last `WINDOW` training losses (each the mean over the data-parallel replicas) go into `meta.json` as
`loss` (the last), `loss_mean` and `loss_std`. After a resume, the first `CHECKED_STEPS` losses are
compared with them: when one exceeds loss_mean + max(3 x loss_std, 10% of loss_mean), the watch warns,
naming the likely causes. Every rank calls it at the same steps (the dp reduction is a collective).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ResumeLossWatch"]

Reduce = Callable[[torch.Tensor], torch.Tensor]


class ResumeLossWatch:
    WINDOW = 10
    CHECKED_STEPS = 3
    RELATIVE_BOUND = 0.10
    STD_BOUND = 3.0

    def __init__(self) -> None:
        self._recent: deque[torch.Tensor] = deque(maxlen=self.WINDOW)
        self._saved: dict[str, float] | None = None
        self._after_resume: list[torch.Tensor] = []

    def record(self, loss: torch.Tensor, reduce: Reduce) -> str | None:
        """Keep this step's loss; after a resume, return the warning once the first steps jumped."""
        loss = loss.detach().float().reshape(())
        self._recent.append(loss)
        if self._saved is None:
            return None
        self._after_resume.append(loss)
        if len(self._after_resume) < self.CHECKED_STEPS:
            return None
        losses = reduce(torch.stack(self._after_resume)).tolist()
        saved, self._saved, self._after_resume = self._saved, None, []
        bound = max(self.STD_BOUND * saved["loss_std"], self.RELATIVE_BOUND * saved["loss_mean"])
        if max(losses) <= saved["loss_mean"] + bound:
            return None
        return (f"the loss jumped after resuming: {', '.join(f'{value:.4f}' for value in losses)} in the first"
                f" {self.CHECKED_STEPS} steps against {saved['loss_mean']:.4f} +- {saved['loss_std']:.4f} over the"
                f" last {self.WINDOW} steps before the checkpoint (bound: mean + max(3 std, 10% of the mean)). Likely"
                " causes: optimizer state not restored (Adam's moments start from zero), the LR scheduler restarted"
                " (warm-up again) or the data position lost (an epoch started over); check the checkpoint's"
                " optimizer_*, the scheduler state and the sampler.")

    def summary(self, reduce: Reduce) -> dict[str, float]:
        """`loss`, `loss_mean`, `loss_std` of the recent losses (dp means) for `meta.json`; {} before any."""
        if not self._recent:
            return {}
        losses = reduce(torch.stack(list(self._recent)))
        return {"loss": losses[-1].item(), "loss_mean": losses.mean().item(),
                "loss_std": losses.std().item() if losses.numel() > 1 else 0.0}

    def resumed(self, meta: Any) -> None:
        """Watch the next steps against the losses `meta` recorded (nothing when it recorded none)."""
        self._recent.clear()
        self._after_resume = []
        mean, std = getattr(meta, "loss_mean", None), getattr(meta, "loss_std", None)
        self._saved = {"loss_mean": mean, "loss_std": std or 0.0} if mean is not None else None
