"""The Lightning conformance matrix: each feature a user's project relies on, run under TP3DStrategy at
several layouts and by plain Lightning on one process with the same module, data and seed.

A case is a function of a `Run` (the layout, or None for plain Lightning on one process) that trains with
one feature and returns what a user would observe: losses, the checkpoints kept and their scores, the
step a run stopped at, logged values, predictions. `tests/strategies/test_conformance.py` runs every
case in one 4-process world and on one process and compares the records; `python -m
tests.strategies.conformance` prints the docs table (docs/lightning.md holds it, a test keeps it equal).

Data order: under the strategy, Lightning gives the training loader a `DistributedSampler(shuffle=True,
seed=0)` over the dp ranks; on one process the reference loader gets the same sampler over 1 replica, so
a step of per-rank batch b at dp d trains on the same b x d samples as the one-process step of batch
b x d (rank r's rows are the reference batch's rows r, r + d, ...). Validation takes 3 batches, which
every dp split covers without padding.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.spike import SpikeDetection, TrainingSpikeException
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    DeviceStatsMonitor,
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    OnExceptionCheckpoint,
    RichModelSummary,
    StochasticWeightAveraging,
)
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm  # as users import it: before any strategy
from torch.utils.data import DataLoader, DistributedSampler

from lightning_tp3d import TP3DFabricStrategy, TP3DStrategy, grad_norm
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.models.llama import LlamaForCausalLM
from tests.helpers import LEARNING_RATE, SEQ_LEN, MemoryLogger, named_full, reference_network

__all__ = ["CASES", "LAYOUTS", "Case", "Run", "docs_table", "run_case"]

GLOBAL_BATCH = 4
WORLD = 4
VAL_BATCHES = 3
# name -> ((tp, pp, dp), data_parallel_mode)
LAYOUTS: dict[str, tuple[tuple[int, int, int], str]] = {
    "2x2x1": ((2, 2, 1), "replicate"),
    "1x2x2": ((1, 2, 2), "replicate"),
    "2x1x2": ((2, 1, 2), "replicate"),
    "1x2x2-fsdp": ((1, 2, 2), "fsdp"),
    "1x2x2-zero1": ((1, 2, 2), "zero1"),
}
MAIN = ("2x2x1", "1x2x2")


# ---------------------------------------------------------------------------------------------- the pieces
class ConformanceData(TokenDataModule):
    """The tiny corpus in windows of 16 tokens; on one process the training sampler is the one Lightning
    gives the strategy's loaders, over 1 replica (see the module docstring)."""

    def __init__(self, batch_size: int, one_process: bool) -> None:
        super().__init__(source="tiny", seq_len=SEQ_LEN, batch_size=batch_size, val_fraction=0.2)
        self.one_process = one_process

    def train_dataloader(self) -> DataLoader:
        if not self.one_process or self.trainer is not None and self.trainer.overfit_batches:
            return super().train_dataloader()
        sampler = DistributedSampler(self.train_dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
        return DataLoader(self.train_dataset, batch_size=self.batch_size, sampler=sampler, drop_last=True)


class ConformanceModule(CausalLMModule):
    """The reference decoder's module, counting its training steps; options for the cases below.

    `replica_of` = d (one process only) makes the training step return, as its output, the loss of the
    rows a dp rank 0 of d holds (rows 0, d, 2d, ...: see the module docstring) while its gradient stays
    the whole batch's: what a callback reading the step's output sees under DDP or the strategy at dp d.
    """

    def __init__(self, learning_rate: float = LEARNING_RATE, warmup_steps: int = 0, build_in_init: bool = False,
                 example_input: bool = False, fail_at_step: int | None = None, replica_of: int = 1) -> None:
        super().__init__("tiny", learning_rate=learning_rate, warmup_steps=warmup_steps)
        self.training_steps = 0
        self.fail_at_step, self.replica_of, self.build_in_init = fail_at_step, replica_of, build_in_init
        if build_in_init:  # callbacks whose `setup` reaches the network need it before `configure_model`
            self.model = LlamaForCausalLM(self.config)
        if example_input:
            self.example_input_array = torch.zeros(2, SEQ_LEN, dtype=torch.long)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.fail_at_step:
            raise RuntimeError(f"planned failure at step {self.fail_at_step}")
        self.training_steps += 1
        loss = super().training_step(batch, batch_idx)
        if self.replica_of > 1:
            with torch.no_grad():
                replica = self.model(batch["input_ids"][::self.replica_of], labels=batch["labels"][::self.replica_of])
            loss = loss + (replica - loss).detach()
        return loss

    def configure_optimizers(self) -> Any:
        if not self.build_in_init:
            return super().configure_optimizers()
        trainable = [parameter for parameter in self.parameters() if parameter.requires_grad]
        return torch.optim.AdamW(trainable, lr=self.hparams.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)


@dataclass
class Run:
    """One case's run: `layout` names an entry of LAYOUTS, or is None for plain Lightning on one process."""

    layout: str | None
    directory: Path
    replica_of: int = 1  # one process only: see ConformanceModule
    logger: MemoryLogger = field(default_factory=MemoryLogger)

    def module(self, **options: Any) -> ConformanceModule:
        return ConformanceModule(replica_of=self.replica_of, **options)

    @property
    def sizes(self) -> tuple[int, int, int]:
        return LAYOUTS[self.layout][0] if self.layout else (1, 1, 1)

    @property
    def dp(self) -> int:
        return self.sizes[2]

    @property
    def rank(self) -> int:
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    def strategy(self) -> TP3DStrategy | str:
        if self.layout is None:
            return "auto"
        (tp, pp, _), mode = LAYOUTS[self.layout]
        return TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_mode=mode)

    def trainer(self, **overrides: Any) -> L.Trainer:
        kwargs = dict(accelerator="cpu", devices=WORLD if self.layout else 1, strategy=self.strategy(),
                      max_steps=4, logger=self.logger, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0, log_every_n_steps=1,
                      limit_test_batches=VAL_BATCHES, limit_predict_batches=2, default_root_dir=self.directory)
        kwargs.update(overrides)
        return L.Trainer(**kwargs)

    def data(self, global_batch: int = GLOBAL_BATCH) -> ConformanceData:
        return ConformanceData(global_batch // self.dp, one_process=self.layout is None)

    def losses(self) -> list[float]:
        return self.logger.values("train_loss")

    def path(self, name: str) -> Path:
        return self.directory / name


def _step_of(path: str) -> int:
    return int(re.search(r"step=(\d+)", path).group(1))


def _saved_step(path: str | Path) -> int:
    """The global step a checkpoint holds (a folder's meta.json, or Lightning's one file)."""
    path = Path(path)
    if path.is_dir():
        return json.loads((path / "meta.json").read_text())["global_step"]
    return torch.load(path, weights_only=True, map_location="cpu")["global_step"]


def _names(folder: Path) -> list[str]:
    return sorted(entry.name for entry in folder.iterdir()) if folder.exists() else []


def _validate_every(steps: int) -> dict[str, Any]:
    return dict(val_check_interval=steps, check_val_every_n_epoch=None, limit_val_batches=VAL_BATCHES)


# ---------------------------------------------------------------------------------------------- callbacks
def model_checkpoint_top_k(run: Run) -> dict[str, Any]:
    checkpoint = ModelCheckpoint(dirpath=run.path("checkpoints"), filename="{step}", monitor="val_loss",
                                 save_top_k=2, mode="min", save_last=True)
    trainer = run.trainer(callbacks=[checkpoint], enable_checkpointing=True, max_steps=6, **_validate_every(2))
    trainer.fit(ConformanceModule(), run.data())
    record = {"kept": sorted((_step_of(path), float(score)) for path, score in checkpoint.best_k_models.items()),
              "best": _step_of(checkpoint.best_model_path), "best_score": float(checkpoint.best_model_score),
              "on_disk": _names(run.path("checkpoints")), "last": _saved_step(checkpoint.last_model_path),
              "val_losses": run.logger.values("val_loss")}
    record["validate_best"] = trainer.validate(datamodule=run.data(), ckpt_path="best", verbose=False)[0]["val_loss"]
    record["test_last"] = trainer.test(datamodule=run.data(), ckpt_path="last", verbose=False)[0]["test_loss"]
    return record


def model_checkpoint_every_n_steps(run: Run) -> dict[str, Any]:
    checkpoint = ModelCheckpoint(dirpath=run.path("checkpoints"), filename="{step}", every_n_train_steps=2,
                                 save_top_k=-1)
    run.trainer(callbacks=[checkpoint], enable_checkpointing=True, max_steps=6).fit(ConformanceModule(), run.data())
    return {"on_disk": _names(run.path("checkpoints")),
            "steps": [_saved_step(run.path("checkpoints") / name) for name in _names(run.path("checkpoints"))]}


def model_checkpoint_link(run: Run) -> dict[str, Any]:
    checkpoint = ModelCheckpoint(dirpath=run.path("checkpoints"), filename="{step}", every_n_train_steps=2,
                                 save_top_k=1, save_last="link")
    run.trainer(callbacks=[checkpoint], enable_checkpointing=True, max_steps=6).fit(ConformanceModule(), run.data())
    last = run.path("checkpoints") / "last.ckpt"
    return {"on_disk": _names(run.path("checkpoints")), "is_link": last.is_symlink(),
            "target": os.readlink(last) if last.is_symlink() else None, "last_step": _saved_step(last)}


def model_checkpoint_versions(run: Run) -> dict[str, Any]:
    """The same file name saved again: Lightning's version counter asks every rank whether it exists."""
    kept = []
    for _ in range(2):
        checkpoint = ModelCheckpoint(dirpath=run.path("checkpoints"), filename="weights", every_n_train_steps=2,
                                     save_top_k=-1)
        run.trainer(callbacks=[checkpoint], enable_checkpointing=True, max_steps=4).fit(ConformanceModule(), run.data())
        kept.append(sorted(Path(path).name for path in checkpoint.best_k_models))
    return {"kept": kept, "on_disk": _names(run.path("checkpoints"))}


def on_exception_checkpoint(run: Run) -> dict[str, Any]:
    module = ConformanceModule(fail_at_step=3)
    try:
        run.trainer(callbacks=[OnExceptionCheckpoint(run.path("checkpoints"))], enable_checkpointing=True).fit(
            module, run.data())
        error = None
    except RuntimeError as exception:
        error = str(exception)
    saved = run.path("checkpoints") / "on_exception.ckpt"
    return {"error": error, "on_disk": _names(run.path("checkpoints")), "step": _saved_step(saved)}


def early_stopping(run: Run) -> dict[str, Any]:
    # The validation loss falls, so in mode "max" it fails to improve from the second validation on.
    stopping = EarlyStopping(monitor="val_loss", mode="max", patience=2)
    trainer = run.trainer(callbacks=[stopping], max_steps=20, **_validate_every(1))
    trainer.fit(ConformanceModule(), run.data())
    return {"stopped_at": trainer.global_step, "val_losses": run.logger.values("val_loss"),
            "wait_count": stopping.wait_count, "should_stop": trainer.should_stop}


def learning_rate_monitor(run: Run) -> dict[str, Any]:
    trainer = run.trainer(callbacks=[LearningRateMonitor(logging_interval="step")], max_steps=5)
    trainer.fit(ConformanceModule(warmup_steps=4), run.data())
    return {"lr": run.logger.values("lr-AdamW"), "losses": run.losses()}


class _Captured:
    """A summary callback that keeps what it would print (Lightning prints on global rank 0 only)."""

    captured: dict[str, Any] | None = None

    def summarize(self, summary_data: list, total_parameters: int, trainable_parameters: int, model_size: float,
                  total_training_modes: dict[str, int], total_flops: int, **kwargs: Any) -> None:
        self.captured = {"rows": [[name, list(values)] for name, values in summary_data],
                         "total": total_parameters, "trainable": trainable_parameters, "size": model_size,
                         "modes": total_training_modes, "flops": total_flops}


class CapturedModelSummary(_Captured, ModelSummary):
    pass


class CapturedRichModelSummary(_Captured, RichModelSummary):
    pass


def _summary(run: Run, callback: _Captured, **module_options: Any) -> dict[str, Any]:
    run.trainer(callbacks=[callback], max_steps=1).fit(ConformanceModule(**module_options), run.data())
    return {"summary": callback.captured, "rank": run.rank}


def model_summary(run: Run) -> dict[str, Any]:
    return _summary(run, CapturedModelSummary(max_depth=2))


def rich_model_summary(run: Run) -> dict[str, Any]:
    return _summary(run, CapturedRichModelSummary(max_depth=1))


def model_summary_flops(run: Run) -> dict[str, Any]:
    return _summary(run, CapturedModelSummary(max_depth=1), example_input=True)


def device_stats_monitor(run: Run) -> dict[str, Any]:
    run.trainer(callbacks=[DeviceStatsMonitor(cpu_stats=True)], max_steps=2).fit(ConformanceModule(), run.data())
    return {"keys": sorted({name for _, name, _ in run.logger.records if "DeviceStatsMonitor" in name}),
            "losses": run.losses()}


def _refused(run: Run, callbacks: list[Any], **module_options: Any) -> dict[str, Any]:
    module = ConformanceModule(**module_options)
    try:
        run.trainer(callbacks=callbacks, max_epochs=2, max_steps=-1, limit_train_batches=2).fit(module, run.data())
        error = None
    except Exception as exception:  # noqa: BLE001 - the record says what was raised
        error = f"{type(exception).__name__}: {exception}"
    return {"error": error, "training_steps": module.training_steps, "losses": run.losses()}


def stochastic_weight_averaging(run: Run) -> dict[str, Any]:
    return _refused(run, [StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)])


