"""The package's layers: what each folder may import, module sizes, one set of strategy options, one import path
per name, private names of the libraries only in `_compat`, the data-parallel mode decided in one place."""

import ast
import dataclasses
import inspect
import re
import typing
from pathlib import Path

import pytest

import lightning_tp3d
from lightning_tp3d import TP3DFabricStrategy, TP3DStrategy
from lightning_tp3d.plan.data_parallel import DATA_PARALLEL_MODES
from lightning_tp3d.strategies.core import ParallelCore
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
    "cli": {"_compat", "plan", "parallel", "data", "models", "io", "diagnostics", "strategies", "callbacks", "cli"},
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
def test_strategy_signatures_and_docstrings_are_read_from_the_one_declaration(strategy: type) -> None:
    parameters = inspect.signature(strategy).parameters
    hints = typing.get_type_hints(ParallelOptions)
    for field in dataclasses.fields(ParallelOptions):
        assert field.name in parameters, f"{strategy.__name__} lacks {field.name}"
        parameter = parameters[field.name]
        assert parameter.default == field.default, f"{strategy.__name__}.{field.name}: {parameter.default!r}"
        assert parameter.annotation == hints[field.name] and parameter.kind is inspect.Parameter.KEYWORD_ONLY
        assert f"    {field.name}: {field.metadata['help'][:40]}" in strategy.__doc__
    adapter_only = set(parameters) - {field.name for field in dataclasses.fields(ParallelOptions)}
    # the Trainer strategy's own: its loop (accumulation), its checkpoint writer, its process groups
    assert adapter_only <= {"model_attribute", "async_checkpoint", "process_group_backend", "timeout",
                            "global_batch_size"}
    for name in adapter_only:
        assert f"    {name}: " in strategy.__doc__


def test_options_are_handed_over_whole_and_normalised() -> None:
    strategy = TP3DStrategy(tensor_parallel_size=2, pipeline_parallel_size=2, layers_per_stage=[1, 1],
                            recompute="full", pipeline_first_modules=["model.embed_tokens"])
    options = strategy.core.options
    assert (options.tensor_parallel_size, options.pipeline_parallel_size, options.num_microbatches) == (2, 2, 2)
    assert options.layers_per_stage == (1, 1) and options.pipeline_first_modules == ("model.embed_tokens",)
    assert options.recompute == "full"
    with pytest.raises(TypeError, match=r"TP3DStrategy got an unknown option 'tensor_paralel_size'; did you mean"
                                        r" 'tensor_parallel_size'\?"):
        TP3DStrategy(tensor_paralel_size=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.recompute = "none"


MAX_CORE_LINES = 194  # `ParallelCore`: the wiring of layout, mesh, parallelize, the step, checkpoints, release
LIBRARIES = ("torch", "lightning", "transformers", "peft", "torchao")
# The standard library's underscored names that its reference documents: argparse types its sub-parsers
# with a private class; `sys._current_frames` is the documented way to read another thread's stack.
DOCUMENTED_STDLIB_NAMES = {"argparse._SubParsersAction", "sys._current_frames"}
# Subclasses of a library class that read the state its private hooks keep, named with the reason.
SUBCLASSES_OF_PRIVATE_STATE = {
    "callbacks/monitor.py": "TP3DThroughputMonitor overrides ThroughputMonitor's `_update` / `_compute` and reads"
                            " the windows they keep (`_throughputs`, `_t0s`, `_lengths`, `_samples`, `_batches`)",
}


def _modules(root: Path) -> dict[Path, ast.Module]:
    return {file: ast.parse(file.read_text()) for file in sorted(root.rglob("*.py"))}


def _own_private_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Every `_name` the package defines: functions, classes, attributes and variables it assigns."""
    names = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                names.add(str(node.slice.value))  # `self.__dict__["_name"] = ...`
    return names


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _library_names(tree: ast.Module) -> set[str]:
    """Names a module binds to a library's modules or objects (`import torch`, `from torch import nn`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names
                      if alias.name.split(".")[0] in LIBRARIES}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def test_private_names_of_the_libraries_are_used_only_in_compat() -> None:
    """An attribute `_name` is a library's when it is read off a name bound to the library (`torch._C`,
    `dist._x`), whatever the package assigns itself; otherwise when the package assigns no `_name`."""
    trees = _modules(PACKAGE)
    own = _own_private_names(trees)
    found = []
    for file, tree in trees.items():
        relative = file.relative_to(PACKAGE).as_posix()
        if relative.startswith("_compat/"):
            continue
        library_names = _library_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
                private = [part for part in node.module.split(".") if _is_private(part)]
                private += [alias.name for alias in node.names if _is_private(alias.name)]
                found += [f"{relative}:{node.lineno} from {node.module} import {name}" for name in private]
            elif isinstance(node, ast.Import):
                found += [f"{relative}:{node.lineno} import {alias.name}" for alias in node.names
                          if alias.name.split(".")[0] in LIBRARIES and any(map(_is_private, alias.name.split(".")))]
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr")
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str) and _is_private(node.args[1].value)
                  and node.args[1].value not in own):
                found.append(f"{relative}:{node.lineno} {ast.unparse(node)}")
            elif (isinstance(node, ast.Attribute) and _is_private(node.attr)
                  and (node.attr not in own or _root_name(node) in library_names)):
                if relative in SUBCLASSES_OF_PRIVATE_STATE or ast.unparse(node) in DOCUMENTED_STDLIB_NAMES:
                    continue
                found.append(f"{relative}:{node.lineno} {ast.unparse(node)}")
    assert not found, "private names of torch / Lightning outside lightning_tp3d._compat:\n" + "\n".join(found)


