"""`LoraCausalLMModule`: a Hugging Face causal LM from its folder, fine-tuned with PEFT LoRA or QLoRA, for a YAML
recipe.

The module is what a fine-tuning project writes by hand (`get_peft_model(from_pretrained(folder),
LoraConfig(...))` in `configure_model`, then `quantize_base` for QLoRA, the model's own loss, AdamW over the
trainable parameters), so a LightningCLI config can name it (`examples/finetune_lora.yaml`,
`examples/finetune_qlora.yaml`); the strategy treats it as any PEFT model (`models.lora`, `models.qlora`).
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning as L
import torch

from lightning_tp3d.models.qlora import quantize_base
from lightning_tp3d.plan.qlora import NF4_FORMAT, NF4Format

__all__ = ["LoraCausalLMModule"]


class LoraCausalLMModule(L.LightningModule):
    """LoRA fine-tuning of `transformers.AutoModelForCausalLM.from_pretrained(pretrained)`.

    Args:
        pretrained: a Hugging Face folder (or hub name) of the base model.
        lora_rank / lora_alpha / lora_dropout / target_modules: the `peft.LoraConfig` (alpha / r scales the
            update; the design documents' defaults: r 8-64, alpha = 2 r, the attention projections).
        learning_rate / weight_decay: AdamW over the LoRA factors.
        qlora: hold the base's block projections in 4-bit NF4 (`models.qlora.quantize_base`), with
            `nf4_block_size` weights per scale and `nf4_scaler_block_size` scales per factor (the QLoRA
            paper's 64 and 256); checkpoints then hold what trains, and the merged export needs the base
            folder (`ExportCallback(base=...)`, `tp3d export --base`).
    """

    def __init__(self, pretrained: str, lora_rank: int = 16, lora_alpha: int = 32, lora_dropout: float = 0.0,
                 target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
                 learning_rate: float = 2e-4, weight_decay: float = 0.0, qlora: bool = False,
                 nf4_block_size: int = NF4_FORMAT.block_size,
                 nf4_scaler_block_size: int = NF4_FORMAT.scaler_block_size) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        import peft
        import transformers

        base = transformers.AutoModelForCausalLM.from_pretrained(self.hparams.pretrained, dtype=torch.float32)
        config = peft.LoraConfig(r=self.hparams.lora_rank, lora_alpha=self.hparams.lora_alpha,
                                 lora_dropout=self.hparams.lora_dropout,
                                 target_modules=list(self.hparams.target_modules))
        self.model = peft.get_peft_model(base, config)
        if self.hparams.qlora:
            quantize_base(self.model, NF4Format(self.hparams.nf4_block_size, self.hparams.nf4_scaler_block_size))

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [parameter for parameter in self.parameters() if parameter.requires_grad]
        return torch.optim.AdamW(trainable, lr=self.hparams.learning_rate, weight_decay=self.hparams.weight_decay)
