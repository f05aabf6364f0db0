"""Mixed precision under tensor and pipeline parallelism.

* bf16-mixed at (tp, pp, dp) = (2, 2, 2): losses of 10 steps against the single-process bf16 autocast run.
* bf16-true at (2, 2, 1): bf16 weights, losses within bf16 rounding of fp32's.
* 16-mixed at (2, 2, 1) with `TP3DPrecision`: an inf written into one tp rank's gradient makes every rank
  skip that step (weights unchanged everywhere) and halve the scale together; the scale survives a
  checkpoint and the resumed run continues exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.tensor import DTensor

from lightning_tp3d import TP3DPrecision, TP3DStrategy
from lightning_tp3d.precision import ModelParallelGradScaler
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from tests.distributed import run_distributed
from tests.helpers import LEARNING_RATE, SEQ_LEN, MemoryLogger, reference_run, trainer_kwargs, world_size

GLOBAL_BATCH = 8
STEPS = 10
INF_STEP = 3  # the optimizer step (1-based) whose gradients get an inf on one tp rank


class WatchScaler(Callback):
    """Per step: the loss scale after it, and whether this rank's weights changed in it. At `inf_step` it
    writes an inf into one gradient element on the rank at tp coordinate 1 (after backward, before the
    scaler unscales)."""

    def __init__(self, inf_step: int | None) -> None:
        self.inf_step = inf_step
        self.scales: list[float] = []
        self.changed: list[bool] = []
        self._before: list[torch.Tensor] = []

    @staticmethod
    def _local(tensor: torch.Tensor) -> torch.Tensor:
        return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().clone()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._before = [self._local(parameter) for parameter in pl_module.parameters()]

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tp_rank = trainer.strategy.layout.coordinates(trainer.global_rank).tp
        if trainer.global_step + 1 == self.inf_step and tp_rank == 1:
            grad = next(parameter.grad for parameter in pl_module.parameters() if parameter.grad is not None)
            (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = float("inf")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.scales.append(trainer.precision_plugin.scaler.get_scale())
        after = [self._local(parameter) for parameter in pl_module.parameters()]
        self.changed.append(any(not torch.equal(a, b) for a, b in zip(self._before, after)))


def _fit(tp: int, pp: int, steps: int, precision: Any, callbacks: list[Callback] = (), ckpt_path: Path | None = None,
         directory: Path | None = None) -> list[float]:
    dp = world_size() // (tp * pp)
    logger = MemoryLogger()
    options = {"plugins": [precision]} if isinstance(precision, TP3DPrecision) else {"precision": precision}
    trainer = L.Trainer(**trainer_kwargs(
        devices=world_size(), max_steps=steps, logger=logger, callbacks=list(callbacks),
        enable_checkpointing=any(isinstance(callback, ModelCheckpoint) for callback in callbacks),
        default_root_dir=directory,
        strategy=TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, num_microbatches=2), **options))
    trainer.fit(CausalLMModule("tiny", learning_rate=LEARNING_RATE),
                TokenDataModule(seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp, val_fraction=0.2), ckpt_path=ckpt_path)
    return logger.values("train_loss")


def run_fp16_world(directory: str) -> dict[str, Any]:
    directory = Path(directory)
    watch = WatchScaler(INF_STEP)
    saver = ModelCheckpoint(dirpath=directory, filename="step4", every_n_train_steps=4)
    straight = _fit(2, 2, 6, TP3DPrecision("16-mixed"), [watch, saver], directory=directory)
    resumed_watch = WatchScaler(None)
    resumed = _fit(2, 2, 6, TP3DPrecision("16-mixed"), [resumed_watch], ckpt_path=directory / "step4.ckpt")
    dtypes = LinearOutputDtypes()
    bf16_true = _fit(2, 2, 3, "bf16-true", [dtypes])
    return {"straight": straight, "scales": watch.scales, "changed": watch.changed, "resumed": resumed,
            "resumed_scales": resumed_watch.scales, "bf16_true": bf16_true, "bf16_true_dtypes": dtypes.dtypes}


class LinearOutputDtypes(Callback):
    """The dtypes the linear layers of this rank produced during training (autocast makes them bf16)."""

    def __init__(self) -> None:
        self.dtypes: set[str] = set()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for module in pl_module.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(lambda _, __, output: self.dtypes.add(str(output.dtype)))


def run_bf16_world() -> dict[str, Any]:
    dtypes = LinearOutputDtypes()
    return {"losses": _fit(2, 2, STEPS, "bf16-mixed", [dtypes]), "dtypes": dtypes.dtypes}


@pytest.fixture(scope="module")
def fp16(tmp_path_factory) -> list[dict[str, Any]]:
    return run_distributed(4, "tests.test_precision:run_fp16_world", str(tmp_path_factory.mktemp("fp16")))


def test_bf16_mixed_at_2x2x2_matches_single_process_bf16():
    """Tolerance: one bf16 unit roundoff (2^-8) of the loss; the runs differ by ~1e-3 on losses of 3.6-5.5."""
    reference = reference_run(STEPS, GLOBAL_BATCH, autocast_dtype=torch.bfloat16)["losses"]
    for rank in run_distributed(8, "tests.test_precision:run_bf16_world"):
        assert rank["dtypes"] == {"torch.bfloat16"}
        assert len(rank["losses"]) == STEPS
        for parallel, single in zip(rank["losses"], reference):
            assert abs(parallel - single) <= 2**-8 * abs(single)


def test_bf16_true_at_2x2x1_trains_in_bf16(fp16):
    """bf16 weights and optimizer state: the first steps stay within one bf16 unit roundoff of fp32's losses."""
    reference = reference_run(3, GLOBAL_BATCH)["losses"]
    for rank in fp16:
        assert rank["bf16_true_dtypes"] == {"torch.bfloat16"}
        for parallel, single in zip(rank["bf16_true"], reference, strict=True):
            assert abs(parallel - single) <= 2**-8 * abs(single)


def test_inf_on_one_tp_rank_makes_every_rank_skip_and_halve_the_scale(fp16):
    initial = 2.0**16
    for rank in fp16:
        assert rank["scales"][: INF_STEP + 1] == [initial, initial, initial / 2, initial / 2]
        assert rank["changed"] == [True, True, False, True, True, True]


def test_scaler_state_survives_resume(fp16):
    for rank in fp16:
        assert rank["resumed_scales"] == rank["scales"][4:]
        assert rank["resumed"] == rank["straight"][4:]


def test_precision_plugin_choices():
    assert isinstance(TP3DPrecision("16-mixed").scaler, ModelParallelGradScaler)
    assert TP3DPrecision("bf16-mixed").scaler is None
    with pytest.raises(ValueError, match=r"TP3DPrecision\(precision='32-true'\): use '16-mixed' or 'bf16-mixed'"):
        TP3DPrecision("32-true")
