"""`CausalLMModule`: the LightningModule that trains the reference decoder at any layout.

The contract with `TP3DStrategy` (what makes one module run unchanged at every (tp, pp, dp)):

* the network is built in `configure_model` (or `__init__`) and stored under one attribute,
  `self.model` by default (`TP3DStrategy(model_attribute=...)` names another);
* the loss is computed by calling that network with the labels, `self.model(input_ids, labels=labels)`,
  which returns the mean token loss; the strategy may route this call through a pipeline schedule;
* batches are dicts with `input_ids` and `labels` of shape `[batch, seq]` (`labels` already shifted:
  `labels[:, s]` is the token that follows `input_ids[:, s]`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning as L
import torch

from lightning_tp3d._compat.lightning import attached_trainer
from lightning_tp3d.models.llama import LlamaForCausalLM
from lightning_tp3d.plan.config import ModelConfig, resolve_model_config

__all__ = ["CausalLMModule"]


class CausalLMModule(L.LightningModule):
    """Next-token training of `LlamaForCausalLM` with AdamW.

    Args:
        model: a preset name (`tiny`, `deepseek-llm-7b`, ...), a `config.json` path or a `ModelConfig`.
        learning_rate, weight_decay, betas: AdamW settings.
        warmup_steps: optimizer steps of linear learning-rate warm-up (`lr x min(1, (step + 1) / warmup_steps)`);
            0 keeps the rate constant.
        init_seed: seed of the weight initialisation; weights are a function of (seed, parameter name) only,
            independent of the rank's random state, so every layout starts from identical weights.
    """

    def __init__(
        self,
        model: str | ModelConfig = "tiny",
        learning_rate: float = 3e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        init_seed: int = 0,
        warmup_steps: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model"])
        self.config = resolve_model_config(model)
        self.model: LlamaForCausalLM | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        # Under TP3DStrategy the network is declared on the meta device and the strategy materialises only
        # this rank's shard (same values at every layout: `LlamaForCausalLM.init_weights`).
        trainer = attached_trainer(self)
        strategy = trainer.strategy if trainer is not None else None
        sharded = getattr(strategy, "materializes_meta_networks", False)
        with torch.device("meta") if sharded else contextlib.nullcontext():
            self.model = LlamaForCausalLM(self.config, init_seed=self.hparams.init_seed)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(batch["input_ids"], labels=batch["labels"])
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(batch["input_ids"], labels=batch["labels"])
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(batch["input_ids"], labels=batch["labels"])
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The logits `[batch, seq, vocab]` of the batch's `input_ids` (whole, on every rank)."""
        return self.model(batch["input_ids"])

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(
            self.parameters(),
            lr=self.hparams.learning_rate,
            weight_decay=self.hparams.weight_decay,
            betas=tuple(self.hparams.betas),
        )
        warmup_steps = self.hparams.warmup_steps
        if warmup_steps == 0:
            return optimizer
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
