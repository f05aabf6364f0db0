"""`import lightning_tp3d` is light, and the package is connected to Lightning whatever the import order.

Each case runs in a fresh interpreter (an import happens once per process): after the user's imports,
"tp3d" is in the Trainer's and Fabric's registries, `load_from_checkpoint` reads checkpoint folders
(`pl_load` wrapped), Lightning's own `grad_norm` is routed to the package's, and no module of the package
was imported twice or half.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_REPORT = """
import json, sys
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
import lightning.pytorch.core.saving as saving
import lightning.pytorch.utilities.grads as grads
print(json.dumps({"trainer": "tp3d" in StrategyRegistry, "fabric": "tp3d" in STRATEGY_REGISTRY,
                  "folders": hasattr(saving.pl_load, "__wrapped__"),
                  "grad_norm": grads.grad_norm.__code__.co_name == "_routed_grad_norm",
                  "watching": [type(one).__name__ for one in sys.meta_path if "Watcher" in type(one).__name__]}))
"""

IMPORT_ORDERS = {
    "package-then-lightning": "import lightning_tp3d\nimport lightning",
    "lightning-then-package": "import lightning\nimport lightning_tp3d",
    "a-module-that-imports-lightning": "from lightning_tp3d.models import CausalLMModule",
    "the-compat-module-first": "import lightning_tp3d._compat.lightning",
    "a-strategy-by-name": "from lightning_tp3d import TP3DStrategy",
    "fabric-alone": "import lightning_tp3d\nfrom lightning.fabric import Fabric",
}


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("order", list(IMPORT_ORDERS))
def test_the_package_connects_to_lightning_in_any_import_order(order):
    report = json.loads(_run(IMPORT_ORDERS[order] + _REPORT).splitlines()[-1])
    assert report == {"trainer": True, "fabric": True, "folders": True, "grad_norm": True, "watching": []}


def test_lightnings_grad_norm_imported_before_the_package_is_routed_and_unchanged_without_the_strategy():
    """A user's module imports Lightning's `grad_norm` before any strategy: that reference is routed too, and
    on a module no `TP3DStrategy` trains it gives what Lightning's code gives."""
    code = """
import json, torch
from lightning.pytorch.utilities import grad_norm
layer = torch.nn.Linear(3, 2)
layer(torch.arange(3.0).unsqueeze(0)).sum().backward()
before = {key: float(value) for key, value in grad_norm(layer, 2).items()}
import lightning_tp3d
after = {key: float(value) for key, value in grad_norm(layer, 2).items()}
print(json.dumps({"routed": grad_norm.__code__.co_name == "_routed_grad_norm", "before": before, "after": after}))
"""
    report = json.loads(_run(code).splitlines()[-1])
    assert report["routed"] and report["after"] == report["before"], report
    assert set(report["before"]) == {"grad_2.0_norm/weight", "grad_2.0_norm/bias", "grad_2.0_norm_total"}


def test_the_package_imports_neither_torch_nor_lightning():
    code = ("import sys, lightning_tp3d, lightning_tp3d.cli, lightning_tp3d.cli.plan\n"
            "print(sorted(name for name in ('torch', 'lightning', 'transformers') if name in sys.modules))")
    assert _run(code).strip() == "[]"
