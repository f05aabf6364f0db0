"""The one core behind the Trainer and Fabric strategies: layout -> mesh -> parallelize(network) -> step.

`ParallelCore` orchestrates what does not depend on who drives the loop, in this order: the
`ParallelLayout` for the launched world, the ("pp", "dp", "tp") mesh, the parallelisation of a network
(pipeline split, tensor parallel, activation recompute, FSDP2, materialisation, the pipelined forward),
the step's gradient hand-over, data-parallel reduction and clipping, and checkpoint save and load. The
mechanics live in `lightning_tp3d.parallel` and `lightning_tp3d.io`; `TP3DStrategy` (Trainer) and
`TP3DFabricStrategy` (Fabric) adapt the core to their hooks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp3d.data.sampler import SamplePosition
from lightning_tp3d.diagnostics.doctor import DoctorReport, run_doctor
from lightning_tp3d.io.checkpoint import PendingSave, load_checkpoint, load_rng_state, save_checkpoint
from lightning_tp3d.io.checkpoint_format import MODEL_GROUP, CheckpointMeta
from lightning_tp3d.io.hf import load_hf_weights
from lightning_tp3d.io.random_state import restore_rng_state
from lightning_tp3d.models.huggingface import HuggingFaceStages, is_huggingface_causal_lm
from lightning_tp3d.models.llama import causal_lm_loss
from lightning_tp3d.parallel.data_parallel import DataParallel, build_data_parallel
from lightning_tp3d.parallel.grad_norm import clip_grad_norm_
from lightning_tp3d.parallel.materialize import materialize_network
from lightning_tp3d.parallel.mesh import build_device_mesh, mesh_device
from lightning_tp3d.parallel.paths import indexed_blocks, resolve_attribute
from lightning_tp3d.parallel.pipeline import (
    GradientHandOver,
    PipelineRunner,
    PipelineStages,
    install_pipelined_forward,
    split_network,
)
from lightning_tp3d.parallel.recompute import recompute_network_layers
from lightning_tp3d.parallel.tensor import (
    apply_tensor_parallel,
    check_plan_matches,
    plan_entries_present,
    resolve_tp_plan,
)
from lightning_tp3d.plan.data_parallel import DataParallelPlan, choose_data_parallel
from lightning_tp3d.plan.layout import LayoutError, ParallelLayout
from lightning_tp3d.plan.schedules import PipelinePlan, plan_pipeline
from lightning_tp3d.strategies.options import ParallelOptions

__all__ = ["FLAT_OPTIMIZER_STATE", "ParallelCore", "UNSTEPPED", "model_config"]

# Flattened optimizer state is keyed by parameter name (`state.<name>.exp_avg`), not by position, so the
# state of a stage's parameters is found again under any pipeline split.
FLAT_OPTIMIZER_STATE = StateDictOptions(flatten_optimizer_state_dict=True)
# The flag in a saved optimizer state telling that the optimizer had taken no step (see `optimizer_state`).
UNSTEPPED = "tp3d_unstepped"

_MODEL_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads")


def model_config(*owners: nn.Module | None) -> Any | None:
    """The first `config` with the decoder's shape fields found on `owners` (network, LightningModule)."""
    for owner in owners:
        config = getattr(owner, "config", None)
        if config is not None and all(hasattr(config, field) for field in _MODEL_SHAPE_FIELDS):
            return config
    return None


