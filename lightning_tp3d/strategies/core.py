"""The one core behind the Trainer and Fabric strategies: layout -> mesh -> parallelize(network) -> step.

`ParallelCore` owns everything that does not depend on who drives the loop: the validated options, the
`ParallelLayout` for the launched world, the ("pp", "dp", "tp") mesh, the parallelisation of a network
(pipeline split, tensor parallel, activation recompute, FSDP2, the pipelined forward), the gradients a
pipeline schedule computes, the data-parallel gradient all-reduce, global-norm clipping and the
checkpoint metadata. `TP3DStrategy` (Trainer) and `TP3DFabricStrategy` (Fabric) are thin adapters.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
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
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_tp3d.data.sampler import SamplePosition
from lightning_tp3d.diagnostics.doctor import DoctorReport, run_doctor
from lightning_tp3d.io.checkpoint import MODEL_GROUP, CheckpointMeta, load_checkpoint, load_rng_state
from lightning_tp3d.io.hf import load_hf_weights
from lightning_tp3d.io.random_state import restore_rng_state
from lightning_tp3d.models.llama import causal_lm_loss
from lightning_tp3d.parallel.data import DATA_PARALLEL_MODES, all_reduce_gradients, apply_fsdp
from lightning_tp3d.parallel.grad_norm import clip_grad_norm_
from lightning_tp3d.parallel.materialize import materialize_network
from lightning_tp3d.parallel.mesh import build_device_mesh, mesh_device
from lightning_tp3d.parallel.pipeline import (
    PipelinePlan,
    PipelineRunner,
    StageModule,
    plan_pipeline,
    prune_to_stages,
    stages_per_rank_of,
)
from lightning_tp3d.parallel.recompute import (
    DEFAULT_SELECTIVE_TARGET,
    apply_recompute,
    check_recompute_options,
    recomputed_layers,
)
from lightning_tp3d.parallel.tensor import (
    apply_tensor_parallel,
    check_plan_matches,
    plan_entries_present,
    resolve_tp_plan,
    shard_gradients_like_parameters,
)
from lightning_tp3d.plan.layout import LayoutError, ParallelLayout

__all__ = ["FLAT_OPTIMIZER_STATE", "ParallelCore", "model_config", "resolve_attribute"]

# Flattened optimizer state is keyed by parameter name (`state.<name>.exp_avg`), not by position, so the
# state of a stage's parameters is found again under any pipeline split.
FLAT_OPTIMIZER_STATE = StateDictOptions(flatten_optimizer_state_dict=True)

_MODEL_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads")


def resolve_attribute(root: nn.Module, path: str, what: str) -> Any:
    """`root.a.b` for `path="a.b"` (the empty path is `root`), with an error naming the option to set."""
    value: Any = root
    for part in filter(None, path.split(".")):
        if not hasattr(value, part):
            raise AttributeError(
                f"{type(root).__name__} has no {what} at {path!r} (no attribute {part!r} on"
                f" {type(value).__name__}); build it in `configure_model` or pass TP3DStrategy({what}=...)."
            )
        value = getattr(value, part)
    return value


def model_config(*owners: nn.Module | None) -> Any | None:
    """The first `config` with the decoder's shape fields found on `owners` (network, LightningModule)."""
    for owner in owners:
        config = getattr(owner, "config", None)
        if config is not None and all(hasattr(config, field) for field in _MODEL_SHAPE_FIELDS):
            return config
    return None


