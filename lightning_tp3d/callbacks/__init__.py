"""Lightning callbacks: export and consistency checks at the end of fit, the throughput monitor, GPU
hardware metrics, the stalled-rank report, plain-text loss lines and the per-group traffic of a step."""

from lightning_tp3d.callbacks.export import ConsistencyCheck, ExportCallback
from lightning_tp3d.callbacks.hardware import HardwareMonitor
from lightning_tp3d.callbacks.monitor import TP3DThroughputMonitor
from lightning_tp3d.callbacks.profile import StepProfiler
from lightning_tp3d.callbacks.progress import PrintLosses
from lightning_tp3d.callbacks.stall import StalledRankMonitor
from lightning_tp3d.callbacks.traffic import RecordTraffic

__all__ = ["ConsistencyCheck", "ExportCallback", "HardwareMonitor", "PrintLosses", "RecordTraffic", "StepProfiler",
           "StalledRankMonitor", "TP3DThroughputMonitor"]
