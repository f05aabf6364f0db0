"""`TP3DFabricStrategy`: a Fabric loop at (tp, pp, dp) = (2, 2, 1) on 4 processes, with global-norm
clipping, gives the Trainer run's losses (same layout, same clipping) within 1e-5, and both give the
single-process reference's; a Fabric checkpoint saved after 5 steps and loaded into a fresh model and
optimizer continues with the same losses (exactly)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_tp3d import TP3DFabricStrategy, TP3DStrategy
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from tests.distributed import run_distributed
from tests.helpers import (
    LEARNING_RATE,
    SEQ_LEN,
    MemoryLogger,
    named_full,
    reference_network,
    reference_run,
    trainer_kwargs,
)

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

STEPS = 10
SAVED_AT = 5
GLOBAL_BATCH = 8
CLIP = 0.5


def _fabric_losses(directory: Path, load: bool) -> list[float]:
    strategy = TP3DFabricStrategy(tensor_parallel_size=2, pipeline_parallel_size=2, num_microbatches=2)
    fabric = L.Fabric(accelerator="cpu", devices=4, strategy=strategy)
    fabric.launch()
    model = fabric.setup(reference_network())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95),
                                                          weight_decay=0.0))
    data = TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH, val_fraction=0.2)
    data.setup()
    loader = fabric.setup_dataloaders(DataLoader(data.train_dataset, batch_size=GLOBAL_BATCH, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if load:
        fabric.load(directory / "fabric.ckpt", state)
    losses = []
    for index, batch in enumerate(loader):
        if index < state["step"]:
            continue  # the loop owns its data position: skip what the checkpoint already trained on
        loss = model(batch["input_ids"], labels=batch["labels"])
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        state["step"] = index + 1
        if not load and state["step"] == SAVED_AT:
            fabric.save(directory / "fabric.ckpt", state)
        if state["step"] == STEPS:
            break
    return losses


ACCUMULATE = 2


def _fabric_accumulating(steps: int = 3) -> dict[str, Any]:
    """(1, 2, 2) replicate, 1F1B: each step accumulates 2 batches of 2 per dp rank under `no_backward_sync`
    (gradients are all-reduced over dp once, after the second batch) with `fabric.backward(loss / 2)`."""
    strategy = TP3DFabricStrategy(pipeline_parallel_size=2, num_microbatches=2)
    fabric = L.Fabric(accelerator="cpu", devices=4, strategy=strategy)
    fabric.launch()
    model = fabric.setup(reference_network())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95),
                                                          weight_decay=0.0))
    all_reduces = []
    all_reduce = strategy.core.all_reduce_gradients
    strategy.core.all_reduce_gradients = lambda parameters: all_reduces.append(1) or all_reduce(parameters)
    data = TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH, val_fraction=0.2)
    data.setup()
    batch_size = GLOBAL_BATCH // 2 // ACCUMULATE
    loader = fabric.setup_dataloaders(DataLoader(data.train_dataset, batch_size=batch_size, shuffle=True))
    batches = iter(loader)
    last_batch_losses, first_grads = [], None
    for _ in range(steps):
        for index in range(ACCUMULATE):
            batch = next(batches)
            with fabric.no_backward_sync(model, enabled=index < ACCUMULATE - 1):
                loss = model(batch["input_ids"], labels=batch["labels"])
                fabric.backward(loss / ACCUMULATE)
        if first_grads is None:
            first_grads = named_full(model, "grad", prefix="_forward_module.")
        optimizer.step()
        optimizer.zero_grad()
        last_batch_losses.append(fabric.all_reduce(loss.detach()).item())
    return {"last_batch_losses": last_batch_losses, "first_grads": first_grads, "all_reduces": len(all_reduces)}


def run_world(directory: str) -> dict[str, Any]:
    directory = Path(directory)
    logger = MemoryLogger()
    strategy = TP3DStrategy(tensor_parallel_size=2, pipeline_parallel_size=2, num_microbatches=2)
    L.Trainer(**trainer_kwargs(devices=4, strategy=strategy, max_steps=STEPS, logger=logger,
                               gradient_clip_val=CLIP)).fit(
        CausalLMModule("tiny", learning_rate=LEARNING_RATE),
        TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH, val_fraction=0.2))
    return {"trainer": logger.values("train_loss"), "fabric": _fabric_losses(directory, load=False),
            "resumed": _fabric_losses(directory, load=True), "accumulating": _fabric_accumulating()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict[str, Any]]:
    return run_distributed(4, "tests.strategies.test_fabric:run_world", str(tmp_path_factory.mktemp("fabric")))


def test_fabric_loop_matches_the_trainer_and_the_reference(runs):
    reference = reference_run(STEPS, GLOBAL_BATCH, clip_norm=CLIP)["losses"]
    for rank in runs:
        assert len(rank["fabric"]) == len(rank["trainer"]) == STEPS
        assert max(abs(a - b) for a, b in zip(rank["fabric"], rank["trainer"])) <= 1e-5
        assert max(abs(a - b) for a, b in zip(rank["fabric"], reference)) <= 1e-5


def test_fabric_checkpoint_resumes_exactly(runs):
    for rank in runs:
        assert rank["resumed"] == rank["fabric"][SAVED_AT:]


def test_fabric_accumulation_under_pipelining_matches_the_reference(runs):
    """The loop's `loss / 2` reaches the schedule's gradients: 2 accumulated batches = one batch of 8."""
    reference = reference_run(3, GLOBAL_BATCH, accumulate=ACCUMULATE)
    gradients: dict[str, torch.Tensor] = {}
    for rank in runs:
        result = rank["accumulating"]
        assert result["all_reduces"] == 3, "one dp all-reduce per step: no_backward_sync skipped the others"
        torch.testing.assert_close(torch.tensor(result["last_batch_losses"]),
                                   torch.tensor(reference["last_batch_losses"]), rtol=1e-5, atol=0.0)
        for name, gradient in result["first_grads"].items():
            torch.testing.assert_close(gradient, reference["first_grads"][name], rtol=1e-5, atol=1e-7)
        gradients.update(result["first_grads"])
    assert gradients.keys() == reference["first_grads"].keys()


def test_registered_in_fabric():
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    assert STRATEGY_REGISTRY["tp3d"]["strategy"] is TP3DFabricStrategy
