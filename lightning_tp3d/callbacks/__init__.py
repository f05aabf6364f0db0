"""Lightning callbacks: export and consistency checks at the end of fit, the throughput monitor, and
plain-text loss lines."""

from lightning_tp3d.callbacks.deploy import ConsistencyCheck, ExportCallback
from lightning_tp3d.callbacks.monitor import TP3DThroughputMonitor
from lightning_tp3d.callbacks.progress import PrintLosses

__all__ = ["ConsistencyCheck", "ExportCallback", "PrintLosses", "TP3DThroughputMonitor"]
