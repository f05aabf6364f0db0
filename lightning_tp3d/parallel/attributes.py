"""Dotted attribute paths inside a network (`"model.layers"`, `"self_attn.core_attention"`): the one walker
the strategies, the pipeline split and recompute use; and `"package.module:name"` import paths of options."""

from __future__ import annotations

from importlib import import_module
from typing import Any

from torch import nn

__all__ = ["find_attribute", "import_object", "indexed_blocks", "resolve_attribute", "set_attribute"]


def find_attribute(root: Any, path: str) -> Any | None:
    """`root.a.b` for `path="a.b"` (the empty path is `root`), None where a part is missing."""
    value = root
    for part in filter(None, path.split(".")):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def resolve_attribute(root: nn.Module, path: str, what: str) -> Any:
    """`root.a.b` for `path="a.b"`, with an error naming the strategy option `what` to set."""
    value: Any = root
    for part in filter(None, path.split(".")):
        if not hasattr(value, part):
            raise AttributeError(
                f"{type(root).__name__} has no {what} at {path!r} (no attribute {part!r} on"
                f" {type(value).__name__}); build it in `configure_model` or pass TP3DStrategy({what}=...)."
            )
        value = getattr(value, part)
    return value


def set_attribute(root: nn.Module, path: str, value: Any) -> None:
    """`root.a.b = value` for `path="a.b"`."""
    parent_path, _, name = path.rpartition(".")
    setattr(find_attribute(root, parent_path) if parent_path else root, name, value)


def indexed_blocks(layers: nn.ModuleDict | nn.ModuleList) -> dict[int, nn.Module]:
    """Global layer index -> block, for blocks in a ModuleList or in a ModuleDict keyed by global index
    (a pruned pipeline stage keeps only its own keys)."""
    if isinstance(layers, nn.ModuleDict):
        return {int(key) if key.isdigit() else position: block
                for position, (key, block) in enumerate(layers.items())}
    return dict(enumerate(layers))


def import_object(path: str, option: str) -> Any:
    """The object at `"package.module:name"` (an option given by name, e.g. in a YAML file)."""
    module_name, _, attribute = path.partition(":")
    if not attribute:
        raise ValueError(f"{option}={path!r} must look like 'package.module:name'.")
    return getattr(import_module(module_name), attribute)
