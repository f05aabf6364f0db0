"""What the benchmark scripts share: the CPU benchmark model, the machine, a Trainer that only trains and a
step recorder."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_tp3d import ModelConfig

__all__ = ["CONFIG", "CONFIG_160M", "MACHINE", "StepRecorder", "benchmark_trainer"]

# The reference decoder at a size two CPU cores train in well under a second per step.
CONFIG = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
# A decoder of about 160M parameters (640 MB in fp32): checkpoint and serving throughput.
CONFIG_160M = ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                          num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=512)



def _machine() -> str:
    """This machine as the JSON records it: cores and CPU model (read, not assumed: Intel and AMD machines
    round differently), the GPU if any, and the versions."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if line.startswith("model name")]
    cpu = names[0] if names else platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    return f"{os.cpu_count()} vCPUs ({cpu}), {gpu}, torch {torch.__version__}, {backend}, Lightning {L.__version__}"


MACHINE = _machine()


def benchmark_trainer(devices: int, strategy: Any, max_steps: int, callbacks: list[Any], accelerator: str = "cpu",
                      **kwargs: Any) -> L.Trainer:
    """A Trainer on `devices` processes that only trains: no logger, checkpoints, bars or validation."""
    return L.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, max_steps=max_steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=callbacks, num_sanity_val_steps=0, limit_val_batches=0, **kwargs)


class StepRecorder(Callback):
    """Each training step's wall time (a GPU synchronised at both ends), loss, pipeline idle fraction
    (`TP3DStrategy.pipeline_timing`, when pipelining), the time the dp gradient reduction took after
    backward (`ParallelCore.last_gradient_wait_seconds`) and, with `keep_batches`, a copy of its batch."""

    def __init__(self, keep_batches: bool = False) -> None:
        self.keep_batches = keep_batches
        self.batches: list[dict[str, torch.Tensor]] = []
        self.seconds: list[float] = []
        self.losses: list[float] = []
        self.idle: list[float] = []
        # (step, busy, wait) seconds and compute actions of `pipeline_timing`
        self.pipeline_steps: list[tuple[float, float, float, int]] = []
        self.gradient_wait: list[float] = []  # host seconds the dp reduction took after backward
        self._started = 0.0

    @staticmethod
    def _synchronize(trainer: L.Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, *args: Any) -> None:
        if self.keep_batches:
            self.batches.append({key: value.clone() for key, value in batch.items()})
        self._synchronize(trainer)
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self._synchronize(trainer)
        self.seconds.append(time.perf_counter() - self._started)
        self.losses.append(float(outputs["loss"]))
        core = getattr(trainer.strategy, "core", None)
        if core is not None:
            self.gradient_wait.append(core.last_gradient_wait_seconds)
        timing = getattr(trainer.strategy, "pipeline_timing", None)
        if timing is not None:
            self.idle.append(timing.idle_fraction)
            self.pipeline_steps.append((timing.step_seconds, timing.busy_seconds, timing.wait_seconds, timing.actions))
