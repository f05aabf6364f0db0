"""Lightning features that assume the whole model lives in one process: adapted where they can be, refused
before the first step where they cannot, with the reason and what to use instead.

Refused (`check_lightning_features`):

* `Trainer(detect_anomaly=True)` with tensor parallelism: torch's anomaly detection runs an operator on
  every backward output that DTensor cannot run (under pipelining, the schedule's first step, which
  infers the stages' shapes through uninitialised tensors, runs without it: `parallel.pipeline.runner`).
* `StochasticWeightAveraging`: it deep-copies the LightningModule and averages whole parameters; a rank
  holds a tp shard, a pipeline stage or an FSDP part, and the copy would be none of them.
* `BaseFinetuning` callbacks (e.g. `BackboneFinetuning`) in `data_parallel_mode="zero1"` with dp > 1:
  they add a parameter group mid-fit, but the zero1 optimizer holds each dp rank's parts of the
  parameters it was given when fit started; a group of whole parameters added later would be updated
  from gradients that are never reduced over dp.
* a network compiled by the user (`torch.compile(network)` or `network.compile()`): the strategy has to
  split, shard and name the module itself.

Adapted (`adapt_callbacks`): under pipelining the model summary callbacks count every stage
(`strategies.summary`); `BaseFinetuning`'s test of "already in the optimizer" (`torch.equal`, which
refuses a plain tensor against a DTensor) gets `same_values`, which compares whole values as one process
would. `ckpt_path="last"` with a `ModelCheckpoint(dirpath=...)` on remote storage, which Lightning's
listing misses, finds the newest complete `last` checkpoint there (`last_remote_checkpoint`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BaseFinetuning, ModelCheckpoint, ModelSummary, StochasticWeightAveraging
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_tp3d._compat.lightning import compare_finetuning_parameters_with, use_model_summary
from lightning_tp3d._compat.torch import TORCH_VERSION, is_compiled
from lightning_tp3d.io.last_checkpoint import newest_last_checkpoint
from lightning_tp3d.io.storage import is_remote, location
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.strategies.summary import WholeModelSummary

__all__ = ["UnsupportedFeatureError", "adapt_callbacks", "check_lightning_features", "check_network_is_not_compiled",
           "last_remote_checkpoint", "same_values"]


class UnsupportedFeatureError(ValueError):
    """A Lightning feature TP3DStrategy cannot run at this layout; the message says why and what to use."""


def check_lightning_features(callbacks: Iterable[Any], shards_optimizers: bool, layout: ParallelLayout,
                             detect_anomaly: bool) -> None:
    """Refuse, before training starts, the features listed in this module's docstring; `shards_optimizers`:
    the data-parallel mode hands the optimizers parts of the parameters (`DataParallel.shards_optimizers`)."""
    if detect_anomaly and layout.tensor_parallel_size > 1:
        raise UnsupportedFeatureError(
            "Trainer(detect_anomaly=True) is not supported with tensor_parallel_size > 1: torch's anomaly detection"
            f" (torch {TORCH_VERSION}) checks every backward output with aten._is_any_true, which DTensor cannot run"
            " (no sharding strategy). Find the step at tensor_parallel_size=1 (pipeline and data parallel work), or"
            " rely on the strategy's non-finite step guard (skip_non_finite_steps), which names the steps."
        )
    for callback in callbacks:
        if isinstance(callback, StochasticWeightAveraging):
            raise UnsupportedFeatureError(
                "StochasticWeightAveraging is not supported by TP3DStrategy: it deep-copies the LightningModule and"
                " averages whole parameters, but each rank holds only its shard (tensor parallel), stage (pipeline"
                " parallel) or part (FSDP). Remove the callback; for its learning-rate schedule use"
                " torch.optim.swa_utils.SWALR in configure_optimizers, and average the exports of the last"
                " checkpoints (`tp3d export`) after training."
            )
        if isinstance(callback, BaseFinetuning) and shards_optimizers:
            raise UnsupportedFeatureError(
                f"{type(callback).__name__} (a BaseFinetuning callback) adds a parameter group during fit, which"
                " data_parallel_mode='zero1' cannot take: its optimizer holds each dp rank's parts of the parameters"
                " it had when fit started. Use data_parallel_mode='replicate' or 'fsdp' with this callback."
            )


def check_network_is_not_compiled(network: nn.Module, attribute: str) -> None:
    if is_compiled(network):
        raise UnsupportedFeatureError(
            f"LightningModule.{attribute} is compiled (torch.compile(...) or .compile()): TP3DStrategy splits the"
            " network into pipeline stages, shards it with its tp_plan and names its checkpoint tensors, which needs"
            " the module itself. Build it uncompiled in configure_model and pass TP3DStrategy(compile=True) (or"
            " compile=dict(...) with torch.compile's keywords): the strategy compiles each block once it is split."
        )


def same_values(first: torch.Tensor, second: torch.Tensor) -> bool:
    """`torch.equal` of the whole tensors, for plain tensors and DTensors alike (a collective over a
    DTensor's mesh, reached by all its ranks alike: the shapes it depends on are global)."""
    if first is second:
        return True
    if first.shape != second.shape:
        return False
    if isinstance(first, DTensor) != isinstance(second, DTensor) or (
            isinstance(first, DTensor) and (first.device_mesh, first.placements) != (second.device_mesh,
                                                                                      second.placements)):
        first, second = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor for tensor in (first, second))
    return torch.equal(first, second)


def adapt_callbacks(callbacks: Iterable[Any], pp_group: dist.ProcessGroup | None) -> list[Callable[[], None]]:
    """Adapt the callbacks listed in this module's docstring (`pp_group`: None without pipelining); returns
    what restores Lightning's own functions after fit."""
    callbacks = list(callbacks)
    if pp_group is not None:
        for callback in callbacks:
            if isinstance(callback, ModelSummary):
                use_model_summary(callback, lambda module, depth: WholeModelSummary(module, depth, pp_group))
    if any(isinstance(callback, BaseFinetuning) for callback in callbacks):
        return [compare_finetuning_parameters_with(same_values)]
    return []


def last_remote_checkpoint(trainer: Any) -> str | None:
    """What `ckpt_path="last"` means when a `ModelCheckpoint` writes to remote storage: the newest complete
    `last` checkpoint over the callbacks' folders (`io.last_checkpoint`), or None to let Lightning resolve
    it (no folder is remote). Callbacks without a `dirpath` (the logger's folder, local) are Lightning's."""
    callbacks = [callback for callback in trainer.checkpoint_callbacks
                 if isinstance(callback, ModelCheckpoint) and callback.dirpath]
    if not any(is_remote(location(callback.dirpath)) for callback in callbacks):
        return None
    return newest_last_checkpoint((str(callback.dirpath), callback.CHECKPOINT_NAME_LAST, callback.FILE_EXTENSION)
                                  for callback in callbacks)
