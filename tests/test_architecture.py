"""The package's layers: what each folder may import, module sizes, one set of strategy options, old paths."""

import ast
import dataclasses
import importlib
import inspect
import sys
from pathlib import Path

import pytest

import lightning_tp3d
from lightning_tp3d import TP3DFabricStrategy, TP3DStrategy
from lightning_tp3d._moved import MOVED_MODULES
from lightning_tp3d.strategies.options import ParallelOptions

PACKAGE = Path(lightning_tp3d.__file__).parent
# Each layer may import itself and the layers listed (data flows one way: plan -> parallel -> ... -> cli).
# `_compat` (the private names of torch and Lightning) sits under every layer but the torch-free `plan`.
ALLOWED = {
    "_compat": {"_compat"},
    "plan": {"plan"},
    "parallel": {"_compat", "plan", "parallel"},
    "data": {"_compat", "data"},
    "models": {"_compat", "plan", "parallel", "models"},
    "io": {"_compat", "plan", "parallel", "io"},
    "diagnostics": {"_compat", "plan", "parallel", "models", "io", "diagnostics"},
    "strategies": {"_compat", "plan", "parallel", "data", "models", "io", "diagnostics", "strategies"},
    "callbacks": {"_compat", "plan", "parallel", "data", "models", "io", "diagnostics", "strategies", "callbacks"},
}
MAX_MODULE_LINES = 400


def _imports(file: Path) -> list[str]:
    modules = []
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
    return modules


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_the_layers_below(layer: str) -> None:
    for file in sorted((PACKAGE / layer).rglob("*.py")):
        for module in _imports(file):
            parts = module.split(".")
            if parts[0] == "lightning_tp3d" and len(parts) > 1 and parts[1] in ALLOWED:
                assert parts[1] in ALLOWED[layer], f"{file.relative_to(PACKAGE)} imports {module}"
            if layer == "plan":  # pure arithmetic: runs before anything is launched, on any machine
                assert not module.startswith(("torch", "lightning.")), f"{file.relative_to(PACKAGE)} imports {module}"


def test_every_folder_is_a_known_layer_and_no_module_is_long() -> None:
    folders = {path.parent.relative_to(PACKAGE).parts[0] for path in PACKAGE.rglob("*.py")
               if path.parent != PACKAGE}
    assert folders == set(ALLOWED)
    for file in PACKAGE.rglob("*.py"):
        assert len(file.read_text().splitlines()) <= MAX_MODULE_LINES, file


@pytest.mark.parametrize("strategy", [TP3DStrategy, TP3DFabricStrategy])
def test_strategy_signatures_carry_every_option_with_its_default(strategy: type) -> None:
    parameters = inspect.signature(strategy).parameters
    for field in dataclasses.fields(ParallelOptions):
        assert field.name in parameters, f"{strategy.__name__} lacks {field.name}"
        default = parameters[field.name].default
        assert default == field.default, f"{strategy.__name__}.{field.name}: {default!r} != {field.default!r}"
    adapter_only = set(parameters) - {field.name for field in dataclasses.fields(ParallelOptions)}
    assert adapter_only <= {"model_attribute", "async_checkpoint", "process_group_backend", "timeout"}


def test_options_are_handed_over_whole_and_normalised() -> None:
    strategy = TP3DStrategy(tensor_parallel_size=2, pipeline_parallel_size=2, layers_per_stage=[1, 1],
                            recompute="full", pipeline_first_modules=["model.embed_tokens"])
    options = strategy.core.options
    assert (options.tensor_parallel_size, options.pipeline_parallel_size, options.num_microbatches) == (2, 2, 2)
    assert options.layers_per_stage == (1, 1) and options.pipeline_first_modules == ("model.embed_tokens",)
    assert options.recompute == "full"
    with pytest.raises(TypeError, match=r"no value for \['preflight'\]"):
        ParallelOptions.from_arguments({field.name: field.default for field in dataclasses.fields(ParallelOptions)
                                        if field.name != "preflight"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.recompute = "none"


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_old_module_paths_import_the_moved_module_with_a_warning(old: str) -> None:
    new = importlib.import_module(MOVED_MODULES[old])
    sys.modules.pop(old, None)
    with pytest.warns(FutureWarning, match=f"{old} moved to {MOVED_MODULES[old]}"):
        module = importlib.import_module(old)
    assert module is new and module.__spec__.name == MOVED_MODULES[old]
    assert all(hasattr(module, name) for name in new.__all__)
