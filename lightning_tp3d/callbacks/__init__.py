"""Lightning callbacks: export and consistency checks at the end of fit, and the throughput monitor."""

from lightning_tp3d.callbacks.deploy import ConsistencyCheck, ExportCallback
from lightning_tp3d.callbacks.monitor import TP3DThroughputMonitor

__all__ = ["ConsistencyCheck", "ExportCallback", "TP3DThroughputMonitor"]
