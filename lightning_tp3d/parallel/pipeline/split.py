"""Splitting one network into this rank's pipeline stages, in place.

A rank keeps one network holding only what its stages own: the blocks of its layer ranges (still keyed
by global index, so parameter names do not change), the first-stage modules (embedding) if it runs
stage 0 and the last-stage modules (final norm, head) if it runs the last stage. Each stage is a
`StageModule`, a view that applies `first modules -> blocks -> last modules` in order to the same
module objects (nothing is copied), which `PipelineStage` wraps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_tp3d.parallel.attributes import resolve_attribute, set_attribute
from lightning_tp3d.plan.schedules import PipelinePlan

__all__ = ["StageModule", "prune_to_stages", "split_network"]


def prune_to_stages(
    network: nn.Module, plan: PipelinePlan, layers: nn.ModuleDict, first_modules: Sequence[str],
    last_modules: Sequence[str],
) -> None:
    """Delete from `network` every block, first- and last-stage module that this rank's stages do not run."""
    owned = {str(index) for layer_range in plan.layer_ranges for index in layer_range}
    for key in list(layers.keys()):
        if key not in owned:
            del layers[key]
    if 0 not in plan.stage_indices:
        for path in first_modules:
            set_attribute(network, path, None)
    if plan.num_stages - 1 not in plan.stage_indices:
        for path in last_modules:
            set_attribute(network, path, None)


class StageModule(nn.Module):
    """One pipeline stage: x -> first modules -> blocks -> last modules, over shared module objects."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in self.parts:
            x = part(x)
        return x


def split_network(network: nn.Module, plan: PipelinePlan, layers_attribute: str, first_modules: Sequence[str],
                  last_modules: Sequence[str]) -> list[tuple[list[nn.Module], dict[int, nn.Module], list[nn.Module]]]:
    """Prune `network` to this rank's stages; return each stage's (first modules, blocks by global index,
    last modules), in `plan` order. Blocks held in an `nn.ModuleList` are first moved into an
    `nn.ModuleDict` keyed by global index (same parameter names), so pruning keeps every name."""
    layers = resolve_attribute(network, layers_attribute, "layers_attribute")
    if isinstance(layers, nn.ModuleList):
        layers = nn.ModuleDict({str(index): block for index, block in enumerate(layers)})
        set_attribute(network, layers_attribute, layers)
    if not isinstance(layers, nn.ModuleDict):
        raise TypeError(
            f"pipeline parallelism needs the blocks in an nn.ModuleList or an nn.ModuleDict keyed by global layer"
            f" index, but {layers_attribute} is a {type(layers).__name__}; see docs/concepts.md."
        )
    first = [resolve_attribute(network, path, "pipeline_first_modules entry") for path in first_modules]
    last = [resolve_attribute(network, path, "pipeline_last_modules entry") for path in last_modules]
    prune_to_stages(network, plan, layers, first_modules, last_modules)
    return [(first if index == 0 else [], {layer: layers[str(layer)] for layer in layer_range},
             last if index == plan.num_stages - 1 else [])
            for index, layer_range in zip(plan.stage_indices, plan.layer_ranges)]