class UnfreezeMLPs(BaseFinetuning):
    """Freezes every MLP before fit and unfreezes them into a new parameter group at epoch 1."""

    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(self._mlps(pl_module))

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(self._mlps(pl_module), optimizer, lr=1e-3)

    @staticmethod
    def _mlps(pl_module: L.LightningModule) -> list[torch.nn.Module]:
        return [module for name, module in pl_module.named_modules() if name.endswith(".mlp")]


def finetuning(run: Run) -> dict[str, Any]:
    record = _refused(run, [UnfreezeMLPs()], build_in_init=True)
    return record


def gradient_accumulation_scheduler(run: Run) -> dict[str, Any]:
    trainer = run.trainer(callbacks=[GradientAccumulationScheduler({0: 1, 1: 2})], max_epochs=2, max_steps=-1,
                          limit_train_batches=4)
    trainer.fit(ConformanceModule(), run.data())
    return {"losses": run.losses(), "steps": trainer.global_step}


def learning_rate_finder(run: Run) -> dict[str, Any]:
    """On dp ranks the finder's curve is dp rank 0's replica loss, as under DDP (the test emulates it)."""
    trainer = run.trainer(max_steps=3)
    module, data = run.module(), run.data()
    finder = Tuner(trainer).lr_find(module, datamodule=data, min_lr=1e-4, max_lr=1e-1, num_training=6,
                                    early_stop_threshold=None)
    suggestion = module.hparams.learning_rate
    trainer.fit(module, data)
    return {"lr": finder.results["lr"], "loss": finder.results["loss"], "suggestion": suggestion,
            "losses": run.losses()}


