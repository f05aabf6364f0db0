"""`import lightning_tp3d` is light, and the package is connected to Lightning whatever the import order.

Each case runs in a fresh interpreter (an import happens once per process): after the user's imports,
"tp3d" is in the Trainer's and Fabric's registries, `load_from_checkpoint` reads checkpoint folders
(`pl_load` wrapped), and no module of the package was imported twice or half.
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
print(json.dumps({"trainer": "tp3d" in StrategyRegistry, "fabric": "tp3d" in STRATEGY_REGISTRY,
                  "folders": hasattr(saving.pl_load, "__wrapped__"),
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
    assert report == {"trainer": True, "fabric": True, "folders": True, "watching": []}


def test_the_package_imports_neither_torch_nor_lightning():
    code = ("import sys, lightning_tp3d, lightning_tp3d.cli, lightning_tp3d.cli.plan\n"
            "print(sorted(name for name in ('torch', 'lightning', 'transformers') if name in sys.modules))")
    assert _run(code).strip() == "[]"
