"""lightning_tp3d: tensor x pipeline x data parallel training for Lightning, from layout to serving."""

from importlib.metadata import version

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_tp3d._compat.lightning import quiet_known_deprecations, read_checkpoint_folders_with
from lightning_tp3d.io.checkpoint_format import is_checkpoint_folder, read_lightning_checkpoint
from lightning_tp3d.plan.config import MODEL_PRESETS, ModelConfig, resolve_model_config
from lightning_tp3d.plan.layout import LayoutError, ParallelLayout, RankCoordinates
from lightning_tp3d.strategies import TP3DFabricStrategy, TP3DPrecision, TP3DStrategy
from lightning_tp3d.strategies.features import UnsupportedFeatureError
from lightning_tp3d.strategies.grad_norm import grad_norm

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

# `LightningModule.load_from_checkpoint(folder)` reads a checkpoint folder as Lightning's one-file checkpoint.
read_checkpoint_folders_with(is_checkpoint_folder, read_lightning_checkpoint)
quiet_known_deprecations()  # a Lightning / torch mismatch, harmless: `_compat.lightning`

__version__ = version("lightning-tp3d")  # pyproject.toml is the one place the version is written

if TP3DStrategy.strategy_name not in StrategyRegistry:
    TP3DStrategy.register_strategies(StrategyRegistry)
if "tp3d" not in FABRIC_STRATEGY_REGISTRY:
    TP3DFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