class ParallelCore:
    """Options, layout, mesh and the parallel network of one run (see the module docstring).

    The arguments are `TP3DStrategy`'s; they are validated here, at construction, so a typo fails before
    any process is launched.
    """

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int | str = "auto",
        data_parallel_mode: str = "replicate",
        num_microbatches: int | None = None,
        pipeline_schedule: str = "1f1b",
        stages_per_rank: int = 2,
        layers_per_stage: Sequence[int] | None = None,
        tp_plan: Mapping[str, ParallelStyle] | Callable[[], Mapping[str, ParallelStyle]] | str | None = None,
        layers_attribute: str = "model.layers",
        pipeline_first_modules: Sequence[str] = ("model.embed_tokens",),
        pipeline_last_modules: Sequence[str] = ("model.norm", "lm_head"),
        recompute: str = "none",
        recompute_method: str = "uniform",
        recompute_num_layers: int = 1,
        recompute_target: str = DEFAULT_SELECTIVE_TARGET,
        pretrained: str | Path | None = None,
        preflight: bool = False,
    ) -> None:
        num_microbatches = num_microbatches or pipeline_parallel_size
        ParallelLayout(tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                       num_microbatches=num_microbatches, layers_per_stage=layers_per_stage)
        if pipeline_parallel_size > 1:
            stages_per_rank_of(pipeline_schedule, pipeline_parallel_size, num_microbatches, stages_per_rank)
            if num_microbatches < pipeline_parallel_size:
                bubble = (pipeline_parallel_size - 1) / (num_microbatches + pipeline_parallel_size - 1)
                rank_zero_warn(
                    f"num_microbatches={num_microbatches} < pipeline_parallel_size={pipeline_parallel_size}: the"
                    f" pipeline bubble is at least {bubble:.0%} of each step; use num_microbatches >="
                    " pipeline_parallel_size."
                )
        check_recompute_options(recompute, recompute_method, recompute_num_layers)
        if data_parallel_mode not in DATA_PARALLEL_MODES:
            raise ValueError(
                f"data_parallel_mode={data_parallel_mode!r} is not one of {list(DATA_PARALLEL_MODES)}."
            )
        self.pretrained = Path(pretrained) if pretrained is not None else None
        if self.pretrained is not None and not (self.pretrained / "config.json").is_file():
            raise FileNotFoundError(
                f"pretrained={str(pretrained)!r} is not a Hugging Face folder (no config.json in it)."
            )
        self._sizes = (tensor_parallel_size, pipeline_parallel_size, data_parallel_size)
        self._num_microbatches = num_microbatches
        self._pipeline_schedule = pipeline_schedule
        self._stages_per_rank = stages_per_rank
        self._layers_per_stage = tuple(layers_per_stage) if layers_per_stage is not None else None
        self._tp_plan = resolve_tp_plan(tp_plan)
        self._layers_attribute = layers_attribute
        self._pipeline_first_modules = tuple(pipeline_first_modules)
        self._pipeline_last_modules = tuple(pipeline_last_modules)
        self._recompute = (recompute, recompute_method, recompute_num_layers, recompute_target)
        self._preflight = preflight
        self.data_parallel_mode = data_parallel_mode
        self.preflight_report: DoctorReport | None = None
        self.pipeline: PipelineRunner | None = None
        self.sample_position = SamplePosition()
        self._layout: ParallelLayout | None = None
        self._mesh: DeviceMesh | None = None
        self._parallelized: nn.Module | None = None
        self._pending_gradients: list[tuple[nn.Parameter, torch.Tensor | None]] = []
        self._pending_factor: torch.Tensor | None = None
        self.last_clip_norm: torch.Tensor | None = None

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> ParallelCore:
        """The core for a strategy's constructor arguments (`locals()`): those that are the core's options."""
        names = inspect.signature(cls).parameters
        return cls(**{name: value for name, value in arguments.items() if name in names})

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

    def validate_model(self, config: Any) -> None:
        """Check `config` against the layout once it is resolved (before any process group exists)."""
        if self._layout is not None:
            self._layout.validate_model(config)

    def resolve_layout(self, world_size: int) -> ParallelLayout:
        tp, pp, dp = self._sizes
        self._layout = ParallelLayout.resolve(world_size=world_size, tensor_parallel_size=tp,
                                              pipeline_parallel_size=pp, data_parallel_size=dp,
                                              num_microbatches=self._num_microbatches,
                                              layers_per_stage=self._layers_per_stage)
        return self._layout

    def setup_mesh(self, world_size: int, device_type: str, timeout: timedelta | None) -> DeviceMesh:
        """The ("pp", "dp", "tp") mesh with `timeout` on every group; the preflight measurement if asked."""
        self._mesh = build_device_mesh(self.resolve_layout(world_size), device_type, timeout)
        if self._preflight and self.preflight_report is None:
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
    def blocks(self, network: nn.Module) -> list[nn.Module]:
        layers = resolve_attribute(network, self._layers_attribute, "layers_attribute")
        return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)

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
        layout = self.layout
        if layout.tensor_parallel_size > 1:
            check_plan_matches(network, self._tp_plan)
        stage_modules: list[StageModule] = []
        pipeline_plan = None
        if layout.pipeline_parallel_size > 1:
            pipeline_plan, stage_modules = self._split_pipeline(network, config)
        elif config is not None:
            layout.validate_model(config)
        if layout.tensor_parallel_size > 1:
            apply_tensor_parallel(network, self.mesh["tp"], plan_entries_present(network, self._tp_plan))
        if self._recompute[0] != "none":
            self._apply_recompute(network, pipeline_plan)
        if self.data_parallel_mode == "fsdp":
            # Under pipelining each stage module is called directly, so each is an FSDP root of its own,
            # and its parameters stay gathered through the step's micro-batches (see `apply_fsdp`).
            apply_fsdp(stage_modules or [network], self.mesh["dp"], self.blocks(network),
                       reshard_after_forward=pipeline_plan is None)
        if pipeline_plan is not None:
            self._install_pipeline(network, pipeline_plan, stage_modules, loss_scale, device)
        materialize_network(network, device)
        self._parallelized = network
        return True

    def load_pretrained(self, network: nn.Module) -> None:
        if self.pretrained is not None:
            load_hf_weights(network, self.pretrained)

    def _apply_recompute(self, network: nn.Module, pipeline_plan: PipelinePlan | None) -> None:
        granularity, method, num_layers, target = self._recompute
        layers = resolve_attribute(network, self._layers_attribute, "layers_attribute")
        if isinstance(layers, nn.ModuleDict):
            blocks = {int(key) if key.isdigit() else position: block
                      for position, (key, block) in enumerate(layers.items())}
        else:
            blocks = dict(enumerate(layers))
        stage_layers = pipeline_plan.layer_ranges if pipeline_plan is not None else [sorted(blocks)]
        chosen = recomputed_layers(stage_layers, method, num_layers)
        apply_recompute({index: blocks[index] for index in chosen}, granularity, target)

    def _split_pipeline(self, network: nn.Module, config: Any | None) -> tuple[PipelinePlan, list[StageModule]]:
        layout = self.layout
        layers = resolve_attribute(network, self._layers_attribute, "layers_attribute")
        if not isinstance(layers, nn.ModuleDict):
            raise TypeError(
                f"pipeline parallelism needs the blocks in an nn.ModuleDict keyed by global layer index, but"
                f" {self._layers_attribute} is a {type(layers).__name__}; see docs/concepts.md."
            )
        if config is not None and getattr(config, "tie_word_embeddings", False):
            raise LayoutError(
                "tie_word_embeddings=True with pipeline_parallel_size > 1 is not supported: the embedding and the"
                " head live on different stages; untie them or use pipeline_parallel_size=1."
            )
        num_layers = len(layers)
        plan = plan_pipeline(
            self._pipeline_schedule, layout.pipeline_parallel_size, self.mesh.get_local_rank("pp"),
            layout.num_microbatches, self._stages_per_rank,
            lambda stages: layout.stage_layer_ranges(num_layers, stages),
        )
        if config is not None:
            layout.validate_model(config, plan.num_stages)
        for path in self._pipeline_first_modules + self._pipeline_last_modules:
            resolve_attribute(network, path, "pipeline_first_modules / pipeline_last_modules entry")
        prune_to_stages(network, plan, layers, self._pipeline_first_modules, self._pipeline_last_modules)
        return plan, [self._stage_module(network, layers, plan, index, layer_range)
                      for index, layer_range in zip(plan.stage_indices, plan.layer_ranges)]

    def _stage_module(self, network: nn.Module, layers: nn.ModuleDict, plan: PipelinePlan, index: int,
                      layer_range: range) -> StageModule:
        parts: list[nn.Module] = []
        if index == 0:
            parts += [resolve_attribute(network, path, "pipeline_first_modules")
                      for path in self._pipeline_first_modules]
        parts += [layers[str(layer)] for layer in layer_range]
        if index == plan.num_stages - 1:
            parts += [resolve_attribute(network, path, "pipeline_last_modules")
                      for path in self._pipeline_last_modules]
        return StageModule(parts)

    def _install_pipeline(self, network: nn.Module, plan: PipelinePlan, stage_modules: list[StageModule],
                          loss_scale: Callable[[], torch.Tensor | float], device: torch.device) -> None:
        """Route `network(input_ids, labels=...)` through the schedule (the LightningModule contract)."""
        loss_fn = getattr(network, "loss_function", causal_lm_loss)
        runner = PipelineRunner(stage_modules, plan, self.layout.num_microbatches, loss_fn, self.group("pp"), device)
        self.pipeline = runner
        core = self

        def pipelined_forward(input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
            train = network.training and torch.is_grad_enabled() and labels is not None
            if not train:
                return runner(input_ids, labels, train=False)
            runner.loss_scale = loss_scale()
            # The schedule computes gradients inside the forward call; a Trainer zeroes gradients between
            # `training_step` and `backward`: keep them aside until `take_pipeline_gradients`.
            parameters = list(network.parameters())
            previous = [parameter.grad for parameter in parameters]
            for parameter in parameters:
                parameter.grad = None
            loss = runner(input_ids, labels, train=True)
            core._pending_gradients = [(parameter, parameter.grad) for parameter in parameters]
            for parameter, grad in zip(parameters, previous):
                parameter.grad = grad
            return core._loss_handing_over_gradients(loss, runner.loss_scale)

        network.forward = pipelined_forward

    def _loss_handing_over_gradients(self, loss: torch.Tensor, schedule_scale: torch.Tensor | float) -> torch.Tensor:
        """`loss` plus a zero leaf, so that a loop's `.backward()` on any function of the loss (`loss / k` when
        accumulating k batches, a scaler's `scale(loss)`) delivers c = d(objective) / d(loss) to the leaf.
        The schedule computed its gradients for `schedule_scale x loss`; `take_pipeline_gradients` then
        scales them by c / schedule_scale. (The Trainer calls no `.backward()`: its schedule scale already
        holds the accumulation and loss-scale factors, and the gradients are handed over as they are.)"""
        anchor = torch.zeros((), dtype=loss.dtype, device=loss.device, requires_grad=True)

        def receive(gradient: torch.Tensor) -> None:
            self._pending_factor = gradient.detach() / schedule_scale

        anchor.register_hook(receive)
        return loss + anchor

    # ------------------------------------------------------------------ step
    def take_pipeline_gradients(self) -> None:
        """Add the gradients the last pipelined forward computed (the backward of a pipelined step), scaled
        by what the loop's backward of the returned loss asked for (see `_loss_handing_over_gradients`)."""
        factor, self._pending_factor = self._pending_factor, None
        for parameter, grad in self._pending_gradients:
            if grad is None:
                continue
            if factor is not None:  # scaling commutes with every placement: scale the local part
                (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(factor.to(grad.device))
            parameter.grad = grad if parameter.grad is None else parameter.grad.add_(grad)
        self._pending_gradients = []

    def all_reduce_gradients(self, parameters: Iterable[nn.Parameter]) -> None:
        """Shard each gradient like its parameter (see `shard_gradients_like_parameters`), then average
        gradients over dp in `"replicate"` mode (FSDP2 reduce-scatters them itself)."""
        parameters = list(parameters)
        shard_gradients_like_parameters(parameters)
        if self.data_parallel_mode == "replicate" and self.layout.data_parallel_size > 1:
            all_reduce_gradients(parameters, self.group("dp"), self.layout.data_parallel_size)

    def clip_gradients_by_norm(self, parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Scale gradients so their global 2-norm (tp shards, dp shards, pp stages) is at most `max_norm`;
        returns that norm (kept as `last_clip_norm`, which the throughput monitor logs)."""
        self.last_clip_norm = clip_grad_norm_(parameters, max_norm, self.group("pp"), mesh_device(self.mesh))
        return self.last_clip_norm

    @staticmethod
    def clip_gradients_by_value(parameters: Iterable[nn.Parameter], clip_value: float) -> None:
        for parameter in parameters:
            grad = parameter.grad
            if grad is not None:
                (grad.to_local() if isinstance(grad, DTensor) else grad).clamp_(-clip_value, clip_value)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_meta(self, world_size: int, global_step: int, epoch: int, network_prefix: str,
                        config: Any | None) -> CheckpointMeta:
        position = self.sample_position
        return CheckpointMeta(
            layout=self.layout.to_dict(), world_size=world_size, global_step=global_step, epoch=epoch,
            consumed_samples=position.consumed,
            consumed_samples_in_epoch=position.consumed_in_epoch if position.epoch == epoch else 0,
            network_prefix=network_prefix, data_parallel_mode=self.data_parallel_mode,
            model_config=config.to_dict() if hasattr(config, "to_dict") else None,
        )

    @staticmethod
    def sharded_state(model_state: dict[str, Any], optimizer_states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The groups `checkpoint.save_checkpoint` writes: the module and each (flattened) optimizer."""
        optimizers = {f"optimizer_{index}": state for index, state in enumerate(optimizer_states)}
        return {MODEL_GROUP: model_state, **optimizers}

    def load(self, path: Path, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], strict: bool,
             global_rank: int) -> tuple[CheckpointMeta, dict[str, Any]]:
        """Fill `module` and `optimizers` from a checkpoint of any layout, restore this rank's random states
        (same layout only) and the consumed-samples position; return the meta and the saved trainer state."""
        model_state = get_model_state_dict(module)
        optimizer_states = [get_optimizer_state_dict(module, optimizer, options=FLAT_OPTIMIZER_STATE)
                            for optimizer in optimizers]
        meta, trainer_state = load_checkpoint(path, self.sharded_state(model_state, optimizer_states), strict=strict)
        set_model_state_dict(module, model_state, options=StateDictOptions(strict=strict))
        for optimizer, optimizer_state in zip(optimizers, optimizer_states):
            set_optimizer_state_dict(module, optimizer, optimizer_state, options=FLAT_OPTIMIZER_STATE)
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
