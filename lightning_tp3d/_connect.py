"""Connecting the package to Lightning when Lightning is imported, so `import lightning_tp3d` stays light.

The planner (`tp3d plan`, `tp3d --help`, the advisor) imports neither torch nor Lightning, so importing the
package must not. Yet once a user's program has imported both, in either order, the package is connected:
`Trainer(strategy="tp3d")` and `Fabric(strategy="tp3d")` find the strategies in Lightning's registries,
`LightningModule.load_from_checkpoint(folder)` reads a checkpoint folder, `ckpt_path="last"` finds
checkpoints on remote storage, Lightning's own `grad_norm` gives whole-model norms under the package's
strategies, and a known Lightning / torch deprecation is quiet (`_compat.lightning`).
`connect()` does the five, once, at the first moment when
Lightning is imported and no module of this package is in the middle of its own import (it imports the
strategies, which may be what imported Lightning):

* at `import lightning_tp3d` when Lightning came first;
* otherwise at the end of `import lightning`, or of the outermost import of one of the package's modules
  during which Lightning was imported (`from lightning_tp3d.models import CausalLMModule`, and the first
  use of a package name that needs Lightning, `lightning_tp3d.TP3DStrategy`, which imports its module).

`ImportWatcher`, a finder on `sys.meta_path`, sees those imports end: it finds each module with the
finders after it and wraps the loader so that it counts the nesting and calls `connect` at the outermost
end; what a module contains is untouched. It leaves `sys.meta_path` when the package is connected.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

__all__ = ["ImportWatcher", "connect", "connect_when_lightning_is_imported"]

_PACKAGE = __name__.rpartition(".")[0]
_connected = False


def connect() -> None:
    """Register "tp3d" with the Trainer's and Fabric's registries, let `load_from_checkpoint` read checkpoint
    folders and `ckpt_path="last"` find remote ones, route Lightning's `grad_norm` to the package's, and
    quiet the known deprecation; once per process (later
    calls return at once)."""
    global _connected
    if _connected:
        return
    _connected = True
    ImportWatcher.remove()
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_tp3d._compat.lightning import (
        quiet_known_deprecations,
        read_checkpoint_folders_with,
        resolve_last_checkpoint_with,
        route_grad_norm_with,
    )
    from lightning_tp3d.io.checkpoint_format import is_checkpoint_folder, read_lightning_checkpoint
    from lightning_tp3d.strategies import TP3DFabricStrategy, TP3DStrategy
    from lightning_tp3d.strategies.features import last_remote_checkpoint
    from lightning_tp3d.strategies.grad_norm import grad_norm

    read_checkpoint_folders_with(is_checkpoint_folder, read_lightning_checkpoint)
    resolve_last_checkpoint_with(
        lambda trainer: last_remote_checkpoint(trainer) if isinstance(trainer.strategy, TP3DStrategy) else None)
    route_grad_norm_with(grad_norm)  # under TP3DStrategy whole-model norms, else Lightning's own code
    quiet_known_deprecations()  # a Lightning / torch mismatch, harmless: `_compat.lightning`
    if TP3DStrategy.strategy_name not in StrategyRegistry:
        TP3DStrategy.register_strategies(StrategyRegistry)
    if TP3DFabricStrategy.strategy_name not in FABRIC_STRATEGY_REGISTRY:
        TP3DFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)


def connect_when_lightning_is_imported() -> None:
    """Connect now if Lightning is imported, else as soon as it is (see the module docstring)."""
    if "lightning" in sys.modules:
        connect()
    else:
        ImportWatcher.install()


class ImportWatcher(importlib.abc.MetaPathFinder):
    """Finds `lightning` and the package's modules with the finders after it, and has their imports counted."""

    depth = 0  # the watched imports under way, nested

    @classmethod
    def install(cls) -> None:
        if not any(isinstance(finder, cls) for finder in sys.meta_path):
            sys.meta_path.insert(0, cls())

    @classmethod
    def remove(cls) -> None:
        sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, cls)]

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> ModuleSpec | None:
        if fullname != "lightning" and not fullname.startswith(f"{_PACKAGE}."):
            return None
        later = sys.meta_path[sys.meta_path.index(self) + 1:] if self in sys.meta_path else []
        for finder in later:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _CountingLoader(spec.loader)
                return spec
        return None


class _CountingLoader(importlib.abc.Loader):
    """Runs the module's own loader; at the end of the outermost watched import, connects if it can."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        ImportWatcher.depth += 1
        try:
            self.loader.exec_module(module)
        finally:
            ImportWatcher.depth -= 1
        if ImportWatcher.depth == 0 and "lightning" in sys.modules:
            connect()

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, resource readers: the module's loader's
        return getattr(self.loader, name)
