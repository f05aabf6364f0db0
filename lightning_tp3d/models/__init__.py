"""Reference models and the LightningModule that trains them."""

from lightning_tp3d.models.llama import IGNORE_INDEX, LlamaForCausalLM, causal_lm_loss
from lightning_tp3d.models.module import CausalLMModule

__all__ = ["IGNORE_INDEX", "CausalLMModule", "LlamaForCausalLM", "causal_lm_loss"]
