"""`PrintLosses`: the training loss every few steps and the held-out loss after each validation, printed
by rank 0 as plain lines (what a run without a logger or a progress bar shows)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

__all__ = ["PrintLosses"]


class PrintLosses(Callback):
    """Print `step N  loss X` at step 1 and every `every_n_steps` steps (the batch loss averaged over the
    data-parallel replicas, so the global batch's), and `step N  val_loss Y` after each validation (the
    `val_loss` the module logs)."""

    def __init__(self, every_n_steps: int = 5) -> None:
        self.every_n_steps = every_n_steps

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step != 1 and step % self.every_n_steps:
            return
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        loss = trainer.strategy.reduce(loss.detach())  # a collective: every rank takes part
        if trainer.is_global_zero:
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        value = trainer.callback_metrics.get("val_loss")
        if trainer.is_global_zero and isinstance(value, torch.Tensor) and not trainer.sanity_checking:
            print(f"step {trainer.global_step:4d}  val_loss {value.item():.4f}", flush=True)
