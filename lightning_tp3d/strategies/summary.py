"""The model summary of the whole model when each rank holds one pipeline stage.

Lightning's `ModelSummary` callback counts the parameters of the module it is given, and only rank 0
prints; under pipelining rank 0 holds the first stage, so the table would show a part of the model.
`WholeModelSummary` is Lightning's summary of each rank's modules, merged over the pp group: a row (a
module name at the summary's depth) present on several stages (the network's root, the blocks'
container) adds up its parameter counts and FLOPs, a row held by one stage keeps its values, and the
totals count each module and parameter once. Tensor-parallel and FSDP parameters are DTensors whose
`numel()` is already the whole tensor's, so they need no merging; stages are the only split.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities.model_summary import ModelSummary

from lightning_tp3d._compat.lightning import set_summary_layers, summary_flop_counts, summary_layers

__all__ = ["WholeModelSummary"]


class WholeModelSummary(ModelSummary):
    """`ModelSummary(model, max_depth)` with every pipeline stage's rows and totals (a collective over
    `pp_group`: every rank of the group builds it)."""

    def __init__(self, model: pl.LightningModule, max_depth: int, pp_group: dist.ProcessGroup) -> None:
        super().__init__(model, max_depth)
        flops = summary_flop_counts(self)
        local = {
            "rows": [(name, layer.layer_type, layer.num_parameters, layer.training, layer.in_size, layer.out_size,
                      sum(flops.get(f"{type(model).__name__}.{name}", {}).values()))
                     for name, layer in summary_layers(self).items()],
            "modules": {name: module.training for name, module in list(model.named_modules())[1:]},
            "parameters": super().total_parameters,
            "trainable": super().trainable_parameters,
            "flops": super().total_flops,
        }
        stages: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(stages, local, group=pp_group)
        rows: dict[str, list[Any]] = {}
        modules: dict[str, bool] = {}
        for stage in stages:
            for name, layer_type, parameters, training, in_size, out_size, flops in stage["rows"]:
                if name in rows:
                    rows[name][2] += parameters
                    rows[name][6] += flops
                else:
                    rows[name] = [name, layer_type, parameters, training, in_size, out_size, flops]
            modules.update(stage["modules"])
        self._rows = list(rows.values())
        set_summary_layers(self, list(rows))  # Lightning numbers the table's rows by these names
        self._modules = modules
        self._totals = {key: sum(stage[key] for stage in stages) for key in ("parameters", "trainable", "flops")}

    @property
    def layer_names(self) -> list[str]:
        return [row[0] for row in self._rows]

    @property
    def layer_types(self) -> list[str]:
        return [row[1] for row in self._rows]

    @property
    def param_nums(self) -> list[int]:
        return [row[2] for row in self._rows]

    @property
    def training_modes(self) -> list[bool]:
        return [row[3] for row in self._rows]

    @property
    def in_sizes(self) -> list:
        return [row[4] for row in self._rows]

    @property
    def out_sizes(self) -> list:
        return [row[5] for row in self._rows]

    @property
    def flop_counts(self) -> dict[str, dict[Any, int]]:
        return {row[0]: {"total": row[6]} for row in self._rows}

    @property
    def total_training_modes(self) -> dict[str, int]:
        modes = list(self._modules.values())
        return {"train": modes.count(True), "eval": modes.count(False)}

    @property
    def total_parameters(self) -> int:
        return self._totals["parameters"]

    @property
    def trainable_parameters(self) -> int:
        return self._totals["trainable"]

    @property
    def total_flops(self) -> int:
        return self._totals["flops"]