def test_no_data_parallel_mode_is_compared_outside_its_chooser() -> None:
    """`plan.data_parallel.choose_data_parallel` turns the mode into a plan; everything else reads the plan."""
    for file, tree in _modules(PACKAGE).items():
        if file == PACKAGE / "plan" / "data_parallel.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                constants = [operand.value for operand in [node.left, *node.comparators]
                             if isinstance(operand, ast.Constant)]
                compared = [value for value in constants if value in DATA_PARALLEL_MODES]
                assert not compared, f"{file.relative_to(PACKAGE)}:{node.lineno} compares with {compared}"


def test_parallel_core_is_the_wiring_only() -> None:
    source, _ = inspect.getsourcelines(ParallelCore)
    assert len(source) <= MAX_CORE_LINES, f"ParallelCore has {len(source)} lines (at most {MAX_CORE_LINES})"


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)}
    return names


def _module_file(module: str) -> Path:
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def test_every_name_is_imported_from_the_module_that_defines_it() -> None:
    """One import path per name: a module's `__all__` lists what it defines; a package's `__init__` may
    gather names of its own modules (and the top-level package the public API); `_compat` gives the
    libraries' private names public ones. Checked for every import of the package, its tests, benchmarks,
    examples and the Python blocks of the README and docs."""
    for file, tree in _modules(PACKAGE).items():
        exported = next((ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                         and any(getattr(target, "id", None) == "__all__" for target in node.targets)), [])
        package = ".".join(file.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        imported = {alias.asname or alias.name: node.module for node in tree.body
                    if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
        for name in exported:
            source = imported.get(name)
            if source is None or "._compat" in package or package == "lightning_tp3d":
                continue
            assert file.name == "__init__.py" and source.startswith(package + "."), (
                f"{package} re-exports {name} from {source}")
    trees = {}
    for root in (PACKAGE, PACKAGE.parent / "tests", PACKAGE.parent / "benchmarks", PACKAGE.parent / "examples"):
        trees.update(_modules(root))
    for page in [PACKAGE.parent / "README.md", *sorted((PACKAGE.parent / "docs").glob("*.md"))]:
        for index, block in enumerate(re.findall(r"^```python\n(.*?)^```", page.read_text(), re.M | re.S)):
            trees[page.with_name(f"{page.name} block {index}")] = ast.parse(block)
    for file, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_tp3d")):
                continue
            target = _module_file(node.module)
            if target.name == "__init__.py" or "_compat" in target.parts:
                continue
            defined = _top_level_names(ast.parse(target.read_text()))
            for alias in node.names:
                assert alias.name in defined or _module_file(f"{node.module}.{alias.name}").exists(), (
                    f"{file}:{node.lineno} imports {alias.name} from {node.module}, which does not define it")


# Every place the package replaces a function or method of an object it did not create, with the reason no
# hook serves. Keys: (module, what is replaced). The test below finds them all; a new one needs a reason here.
RUNTIME_PATCHES = {
    ("_compat/torch.py", "schedules._wait_batch_p2p"): "torch's schedules wait for their point-to-point work"
        " through this module function and report no time; timed inside one step, restored after it",
    ("strategies/precision.py", "plugin.clip_grad_by_norm"): "Lightning clips through the precision plugin, which"
        " sees only local gradients; no strategy hook sits between the module's clip request and the clip",
    ("strategies/precision.py", "plugin.clip_grad_by_value"): "as clip_grad_by_norm: the dp reduction must come"
        " first under manual optimization",
    ("strategies/non_finite.py", "module.lr_scheduler_step"): "Lightning steps step-interval LR schedulers after"
        " every optimizer step, skipped or not; the module's own hook is wrapped on the instance and restored",
    ("parallel/pipeline/forward.py", "network.forward"): "the LightningModule calls `self.model(...)` unchanged;"
        " under pipelining that call must run the schedule, and a forward hook cannot skip the forward",
    ("parallel/recompute.py", "block.forward"): "checkpoint the block's forward in place: torch's"
        " checkpoint_wrapper adds `_checkpoint_wrapped_module` to every parameter name",
    ("parallel/recompute.py", "target.forward"): "as block.forward, for the selective target module",
    ("parallel/compile.py", "block.forward"): "compile the block's forward in place: torch.compile(block) adds"
        " `_orig_mod` to every parameter name, and block.compile() would pull FSDP2's hooks into the graph",
    ("parallel/recompute.py", "setattr(owner)"): "as block.forward, for a selective target that is a method",
    ("parallel/pipeline/runner.py", "setattr(stage)"): "torch's PipelineStage has no hook around its chunk"
        " computations; the timing of compute against idle needs one",
    ("diagnostics/traffic.py", "setattr(c10d)"): "gloo's flight recorder records no point-to-point sends; the"
        " traffic recorder counts them while it records, and restores the functions",
    ("diagnostics/traffic.py", "setattr(dist)"): "as setattr(c10d), for the names torch.distributed exports",
    ("parallel/labels.py", "setattr(c10d)"): "the step profiler needs each collective's mesh group on the"
        " timeline, and torch's profiler records no group; restored when the profile ends",
    ("parallel/labels.py", "setattr(dist)"): "as setattr(c10d), for the names torch.distributed exports",
    ("parallel/labels.py", "setattr(functional_collectives)"): "as setattr(c10d), for DTensor's functional"
        " collectives and the wait for their results",
    ("_compat/lightning.py", "callback._summary"): "see the `_compat.lightning` docstring: ModelSummary",
    ("_compat/lightning.py", "_saving.pl_load"): "see the `_compat.lightning` docstring: load_from_checkpoint",
    ("_compat/lightning.py", "BaseFinetuning.filter_on_optimizer"): "see the `_compat.lightning` docstring",
    ("_compat/lightning.py", "_CheckpointConnector._parse_ckpt_path"): "see the `_compat.lightning` docstring:"
        ' ckpt_path="last" on remote storage',
}


def _runtime_patches(file: Path, tree: ast.Module) -> set[tuple[str, str]]:
    """Assignments of a function to an attribute of another object: `x.name = f`, `setattr(x, name, f)`,
    where f is a function of this file, `types.MethodType(...)`, `staticmethod(...)`, a call of a wrapper of
    this file (a function defining a function), or a variable holding one of those."""
    definitions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    functions = {node.name for node in definitions}
    wrappers = {node.name for node in definitions if any(isinstance(inner, (ast.FunctionDef, ast.Lambda))
                                                         for inner in ast.walk(node) if inner is not node)}

    def makes_function(value: ast.expr) -> bool:
        if isinstance(value, ast.Name):
            return value.id in functions or value.id in wrapped_names
        if isinstance(value, ast.Call):
            called = value.func.attr if isinstance(value.func, ast.Attribute) else getattr(value.func, "id", "")
            return called in {"MethodType", "staticmethod"} or called in wrappers
        return False

    wrapped_names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and makes_function(node.value):
            wrapped_names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
    relative = str(file.relative_to(PACKAGE))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and makes_function(node.value):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and getattr(target.value, "id", None) not in ("self", "cls"):
                    found.add((relative, ast.unparse(target)))
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) == 3
              and makes_function(node.args[2]) and getattr(node.args[0], "id", None) not in ("self", "cls")):
            found.add((relative, f"setattr({ast.unparse(node.args[0])})"))
    return found


def test_run_time_patches_are_the_listed_ones_each_with_its_reason() -> None:
    found = set().union(*(_runtime_patches(file, tree) for file, tree in _modules(PACKAGE).items()))
    assert found == set(RUNTIME_PATCHES), (sorted(found - set(RUNTIME_PATCHES)), sorted(set(RUNTIME_PATCHES) - found))
