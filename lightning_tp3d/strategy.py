"""`TP3DStrategy`: tensor x pipeline x data parallel training inside `lightning.Trainer`.

Data flows one way: the constructor's sizes become a `ParallelLayout` (validated against the world
size before processes are launched and against the model config before any process group exists),
the layout becomes a ("pp", "dp", "tp") `DeviceMesh`, and the mesh shards the LightningModule's network
in the order tensor parallel -> data parallel (FSDP2 must wrap parameters that are already DTensors).

Example usage::

    trainer = Trainer(accelerator="cpu", devices=4, strategy=TP3DStrategy(tensor_parallel_size=2))
    trainer.fit(CausalLMModule("tiny"), TokenDataModule(batch_size=4))

or by name, `Trainer(strategy="tp3d")`, which is plain data parallelism over all processes.
"""

from __future__ import annotations

import os
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from lightning.pytorch.utilities.data import _update_dataloader, extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_tp3d.checkpoint import (
    MODEL_GROUP,
    CheckpointMeta,
    PendingSave,
    load_checkpoint,
    load_rng_state,
    save_checkpoint,
)
from lightning_tp3d.collectives import enable_collective_recording, naming_stuck_collectives
from lightning_tp3d.data.sampler import ResumableDistributedSampler, SamplePosition
from lightning_tp3d.doctor import DoctorReport, run_doctor
from lightning_tp3d.export import load_hf_weights
from lightning_tp3d.layout import LayoutError, ParallelLayout
from lightning_tp3d.mesh import build_device_mesh
from lightning_tp3d.parallel.data import DATA_PARALLEL_MODES, all_reduce_gradients, apply_fsdp
from lightning_tp3d.parallel.grad_norm import clip_grad_norm_
from lightning_tp3d.models.llama import causal_lm_loss
from lightning_tp3d.parallel.pipeline import (
    PipelinePlan,
    PipelineRunner,
    StageModule,
    StageTiming,
    plan_pipeline,
    prune_to_stages,
    stages_per_rank_of,
)
from lightning_tp3d.parallel.tensor import (
    apply_tensor_parallel,
    check_plan_matches,
    plan_entries_present,
    resolve_tp_plan,
)
from lightning_tp3d.parallel.recompute import (
    DEFAULT_SELECTIVE_TARGET,
    apply_recompute,
    check_recompute_options,
    recomputed_layers,
)
from lightning_tp3d.precision import ModelParallelGradScaler
from lightning_tp3d.random_state import restore_rng_state

__all__ = ["TP3DStrategy"]

# Flattened optimizer state is keyed by parameter name (`state.<name>.exp_avg`), not by position, so the
# state of a stage's parameters is found again under any pipeline split.
_FLAT_OPTIMIZER_STATE = StateDictOptions(flatten_optimizer_state_dict=True)

_MODEL_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads")


def _resolve_attribute(root: nn.Module, path: str, what: str) -> Any:
    value: Any = root
    for part in path.split("."):
        if not hasattr(value, part):
            raise AttributeError(
                f"{type(root).__name__} has no {what} at {path!r} (no attribute {part!r} on"
                f" {type(value).__name__}); build it in `configure_model` or pass TP3DStrategy({what}=...)."
            )
        value = getattr(value, part)
    return value


def _model_config(lightning_module: nn.Module, network: nn.Module | None) -> Any | None:
    for owner in (network, lightning_module):
        config = getattr(owner, "config", None)
        if config is not None and all(hasattr(config, field) for field in _MODEL_SHAPE_FIELDS):
            return config
    return None


