"""The Lightning adapters: `TP3DStrategy` (Trainer), `TP3DFabricStrategy` (Fabric) and `TP3DPrecision`,
over one `ParallelCore` that does the work (layout -> mesh -> parallelize -> step -> checkpoint)."""

from lightning_tp3d.strategies.fabric import TP3DFabricStrategy
from lightning_tp3d.strategies.precision import TP3DPrecision
from lightning_tp3d.strategies.trainer import TP3DStrategy

__all__ = ["TP3DFabricStrategy", "TP3DPrecision", "TP3DStrategy"]
