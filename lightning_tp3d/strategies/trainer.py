"""`TP3DStrategy`: tensor x pipeline x data parallel training inside `lightning.Trainer`.

Data flows one way: the constructor's sizes become a `ParallelLayout` (validated against the world
size before processes are launched and against the model config before any process group exists),
the layout becomes a ("pp", "dp", "tp") `DeviceMesh`, and the mesh shards the LightningModule's network
in the order pipeline split -> tensor parallel -> recompute -> data parallel. That work is done by
`ParallelCore` (shared with the Fabric strategy); this class adapts it to the Trainer's hooks.

Example usage::

    trainer = Trainer(accelerator="cpu", devices=4, strategy=TP3DStrategy(tensor_parallel_size=2))
    trainer.fit(CausalLMModule("tiny"), TokenDataModule(batch_size=4))

or by name, `Trainer(strategy="tp3d")`, which is plain data parallelism over all processes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_tp3d._compat.lightning import (
    detects_anomaly,
    materialize_distributed_module,
    set_device_mesh,
    should_accumulate,
    update_dataloader,
)
from lightning_tp3d.data.sampler import ResumableDistributedSampler, SamplePosition
from lightning_tp3d.io.checkpoint import PendingSave
from lightning_tp3d.io.storage import location
from lightning_tp3d.parallel.attributes import resolve_attribute
from lightning_tp3d.strategies.accumulation import accumulation_for, rescale_batch_progress
from lightning_tp3d.strategies.base import TP3DStrategyBase, name_stuck_collectives_in
from lightning_tp3d.strategies.checkpointing import model_config
from lightning_tp3d.strategies.core import ParallelCore
from lightning_tp3d.strategies.features import adapt_callbacks, check_lightning_features, check_network_is_not_compiled
from lightning_tp3d.strategies.loss_watch import ResumeLossWatch
from lightning_tp3d.strategies.non_finite import hold_schedulers_on_skipped_steps, release_schedulers
from lightning_tp3d.strategies.options import ParallelOptions, document_options, with_option_signature
from lightning_tp3d.strategies.precision import (
    TP3DPrecision,
    check_supported_precision,
    current_loss_scale,
    route_gradient_clipping,
)

__all__ = ["TP3DStrategy"]


@document_options
class TP3DStrategy(TP3DStrategyBase, ModelParallelStrategy):
    """Trainer strategy for 3-D parallel training on a ("pp", "dp", "tp") device mesh.

    Args:
        model_attribute: attribute of the LightningModule holding the network to parallelise.
        process_group_backend: "gloo" / "nccl"; default from the device (gloo on CPU, nccl on CUDA).
        timeout: timeout of every collective, on the default group and on each mesh dimension's groups; a
            collective that does not complete in time raises `CollectiveTimeoutError` naming the group
            (tp / pp / dp), the operation and the ranks, instead of hanging.
        async_checkpoint: write checkpoints in a background thread (tensors are first copied to CPU
            memory); a checkpoint appears under its name once the next save starts or fit ends.
        global_batch_size: samples per optimizer step at any data-parallel size: the Trainer accumulates
            global_batch_size / (per-rank batch x dp) batches (`strategies.accumulation`), so a run resumed at
            another dp (an elastic restart after a lost node) takes the same steps on the same samples.

    The options before those (`strategies.options.ParallelOptions`, one declaration for both strategies, the
    ledger and `docs/options.md`) are written into this docstring when the class is defined.

    Mixed precision: `Trainer(precision="bf16-mixed" | "bf16-true")`, or for fp16 with a loss scaler that
    every rank agrees on, `Trainer(plugins=[TP3DPrecision("16-mixed")])` (see `lightning_tp3d.strategies.precision`).
    """

    @with_option_signature
    def __init__(self, *, model_attribute: str = "model", process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, async_checkpoint: bool = False,
                 global_batch_size: int | None = None, **options: Any) -> None:
        if global_batch_size is not None and (not isinstance(global_batch_size, int) or global_batch_size < 1):
            raise ValueError(f"global_batch_size={global_batch_size!r}: give a positive number of samples per step.")
        parallel_options = ParallelOptions.from_keywords(type(self).__name__, options)
        tp, _, dp = parallel_options.sizes
        super().__init__(data_parallel_size=dp, tensor_parallel_size=tp, save_distributed_checkpoint=True,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.core = ParallelCore(parallel_options)
        self._model_attribute = model_attribute
        self._resume_position: SamplePosition | None = None
        self._async_checkpoint = async_checkpoint
        self._global_batch_size = global_batch_size
        self._saved_accumulation: int | None = None
        self._checkpoint_group: torch.distributed.ProcessGroup | None = None
        self._pending_save: PendingSave | None = None
        self._restore_lightning: list[Callable[[], None]] = []
        self.loss_watch = ResumeLossWatch()

    # A network built on the meta device (in `configure_model`) is materialised as this rank's shard in
    # `setup` and initialised by its `init_weights()` (see `parallel.materialize`); modules may rely on it.
    materializes_meta_networks = True

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        config = model_config(getattr(model, self._model_attribute.split(".")[0], None), model)
        if config is not None:
            self.core.validate_model(config)

    @override
    def setup_environment(self) -> None:
        self._setup_distributed_mesh()
        # `LightningModule.device_mesh` makes the mesh reachable from `configure_model` and the steps.
        set_device_mesh(self.lightning_module, self._device_mesh)
        if self._async_checkpoint and self._checkpoint_group is None:
            # The background writer's collectives need a group of their own: they overlap with training's.
            self._checkpoint_group = torch.distributed.new_group(backend="gloo")

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Make the training sampler resumable at the consumed-samples position, and give every DataLoader
        its own generator: starting an iterator then draws its worker seed from it instead of from the
        global random state, so a resumed run's random stream matches the uninterrupted run's."""
        if not isinstance(dataloader, DataLoader):
            return dataloader
        trainer = self.lightning_module.trainer
        if trainer.training:
            self._set_accumulation(trainer, dataloader)
        if trainer.training and type(dataloader.sampler) is DistributedSampler:
            sampler = ResumableDistributedSampler.like(dataloader.sampler)
            # Lightning starts the first iterator of a fit before it sets the sampler's epoch.
            sampler.set_epoch(trainer.fit_loop.epoch_progress.current.processed)
            if self._resume_position is not None:
                sampler.resume(self._resume_position.epoch, self._resume_position.consumed_in_epoch)
            dataloader = update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)
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

    def _set_accumulation(self, trainer: pl.Trainer, dataloader: DataLoader) -> None:
        """`global_batch_size`'s accumulation, and Lightning's batch counts of a checkpoint saved at another
        accumulation converted to this one (`strategies.accumulation`)."""
        if self._global_batch_size is not None:
            if any(isinstance(callback, GradientAccumulationScheduler) for callback in trainer.callbacks):
                raise ValueError("TP3DStrategy(global_batch_size=...) sets the accumulation itself; remove the"
                                 " GradientAccumulationScheduler callback, or leave global_batch_size unset.")
            trainer.accumulate_grad_batches = accumulation_for(self._global_batch_size, dataloader.batch_size,
                                                               self.layout.data_parallel_size,
                                                               trainer.accumulate_grad_batches)
        if self._saved_accumulation is not None:
            rescale_batch_progress(trainer.fit_loop.epoch_loop.batch_progress, self._saved_accumulation,
                                   trainer.accumulate_grad_batches)
            self._saved_accumulation = None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's step; its loss feeds the resume watch (`strategies.loss_watch`)."""
        output = super().training_step(*args, **kwargs)
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            warning = self.loss_watch.record(loss, self.reduce)
            if warning is not None:
                rank_zero_warn(warning)
        return output

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Every dp rank holds an equal share of the global batch (the sampler pads the epoch evenly).
        self.core.sample_position.advance(self.lightning_module.trainer.current_epoch,
                                          extract_batch_size(batch) * self.layout.data_parallel_size)

    # ------------------------------------------------------------------ model
    @property
    def network(self) -> nn.Module:
        """The LightningModule's network (`model_attribute`), sharded once the strategy is set up."""
        network = resolve_attribute(self.lightning_module, self._model_attribute, "model_attribute")
        if not isinstance(network, nn.Module):
            raise TypeError(
                f"LightningModule.{self._model_attribute} is {type(network).__name__}, not an nn.Module; build the"
                " network in `configure_model` or point TP3DStrategy(model_attribute=...) at it."
            )
        check_network_is_not_compiled(network, self._model_attribute)
        return network

    def _loss_scale(self) -> torch.Tensor | float:
        """What a pipeline schedule multiplies the loss by: the fp16 loss scale / gradient accumulation."""
        scale = current_loss_scale(getattr(self.precision_plugin, "scaler", None))
        return scale / self.lightning_module.trainer.accumulate_grad_batches

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Parallelise the network, then Lightning's own setup (`Strategy.setup`: accelerator, precision
        conversion, device, optimizers through `setup_optimizers`, precision plugin).

        `ModelParallelStrategy.setup` is skipped on purpose: it refuses a LightningModule without
        `configure_model`, which plain Lightning (and this strategy) accept, and what it adds to
        `Strategy.setup` (materialising meta modules, a barrier) happens here, after the network is
        sharded."""
        assert self.model is not None
        check_supported_precision(self.precision_plugin.precision, getattr(self.precision_plugin, "scaler", None),
                                  self.world_size, self.core.options.float8)
        check_lightning_features(trainer.callbacks, self.core.data_parallel.shards_optimizers, self.layout,
                                 detects_anomaly(trainer))
        if isinstance(self.precision_plugin, TP3DPrecision):
            self.precision_plugin.bind_device(self.root_device.type)
        network = self.network
        # Once per network: `validate` after `fit` keeps the parallel model and its trained weights.
        first_setup = self.core.parallelize(network, model_config(network, self.lightning_module), self._loss_scale,
                                            self.root_device)
        materialize_distributed_module(self.model, self.root_device)
        if first_setup:
            self.core.load_pretrained(network)
        Strategy.setup(self, trainer)
        self.barrier()
        route_gradient_clipping(self.precision_plugin, self.core, self.reduce_gradients)
        pp_group = self.core.group("pp") if self.layout.pipeline_parallel_size > 1 else None
        self._restore_lightning = self._restore_lightning or adapt_callbacks(trainer.callbacks, pp_group)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's optimizers, then this dp rank's parts of them in `"zero1"` mode
        (`parallel.data_parallel.zero`) and the LR schedulers held on skipped steps (`strategies.non_finite`)."""
        super().setup_optimizers(trainer)
        self.core.data_parallel.shard_optimizers(self.model, self.optimizers)
        hold_schedulers_on_skipped_steps(self.lightning_module, self.lr_scheduler_configs, self.step_guard)

    # ------------------------------------------------------------------ step
    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Under pipelining the schedule already ran backward inside `training_step`; only the hooks run."""
        if self.core.pipeline is None:
            trainer = self.lightning_module.trainer
            last = self.lightning_module.automatic_optimization and not should_accumulate(trainer)
            self.core.before_backward(self.lightning_module.parameters(), completes_gradients=last)
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.core.take_pipeline_gradients()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """All-reduce the gradients after the (last accumulated) backward, before unscaling, clipping and the
        update; skip the update on every rank when a loss or gradient is not finite on any
        (`strategies.non_finite`): no parameter, optimizer state or step-interval LR scheduler moves."""
        trainer = self.lightning_module.trainer
        scaler = getattr(self.precision_plugin, "scaler", None)

        def closure_then_all_reduce() -> Any:
            result = closure()
            parameters = self.reduce_gradients()
            if self._skips_non_finite_step(result, parameters, trainer.global_step, scaler):
                raise _SkippedStep
            return result

        try:
            output = super().optimizer_step(optimizer, closure_then_all_reduce, model, **kwargs)
            self.core.data_parallel.after_optimizer_step()
            return output
        except _SkippedStep:
            return None
        finally:
            if self.step_guard.skipped_steps:
                self.lightning_module.log("skipped_steps", float(self.step_guard.skipped_steps), on_step=True,
                                          on_epoch=False)

    def reduce_gradients(self) -> list[nn.Parameter]:
        """Reduce the module's gradients over dp (once per backward, see `ParallelCore.all_reduce_gradients`);
        returns the parameters the optimizer updates (in "zero1" mode: each dp rank's parts). Clipping
        calls it too: under manual optimization the module clips before `optimizer.step()`."""
        return self.core.all_reduce_gradients(self.lightning_module.parameters())

    # ------------------------------------------------------------------ checkpoints
    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return self.core.optimizer_state(self.model, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint folder (see `lightning_tp3d.io.checkpoint`) atomically at `filepath`."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} writes DCP shards itself and takes no storage_options.")
        path = location(self.broadcast(str(filepath)))
        self.finish_pending_save()
        model_state, optimizer_states = checkpoint.pop("state_dict"), checkpoint.pop("optimizer_states", [])
        meta = self.core.checkpoint_meta(self.world_size, checkpoint.get("global_step", 0), checkpoint.get("epoch", 0),
                                         self._model_attribute + ".", self.network,
                                         str(self.precision_plugin.precision), self.loss_watch.summary(self.reduce))
        # Only inside a running fit, whose teardown finishes the save; a save after fit is synchronous.
        trainer_state = self.lightning_module.trainer.state
        asynchronous = (self._async_checkpoint and trainer_state.fn == TrainerFn.FITTING
                        and trainer_state.status == TrainerStatus.RUNNING)
        meta = replace(meta, accumulate_grad_batches=self.lightning_module.trainer.accumulate_grad_batches)
        self._pending_save = self.core.save(path, model_state, optimizer_states, checkpoint, meta,
                                            asynchronous=asynchronous, process_group=self._checkpoint_group,
                                            module=self.lightning_module)

    def finish_pending_save(self) -> None:
        """Wait for an asynchronous save and move it under its name (a collective; a no-op without one)."""
        if self._pending_save is not None:
            self._pending_save.finish()
            self._pending_save = None

    @override
    def teardown(self) -> None:
        self.finish_pending_save()
        if self.lightning_module is not None:
            release_schedulers(self.lightning_module)
        while self._restore_lightning:
            self._restore_lightning.pop()()
        self.core.release()
        super().teardown()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the model and optimizers at the current layout, whatever layout saved them, plus the
        random states (same layout only) and the data position; return the trainer's state for Lightning
        (loops, callbacks, LR schedulers). Files are always read with `weights_only=True`."""
        path = location(self.broadcast(str(checkpoint_path)))
        self.finish_pending_save()
        meta, trainer_state = self.core.load(path, self.model, self.optimizers, self.lightning_module.strict_loading,
                                             self.global_rank)
        self._resume_position = replace(self.core.sample_position)
        self._saved_accumulation = meta.accumulate_grad_batches
        self.loss_watch.resumed(meta)
        return trainer_state

    # ------------------------------------------------------------------ collectives
    @override
    def reduce(
        self, tensor: torch.Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> torch.Tensor | Any:
        """Over the dp group by default (see `TP3DStrategyBase._reduction_group`)."""
        return super().reduce(tensor, group=self._reduction_group(group), reduce_op=reduce_op)


class _SkippedStep(Exception):
    """Raised inside the optimizer's closure to leave `optimizer.step` before it updates anything."""


name_stuck_collectives_in(TP3DStrategy, ("training_step", "validation_step", "test_step", "predict_step",
                                         "optimizer_step", "backward", "save_checkpoint", "load_checkpoint",
                                         "barrier", "broadcast", "reduce", "all_gather", "reduce_boolean_decision"))
