"""`parallelize_network`: one network made parallel over the ("pp", "dp", "tp") mesh, in torchtitan's order.

    1. pipeline split      this rank's stages of the network (`parallel.pipeline.split`)
       float8              the blocks' linear layers as torchao's Float8Linear (`parallel.float8`), whose
                           weights the next steps shard like any linear layer's
    2. tensor parallel     DTensor weights over tp (`parallel.tensor`)
       expert parallel     the routed experts split over the expert mesh's "ep" (`parallel.experts`)
    3. recompute           activation checkpointing per block (`parallel.recompute`)
    4. compile             each block's forward through `torch.compile` (`parallel.compile`)
       router loss         a mixture of experts' balancing loss over the whole batch at dp > 1
                           (`models.router_loss`)
    5. data parallel       `DataParallel.wrap`: FSDP2 units around the recomputed blocks (it must wrap
                           parameters that are already DTensors, and its units must contain the
                           recomputed code, so the recompute runs on unsharded parameters)
    6. pipelined forward   `network(input_ids, labels=...)` runs the schedule (`parallel.pipeline.forward`)
    7. materialise         a network built on the meta device gets this rank's shard only, initialised
                           from its seed and global names (`parallel.materialize`)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp3d.models.adapter import ModelAdapter
from lightning_tp3d.models.lora import check_peft_construction
from lightning_tp3d.models.router_loss import GlobalRouterLoss, adds_router_loss, check_router_loss
from lightning_tp3d.parallel.attributes import indexed_blocks, resolve_attribute
from lightning_tp3d.parallel.compile import compile_blocks, warn_of_training_cache
from lightning_tp3d.parallel.data_parallel import DataParallel
from lightning_tp3d.parallel.experts import shard_experts
from lightning_tp3d.parallel.float8 import check_float8_device, convert_blocks_to_float8
from lightning_tp3d.parallel.materialize import materialize_network
from lightning_tp3d.parallel.nf4 import check_quantized_base
from lightning_tp3d.parallel.pipeline import (
    GradientHandOver,
    PipelineRunner,
    PipelineStages,
    install_pipelined_forward,
    split_network,
)
from lightning_tp3d.parallel.recompute import recompute_network_layers
from lightning_tp3d.parallel.tensor import apply_tensor_parallel, check_plan_matches, plan_entries_present
from lightning_tp3d.plan.layout import LayoutError, ParallelLayout
from lightning_tp3d.plan.schedules import PipelinePlan, plan_pipeline
from lightning_tp3d.strategies.options import ParallelOptions

__all__ = ["ParallelNetwork", "parallelize_network"]

ParallelNetwork = tuple[PipelineRunner | None, GradientHandOver | None]


def parallelize_network(network: nn.Module, config: Any | None, layout: ParallelLayout, mesh: DeviceMesh,
                        options: ParallelOptions, adapter: ModelAdapter, data_parallel: DataParallel,
                        loss_scale: Callable[[], torch.Tensor | float], device: torch.device,
                        expert_mesh: DeviceMesh | None = None) -> ParallelNetwork:
    """Make `network` parallel in place, in the module docstring's order, where its family's `adapter`
    says its parts are (`models.adapter`); `config` (its shape, if known) is checked against the layout.
    `loss_scale()` is what the pipeline schedule multiplies the loss by before its backward (fp16 scale /
    accumulation); `expert_mesh`: the ("edp", "ep") mesh when `layout.expert_parallel_size` > 1. Returns the
    pipeline runner and the gradient hand-over (None, None without pipelining)."""
    check_quantized_base(network, layout, sharded_over_dp=data_parallel.plan.parameter_shards > 1)
    check_peft_construction(network, options.pretrained)
    adapter.check_features(recompute=options.recompute, compiled=options.compile is not None, float8=options.float8)
    if layout.expert_parallel_size > 1:
        _check_experts(network, adapter, layout)
    check_router_loss(network, layout)
    tp_plan = adapter.tp_plan()
    if layout.tensor_parallel_size > 1:
        check_plan_matches(network, tp_plan, adapter.name)
    stage_modules: list[nn.Module] = []
    pipeline_plan = None
    stages = adapter.pipeline_stages()
    if layout.pipeline_parallel_size > 1:
        pipeline_plan, stage_modules = _split_pipeline(network, config, layout, mesh, options, adapter, stages)
    elif config is not None:
        layout.validate_model(config)
    layers = _layers(network, adapter)  # this rank's blocks once split
    if options.float8 is not None:
        check_float8_device(options.float8, device)
        convert_blocks_to_float8(indexed_blocks(layers).values(), options.float8)
    if layout.tensor_parallel_size > 1:
        apply_tensor_parallel(network, mesh["tp"], plan_entries_present(network, tp_plan))
    if layout.expert_parallel_size > 1:
        shard_experts(adapter.routed_experts(indexed_blocks(layers).values()), expert_mesh)
    if options.recompute != "none":
        stage_layers = pipeline_plan.layer_ranges if pipeline_plan is not None else [sorted(indexed_blocks(layers))]
        recompute_network_layers(layers, stage_layers, options.recompute, options.recompute_method,
                                 options.recompute_num_layers, options.recompute_target)
    if options.compile is not None:
        if pipeline_plan is None:
            warn_of_training_cache(config)
        compile_blocks(indexed_blocks(layers).values(), options.compile)
    if layout.data_parallel_size > 1 and adds_router_loss(network):  # the whole batch's balancing loss
        GlobalRouterLoss(mesh["dp"].get_group(), layout.data_parallel_size).install(network)
    data_parallel.wrap(stage_modules or [network], indexed_blocks(layers).values())
    pipeline, handover = None, None
    if pipeline_plan is not None:
        loss_fn = adapter.loss_function(network)
        pipeline = PipelineRunner(stage_modules, pipeline_plan, layout.num_microbatches, loss_fn,
                                  mesh["pp"].get_group(), device)
        handover = install_pipelined_forward(network, pipeline, loss_scale, stages)
    materialize_network(network, device)
    return pipeline, handover


def _check_experts(network: nn.Module, adapter: ModelAdapter, layout: ParallelLayout) -> None:
    """Expert parallelism needs routed experts somewhere in the whole network (read before the split)."""
    if not adapter.routed_experts(indexed_blocks(_layers(network, adapter)).values()):
        raise LayoutError(
            f"expert_parallel_size={layout.expert_parallel_size} needs a mixture-of-experts model, but the"
            f" {adapter.name} network has no routed experts its model adapter knows of; use expert_parallel_size=1."
        )


def _layers(network: nn.Module, adapter: ModelAdapter) -> nn.ModuleDict | nn.ModuleList:
    return resolve_attribute(network, adapter.layers_attribute, "layers_attribute")


def _split_pipeline(network: nn.Module, config: Any | None, layout: ParallelLayout, mesh: DeviceMesh,
                    options: ParallelOptions, adapter: ModelAdapter, stages: PipelineStages
                    ) -> tuple[PipelinePlan, list[nn.Module]]:
    if config is not None and getattr(config, "tie_word_embeddings", False):
        raise LayoutError(
            "tie_word_embeddings=True with pipeline_parallel_size > 1 is not supported: the embedding and the"
            " head live on different stages; untie them or use pipeline_parallel_size=1."
        )
    num_layers = len(_layers(network, adapter))
    plan = plan_pipeline(
        options.pipeline_schedule, layout.pipeline_parallel_size, mesh.get_local_rank("pp"),
        layout.num_microbatches, options.stages_per_rank,
        lambda stages_total: layout.stage_layer_ranges(num_layers, stages_total),
    )
    if config is not None:
        layout.validate_model(config, plan.num_stages)
    pieces = split_network(network, plan, adapter.layers_attribute, adapter.first_modules, adapter.last_modules)
    return plan, [stages.stage_module(network, first, blocks, last) for first, blocks, last in pieces]