def batch_size_finder(run: Run) -> dict[str, Any]:
    """Lightning refuses the batch-size finder under every distributed strategy (DDP's too)."""
    trainer = run.trainer(max_steps=2)
    module, data = ConformanceModule(), run.data()
    try:
        Tuner(trainer).scale_batch_size(module, datamodule=data, mode="power", steps_per_trial=1, max_trials=2,
                                        init_val=data.batch_size)
        trainer.fit(module, data)
        error = None
    except ValueError as exception:
        error = f"{type(exception).__name__}: {exception}"
    return {"error": error, "training_steps": module.training_steps, "global_batch": data.batch_size * run.dp,
            "losses": run.losses()}


class _SaveAtStart(L.Callback):
    """`trainer.save_checkpoint` before the first optimizer step (as the tuner and many users do)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def checkpoint_before_first_step(run: Run) -> dict[str, Any]:
    path = run.path("start.ckpt")
    run.trainer(callbacks=[_SaveAtStart(path)]).fit(ConformanceModule(), run.data())
    saved, resumed = run.losses(), Run(run.layout, run.directory)
    resumed.trainer().fit(ConformanceModule(), resumed.data(), ckpt_path=path)
    return {"losses": saved, "resumed_losses": resumed.losses()}


class _CompiledModule(ConformanceModule):
    def configure_model(self) -> None:
        super().configure_model()
        self.model = torch.compile(self.model)


def compiled_network(run: Run) -> dict[str, Any]:
    module = _CompiledModule()
    try:
        run.trainer().fit(module, run.data())
        error = None
    except Exception as exception:  # noqa: BLE001 - the record says what was raised
        error = f"{type(exception).__name__}: {exception}"
    return {"error": error, "training_steps": module.training_steps}


# ---------------------------------------------------------------------------------------------- Trainer flags
def _fit_losses(run: Run, module: L.LightningModule | None = None, **overrides: Any) -> dict[str, Any]:
    trainer = run.trainer(**overrides)
    module = module or ConformanceModule()
    trainer.fit(module, run.data())
    steps = {key: [step for step, name, _ in run.logger.records if name == key] for key in ("train_loss", "val_loss")}
    return {"losses": run.losses(), "loss_steps": steps["train_loss"], "val_losses": run.logger.values("val_loss"),
            "val_steps": steps["val_loss"],
            "global_step": trainer.global_step, "epochs": trainer.current_epoch}


def gradient_clip_norm(run: Run) -> dict[str, Any]:
    return _fit_losses(run, gradient_clip_val=0.05)


def gradient_clip_value(run: Run) -> dict[str, Any]:
    return _fit_losses(run, gradient_clip_val=0.002, gradient_clip_algorithm="value")


def accumulate_grad_batches(run: Run) -> dict[str, Any]:
    return _fit_losses(run, accumulate_grad_batches=2)


def val_check_interval_int(run: Run) -> dict[str, Any]:
    return _fit_losses(run, max_steps=6, val_check_interval=3, limit_val_batches=VAL_BATCHES)


def val_check_interval_float(run: Run) -> dict[str, Any]:
    return _fit_losses(run, max_steps=-1, max_epochs=1, limit_train_batches=4, val_check_interval=0.5,
                       limit_val_batches=VAL_BATCHES)


def check_val_every_n_epoch(run: Run) -> dict[str, Any]:
    return _fit_losses(run, max_steps=-1, max_epochs=4, limit_train_batches=1, check_val_every_n_epoch=2,
                       limit_val_batches=VAL_BATCHES)


def limit_batches(run: Run) -> dict[str, Any]:
    return _fit_losses(run, max_steps=-1, max_epochs=2, limit_train_batches=3, limit_val_batches=2)


class _CountValidation(ConformanceModule):
    def __init__(self) -> None:
        super().__init__()
        self.sanity_steps = 0

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.sanity_steps += int(self.trainer.sanity_checking)
        return super().validation_step(batch, batch_idx)


def num_sanity_val_steps(run: Run) -> dict[str, Any]:
    module = _CountValidation()
    record = _fit_losses(run, module, num_sanity_val_steps=2, max_steps=2, **_validate_every(2))
    return {**record, "sanity_steps": module.sanity_steps}


def fast_dev_run(run: Run) -> dict[str, Any]:
    """Lightning replaces the loggers with a dummy under fast_dev_run: the metrics stay in callback_metrics."""
    module = ConformanceModule()
    trainer = run.trainer(fast_dev_run=2, limit_val_batches=None)
    trainer.fit(module, run.data())
    return {"training_steps": module.training_steps, "logged": run.logger.records,
            "metrics": {name: float(value) for name, value in trainer.callback_metrics.items()}}


def overfit_batches(run: Run) -> dict[str, Any]:
    return _fit_losses(run, overfit_batches=2, max_steps=-1, max_epochs=3)


def max_time(run: Run) -> dict[str, Any]:
    # The one-process reference runs 4x longer, so that its losses cover every step a parallel run takes in
    # its 2 s: a step of the tiny model on one process is not 4x slower than on 4 ranks sharing the cores.
    started, seconds = time.monotonic(), 2 if run.layout else 8
    record = _fit_losses(run, max_time={"seconds": seconds}, max_steps=-1, max_epochs=1000, limit_train_batches=2)
    return {**record, "seconds": time.monotonic() - started}


def max_epochs(run: Run) -> dict[str, Any]:
    return _fit_losses(run, max_steps=-1, max_epochs=3, limit_train_batches=2)


def deterministic(run: Run) -> dict[str, Any]:
    return _fit_losses(run, deterministic=True)


def detect_anomaly(run: Run) -> dict[str, Any]:
    module = ConformanceModule()
    try:
        record = _fit_losses(run, module, detect_anomaly=True, max_steps=2)
    except Exception as exception:  # noqa: BLE001 - refused at tensor parallel sizes > 1
        record = {"error": f"{type(exception).__name__}: {exception}", "losses": run.losses()}
    return {**record, "training_steps": module.training_steps}


def log_every_n_steps(run: Run) -> dict[str, Any]:
    return _fit_losses(run, max_steps=7, log_every_n_steps=3)


def _profiled(run: Run, profiler: str) -> dict[str, Any]:
    trainer = run.trainer(profiler=profiler, max_steps=2)
    trainer.fit(ConformanceModule(), run.data())
    return {"losses": run.losses(), "profiler": type(trainer.profiler).__name__}


def profiler_simple(run: Run) -> dict[str, Any]:
    return _profiled(run, "simple")


def profiler_advanced(run: Run) -> dict[str, Any]:
    return _profiled(run, "advanced")


def profiler_pytorch(run: Run) -> dict[str, Any]:
    return _profiled(run, "pytorch")


# ---------------------------------------------------------------------------------------------- loops
def evaluation_loops(run: Run) -> dict[str, Any]:
    checkpoint = ModelCheckpoint(dirpath=run.path("checkpoints"), filename="{step}", monitor="val_loss", mode="min",
                                 save_top_k=1, save_last=True)
    every = ModelCheckpoint(dirpath=run.path("every"), filename="{step}", every_n_train_steps=2, save_top_k=-1)
    trainer = run.trainer(callbacks=[checkpoint, every], enable_checkpointing=True, max_steps=4, **_validate_every(2))
    trainer.fit(ConformanceModule(), run.data())
    data = run.data()
    validate_best = trainer.validate(datamodule=data, ckpt_path="best", verbose=False)[0]["val_loss"]
    predictions = trainer.predict(datamodule=data, ckpt_path="best", return_predictions=True)
    test_last = trainer.test(datamodule=data, ckpt_path="last", verbose=False)[0]["test_loss"]
    best = _step_of(checkpoint.best_model_path)
    # A checkpoint path restores the callbacks' states saved in it, as on one process (the monitored
    # callback had no best model yet at step 2, so "best" would be refused after it).
    path = run.path("every") / "step=2.ckpt"
    validate_path = trainer.validate(datamodule=data, ckpt_path=path, verbose=False)[0]["val_loss"]
    trainer_predict = L.Trainer(accelerator="cpu", devices=WORLD if run.layout else 1, strategy=run.strategy(),
                                logger=False, enable_progress_bar=False, enable_model_summary=False,
                                limit_predict_batches=2, default_root_dir=run.directory)
    fresh = trainer_predict.predict(ConformanceModule(), datamodule=run.data(), ckpt_path=path)
    return {"validate_best": validate_best, "test_last": test_last, "validate_path": validate_path,
            "best": best, "best_after_path": checkpoint.best_model_path,
            "predictions": [p[:, -1] for p in predictions[:2]],
            "fresh_predictions": [p[:, -1] for p in fresh]}


class _ManualModule(ConformanceModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = self.model(batch["input_ids"], labels=batch["labels"])
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        optimizer.step()
        self.log("train_loss", loss, sync_dist=True)
        return loss


def manual_optimization(run: Run) -> dict[str, Any]:
    return _fit_losses(run, _ManualModule())


class _PlateauModule(ConformanceModule):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate, betas=(0.9, 0.95),
                                      weight_decay=0.0)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss",
                                                         "interval": "step", "frequency": 2}}


def reduce_lr_on_plateau(run: Run) -> dict[str, Any]:
    monitor = LearningRateMonitor(logging_interval="step")
    record = _fit_losses(run, _PlateauModule(), callbacks=[monitor], max_steps=7, **_validate_every(2))
    return {**record, "lr": run.logger.values("lr-AdamW")}


class _LoggingModule(ConformanceModule):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        tokens = batch["input_ids"].float()
        self.log("token_sum", tokens.sum(), reduce_fx="sum", sync_dist=True, on_step=True, on_epoch=True)
        self.log("token_max", tokens.max(), reduce_fx="max", sync_dist=True, on_step=False, on_epoch=True)
        self.log("loss_epoch", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.log("val_samples", float(batch["input_ids"].shape[0]), reduce_fx="sum", sync_dist=True)
        return super().validation_step(batch, batch_idx)


def self_log(run: Run) -> dict[str, Any]:
    _fit_losses(run, _LoggingModule(), max_steps=-1, max_epochs=2, limit_train_batches=2,
                limit_val_batches=VAL_BATCHES)
    return {name: run.logger.values(name) for name in ("token_sum_step", "token_sum_epoch", "token_max",
                                                        "loss_epoch", "val_samples", "train_loss")}


class _GatheringModule(ConformanceModule):
    def __init__(self) -> None:
        super().__init__()
        self.gathered: list[torch.Tensor] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.gathered.append(self.all_gather(batch["input_ids"]))
        return super().training_step(batch, batch_idx)


def all_gather(run: Run) -> dict[str, Any]:
    module = _GatheringModule()
    run.trainer(max_steps=2).fit(module, run.data())
    return {"gathered": module.gathered}


def loggers(run: Run) -> dict[str, Any]:
    csv, tensorboard = CSVLogger(run.path("logs")), TensorBoardLogger(run.path("logs"), name="tb")
    run.trainer(logger=[csv, tensorboard], max_steps=4, **_validate_every(2)).fit(ConformanceModule(), run.data())
    record: dict[str, Any] = {"rank": run.rank}
    if run.rank == 0:  # the loggers write on global rank 0 only
        lines = (Path(csv.log_dir) / "metrics.csv").read_text().splitlines()
        record["csv"] = [lines[0].split(",")] + [[float(value) if value else None for value in line.split(",")]
                                                 for line in lines[1:]]
        record["tensorboard"] = read_tensorboard_scalars(Path(tensorboard.log_dir))
    return record


def read_tensorboard_scalars(folder: Path) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every scalar in the event files of `folder` (records: u64 length, u32 crc,
    data, u32 crc)."""
    from tensorboardX.proto.event_pb2 import Event

    scalars = []
    for file in sorted(folder.glob("events.out.tfevents.*")):
        data, offset = file.read_bytes(), 0
        while offset < len(data):
            length = int.from_bytes(data[offset:offset + 8], "little")
            event = Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            scalars += [(value.tag, event.step, value.simple_value) for value in event.summary.value]
    return scalars


