"""Old module paths of 0.1 (before the package was arranged in layers), kept importable with a warning.

`import lightning_tp3d.strategy` (or a YAML `class_path: lightning_tp3d.monitor.TP3DThroughputMonitor`)
finds the module at its new path, `lightning_tp3d.strategies.trainer`, under the old name as well, and
warns once with the new path. The aliases will be removed in 0.3.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED_MODULES", "install_moved_module_finder"]

MOVED_MODULES: dict[str, str] = {
    "lightning_tp3d.layout": "lightning_tp3d.plan.layout",
    "lightning_tp3d.config": "lightning_tp3d.plan.config",
    "lightning_tp3d.ledger": "lightning_tp3d.plan.ledger",
    "lightning_tp3d.units": "lightning_tp3d.plan.units",
    "lightning_tp3d.mesh": "lightning_tp3d.parallel.mesh",
    "lightning_tp3d.collectives": "lightning_tp3d.parallel.collectives",
    "lightning_tp3d.timing": "lightning_tp3d.parallel.timing",
    "lightning_tp3d.core": "lightning_tp3d.strategies.core",
    "lightning_tp3d.strategy": "lightning_tp3d.strategies.trainer",
    "lightning_tp3d.fabric": "lightning_tp3d.strategies.fabric",
    "lightning_tp3d.precision": "lightning_tp3d.strategies.precision",
    "lightning_tp3d.checkpoint": "lightning_tp3d.io.checkpoint",
    "lightning_tp3d.folders": "lightning_tp3d.io.folders",
    "lightning_tp3d.random_state": "lightning_tp3d.io.random_state",
    "lightning_tp3d.export": "lightning_tp3d.io.export",
    "lightning_tp3d.doctor": "lightning_tp3d.diagnostics.doctor",
    "lightning_tp3d.consistency": "lightning_tp3d.diagnostics.consistency",
    "lightning_tp3d.monitor": "lightning_tp3d.callbacks.monitor",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old module name to the module object at its new path (one object, two names)."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new_name = MOVED_MODULES[spec.name]
        warnings.warn(f"{spec.name} moved to {new_name}; import it from there ({spec.name} goes in 0.3).",
                      FutureWarning, stacklevel=2)
        module = importlib.import_module(new_name)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._own_spec  # the import system set the alias's spec; the module keeps its own


def install_moved_module_finder() -> None:
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
