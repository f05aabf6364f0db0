"""lightning_tp3d: tensor x pipeline x data parallel training for Lightning, from layout to serving.

Importing the package imports neither torch nor Lightning (the planner is arithmetic): the names that
need them load on first use, and the package connects itself to Lightning (the "tp3d" strategy name,
checkpoint folders in `load_from_checkpoint`) as soon as Lightning is imported (`lightning_tp3d._connect`).
"""

from importlib import import_module
from importlib.metadata import version
from typing import Any

from lightning_tp3d._connect import connect_when_lightning_is_imported
from lightning_tp3d.plan.config import MODEL_PRESETS, ModelConfig, resolve_model_config
from lightning_tp3d.plan.layout import LayoutError, ParallelLayout, RankCoordinates

__all__ = [
    "LayoutError",
    "MODEL_PRESETS",
    "ModelConfig",
    "ParallelLayout",
    "RankCoordinates",
    "TP3DFabricStrategy",
    "TP3DPrecision",
    "TP3DStrategy",
    "UnsupportedFeatureError",
    "grad_norm",
    "resolve_model_config",
]

__version__ = version("lightning-tp3d")  # pyproject.toml is the one place the version is written

# the public names that import torch and Lightning, and the module each comes from
_LOADED_ON_USE = {
    "TP3DFabricStrategy": "lightning_tp3d.strategies",
    "TP3DPrecision": "lightning_tp3d.strategies",
    "TP3DStrategy": "lightning_tp3d.strategies",
    "UnsupportedFeatureError": "lightning_tp3d.strategies.features",
    "grad_norm": "lightning_tp3d.strategies.grad_norm",
}


def __getattr__(name: str) -> Any:
    if name not in _LOADED_ON_USE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_LOADED_ON_USE[name]), name)  # connects to Lightning if it is the first
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


connect_when_lightning_is_imported()
