"""The loss in meta.json and the warning when a resumed run's loss jumps."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_tp3d import TP3DStrategy
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.strategies.loss_watch import ResumeLossWatch
from tests.distributed import run_distributed
from tests.helpers import SEQ_LEN, trainer_kwargs, world_size

SAVE_AT = 30
LEARNING_RATE = 5e-2  # at this rate Adam restarting from zero moments makes the loss jump visibly:
# measured, the first 3 losses after a resume 3.02, 2.98, 2.99 (correct) and 3.02, 3.70, 3.64 (moments
# dropped) against 3.03 +- 0.13 before the save: bound 3.42


class Meta:
    def __init__(self, mean: float | None, std: float | None) -> None:
        self.loss_mean, self.loss_std = mean, std


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def test_watch_warns_only_beyond_the_stated_bound():
    watch = ResumeLossWatch()
    for value in (3.0, 2.9, 2.8):
        assert watch.record(torch.tensor(value), _identity) is None
    assert watch.summary(_identity) == pytest.approx({"loss": 2.8, "loss_mean": 2.9, "loss_std": 0.1})
    watch.resumed(Meta(2.9, 0.1))  # bound: 2.9 + max(0.3, 0.29) = 3.2
    assert [watch.record(torch.tensor(value), _identity) for value in (3.1, 3.19, 2.7)] == [None] * 3
    watch.resumed(Meta(2.9, 0.1))
    results = [watch.record(torch.tensor(value), _identity) for value in (2.9, 3.3, 3.0)]
    assert results[:2] == [None, None] and results[2].startswith("the loss jumped after resuming: 2.9000, 3.3000,")
    assert "optimizer state not restored" in results[2]
    watch.resumed(Meta(None, None))  # a checkpoint without losses: nothing to compare with
    assert all(watch.record(torch.tensor(9.0), _identity) is None for _ in range(5))


class DropOptimizerState(Callback):
    """Resume "forgetting" the optimizer: Adam's moments start from zero again."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for optimizer in trainer.optimizers:
            optimizer.state.clear()


def _fit(directory: Path, max_steps: int, resume: bool, callbacks: list[Callback]) -> list[str]:
    strategy = TP3DStrategy()  # dp = 2
    trainer = L.Trainer(**trainer_kwargs(devices=world_size(), strategy=strategy, max_steps=max_steps, logger=False,
                                         enable_checkpointing=not resume, callbacks=callbacks))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(CausalLMModule("tiny", learning_rate=LEARNING_RATE),
                    TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=4, val_fraction=0.2),
                    ckpt_path=str(directory / "saved.ckpt") if resume else None)
    return [str(warning.message) for warning in caught if "loss jumped" in str(warning.message)]


def run_resumes(directory: str) -> dict[str, Any]:
    directory = Path(directory)
    _fit(directory, SAVE_AT, False, [ModelCheckpoint(dirpath=directory, filename="saved",
                                                     every_n_train_steps=SAVE_AT)])
    return {"correct": _fit(directory, SAVE_AT + ResumeLossWatch.CHECKED_STEPS, True, []),
            "dropped": _fit(directory, SAVE_AT + ResumeLossWatch.CHECKED_STEPS, True, [DropOptimizerState()])}


@pytest.mark.distributed
def test_a_resume_that_drops_the_optimizer_state_warns_and_a_correct_one_does_not(tmp_path):
    (rank0, rank1) = run_distributed(2, "tests.strategies.test_loss_watch:run_resumes", str(tmp_path))
    meta = json.loads((tmp_path / "saved.ckpt" / "meta.json").read_text())
    assert meta["loss"] > 0 and meta["loss_mean"] > 0 and meta["loss_std"] >= 0
    assert rank0["correct"] == [] and rank1["correct"] == [] and rank1["dropped"] == []  # rank 0 warns
    assert len(rank0["dropped"]) == 1 and "optimizer state not restored" in rank0["dropped"][0], rank0
