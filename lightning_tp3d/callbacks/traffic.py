"""`RecordTraffic`: what this rank sends over each mesh group in one training step, logged per group.

It records one step (by default the second: the first builds FSDP2's and DTensor's state) with
`diagnostics.traffic.TrafficRecorder` and logs `traffic/<group>_calls` and `traffic/<group>_bytes` (the
payload handed to the group's collectives and sends, per rank). Compare with `tp3d plan`'s communication
ledger (`plan.communication`), which predicts the same figures.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from lightning_tp3d.diagnostics.traffic import TrafficRecorder

__all__ = ["RecordTraffic"]


class RecordTraffic(Callback):
    """Record training step `step` (0-based global step); `recorder` holds the counts afterwards."""

    def __init__(self, step: int = 1) -> None:
        self.step = step
        self.recorder: TrafficRecorder | None = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.recorder = TrafficRecorder(trainer.strategy.device_mesh).__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.recorder is None or trainer.global_step != self.step + 1:
            return
        self.recorder.__exit__(None, None, None)
        for group, total in self.recorder.per_group().items():
            pl_module.log(f"traffic/{group}_calls", float(total["calls"]), rank_zero_only=True)
            pl_module.log(f"traffic/{group}_bytes", float(total["payload_bytes"]), rank_zero_only=True)