# ---------------------------------------------------------------------------------------------- decisions
class _Votes(L.Callback):
    """At the start of training: the answers of `reduce_boolean_decision` when rank 3 alone votes True,
    and when it alone votes False."""

    answers: dict[str, bool] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        alone = trainer.global_rank == WORLD - 1
        decide = trainer.strategy.reduce_boolean_decision
        self.answers = {"one_true_all": decide(alone, all=True), "one_true_any": decide(alone, all=False),
                        "one_false_all": decide(not alone, all=True), "one_false_any": decide(not alone, all=False)}


def reduce_boolean_decision(run: Run) -> dict[str, Any]:
    votes = _Votes()
    run.trainer(callbacks=[votes], max_steps=1).fit(ConformanceModule(), run.data())
    return votes.answers


class _GradNorms(L.Callback):
    norms: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.norms = self.norms + [{key: float(value) for key, value in grad_norm(pl_module, 2).items()}]


def grad_norm_helper(run: Run) -> dict[str, Any]:
    norms = _GradNorms()
    run.trainer(callbacks=[norms], max_steps=2).fit(ConformanceModule(), run.data())
    return {"norms": norms.norms}


class _LogsLightningGradNorm(ConformanceModule):
    """Lightning's documented idiom, unchanged: its own `grad_norm` logged in `on_before_optimizer_step`."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.log_dict(lightning_grad_norm(self, norm_type=2))


def lightning_grad_norm_idiom(run: Run) -> dict[str, Any]:
    """Every step's logged norms: each parameter's under its full name, and the total."""
    run.trainer(max_steps=2).fit(_LogsLightningGradNorm(), run.data())
    names = sorted({name for _, name, _ in run.logger.records if name.startswith("grad_2.0_norm")})
    return {"names": names, "norms": {name: run.logger.values(name) for name in names}}


def load_from_checkpoint(run: Run) -> dict[str, Any]:
    """One process reads the checkpoint, as a user after training would: a step's, and the `last.ckpt` that
    `save_last=True` writes, with `map_location="cpu"`."""
    checkpoint = ModelCheckpoint(dirpath=run.path("checkpoints"), filename="{step}", every_n_train_steps=2,
                                 save_last=True)
    run.trainer(callbacks=[checkpoint], enable_checkpointing=True, max_steps=2).fit(ConformanceModule(), run.data())
    record: dict[str, Any] = {"rank": run.rank}
    if run.rank == 0:
        module = ConformanceModule.load_from_checkpoint(run.path("checkpoints") / "step=2.ckpt")
        record["weights"] = {name: value.detach().clone() for name, value in module.state_dict().items()}
        record["hparams"] = dict(module.hparams)
        last = ConformanceModule.load_from_checkpoint(run.path("checkpoints") / "last.ckpt", map_location="cpu")
        record["last_weights"] = {name: value.detach().clone() for name, value in last.state_dict().items()}
    return record


# ---------------------------------------------------------------------------------------------- Fabric
def _fabric(run: Run, **options: Any) -> L.Fabric:
    strategy: Any = "auto"
    if run.layout is not None:
        (tp, pp, _), mode = LAYOUTS[run.layout]
        strategy = TP3DFabricStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_mode=mode)
    fabric = L.Fabric(accelerator="cpu", devices=WORLD if run.layout else 1, strategy=strategy, **options)
    fabric.launch()
    return fabric


def _fabric_training(fabric: L.Fabric) -> tuple[Any, Any]:
    model = fabric.setup(reference_network())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.0)
    return model, fabric.setup_optimizers(optimizer)


def _fabric_batches(fabric: L.Fabric, run: Run, batch_size: int) -> Any:
    """Per-rank batches of `batch_size`; one process reads with the sampler Fabric gives dp ranks."""
    data = ConformanceData(batch_size, one_process=run.layout is None)
    data.setup()
    sampler = DistributedSampler(data.train_dataset, 1, 0, shuffle=True, seed=0) if run.layout is None else None
    loader = DataLoader(data.train_dataset, batch_size=batch_size, shuffle=sampler is None, sampler=sampler,
                        drop_last=True)
    return iter(fabric.setup_dataloaders(loader))


def _dp_rank(fabric: L.Fabric) -> int:
    layout = getattr(fabric.strategy, "layout", None)
    return layout.coordinates(fabric.global_rank).dp if layout is not None else 0


def fabric_collectives(run: Run) -> dict[str, Any]:
    fabric = _fabric(run)
    replica = _dp_rank(fabric)
    fabric.barrier()
    alone = fabric.global_rank == WORLD - 1
    decide = fabric.strategy.reduce_boolean_decision
    return {"all_reduce": float(fabric.all_reduce(torch.tensor(float(replica + 1)))),
            "all_gather": fabric.all_gather(torch.tensor([replica])).flatten().tolist(),
            "broadcast": fabric.broadcast({"from": fabric.global_rank}, src=0),
            "votes": [decide(alone, all=True), decide(alone, all=False), decide(not alone, all=True),
                      decide(not alone, all=False)]}


def fabric_accumulate_and_clip(run: Run) -> dict[str, Any]:
    """Two batches per step under `no_backward_sync`, `backward(loss / 2)`, global-norm clipping."""
    fabric = _fabric(run)
    model, optimizer = _fabric_training(fabric)
    batches = _fabric_batches(fabric, run, 2 * GLOBAL_BATCH // 2 // run.dp)
    losses, norms = [], []
    for _ in range(3):
        for index in range(2):
            batch = next(batches)
            with fabric.no_backward_sync(model, enabled=index == 0):
                loss = model(batch["input_ids"], labels=batch["labels"])
                fabric.backward(loss / 2)
            losses.append(float(fabric.all_reduce(loss.detach())))
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=0.05)))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "norms": norms}


def fabric_save_load_filter(run: Run) -> dict[str, Any]:
    """Save the norms and the head only (`filter`), load into a fresh model with `strict=False`."""
    fabric = _fabric(run)
    model, optimizer = _fabric_training(fabric)
    batch = next(_fabric_batches(fabric, run, GLOBAL_BATCH // run.dp))
    fabric.backward(model(batch["input_ids"], labels=batch["labels"]))
    optimizer.step()
    path = fabric.broadcast(str(run.path("filtered.ckpt")))
    keep = {"model": lambda name, _: "norm" in name or "lm_head" in name}
    fabric.save(path, {"model": model, "step": 1}, filter=keep)
    fresh, _ = _fabric_training(fabric)
    state = {"model": fresh, "step": 0}
    fabric.load(path, state, strict=False)
    try:  # plain Fabric saves what an optimizer filter keeps; the strategy saves a sharded state whole
        fabric.save(run.path("optimizer.ckpt"), {"model": model, "optimizer": optimizer},
                    filter={"optimizer": lambda name, _: name == "state"})
        optimizer_filter = None
    except ValueError as error:
        optimizer_filter = str(error)
    return {"step": state["step"], "loaded": named_full(fresh, "data", "_forward_module."),
            "trained": named_full(model, "data", "_forward_module."), "optimizer_filter": optimizer_filter}


def fabric_spike_detection(run: Run) -> dict[str, Any]:
    """Rank 3 alone (the only rank on one process) sees a spike at batch 5: every rank stops there."""
    detection = SpikeDetection(window=3, warmup=2, exclude_batches_path=run.path("skip"))
    fabric = _fabric(run, callbacks=[detection])
    spiking = fabric.global_rank == (WORLD - 1 if run.layout else 0)
    try:
        for index in range(8):
            loss = torch.tensor(100.0 if spiking and index == 5 else 1.0 + 0.01 * index)
            fabric.call("on_train_batch_end", fabric=fabric, loss=loss, batch=None, batch_idx=index)
        stopped_at = None
    except TrainingSpikeException:
        stopped_at = index
    return {"stopped_at": stopped_at, "excluded": detection.bad_batches}


# ---------------------------------------------------------------------------------------------- the matrix
@dataclass(frozen=True)
class Case:
    """A feature, the function that exercises it, the layouts it runs at and which of them refuse it
    (layout -> the reason, a regular expression the error must match before any training step)."""

    feature: str
    run: Callable[[Run], dict[str, Any]]
    layouts: tuple[str, ...] = MAIN
    refused: dict[str, str] = field(default_factory=dict)
    note: str = ""
    replica_semantics: bool = False  # at dp d, compare with one process emulating DDP's rank 0 (`replica_of=d`)


_SWA_REFUSAL = "StochasticWeightAveraging is not supported by TP3DStrategy"
_COMPILED = (r"LightningModule.model is compiled \(torch.compile\(...\) or .compile\(\)\).*"
             r" pass TP3DStrategy\(compile=True\)")
_LIGHTNING_REFUSES_TUNING = "Tuning the batch size is currently not supported with distributed strategies"
CASES: dict[str, Case] = {
    "model_checkpoint_top_k": Case("ModelCheckpoint: monitor + top-k + save_last; validate/test(ckpt_path)",
                                   model_checkpoint_top_k, ("2x2x1", "1x2x2", "2x1x2")),
    "model_checkpoint_every_n_steps": Case("ModelCheckpoint: every_n_train_steps", model_checkpoint_every_n_steps),
    "model_checkpoint_link": Case("ModelCheckpoint: save_last='link'", model_checkpoint_link),
    "model_checkpoint_versions": Case("ModelCheckpoint: versioned names (-v1)", model_checkpoint_versions),
    "on_exception_checkpoint": Case("OnExceptionCheckpoint", on_exception_checkpoint),
    "early_stopping": Case("EarlyStopping", early_stopping),
    "learning_rate_monitor": Case("LearningRateMonitor", learning_rate_monitor),
    "model_summary": Case("ModelSummary (whole-model counts)", model_summary),
    "rich_model_summary": Case("RichModelSummary", rich_model_summary),
    "model_summary_flops": Case("ModelSummary with example_input_array (FLOPs)", model_summary_flops),
    "device_stats_monitor": Case("DeviceStatsMonitor", device_stats_monitor),
    "stochastic_weight_averaging": Case("StochasticWeightAveraging", stochastic_weight_averaging,
                                        refused={"2x2x1": _SWA_REFUSAL, "1x2x2": _SWA_REFUSAL},
                                        note="refused: it deep-copies the module and averages whole parameters"),
    "finetuning": Case("BaseFinetuning / BackboneFinetuning (unfreeze + add_param_group mid-fit)", finetuning,
                       ("2x2x1", "1x2x2", "1x2x2-fsdp", "1x2x2-zero1"),
                       refused={"1x2x2-zero1": r"adds a parameter group during fit, which data_parallel_mode='zero1'"},
                       note="zero1 refused: its optimizer holds the parts of the parameters it had at the start"),
    "gradient_accumulation_scheduler": Case("GradientAccumulationScheduler", gradient_accumulation_scheduler),
    "learning_rate_finder": Case("Tuner.lr_find", learning_rate_finder, replica_semantics=True,
                                 note="at dp > 1 the curve is dp replica 0's loss, as under DDP"),
    "batch_size_finder": Case("Tuner.scale_batch_size", batch_size_finder,
                              refused={"2x2x1": _LIGHTNING_REFUSES_TUNING, "1x2x2": _LIGHTNING_REFUSES_TUNING},
                              note="refused by Lightning under every distributed strategy, DDP's too"),
    "gradient_clip_norm": Case("gradient_clip_val (norm)", gradient_clip_norm),
    "gradient_clip_value": Case("gradient_clip_algorithm='value'", gradient_clip_value),
    "accumulate_grad_batches": Case("accumulate_grad_batches", accumulate_grad_batches),
    "val_check_interval_int": Case("val_check_interval (int)", val_check_interval_int),
    "val_check_interval_float": Case("val_check_interval (float)", val_check_interval_float),
    "check_val_every_n_epoch": Case("check_val_every_n_epoch", check_val_every_n_epoch),
    "limit_batches": Case("limit_train_batches / limit_val_batches", limit_batches),
    "num_sanity_val_steps": Case("num_sanity_val_steps", num_sanity_val_steps),
    "fast_dev_run": Case("fast_dev_run", fast_dev_run),
    "overfit_batches": Case("overfit_batches", overfit_batches),
    "max_time": Case("max_time", max_time, note="every rank stops at rank 0's step"),
    "max_epochs": Case("max_epochs (several epochs)", max_epochs),
    "deterministic": Case("deterministic=True", deterministic),
    "detect_anomaly": Case("detect_anomaly=True", detect_anomaly, ("2x2x1", "1x2x2", "1x2x2-fsdp"),
                           refused={"2x2x1": r"detect_anomaly=True\) is not supported with tensor_parallel_size > 1"},
                           note="refused at tp > 1: DTensor cannot run anomaly mode's NaN check"),
    "log_every_n_steps": Case("log_every_n_steps", log_every_n_steps),
    "profiler_simple": Case("profiler='simple'", profiler_simple),
    "profiler_advanced": Case("profiler='advanced'", profiler_advanced),
    "profiler_pytorch": Case("profiler='pytorch'", profiler_pytorch),
    "evaluation_loops": Case("validate / test / predict with ckpt_path best, last, a path", evaluation_loops),
    "manual_optimization": Case("manual optimization + clip_gradients", manual_optimization),
    "reduce_lr_on_plateau": Case("ReduceLROnPlateau on a monitored metric", reduce_lr_on_plateau),
    "self_log": Case("self.log: on_step / on_epoch / reduce_fx / sync_dist", self_log),
    "all_gather": Case("self.all_gather", all_gather, note="[dp, ...], as DDP's processes"),
    "loggers": Case("CSVLogger, TensorBoardLogger", loggers),
    "reduce_boolean_decision": Case("strategy.reduce_boolean_decision (all / any)", reduce_boolean_decision,
                                    ("2x1x2", "1x2x2")),
    "grad_norm": Case("lightning_tp3d.grad_norm (Lightning's grad_norm)", grad_norm_helper,
                      note="the same as Lightning's own, which is routed to it"),
    "lightning_grad_norm": Case("self.log_dict(lightning.pytorch.utilities.grad_norm(self, 2))",
                                lightning_grad_norm_idiom,
                                note="whole-model norms under every parameter's full name, on every rank"),
    "load_from_checkpoint": Case("LightningModule.load_from_checkpoint(folder, or its last.ckpt)",
                                 load_from_checkpoint),
    "checkpoint_before_first_step": Case("trainer.save_checkpoint before the first step, then train and resume",
                                         checkpoint_before_first_step),
    "compiled_network": Case("torch.compile(model) in configure_model", compiled_network,
                             refused={"2x2x1": _COMPILED, "1x2x2": _COMPILED},
                             note="refused naming `compile=True`: the strategy splits, shards and names the module,"
                                  " then compiles its blocks"),
    "fabric_collectives": Case("Fabric: all_reduce / all_gather / broadcast / barrier / reduce_boolean_decision",
                               fabric_collectives, ("2x1x2", "1x2x2"), note="values over dp, decisions over all ranks"),
    "fabric_accumulate_and_clip": Case("Fabric: no_backward_sync + clip_gradients", fabric_accumulate_and_clip),
    "fabric_save_load_filter": Case("Fabric: save / load with filter", fabric_save_load_filter,
                                    note="a filter on an optimizer's key is refused"),
    "fabric_spike_detection": Case("Fabric: SpikeDetection", fabric_spike_detection, ("2x1x2", "1x2x2")),
}


def run_case(name: str, layout: str | None, directory: Path, replica_of: int = 1) -> dict[str, Any]:
    """Run one case; a run that raises records the error (a refusal is a result too)."""
    directory.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        record = CASES[name].run(Run(layout, directory, replica_of))
    except Exception as error:  # noqa: BLE001 - reported by the comparison, with the case's name
        record = {"exception": f"{type(error).__name__}: {error}"}
    record["seconds"] = time.monotonic() - started
    return record


def docs_table() -> str:
    """The table of docs/lightning.md: every case, its status at each layout it runs at, and notes."""
    layouts = [name for name in LAYOUTS if any(name in case.layouts for case in CASES.values())]
    lines = ["| feature | " + " | ".join(layouts) + " | notes |", "| --- |" + " --- |" * (len(layouts) + 1)]
    for case in CASES.values():
        cells = ["refused" if layout in case.refused else "as one process" if layout in case.layouts else ""
                 for layout in layouts]
        lines.append(f"| {case.feature} | " + " | ".join(cells) + f" | {case.note} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(docs_table())
