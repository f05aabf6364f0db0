"""GPU utilisation, memory, temperature and power through NVML, logged beside the training metrics.

The design documents' monitoring chapter asks for the hardware metrics next to loss, learning rate,
gradient norm and throughput: GPU utilisation under 60% points at data loading or communication, over
90% with flat throughput at the kernels. `HardwareMonitor` reads NVML (`nvidia-ml-py`, imported as
`pynvml`) for this rank's GPU at every logging step (`Trainer(log_every_n_steps=...)`), gathers every
rank's reading (one object all-gather over the world, at logging steps only) and logs, for each metric,
the mean, min and max over the ranks and the worst rank (the least utilised GPU; the hottest, most
power-drawing, fullest one), so one idle or overheating GPU of many stands out without a curve per rank:

    hardware/gpu_utilization_percent_{mean,min,max,worst_rank}
    hardware/memory_used_gib_{...}, hardware/temperature_c_{...}, hardware/power_w_{...}

On a run without CUDA there is no GPU to read: the callback says so once and logs nothing (pass
`read=` to log another reading, e.g. in tests).

Example usage::

    trainer = L.Trainer(strategy=TP3DStrategy(...), callbacks=[HardwareMonitor()], log_every_n_steps=10)
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_tp3d._compat.lightning import log_metrics, should_accumulate, should_update_logs

__all__ = ["HARDWARE_METRICS", "HardwareMonitor", "NvmlReader", "summarize_ranks"]

# metric -> whether a low value is the bad one (utilisation) rather than a high one
HARDWARE_METRICS = {"gpu_utilization_percent": True, "memory_used_gib": False, "temperature_c": False,
                    "power_w": False}
_GIB = 1024**3


class NvmlReader:
    """This process's GPU through NVML: the device with the CUDA device's UUID (so `CUDA_VISIBLE_DEVICES`
    renumbering does not matter). `nvml` is the `pynvml` module of nvidia-ml-py."""

    def __init__(self, nvml: Any, device_uuid: str) -> None:
        nvml.nvmlInit()
        self.nvml = nvml
        self.handle = nvml.nvmlDeviceGetHandleByUUID(device_uuid)

    @classmethod
    def for_current_device(cls) -> NvmlReader:
        try:
            import pynvml
        except ImportError:
            raise ImportError("HardwareMonitor reads the GPU through NVML: `pip install nvidia-ml-py`.") from None
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        return cls(pynvml, uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")

    def read(self) -> dict[str, float]:
        nvml, handle = self.nvml, self.handle
        return {
            "gpu_utilization_percent": float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            "memory_used_gib": nvml.nvmlDeviceGetMemoryInfo(handle).used / _GIB,
            "temperature_c": float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
            "power_w": nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,  # milliwatts
        }


def summarize_ranks(readings: Sequence[dict[str, float]]) -> dict[str, float]:
    """Mean, min, max and worst rank of each metric over `readings` (index = global rank)."""
    metrics: dict[str, float] = {}
    for name, low_is_bad in HARDWARE_METRICS.items():
        values = [reading[name] for reading in readings]
        worst = min if low_is_bad else max
        metrics.update({f"hardware/{name}_mean": statistics.fmean(values), f"hardware/{name}_min": min(values),
                        f"hardware/{name}_max": max(values),
                        f"hardware/{name}_worst_rank": float(values.index(worst(values)))})
    return metrics


class HardwareMonitor(Callback):
    """Logs every rank's GPU metrics (see the module docstring) at the Trainer's logging steps.

    `read` returns this rank's reading (`HARDWARE_METRICS` keys); the default reads this rank's GPU
    through NVML (`NvmlReader`), and logs nothing where there is no CUDA device."""

    def __init__(self, read: Callable[[], dict[str, float]] | None = None) -> None:
        self._read = read
        self.last_logged: dict[str, float] | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._read is None and trainer.strategy.root_device.type == "cuda":
            self._read = NvmlReader.for_current_device().read
        elif self._read is None:
            rank_zero_info("HardwareMonitor: no CUDA device in this run, so no GPU metrics are logged.")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        # once per logging step: not after the batches a step accumulates before its last one
        if self._read is None or not should_update_logs(trainer) or should_accumulate(trainer):
            return
        readings: list[Any] = [self._read()]
        if dist.is_initialized() and dist.get_world_size() > 1:
            readings = [None] * dist.get_world_size()
            dist.all_gather_object(readings, self._read())
        if trainer.is_global_zero:
            self.last_logged = summarize_ranks(readings)
            log_metrics(trainer, self.last_logged, None)  # at the step Lightning logs the loss at
