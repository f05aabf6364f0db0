"""The extension point of pipeline parallelism: how a network's pieces run as a stage.

A pipeline stage receives one tensor (token ids on the first stage, hidden states after) and returns one
(hidden states, logits on the last stage); the schedule sends it on. `PipelineStages` decides how a
stage computes from the modules it owns and how the network's call looks from outside:

* `stage_module(network, first, blocks, last)` builds the stage's `nn.Module` from the first-stage
  modules (embedding) when it is stage 0, its blocks (global index -> block, in order) and the
  last-stage modules (final norm, head) when it is the last stage. The default, `StageModule`, calls
  them one after the other with the previous output alone, which suits blocks of the form
  `block(hidden) -> hidden` (this package's decoder, torchtitan-style models). A model whose blocks take
  more (rotary tables, masks, position ids) computes those inside its stage module, from the stage
  input, on every stage: the tables are cheap and need no sending.
* `loss_function(network)` is the loss of the last stage's output and the labels, per micro-batch
  (a mean over the micro-batch's tokens); None: the package's `causal_lm_loss` (labels already shifted).
* `call_arguments(...)` checks what the LightningModule passes to `network(...)` and returns
  `(input_ids, labels)`; `output(loss, logits)` is what that call returns (the loss or, without labels,
  the logits; a Hugging Face model returns its output object).

A model family's adapter supplies its stages (`models.adapter.ModelAdapter.pipeline_stages`); pass an
instance as `TP3DStrategy(pipeline_stages=...)` (or its import path, `"package.module:Class"`) to
replace them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_tp3d.parallel.pipeline.split import StageModule

__all__ = ["PipelineStages", "StageLoss"]

StageLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PipelineStages:
    """Stages that call first modules -> blocks -> last modules in order, each with the previous output."""

    def stage_module(self, network: nn.Module, first: Sequence[nn.Module], blocks: Mapping[int, nn.Module],
                     last: Sequence[nn.Module]) -> nn.Module:
        return StageModule([*first, *blocks.values(), *last])

    def loss_function(self, network: nn.Module) -> StageLoss | None:
        return getattr(network, "loss_function", None)

    def call_arguments(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                       **unexpected: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if unexpected or input_ids is None:
            raise TypeError(
                "under pipeline parallelism the network is called as network(input_ids, labels=labels); got"
                f" {sorted(unexpected) or 'no input_ids'}."
            )
        return input_ids, labels

    def output(self, network: nn.Module, loss: torch.Tensor | None, logits: torch.Tensor | None) -> Any:
        return loss if loss is not None else logits
