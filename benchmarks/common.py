"""What the benchmark scripts share: the CPU benchmark model, the machine, a Trainer that only trains."""

from __future__ import annotations

from typing import Any

import lightning as L

from lightning_tp3d import ModelConfig

__all__ = ["CONFIG", "MACHINE", "benchmark_trainer"]

# The reference decoder at a size two CPU cores train in well under a second per step.
CONFIG = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)

MACHINE = "2 vCPUs (Intel Xeon), no GPU, torch 2.13.0+cpu, gloo, Lightning 2.6.6"


def benchmark_trainer(devices: int, strategy: Any, max_steps: int, callbacks: list[Any], accelerator: str = "cpu",
                      **kwargs: Any) -> L.Trainer:
    """A Trainer on `devices` processes that only trains: no logger, checkpoints, bars or validation."""
    return L.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, max_steps=max_steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=callbacks, num_sanity_val_steps=0, limit_val_batches=0, **kwargs)