class TP3DStrategy(ModelParallelStrategy):
    """Trainer strategy for 3-D parallel training on a ("pp", "dp", "tp") device mesh.

    Args:
        tensor_parallel_size: processes that split every layer (innermost mesh dimension).
        pipeline_parallel_size: pipeline stages (ranks along "pp").
        num_microbatches: micro-batches each dataloader batch is split into for the pipeline (default: pp).
        pipeline_schedule: one of `gpipe`, `1f1b`, `interleaved_1f1b`, `looped_bfs`,
            `interleaved_zero_bubble`, `zbv_zero_bubble`, `dualpipev`.
        stages_per_rank: stages on each rank for the looped schedules (V-shaped ones always use 2).
        layers_per_stage: explicit layer count of every stage (default: balanced, embedding and head
            counted as one layer each).
        data_parallel_size: model replicas; `"auto"` is world size / (tp x pp).
        data_parallel_mode: `"replicate"` (gradients all-reduced over dp, DDP semantics) or `"fsdp"`
            (FSDP2: parameters, gradients and optimizer state sharded over dp).
        tp_plan: module-name pattern -> `ParallelStyle` mapping, a function returning one, or its
            import path `"package.module:function"`; default: the plan for Hugging Face Llama names.
        model_attribute: attribute of the LightningModule holding the network to parallelise.
        layers_attribute: attribute of that network holding its transformer blocks (FSDP units, stages).
        pipeline_first_modules / pipeline_last_modules: modules of the network run before the blocks on
            the first stage / after them on the last stage; a stage computes first -> blocks -> last.
        process_group_backend: `"gloo"` / `"nccl"`; default from the device (gloo on CPU, nccl on CUDA).
        timeout: timeout of every collective, on the default group and on each mesh dimension's groups; a
            collective that does not complete in time raises `CollectiveTimeoutError` naming the group
            (tp / pp / dp), the operation and the ranks, instead of hanging.
        async_checkpoint: write checkpoints in a background thread (tensors are first copied to CPU
            memory); a checkpoint appears under its name once the next save starts or fit ends.
        recompute: activation recompute granularity, `"none"`, `"full"` (whole blocks) or `"selective"`
            (the part of each block named by `recompute_target`, by default the attention core).
        recompute_method / recompute_num_layers: `"uniform"` recomputes every N-th block (global index),
            `"block"` the first N blocks of each pipeline stage.
        recompute_target: attribute path inside a block of the method or module `"selective"` recomputes.
        pretrained: a Hugging Face folder (safetensors) whose weights initialise the network after it is
            sharded, each rank reading only its own slices (a resumed checkpoint then overrides them).
        preflight: measure each mesh dimension's links when the mesh is built (`tp3d doctor`'s figures at
            1 MiB), log the table and warn with fixes; the report is kept in `preflight_report`.

    Mixed precision: `Trainer(precision="bf16-mixed" | "bf16-true")`, or for fp16 with a loss scaler that
    every rank agrees on, `Trainer(plugins=[TP3DPrecision("16-mixed")])` (see `lightning_tp3d.precision`).
    """

    strategy_name = "tp3d"

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int | Literal["auto"] = "auto",
        data_parallel_mode: Literal["replicate", "fsdp"] = "replicate",
        num_microbatches: int | None = None,
        pipeline_schedule: str = "1f1b",
        stages_per_rank: int = 2,
        layers_per_stage: Sequence[int] | None = None,
        tp_plan: Mapping[str, ParallelStyle] | Callable[[], Mapping[str, ParallelStyle]] | str | None = None,
        model_attribute: str = "model",
        layers_attribute: str = "model.layers",
        pipeline_first_modules: Sequence[str] = ("model.embed_tokens",),
        pipeline_last_modules: Sequence[str] = ("model.norm", "lm_head"),
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        async_checkpoint: bool = False,
        recompute: Literal["none", "full", "selective"] = "none",
        recompute_method: Literal["uniform", "block"] = "uniform",
        recompute_num_layers: int = 1,
        recompute_target: str = DEFAULT_SELECTIVE_TARGET,
        pretrained: str | Path | None = None,
        preflight: bool = False,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        num_microbatches = num_microbatches or pipeline_parallel_size
        # Validates the sizes now, so a typo fails at construction and not after launching processes.
        ParallelLayout(tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                       num_microbatches=num_microbatches, layers_per_stage=layers_per_stage)
        if pipeline_parallel_size > 1:
            stages_per_rank_of(pipeline_schedule, pipeline_parallel_size, num_microbatches, stages_per_rank)
            if num_microbatches < pipeline_parallel_size:
                bubble = (pipeline_parallel_size - 1) / (num_microbatches + pipeline_parallel_size - 1)
                rank_zero_warn(
                    f"num_microbatches={num_microbatches} < pipeline_parallel_size={pipeline_parallel_size}: the"
                    f" pipeline bubble is at least {bubble:.0%}"
                    " of each step; use num_microbatches >= pipeline_parallel_size."
                )
        check_recompute_options(recompute, recompute_method, recompute_num_layers)
        if data_parallel_mode not in DATA_PARALLEL_MODES:
            raise ValueError(
                f"data_parallel_mode={data_parallel_mode!r} is not one of {list(DATA_PARALLEL_MODES)}."
            )
        self._pipeline_parallel_size = pipeline_parallel_size
        self._num_microbatches = num_microbatches
        self._pipeline_schedule = pipeline_schedule
        self._stages_per_rank = stages_per_rank
        self._layers_per_stage = tuple(layers_per_stage) if layers_per_stage is not None else None
        self._pipeline_first_modules = tuple(pipeline_first_modules)
        self._pipeline_last_modules = tuple(pipeline_last_modules)
        self._pipeline: PipelineRunner | None = None
        self._pending_gradients: list[tuple[nn.Parameter, torch.Tensor | None]] = []
        self._data_parallel_mode = data_parallel_mode
        self._tp_plan = resolve_tp_plan(tp_plan)
        self._model_attribute = model_attribute
        self._layers_attribute = layers_attribute
        self._layout: ParallelLayout | None = None
        self._parallelized_network: nn.Module | None = None
        self._sample_position = SamplePosition()
        self._resume_position: SamplePosition | None = None
        self._async_checkpoint = async_checkpoint
        self._recompute = (recompute, recompute_method, recompute_num_layers, recompute_target)
        self._pretrained = Path(pretrained) if pretrained is not None else None
        self._preflight = preflight
        self.preflight_report: DoctorReport | None = None
        if self._pretrained is not None and not (self._pretrained / "config.json").is_file():
            raise FileNotFoundError(
                f"pretrained={str(pretrained)!r} is not a Hugging Face folder (no config.json in it)."
            )
        self._checkpoint_group: torch.distributed.ProcessGroup | None = None
        self._pending_save: PendingSave | None = None

    # ------------------------------------------------------------------ layout and mesh
    @property
    def layout(self) -> ParallelLayout:
        if self._layout is None:
            raise RuntimeError("The layout is resolved when the Trainer configures the strategy (world size known).")
        return self._layout

    @property
    def data_parallel_mode(self) -> str:
        return self._data_parallel_mode

    def _resolve_layout(self) -> ParallelLayout:
        world_size = self.num_nodes * self.num_processes
        return ParallelLayout.resolve(
            world_size=world_size,
            tensor_parallel_size=self._tensor_parallel_size,
            pipeline_parallel_size=self._pipeline_parallel_size,
            data_parallel_size=self._data_parallel_size,
            num_microbatches=self._num_microbatches,
            layers_per_stage=self._layers_per_stage,
        )

    @override
    def _configure_launcher(self) -> None:
        # Called by the Trainer once devices and nodes are known, before any process is launched.
        self._layout = self._resolve_layout()
        super()._configure_launcher()

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        config = _model_config(model, getattr(model, self._model_attribute.split(".")[0], None))
        if config is not None and self._layout is not None:
            self._layout.validate_model(config)

    @override
    def setup_environment(self) -> None:
        enable_collective_recording()  # before any group exists: failed collectives can then be named
        self._setup_distributed()
        self._layout = self._resolve_layout()
        self._device_mesh = build_device_mesh(self._layout, self.root_device.type, self._timeout)
        if self._preflight and self.preflight_report is None:
            self.preflight_report = run_doctor(self._layout, self._device_mesh, sizes=(2**20,), iterations=3)
            rank_zero_info(self.preflight_report.table())
            for warning in self.preflight_report.warnings:
                rank_zero_warn(warning)
        # `LightningModule.device_mesh` makes the mesh reachable from `configure_model` and the steps.
        self.lightning_module._device_mesh = self._device_mesh
        if self._async_checkpoint and self._checkpoint_group is None:
            # The background writer's collectives need a group of their own: they overlap with training's.
            self._checkpoint_group = torch.distributed.new_group(backend="gloo")

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        coordinates = self.layout.coordinates(self.global_rank)
        return {"num_replicas": self.layout.data_parallel_size, "rank": coordinates.dp}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Make the training sampler resumable at the consumed-samples position, and give every DataLoader
        its own generator: starting an iterator then draws its worker seed from it instead of from the
        global random state, so a resumed run's random stream matches the uninterrupted run's."""
        if not isinstance(dataloader, DataLoader):
            return dataloader
        trainer = self.lightning_module.trainer
        if trainer.training and type(dataloader.sampler) is DistributedSampler:
            sampler = ResumableDistributedSampler.like(dataloader.sampler)
            # Lightning starts the first iterator of a fit before it sets the sampler's epoch.
            sampler.set_epoch(trainer.fit_loop.epoch_progress.current.processed)
            if self._resume_position is not None:
                sampler.resume(self._resume_position.epoch, self._resume_position.consumed_in_epoch)
            dataloader = _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)
            # The sampler restores the position itself; Lightning's warning about a non-resumable loader is moot.
            warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
        elif trainer.training and self._resume_position is not None:
            rank_zero_warn(
                f"The training sampler is a {type(dataloader.sampler).__name__}, not the DistributedSampler Lightning"
                " adds: the resumed epoch starts from its first batch. Keep `use_distributed_sampler=True` for an"
                " exact data position."
            )
        if trainer.training:
            self._resume_position = None
        if dataloader.generator is None:
            dataloader.generator = torch.Generator().manual_seed(int(os.environ.get("PL_GLOBAL_SEED", 0)))
        return dataloader

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Every dp rank holds an equal share of the global batch (the sampler pads the epoch evenly).
        self._sample_position.advance(self.lightning_module.trainer.current_epoch,
                                      extract_batch_size(batch) * self.layout.data_parallel_size)

    def _group(self, name: str) -> torch.distributed.ProcessGroup:
        return self.device_mesh[name].get_group()

    # ------------------------------------------------------------------ model
    @property
    def network(self) -> nn.Module:
        """The LightningModule's network (`model_attribute`), sharded once the strategy is set up."""
        return self._network()

    def _network(self) -> nn.Module:
        network = _resolve_attribute(self.lightning_module, self._model_attribute, "model_attribute")
        if not isinstance(network, nn.Module):
            raise TypeError(
                f"LightningModule.{self._model_attribute} is {type(network).__name__}, not an nn.Module; build the"
                " network in `configure_model` or point TP3DStrategy(model_attribute=...) at it."
            )
        return network

    def _blocks(self, network: nn.Module) -> list[nn.Module]:
        layers = _resolve_attribute(network, self._layers_attribute, "layers_attribute")
        return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)

    def _parallelize(self, network: nn.Module) -> None:
        """Pipeline split, then tensor parallel (DTensor weights over tp), then activation recompute, then
        FSDP2 over dp, which must wrap parameters that are already DTensors (and whose units must contain
        the recomputed code, so the recompute runs on unsharded parameters).

        Runs once per network: `trainer.validate` / `test` after `fit` reuse the parallel model.
        """
        if network is self._parallelized_network:
            return
        layout = self.layout
        config = _model_config(self.lightning_module, network)
        if layout.tensor_parallel_size > 1:
            check_plan_matches(network, self._tp_plan)
        stage_modules: list[StageModule] = []
        pipeline_plan = None
        if layout.pipeline_parallel_size > 1:
            pipeline_plan, stage_modules = self._split_pipeline(network, config)
        elif config is not None:
            layout.validate_model(config)
        if layout.tensor_parallel_size > 1:
            apply_tensor_parallel(network, self.device_mesh["tp"], plan_entries_present(network, self._tp_plan))
        if self._recompute[0] != "none":
            self._apply_recompute(network, pipeline_plan)
        if self._data_parallel_mode == "fsdp":
            # Under pipelining each stage module is called directly, so each is an FSDP root of its own.
            roots = stage_modules or [network]
            apply_fsdp(roots, self.device_mesh["dp"], self._blocks(network))
        if pipeline_plan is not None:
            self._install_pipeline(network, pipeline_plan, stage_modules)
        self._parallelized_network = network

    def _apply_recompute(self, network: nn.Module, pipeline_plan: PipelinePlan | None) -> None:
        granularity, method, num_layers, target = self._recompute
        layers = _resolve_attribute(network, self._layers_attribute, "layers_attribute")
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
        layers = _resolve_attribute(network, self._layers_attribute, "layers_attribute")
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
            self._pipeline_schedule, layout.pipeline_parallel_size, self.device_mesh.get_local_rank("pp"),
            layout.num_microbatches, self._stages_per_rank,
            lambda stages: layout.stage_layer_ranges(num_layers, stages),
        )
        if config is not None:
            layout.validate_model(config, plan.num_stages)
        for path in self._pipeline_first_modules + self._pipeline_last_modules:
            _resolve_attribute(network, path, "pipeline_first_modules / pipeline_last_modules entry")
        prune_to_stages(network, plan, layers, self._pipeline_first_modules, self._pipeline_last_modules)
        return plan, [self._stage_module(network, layers, plan, index, layer_range)
                      for index, layer_range in zip(plan.stage_indices, plan.layer_ranges)]

    def _stage_module(self, network: nn.Module, layers: nn.ModuleDict, plan: PipelinePlan, index: int,
                      layer_range: range) -> StageModule:
        parts: list[nn.Module] = []
        if index == 0:
            parts += [_resolve_attribute(network, path, "pipeline_first_modules") for path in
                      self._pipeline_first_modules]
        parts += [layers[str(layer)] for layer in layer_range]
        if index == plan.num_stages - 1:
            parts += [_resolve_attribute(network, path, "pipeline_last_modules") for path in
                      self._pipeline_last_modules]
        return StageModule(parts)

    def _install_pipeline(self, network: nn.Module, plan: PipelinePlan, stage_modules: list[StageModule]) -> None:
        """Route `network(input_ids, labels=...)` through the schedule (the LightningModule contract)."""
        loss_fn = getattr(network, "loss_function", causal_lm_loss)
        runner = PipelineRunner(stage_modules, plan, self.layout.num_microbatches, loss_fn,
                                self._group("pp"), self.root_device)
        self._pipeline = runner
        strategy = self

        def pipelined_forward(input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
            train = network.training and torch.is_grad_enabled() and labels is not None
            if not train:
                return runner(input_ids, labels, train=False)
            # The schedule runs backward itself: the loss carries the fp16 loss scale and 1 / accumulation.
            scaler = getattr(strategy.precision_plugin, "scaler", None)
            loss_scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0
            runner.loss_scale = loss_scale / strategy.lightning_module.trainer.accumulate_grad_batches
            # Lightning zeroes gradients between `training_step` and `backward`, but the schedule computes
            # them inside `training_step`: keep them aside and add them in `backward`.
            parameters = list(network.parameters())
            previous = [parameter.grad for parameter in parameters]
            for parameter in parameters:
                parameter.grad = None
            loss = runner(input_ids, labels, train=True)
            strategy._pending_gradients = [(parameter, parameter.grad) for parameter in parameters]
            for parameter, grad in zip(parameters, previous):
                parameter.grad = grad
            return loss

        network.forward = pipelined_forward

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and not isinstance(scaler, ModelParallelGradScaler) and self.world_size > 1:
            raise ValueError(
                f"The precision plugin's {type(scaler).__name__} checks for inf/nan on each rank alone, so ranks would"
                " disagree on skipping a step; use plugins=[TP3DPrecision('16-mixed')] from lightning_tp3d.precision."
            )
        self.accelerator.setup(trainer)
        network = self._network()
        first_setup = network is not self._parallelized_network  # `validate` after `fit` keeps trained weights
        self._parallelize(network)
        _materialize_distributed_module(self.model, self.root_device)
        if first_setup and self._pretrained is not None:
            load_hf_weights(network, self._pretrained)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._route_gradient_clipping()

    @property
    def pipeline_timing(self) -> StageTiming | None:
        """This rank's busy and idle time in the last pipelined training step (None without pipelining)."""
        return None if self._pipeline is None else self._pipeline.timing

    # ------------------------------------------------------------------ step
    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Under pipelining the schedule already ran backward inside `training_step`; only the hooks run."""
        if self._pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        for parameter, grad in self._pending_gradients:
            if grad is not None:
                parameter.grad = grad if parameter.grad is None else parameter.grad.add_(grad)
        self._pending_gradients = []
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._data_parallel_mode == "replicate" and self.layout.data_parallel_size > 1:
            closure = self._with_gradient_all_reduce(closure)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def _with_gradient_all_reduce(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        # Runs after the (last accumulated) backward and before clipping and the optimizer update.
        def closure_then_all_reduce() -> Any:
            result = closure()
            all_reduce_gradients(self.lightning_module.parameters(), self._group("dp"), self.layout.data_parallel_size)
            return result

        return closure_then_all_reduce

    def _route_gradient_clipping(self) -> None:
        """Make Lightning's `gradient_clip_val` clip by the global norm over tp, dp shards and pp.

        Lightning clips through the precision plugin, which sees only local gradients and cannot mix
        plain tensors with DTensors; its two clipping methods are bound to this strategy's versions.
        """
        strategy = self

        def clip_grad_by_norm(plugin: Any, optimizer: Any, clip_val: float) -> None:
            clip_grad_norm_(plugin.main_params(optimizer), clip_val, strategy._group("pp"))

        def clip_grad_by_value(plugin: Any, optimizer: Any, clip_val: float) -> None:
            for parameter in plugin.main_params(optimizer):
                grad = parameter.grad
                if grad is not None:
                    (grad.to_local() if isinstance(grad, DTensor) else grad).clamp_(-clip_val, clip_val)

        self.precision_plugin.clip_grad_by_norm = types.MethodType(clip_grad_by_norm, self.precision_plugin)
        self.precision_plugin.clip_grad_by_value = types.MethodType(clip_grad_by_value, self.precision_plugin)

    # ------------------------------------------------------------------ checkpoints
    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return get_optimizer_state_dict(self.model, optimizer, options=_FLAT_OPTIMIZER_STATE)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint folder (see `lightning_tp3d.checkpoint`) atomically at `filepath`."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} writes DCP shards itself and takes no storage_options.")
        path = Path(self.broadcast(str(filepath)))
        self.finish_pending_save()
        state = {MODEL_GROUP: checkpoint.pop("state_dict")}
        state.update({f"optimizer_{index}": optimizer_state
                      for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", []))})
        # Only inside a running fit, whose teardown finishes the save; a save after fit is synchronous.
        trainer_state = self.lightning_module.trainer.state
        asynchronous = (self._async_checkpoint and trainer_state.fn == TrainerFn.FITTING
                        and trainer_state.status == TrainerStatus.RUNNING)
        self._pending_save = save_checkpoint(path, state, checkpoint, self._checkpoint_meta(checkpoint),
                                             asynchronous=asynchronous, process_group=self._checkpoint_group)

    def finish_pending_save(self) -> None:
        """Wait for an asynchronous save and move it under its name (a collective; a no-op without one)."""
        if self._pending_save is not None:
            self._pending_save.finish()
            self._pending_save = None

    @override
    def teardown(self) -> None:
        self.finish_pending_save()
        super().teardown()

    def _checkpoint_meta(self, checkpoint: Mapping[str, Any]) -> CheckpointMeta:
        config = _model_config(self.lightning_module, self._network())
        epoch, position = checkpoint.get("epoch", 0), self._sample_position
        return CheckpointMeta(
            layout=self.layout.to_dict(), world_size=self.world_size, global_step=checkpoint.get("global_step", 0),
            epoch=epoch, consumed_samples=position.consumed,
            consumed_samples_in_epoch=position.consumed_in_epoch if position.epoch == epoch else 0,
            network_prefix=self._model_attribute + ".", data_parallel_mode=self._data_parallel_mode,
            model_config=config.to_dict() if hasattr(config, "to_dict") else None,
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the model and optimizers at the current layout, whatever layout saved them, plus the
        random states (same layout only) and the data position; return the trainer's state for Lightning
        (loops, callbacks, LR schedulers). Files are always read with `weights_only=True`."""
        path = Path(self.broadcast(str(checkpoint_path)))
        self.finish_pending_save()
        strict = self.lightning_module.strict_loading
        model_state = get_model_state_dict(self.model)
        optimizer_states = [get_optimizer_state_dict(self.model, optimizer, options=_FLAT_OPTIMIZER_STATE)
                            for optimizer in self.optimizers]
        state = {MODEL_GROUP: model_state}
        state.update({f"optimizer_{index}": optimizer_state for index, optimizer_state in enumerate(optimizer_states)})
        meta, trainer_state = load_checkpoint(path, state, strict=strict)
        set_model_state_dict(self.model, model_state, options=StateDictOptions(strict=strict))
        for optimizer, optimizer_state in zip(self.optimizers, optimizer_states):
            set_optimizer_state_dict(self.model, optimizer, optimizer_state, options=_FLAT_OPTIMIZER_STATE)
        self._restore_run_position(path, meta)
        return trainer_state

    def _restore_run_position(self, path: Path, meta: CheckpointMeta) -> None:
        layout = self.layout
        current = (layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.data_parallel_size)
        if meta.parallel_sizes == current:
            restore_rng_state(load_rng_state(path, self.global_rank))
        else:
            rank_zero_warn(
                f"Resharding checkpoint {path}: saved at (tp, pp, dp) = {meta.parallel_sizes}, loading at {current}."
                " Model and optimizer state are resharded; random states belong to the old ranks and are not"
                " restored."
            )
        rank_zero_info(f"Resuming at step {meta.global_step}, epoch {meta.epoch}, after"
                       f" {meta.consumed_samples_in_epoch} samples of the epoch ({meta.consumed_samples} in all).")
        self._sample_position = SamplePosition(meta.epoch, meta.consumed_samples_in_epoch, meta.consumed_samples)
        self._resume_position = SamplePosition(meta.epoch, meta.consumed_samples_in_epoch, meta.consumed_samples)

    # ------------------------------------------------------------------ collectives
    @override
    def reduce(
        self, tensor: torch.Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> torch.Tensor | Any:
        """Reduce over the dp group by default: logged values are replicated over tp and pp ranks, so a
        reduction over the whole world would count each sample tp x pp times under `"sum"`."""
        if group is None and self._device_mesh is not None:
            group = self._group("dp")
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Tensor x pipeline x data parallel strategy of lightning_tp3d"
        )


# A collective failing inside these hooks raises CollectiveTimeoutError naming the group and the operation.
for _hook in ("training_step", "validation_step", "test_step", "predict_step", "optimizer_step", "backward",
              "save_checkpoint", "load_checkpoint", "barrier", "broadcast", "reduce"):
    setattr(TP3DStrategy, _hook, naming_stuck_collectives(getattr(TP3DStrategy, _hook)))
del _hook
