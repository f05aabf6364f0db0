"""What the activation census scripts share: the tensors autograd saves during a forward, once per storage,
grouped by shape and dtype, and the report (printed lines and the JSON)."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["by_shape", "saved_storages", "write_census"]


def saved_storages(module: nn.Module, forward: Callable[[], Any]) -> list[dict[str, Any]]:
    """Every storage autograd saves while `forward()` runs, `module`'s parameters apart: the first view's shape
    and dtype, the storage's bytes and elements."""
    parameters = {parameter.untyped_storage().data_ptr() for parameter in module.parameters()}
    seen: dict[int, dict[str, Any]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen and storage.data_ptr() not in parameters:
            seen[storage.data_ptr()] = {
                "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                "bytes": storage.nbytes(), "elements": storage.nbytes() // tensor.element_size()}
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return list(seen.values())


def by_shape(tensors: list[dict[str, Any]]) -> dict[str, list[int]]:
    """"shape dtype" -> [tensors, bytes], largest first."""
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for tensor in tensors:
        entry = groups[f"{tuple(tensor['shape'])} {tensor['dtype']}"]
        entry[0] += 1
        entry[1] += tensor["bytes"]
    return dict(sorted(groups.items(), key=lambda item: -item[1][1]))


def write_census(result: dict[str, Any], headline: str, path: str) -> None:
    """Print `headline` and the result's "by_shape" rows; write the result as JSON to `path`."""
    print(headline)
    for name, (count, size) in result["by_shape"].items():
        print(f"  {count:3d} x {name:40s} {size / 1e6:9.2f} MB")
    Path(path).write_text(json.dumps(result, indent=2))
