"""The one core behind the Trainer and Fabric strategies: layout -> mesh -> parallelize(network) -> step.

`ParallelCore` wires the parts that do not depend on who drives the loop, in this order: the
`ParallelLayout` for the launched world and the data-parallel plan it implies (`plan.data_parallel`),
the ("pp", "dp", "tp") mesh and the `DataParallel` built on it, the parallelisation of a network
(`strategies.parallelize`), the step (gradient hand-over, the data-parallel steps, clipping) and the
checkpoint states (`strategies.checkpointing`). `TP3DStrategy` (Trainer) and `TP3DFabricStrategy` (Fabric)
adapt the core to their hooks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp3d.data.sampler import SamplePosition
from lightning_tp3d.diagnostics.doctor import DoctorReport, run_doctor
from lightning_tp3d.io.checkpoint import PendingSave, save_checkpoint
from lightning_tp3d.io.checkpoint_format import CheckpointMeta
from lightning_tp3d.io.hf import load_hf_weights
from lightning_tp3d.models.adapter import ModelAdapter
from lightning_tp3d.parallel.data_parallel import DataParallel, build_data_parallel
from lightning_tp3d.parallel.grad_norm import clip_grad_norm_
from lightning_tp3d.parallel.labels import DP_PHASE, label
from lightning_tp3d.parallel.mesh import build_device_mesh, build_expert_mesh, mesh_device
from lightning_tp3d.parallel.nf4 import quantized_parameters
from lightning_tp3d.parallel.pipeline import GradientHandOver, PipelineRunner
from lightning_tp3d.plan.data_parallel import DataParallelPlan, choose_data_parallel
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.strategies.checkpointing import (
    frozen_weights_fingerprint,
    load_states,
    optimizer_state,
    restore_random_states,
    sharded_state,
    without_frozen,
)
from lightning_tp3d.strategies.options import ParallelOptions
from lightning_tp3d.strategies.parallelize import parallelize_network

__all__ = ["ParallelCore"]


class ParallelCore:
    """Layout, mesh and the parallel network of one run, from validated `ParallelOptions` (given as the
    object, or as its keyword arguments: `ParallelCore(tensor_parallel_size=2)`)."""

    def __init__(self, options: ParallelOptions | None = None, **option_values: Any) -> None:
        if options is not None and option_values:
            raise TypeError("ParallelCore takes a ParallelOptions or its keyword arguments, not both.")
        options = options if options is not None else ParallelOptions(**option_values)
        self.options = options
        self.preflight_report: DoctorReport | None = None
        self.pipeline: PipelineRunner | None = None
        self.sample_position = SamplePosition()
        self.last_clip_norm: torch.Tensor | None = None
        self._layout: ParallelLayout | None = None
        self._mesh: DeviceMesh | None = None
        self._expert_mesh: DeviceMesh | None = None  # ("edp", "ep"), with expert parallelism only
        self._groups: dict[str, torch.distributed.ProcessGroup] = {}
        self._parallelized: nn.Module | None = None
        self._model_adapter: ModelAdapter | None = None  # the parallel network's, read before it was split
        self._handover: GradientHandOver | None = None
        self._data_parallel_plan: DataParallelPlan | None = None
        self._data_parallel: DataParallel | None = None
        self._reduced_parameters: list[nn.Parameter] | None = None  # reduced since the last backward
        self.last_gradient_wait_seconds = 0.0

    # ------------------------------------------------------------------ layout and mesh
    @property
    def layout(self) -> ParallelLayout:
        if self._layout is None:
            raise RuntimeError("The layout is resolved when the strategy is configured (world size known).")
        return self._layout

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("The device mesh is built when the strategy sets up its environment.")
        return self._mesh

    @property
    def data_parallel(self) -> DataParallel:
        """The data-parallel mode's steps (`parallel.data_parallel`), built with the mesh."""
        if self._data_parallel is None:
            raise RuntimeError("The data-parallel mode is built when the strategy sets up its environment.")
        return self._data_parallel

    def release(self) -> None:  # at the end of a run: the data-parallel mode's hooks off the parameters
        if self._data_parallel is not None:
            self._data_parallel.release()

    def validate_model(self, config: Any) -> None:
        """Check `config` against the layout once it is resolved (before any process group exists)."""
        if self._layout is not None:
            self._layout.validate_model(config)

    def resolve_layout(self, world_size: int) -> ParallelLayout:
        (tp, pp, dp), options = self.options.sizes, self.options
        self._layout = ParallelLayout.resolve(
            world_size, tp, pp, dp, num_microbatches=options.num_microbatches,
            layers_per_stage=options.layers_per_stage, expert_parallel_size=options.expert_parallel_size)
        self._data_parallel_plan = choose_data_parallel(
            options.data_parallel_mode, self._layout.data_parallel_size, self._layout.pipeline_parallel_size,
            options.overlap_gradient_reduction, options.fsdp_reshard_after_forward, options.pipeline_schedule)
        return self._layout

    def setup_mesh(self, world_size: int, device_type: str, timeout: timedelta | None) -> DeviceMesh:
        """The ("pp", "dp", "tp") mesh with `timeout` on every group; the preflight measurement if asked."""
        self._mesh = build_device_mesh(self.resolve_layout(world_size), device_type, timeout)
        self._groups = {name: self._mesh[name].get_group() for name in self._mesh.mesh_dim_names}  # sliced once
        self._expert_mesh = build_expert_mesh(self.layout, device_type, timeout)
        self._data_parallel = build_data_parallel(self._data_parallel_plan, self._mesh)
        if self.options.preflight and self.preflight_report is None:
            self.preflight_report = run_doctor(self.layout, self._mesh, sizes=(2**20,), iterations=3)
            rank_zero_info(self.preflight_report.table())
            for warning in self.preflight_report.warnings:
                rank_zero_warn(warning)
        return self._mesh

    def group(self, name: str) -> torch.distributed.ProcessGroup:
        return self._groups[name]  # slicing the mesh each time would read its rank table on the host

    def sampler_kwargs(self, global_rank: int) -> dict[str, Any]:
        return {"num_replicas": self.layout.data_parallel_size, "rank": self.layout.coordinates(global_rank).dp}

    # ------------------------------------------------------------------ network
    def parallelize(self, network: nn.Module, config: Any | None, loss_scale: Callable[[], torch.Tensor | float],
                    device: torch.device) -> bool:
        """Make `network` parallel (`strategies.parallelize.parallelize_network`: pipeline split -> TP ->
        recompute -> compile -> data parallel -> pipelined forward -> materialise) once; returns False when `network`
        is already parallel."""
        if network is self._parallelized:
            return False
        self._model_adapter = self.options.model_adapter_for(network)
        self.pipeline, self._handover = parallelize_network(network, config, self.layout, self.mesh, self.options,
                                                            self._model_adapter, self.data_parallel, loss_scale,
                                                            device, self._expert_mesh)
        self._parallelized = network
        return True

    def model_adapter_of(self, network: nn.Module) -> ModelAdapter:
        """`network`'s `ModelAdapter`: the one read from the whole network before it was parallelised."""
        known = network is self._parallelized and self._model_adapter is not None
        return self._model_adapter if known else self.options.model_adapter_for(network)

    def load_pretrained(self, network: nn.Module) -> None:
        if self.options.pretrained is not None:
            load_hf_weights(network, self.options.pretrained)

    # ------------------------------------------------------------------ step
    def take_pipeline_gradients(self) -> None:
        """Add the gradients the last pipelined forward computed (the backward of a pipelined step), scaled
        by what the loop's backward of the returned loss asked for (see `parallel.pipeline.forward`)."""
        self._reduced_parameters = None
        if self._handover is not None:
            self._handover.take()

    def before_backward(self, parameters: Iterable[nn.Parameter], completes_gradients: bool) -> None:
        """Before a backward (the overlapped all-reduce arms its hooks, `parallel.data_parallel.overlap`);
        `completes_gradients`: the last backward before the optimizer step (not an accumulating one)."""
        self._reduced_parameters = None
        self.data_parallel.before_backward(parameters, completes_gradients)

    def all_reduce_gradients(self, parameters: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """The dp average of the gradients (`DataParallel.reduce_gradients`: each gradient cut like its
        parameter, then all-reduced, waited for where backward launched it, or reduce-scattered to the
        optimizer's parts in `"zero1"` mode; FSDP2 reduced them itself). Returns the parameters that now hold
        the reduced gradients; the host seconds this takes are `last_gradient_wait_seconds` (exposed dp time).

        Once per backward: a later call returns the first call's parameters without reducing again (manual
        optimization clips before its `optimizer.step()`, and both need the reduced gradients)."""
        if self._reduced_parameters is not None:
            return self._reduced_parameters
        started = time.perf_counter()
        with label(DP_PHASE + "reduce_gradients"):
            parameters = self.data_parallel.reduce_gradients(list(parameters))
        self.last_gradient_wait_seconds = time.perf_counter() - started
        self._reduced_parameters = parameters
        return parameters

    def clip_gradients_by_norm(self, parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Scale gradients so their global 2-norm (tp shards, dp shards, pp stages) is at most `max_norm`;
        returns that norm (kept as `last_clip_norm`, which the throughput monitor logs)."""
        self.last_clip_norm = clip_grad_norm_(parameters, max_norm, self.group("pp"), mesh_device(self.mesh))
        return self.last_clip_norm

    # ------------------------------------------------------------------ checkpoints
    def optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """`optimizer`'s flattened state dict: this rank's shards, by global name (`checkpointing.optimizer_state`)."""
        return optimizer_state(self.data_parallel.optimizer_owner(module), optimizer)

    def states_of(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]
                  ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """`module`'s state dict and each optimizer's flattened one: this rank's shards, by global name."""
        return get_model_state_dict(module), [self.optimizer_state(module, optimizer) for optimizer in optimizers]

    def checkpoint_meta(self, world_size: int, global_step: int, epoch: int, network_prefix: str,
                        network: nn.Module, precision: str | None = None,
                        losses: dict[str, float] | None = None) -> CheckpointMeta:
        """What `meta.json` records: layout, step, data position, the network's config."""
        position = self.sample_position
        adapter = self.model_adapter_of(network)
        return CheckpointMeta(
            layout=self.layout.to_dict(), world_size=world_size, global_step=global_step, epoch=epoch,
            consumed_samples=position.consumed,
            consumed_samples_in_epoch=position.consumed_in_epoch if position.epoch == epoch else 0,
            network_prefix=network_prefix, data_parallel_mode=self.options.data_parallel_mode,
            model_config=adapter.config_record(network), lora=adapter.lora_record(network), precision=precision,
            **(losses or {}),
        )

    def save(self, path: Path, model_state: dict[str, Any], optimizer_states: Sequence[dict[str, Any]],
             trainer_state: dict[str, Any], meta: CheckpointMeta, asynchronous: bool = False,
             process_group: torch.distributed.ProcessGroup | None = None, module: nn.Module | None = None
             ) -> PendingSave:
        """Write the module's and optimizers' states (see `states_of`), the loop's `trainer_state`, this
        rank's random states and `meta` (see `checkpoint_meta`) as a sharded checkpoint folder at `path`;
        with `asynchronous`, finish the returned `PendingSave` later (a collective). With
        `save_frozen_weights=False` or a 4-bit QLoRA base, `module`'s frozen weights are left out, fingerprinted."""
        if module is not None and (not self.options.save_frozen_weights or quantized_parameters(module)):
            model_state = without_frozen(model_state, module)
            meta = replace(meta, frozen_weights=frozen_weights_fingerprint(module, self.group("pp")))
        return save_checkpoint(path, sharded_state(model_state, optimizer_states), trainer_state, meta,
                               asynchronous=asynchronous, process_group=process_group)

    def load(self, path: Path, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], strict: bool,
             global_rank: int) -> tuple[CheckpointMeta, dict[str, Any]]:
        """Fill `module` and `optimizers` from a checkpoint of any layout, restore this rank's random states
        (same layout only) and the consumed-samples position; return the meta and the saved trainer state."""
        meta, trainer_state = load_states(path, module, self.data_parallel.optimizer_owner(module), optimizers, strict,
                                          self.options.verify_checkpoints, self.group("pp"))
        restore_random_states(path, meta, self.layout, global_rank)
        rank_zero_info(f"Resuming at step {meta.global_step}, epoch {meta.epoch}, after"
                       f" {meta.consumed_samples_in_epoch} samples of the epoch ({meta.consumed_samples} in all).")
        self.sample_position = SamplePosition(meta.epoch, meta.consumed_samples_in_epoch, meta.consumed_samples)
        return meta, trainer_state