class ParallelCore:
    """Layout, mesh and the parallel network of one run, from validated `ParallelOptions` (given as the
    object, or as its keyword arguments: `ParallelCore(tensor_parallel_size=2)`)."""

    def __init__(self, options: ParallelOptions | None = None, **option_values: Any) -> None:
        if options is not None and option_values:
            raise TypeError("ParallelCore takes a ParallelOptions or its keyword arguments, not both.")
        options = options if options is not None else ParallelOptions(**option_values)
        self.options = options
        self.pretrained = options.pretrained
        self._tp_plan = resolve_tp_plan(options.tp_plan)
        self.preflight_report: DoctorReport | None = None
        self.pipeline: PipelineRunner | None = None
        self.sample_position = SamplePosition()
        self.last_clip_norm: torch.Tensor | None = None
        self._layout: ParallelLayout | None = None
        self._mesh: DeviceMesh | None = None
        self._parallelized: nn.Module | None = None
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

    def validate_model(self, config: Any) -> None:
        """Check `config` against the layout once it is resolved (before any process group exists)."""
        if self._layout is not None:
            self._layout.validate_model(config)

    def resolve_layout(self, world_size: int) -> ParallelLayout:
        tp, pp, dp = self.options.sizes
        self._layout = ParallelLayout.resolve(world_size=world_size, tensor_parallel_size=tp,
                                              pipeline_parallel_size=pp, data_parallel_size=dp,
                                              num_microbatches=self.options.num_microbatches,
                                              layers_per_stage=self.options.layers_per_stage)
        options = self.options
        self._data_parallel_plan = choose_data_parallel(
            options.data_parallel_mode, self._layout.data_parallel_size, self._layout.pipeline_parallel_size,
            options.overlap_gradient_reduction, options.fsdp_reshard_after_forward, options.pipeline_schedule)
        return self._layout

    def setup_mesh(self, world_size: int, device_type: str, timeout: timedelta | None) -> DeviceMesh:
        """The ("pp", "dp", "tp") mesh with `timeout` on every group; the preflight measurement if asked."""
        self._mesh = build_device_mesh(self.resolve_layout(world_size), device_type, timeout)
        self._data_parallel = build_data_parallel(self._data_parallel_plan, self._mesh)
        if self.options.preflight and self.preflight_report is None:
            self.preflight_report = run_doctor(self.layout, self._mesh, sizes=(2**20,), iterations=3)
            rank_zero_info(self.preflight_report.table())
            for warning in self.preflight_report.warnings:
                rank_zero_warn(warning)
        return self._mesh

    def group(self, name: str) -> torch.distributed.ProcessGroup:
        return self.mesh[name].get_group()

    def sampler_kwargs(self, global_rank: int) -> dict[str, Any]:
        return {"num_replicas": self.layout.data_parallel_size, "rank": self.layout.coordinates(global_rank).dp}

    # ------------------------------------------------------------------ network
    def _layers(self, network: nn.Module) -> nn.ModuleDict | nn.ModuleList:
        return resolve_attribute(network, self.options.layers_attribute, "layers_attribute")

    def parallelize(self, network: nn.Module, config: Any | None, loss_scale: Callable[[], torch.Tensor | float],
                    device: torch.device) -> bool:
        """Pipeline split, then tensor parallel (DTensor weights over tp), then activation recompute, then
        FSDP2 over dp, which must wrap parameters that are already DTensors (and whose units must contain
        the recomputed code, so the recompute runs on unsharded parameters); a network built on the meta
        device is then materialised on `device` as this rank's shard only (`materialize_network`).
        `loss_scale()` is what the pipeline schedule multiplies the loss by before its backward (fp16 scale /
        accumulation).

        Runs once per network (returns False when `network` is already parallel).
        """
        if network is self._parallelized:
            return False
        layout, options = self.layout, self.options
        if layout.tensor_parallel_size > 1:
            check_plan_matches(network, self._tp_plan)
        stage_modules: list[nn.Module] = []
        pipeline_plan = None
        stages = options.pipeline_stages or (HuggingFaceStages() if is_huggingface_causal_lm(network)
                                             else PipelineStages())
        if layout.pipeline_parallel_size > 1:
            pipeline_plan, stage_modules = self._split_pipeline(network, config, stages)
        elif config is not None:
            layout.validate_model(config)
        if layout.tensor_parallel_size > 1:
            apply_tensor_parallel(network, self.mesh["tp"], plan_entries_present(network, self._tp_plan))
        if options.recompute != "none":
            layers = self._layers(network)
            stage_layers = pipeline_plan.layer_ranges if pipeline_plan is not None else [sorted(indexed_blocks(layers))]
            recompute_network_layers(layers, stage_layers, options.recompute, options.recompute_method,
                                     options.recompute_num_layers, options.recompute_target)
        self.data_parallel.wrap(stage_modules or [network], indexed_blocks(self._layers(network)).values())
        if pipeline_plan is not None:
            loss_fn = stages.loss_function(network) or causal_lm_loss
            self.pipeline = PipelineRunner(stage_modules, pipeline_plan, layout.num_microbatches, loss_fn,
                                           self.group("pp"), device)
            self._handover = install_pipelined_forward(network, self.pipeline, loss_scale, stages)
        materialize_network(network, device)
        self._parallelized = network
        return True

    def load_pretrained(self, network: nn.Module) -> None:
        if self.pretrained is not None:
            load_hf_weights(network, self.pretrained)

    def _split_pipeline(self, network: nn.Module, config: Any | None,
                        stages: PipelineStages) -> tuple[PipelinePlan, list[nn.Module]]:
        layout, options = self.layout, self.options
        if config is not None and getattr(config, "tie_word_embeddings", False):
            raise LayoutError(
                "tie_word_embeddings=True with pipeline_parallel_size > 1 is not supported: the embedding and the"
                " head live on different stages; untie them or use pipeline_parallel_size=1."
            )
        num_layers = len(self._layers(network))
        plan = plan_pipeline(
            options.pipeline_schedule, layout.pipeline_parallel_size, self.mesh.get_local_rank("pp"),
            layout.num_microbatches, options.stages_per_rank,
            lambda stages: layout.stage_layer_ranges(num_layers, stages),
        )
        if config is not None:
            layout.validate_model(config, plan.num_stages)
        pieces = split_network(network, plan, options.layers_attribute, options.pipeline_first_modules,
                               options.pipeline_last_modules)
        return plan, [stages.stage_module(network, first, blocks, last) for first, blocks, last in pieces]

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
        optimizer's parts in `"zero1"` mode; FSDP2 reduced them itself). Returns the parameters that now
        hold the reduced gradients. The host seconds this takes after backward are kept in
        `last_gradient_wait_seconds` (the exposed dp time).

        Once per backward: a later call returns the first call's parameters without reducing again (manual
        optimization clips before its `optimizer.step()`, and both need the reduced gradients)."""
        if self._reduced_parameters is not None:
            return self._reduced_parameters
        started = time.perf_counter()
        parameters = self.data_parallel.reduce_gradients(list(parameters))
        self.last_gradient_wait_seconds = time.perf_counter() - started
        self._reduced_parameters = parameters
        return parameters

    def shard_optimizers(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """In `"zero1"` mode with dp > 1, hand `optimizers` this dp rank's parts of `module`'s parameters
        (`parallel.data_parallel.zero`); with dp = 1 there is nothing to split."""
        self.data_parallel.shard_optimizers(module, optimizers)

    def after_optimizer_step(self) -> None:
        """In `"zero1"` mode: all-gather the updated parts, so every dp rank holds the whole parameters."""
        self.data_parallel.after_optimizer_step()

    def clip_gradients_by_norm(self, parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Scale gradients so their global 2-norm (tp shards, dp shards, pp stages) is at most `max_norm`;
        returns that norm (kept as `last_clip_norm`, which the throughput monitor logs)."""
        self.last_clip_norm = clip_grad_norm_(parameters, max_norm, self.group("pp"), mesh_device(self.mesh))
        return self.last_clip_norm

    # ------------------------------------------------------------------ checkpoints
    def optimizer_owner(self, module: nn.Module) -> nn.Module:
        """The module whose parameters an optimizer holds: `module`, or in `"zero1"` mode the parts' tree
        (same names, so the state is keyed as in every other mode)."""
        return self.data_parallel.optimizer_owner(module)

    def optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """`optimizer`'s flattened state dict: this rank's shards, keyed by the parameters' global names,
        with `UNSTEPPED`: whether it has taken no step. torch builds a missing state with a step at learning
        rate 0, after which Adam's step count would start at 1 (its bias correction off for the whole run):
        such an optimizer is left without state, and so is one loaded from its checkpoint (`load`)."""
        unstepped = not optimizer.state and all(parameter.grad is None for group in optimizer.param_groups
                                                for parameter in group["params"])
        state = get_optimizer_state_dict(self.optimizer_owner(module), optimizer, options=FLAT_OPTIMIZER_STATE)
        if unstepped:
            optimizer.state.clear()
        return {**state, UNSTEPPED: unstepped}

    def states_of(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]
                  ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """`module`'s state dict and each optimizer's flattened one: this rank's shards, by global name."""
        return get_model_state_dict(module), [self.optimizer_state(module, optimizer) for optimizer in optimizers]

    def checkpoint_meta(self, world_size: int, global_step: int, epoch: int, network_prefix: str,
                        network: nn.Module, precision: str | None = None,
                        losses: dict[str, float] | None = None) -> CheckpointMeta:
        """What `meta.json` records, with the network's config (a `transformers` config records its
        architecture, so that an export writes the model's own `config.json`)."""
        position = self.sample_position
        config = model_config(network)
        record = config.to_dict() if hasattr(config, "to_dict") else None
        if record is not None and "model_type" in record and not record.get("architectures"):
            record["architectures"] = [type(network).__name__]
        return CheckpointMeta(
            layout=self.layout.to_dict(), world_size=world_size, global_step=global_step, epoch=epoch,
            consumed_samples=position.consumed,
            consumed_samples_in_epoch=position.consumed_in_epoch if position.epoch == epoch else 0,
            network_prefix=network_prefix, data_parallel_mode=self.options.data_parallel_mode, model_config=record,
            precision=precision, **(losses or {}),
        )

    @staticmethod
    def _sharded_state(model_state: dict[str, Any], optimizer_states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The groups `io.checkpoint` writes and reads: the module and each (flattened) optimizer."""
        optimizers = {f"optimizer_{index}": state for index, state in enumerate(optimizer_states)}
        return {MODEL_GROUP: model_state, **optimizers}

    def save(self, path: Path, model_state: dict[str, Any], optimizer_states: Sequence[dict[str, Any]],
             trainer_state: dict[str, Any], meta: CheckpointMeta, asynchronous: bool = False,
             process_group: torch.distributed.ProcessGroup | None = None) -> PendingSave:
        """Write the module's and optimizers' states (see `states_of`), the loop's `trainer_state`, this
        rank's random states and `meta` (see `checkpoint_meta`) as a sharded checkpoint folder at `path`;
        with `asynchronous`, finish the returned `PendingSave` later (a collective)."""
        return save_checkpoint(path, self._sharded_state(model_state, optimizer_states), trainer_state, meta,
                               asynchronous=asynchronous, process_group=process_group)

    def load(self, path: Path, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], strict: bool,
             global_rank: int) -> tuple[CheckpointMeta, dict[str, Any]]:
        """Fill `module` and `optimizers` from a checkpoint of any layout, restore this rank's random states
        (same layout only) and the consumed-samples position; return the meta and the saved trainer state."""
        model_state, optimizer_states = self.states_of(module, optimizers)
        for optimizer_state in optimizer_states:
            optimizer_state[UNSTEPPED] = False  # unless the checkpoint says so
        meta, trainer_state = load_checkpoint(path, self._sharded_state(model_state, optimizer_states), strict=strict,
                                              verify=self.options.verify_checkpoints)
        set_model_state_dict(module, model_state, options=StateDictOptions(strict=strict))
        for optimizer, optimizer_state in zip(optimizers, optimizer_states):
            unstepped = optimizer_state.pop(UNSTEPPED)
            set_optimizer_state_dict(self.optimizer_owner(module), optimizer, optimizer_state,
                                     options=FLAT_OPTIMIZER_STATE)
            if unstepped:
                optimizer.state.clear()
        layout = self.layout
        current = (layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.data_parallel_size)
        if meta.parallel_sizes == current:
            restore_rng_state(load_rng_state(path, global_rank))
        else:
            rank_zero_warn(
                f"Resharding checkpoint {path}: saved at (tp, pp, dp) = {meta.parallel_sizes}, loading at {current}."
                " Model and optimizer state are resharded; random states belong to the old ranks and are not"
                " restored."
            )
        rank_zero_info(f"Resuming at step {meta.global_step}, epoch {meta.epoch}, after"
                       f" {meta.consumed_samples_in_epoch} samples of the epoch ({meta.consumed_samples} in all).")
        self.sample_position = SamplePosition(meta.epoch, meta.consumed_samples_in_epoch, meta.consumed_samples)
        return meta, trainer_state
