"""Throughput, MFU, gradient norm, loss scale and peak memory, counted right under tensor and pipeline
parallelism, through Lightning's `ThroughputMonitor` and the Trainer's loggers.

Lightning's `Throughput` turns per-device rates into global ones by multiplying by the world size. Under
tp x pp only the data-parallel ranks see distinct samples (the tp x pp ranks of one replica share theirs),
so samples and tokens per second are multiplied by dp here, while FLOPs are shared: each rank does
1 / (tp x pp) of its replica's work, so per-rank FLOPs are the replica batch's FLOPs / (tp x pp) and the
global FLOPs are that x world size. Model FLOPs per token come from `ledger.training_flops_per_token`;
for a LoRA model (`models.lora.lora_shape`) they count 4 x each frozen weight (no weight gradient) and
6 x the factors of the block projections it adapts.
MFU is per-rank FLOPs/s over the device's peak (torch's table for GPUs and the precision, or
`available_flops=`). With an MFU target (default 0.40 on GPUs, the design documents' bar) the monitor
warns once when the MFU measured after the first full window is below it, naming the likely causes.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterable
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_tp3d._compat.lightning import log_metrics, should_update_logs
from lightning_tp3d._compat.torch import loss_scale_tensor
from lightning_tp3d.models.lora import lora_shape
from lightning_tp3d.parallel.grad_norm import global_grad_norm
from lightning_tp3d.parallel.mesh import mesh_device
from lightning_tp3d.parallel.tensor import local_part
from lightning_tp3d.plan.ledger import training_flops_per_token
from lightning_tp3d.plan.lora import LORA_TARGETS
from lightning_tp3d.plan.schedules import bubble_fraction

__all__ = ["DEFAULT_MFU_TARGET", "TP3DThroughputMonitor", "local_storage_bytes"]

DEFAULT_MFU_TARGET = 0.40  # on GPUs; CPUs have no such bar


def local_storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` on this rank: a DTensor counts its local shard,
    padding and all (FSDP2), a tensor subclass its inner tensors (NF4: 4-bit data, scales, factors), and
    tensors sharing a storage count it once. Compare with the ledger's
    weight, gradient and optimizer bytes for this rank's stage."""
    storages = {}
    for tensor in tensors:
        if tensor is None:
            continue
        for part in _plain_parts(local_part(tensor.detach())):
            storage = part.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _plain_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding `tensor`'s data: a wrapper subclass (an NF4 weight of a QLoRA base) has no
    storage of its own, only its inner tensors (`__tensor_flatten__`)."""
    if type(tensor) in (torch.Tensor, torch.nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [part for name in names for part in _plain_parts(getattr(tensor, name))]


def _tokens(batch: Any) -> int:
    return int(batch["input_ids"].numel()) if isinstance(batch, dict) and "input_ids" in batch else 0


class TP3DThroughputMonitor(ThroughputMonitor):
    """Logs `train/samples_per_sec`, `train/items_per_sec` (tokens), `train/flops_per_sec`, their
    `device/` (per-rank) forms, `train/device/mfu`, `train/device/peak_memory_bytes`, and every optimizer
    step `train/grad_norm` (global, over tp shards and pipeline stages) and `train/loss_scale` (fp16).

    Args:
        window_size: optimizer steps the rates are averaged over.
        available_flops: peak FLOP/s of one device, for MFU where torch has no figure (e.g. CPUs).
        batch_size_fn / length_fn: samples and tokens of a batch (default: `input_ids` rows and elements).
        mfu_target: warn once when the MFU after the first full window is below this (default
            `DEFAULT_MFU_TARGET` on GPUs, none on CPUs; 0 disables); the warning is kept in `mfu_warning`.
    """

    def __init__(self, window_size: int = 20, available_flops: float | None = None,
                 batch_size_fn: Any = extract_batch_size, length_fn: Any = _tokens,
                 mfu_target: float | None = None) -> None:
        super().__init__(batch_size_fn=batch_size_fn, length_fn=length_fn, window_size=window_size)
        self._available_flops_override = available_flops
        self._model_parallel = 1
        self._config: Any = None
        self._lora: tuple[int, tuple[str, ...]] = (0, ())
        self.mfu_target = mfu_target
        self.mfu_warning: str | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        layout = trainer.strategy.layout
        self._model_parallel = layout.tensor_parallel_size * layout.pipeline_parallel_size
        if self._available_flops_override is not None:
            self.available_flops = self._available_flops_override
        if self.mfu_target is None:
            self.mfu_target = DEFAULT_MFU_TARGET if trainer.strategy.root_device.type == "cuda" else 0.0
        for key in list(self._throughputs):  # samples and tokens are distinct only across dp ranks
            self._throughputs[key] = Throughput(available_flops=self.available_flops,
                                                world_size=layout.data_parallel_size, **self.kwargs)

    def _update(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, iter_num: int) -> None:
        stage = trainer.state.stage
        if self._config is None:  # the network exists once `configure_model` has run
            self._config = trainer.strategy.network.config
            rank, targets = lora_shape(trainer.strategy.network)
            self._lora = (rank, tuple(target for target in targets if target in LORA_TARGETS))
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self._t0s[stage]
        samples, tokens = self.batch_size_fn(batch), self.length_fn(batch)
        sequence = tokens // max(samples, 1)
        self._lengths[stage] += tokens
        self._samples[stage] += samples
        self._batches[stage] += 1
        flops_per_token = training_flops_per_token(self._config, sequence, lora_rank=self._lora[0],
                                                   lora_targets=self._lora[1])
        rank_flops = tokens * flops_per_token / self._model_parallel
        self._throughputs[stage].update(time=elapsed, batches=self._batches[stage], samples=self._samples[stage],
                                        lengths=self._lengths[stage], flops=rank_flops)

    def _compute(self, trainer: L.Trainer, iter_num: int | None = None) -> None:
        if not should_update_logs(trainer):
            return
        stage = trainer.state.stage
        throughput = self._throughputs[stage]
        metrics = throughput.compute()
        separator = throughput.separator
        if "flops_per_sec" in metrics:  # Throughput summed dp ranks only; every rank computes
            metrics["flops_per_sec"] *= self._model_parallel
        if trainer.strategy.root_device.type == "cuda":
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        metrics[f"device{separator}peak_memory_bytes"] = peak
        mfu = metrics.get(f"device{separator}mfu")
        if mfu is not None and self.mfu_target and mfu < self.mfu_target and self.mfu_warning is None:
            self._warn_low_mfu(trainer, mfu)
        metrics = {f"{stage.value}{separator}{key}": value for key, value in metrics.items()}
        log_metrics(trainer, metrics, iter_num)

    def _warn_low_mfu(self, trainer: L.Trainer, mfu: float) -> None:
        layout, options = trainer.strategy.layout, trainer.strategy.core.options
        causes = []
        if layout.pipeline_parallel_size > 1:
            bubble = bubble_fraction(layout.pipeline_parallel_size, layout.num_microbatches)
            causes.append(f"the pipeline bubble ({bubble:.0%} of each step at pp={layout.pipeline_parallel_size},"
                          f" num_microbatches={layout.num_microbatches}; about 4 x pp micro-batches shrink it)")
        if options.recompute != "none":
            causes.append(f"activation recompute ({options.recompute}: full recompute repeats the forward, about"
                          " 30% more compute that MFU does not count)")
        causes.append("exposed communication (tp all-reduces must stay on NVLink, see `tp3d doctor`; dp and pp"
                      " traffic not hidden behind compute)")
        self.mfu_warning = (f"MFU {mfu:.1%} is below the target {self.mfu_target:.0%} after warm-up; likely causes: "
                            + "; ".join(causes) + ".")
        rank_zero_warn(self.mfu_warning)

    @staticmethod
    def _clips_by_norm(trainer: L.Trainer) -> bool:
        return bool(trainer.gradient_clip_val) and trainer.gradient_clip_algorithm == "norm"

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        # After unscaling, before clipping. When the run clips by norm, the clipping computes the same
        # global norm right after this hook: it is logged from there (`on_before_zero_grad`), not twice.
        if not self._clips_by_norm(trainer):
            parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
            mesh = trainer.strategy.device_mesh
            norm = global_grad_norm(parameters, mesh["pp"].get_group(), mesh_device(mesh))
            pl_module.log("train/grad_norm", norm, on_step=True, on_epoch=False, sync_dist=False)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            # the scale tensor, not `get_scale()`: no host synchronisation in the step
            pl_module.log("train/loss_scale", loss_scale_tensor(scaler), on_step=True, on_epoch=False)

    def on_before_zero_grad(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        norm = getattr(trainer.strategy.core, "last_clip_norm", None)
        if self._clips_by_norm(trainer) and norm is not None:
            pl_module.log("train/grad_norm", norm, on_step=True, on_epoch=False, sync_dist=False)
