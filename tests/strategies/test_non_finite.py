"""Non-finite steps are skipped by every rank together, in fp32 and bf16, at (tp, pp, dp) = (2, 2, 1).

One rank of four gets the bad value: at step 2 an inf is written into one gradient element on the rank
at (pp 0, tp 1) after backward; at step 4 the rank at (pp 1, tp 0) returns an infinite loss (its
backward then hands infinite gradients to its stage). Every rank must skip both updates: its weights
unchanged, AdamW's step count not advanced, the warm-up LR scheduler held. The losses of all 6 steps
equal a single-process run that computes the loss of steps 2 and 4 but neither steps its optimizer nor its
scheduler there (fp32: rtol 1e-5; bf16: mean |difference| <= 6e-4, which a reference that skips nothing
exceeds: asserted). `skipped_steps` is logged. With `max_consecutive_skips=2` and infs at steps 2 and 3
training stops on every rank with an error naming the steps. A Fabric loop skips the same way.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_tp3d import TP3DFabricStrategy, TP3DStrategy
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.strategies.non_finite import NonFiniteStepGuard, NonFiniteStepsError
from lightning_tp3d.strategies.options import ParallelOptions
from tests.distributed import run_distributed
from tests.helpers import LEARNING_RATE, SEQ_LEN, MemoryLogger, reference_network, reference_run, trainer_kwargs

STEPS = 6
GLOBAL_BATCH = 8
WARMUP = 4
INF_GRADIENT_STEP, INF_LOSS_STEP = 2, 4  # 1-based optimizer steps
BF16_LOSS_TOLERANCE = 6e-4  # mean |loss difference|, as in test_precision


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _write_inf_into_a_gradient(module: torch.nn.Module) -> None:
    """Into this rank's slice of the first query projection's gradient (sharded over tp like its weight)."""
    grad = next(parameter.grad for name, parameter in module.named_parameters() if name.endswith("q_proj.weight"))
    _local(grad).view(-1)[0] = float("inf")


class InfiniteLossModule(CausalLMModule):
    """Returns an infinite loss at `loss_step` on the rank at (pp last, tp 0), after logging the finite one."""

    def __init__(self, loss_step: int | None, **kwargs: Any) -> None:
        super().__init__("tiny", **kwargs)
        self.loss_step = loss_step

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        layout = self.trainer.strategy.layout
        place = layout.coordinates(self.trainer.global_rank)
        if (self.trainer.global_step + 1 == self.loss_step and place.pp == layout.pipeline_parallel_size - 1
                and place.tp == 0):
            loss = loss * float("inf")
        return loss


class WatchSteps(Callback):
    """Writes an inf into a gradient at `gradient_steps` on the rank at (pp 0, tp 1); records per step
    whether this rank's weights changed, the LR after the step and AdamW's step count."""

    def __init__(self, gradient_steps: tuple[int, ...]) -> None:
        self.gradient_steps = gradient_steps
        self.changed: list[bool] = []
        self.learning_rates: list[float] = []
        self.adam_steps: list[int] = []
        self._before: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._before = [_local(parameter).detach().clone() for parameter in pl_module.parameters()]

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        place = trainer.strategy.layout.coordinates(trainer.global_rank)
        if trainer.global_step + 1 in self.gradient_steps and place.pp == 0 and place.tp == 1:
            _write_inf_into_a_gradient(pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        after = [_local(parameter).detach() for parameter in pl_module.parameters()]
        self.changed.append(any(not torch.equal(a, b) for a, b in zip(self._before, after)))
        optimizer = trainer.optimizers[0]
        self.learning_rates.append(optimizer.param_groups[0]["lr"])
        states = [state for state in optimizer.state.values() if "step" in state]
        self.adam_steps.append(int(states[0]["step"]) if states else 0)


def _fit(precision: str, gradient_steps: tuple[int, ...], loss_step: int | None,
         max_consecutive_skips: int = 5) -> dict[str, Any]:
    watch, logger = WatchSteps(gradient_steps), MemoryLogger()
    trainer = L.Trainer(**trainer_kwargs(
        devices=4, max_steps=STEPS, precision=precision, logger=logger, callbacks=[watch],
        strategy=TP3DStrategy(tensor_parallel_size=2, pipeline_parallel_size=2, num_microbatches=2,
                              max_consecutive_skips=max_consecutive_skips)))
    module = InfiniteLossModule(loss_step, learning_rate=LEARNING_RATE, warmup_steps=WARMUP)
    trainer.fit(module, TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH, val_fraction=0.2))
    return {"losses": logger.values("train_loss"), "skipped_logged": logger.values("skipped_steps"),
            "changed": watch.changed, "learning_rates": watch.learning_rates, "adam_steps": watch.adam_steps,
            "hook_released": "lr_scheduler_step" not in module.__dict__}


def _fabric_skip() -> dict[str, Any]:
    """Two Fabric steps at (2, 2, 1); the first gets an inf in one gradient on the rank at (pp 0, tp 1)."""
    strategy = TP3DFabricStrategy(tensor_parallel_size=2, pipeline_parallel_size=2, num_microbatches=2)
    fabric = L.Fabric(accelerator="cpu", devices=4, strategy=strategy)
    fabric.launch()
    model = fabric.setup(reference_network())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE))
    data = TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH, val_fraction=0.2)
    data.setup()
    loader = fabric.setup_dataloaders(DataLoader(data.train_dataset, batch_size=GLOBAL_BATCH))
    place = strategy.layout.coordinates(fabric.global_rank)
    changed, returned = [], []
    for index, batch in zip(range(2), loader):
        before = [_local(parameter).detach().clone() for parameter in model.parameters()]
        fabric.backward(model(batch["input_ids"], labels=batch["labels"]))
        if index == 0 and place.pp == 0 and place.tp == 1:
            _write_inf_into_a_gradient(model)
        returned.append(optimizer.step())
        optimizer.zero_grad()
        changed.append(any(not torch.equal(a, _local(b).detach()) for a, b in zip(before, model.parameters())))
    return {"changed": changed, "skipped": strategy.step_guard.skipped_steps,
            "first_returned_none": returned[0] is None}


def run_world() -> dict[str, Any]:
    results = {precision: _fit(precision, (INF_GRADIENT_STEP,), INF_LOSS_STEP)
               for precision in ("32-true", "bf16-mixed")}
    try:
        _fit("32-true", (2, 3), None, max_consecutive_skips=2)
        results["stopped"] = None
    except NonFiniteStepsError as error:
        results["stopped"] = str(error)
    results["fabric"] = _fabric_skip()
    return results


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_distributed(4, "tests.strategies.test_non_finite:run_world")


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    skipped = (INF_GRADIENT_STEP, INF_LOSS_STEP)
    return {"32-true": reference_run(STEPS, GLOBAL_BATCH, skip_steps=skipped, warmup_steps=WARMUP),
            "bf16-mixed": reference_run(STEPS, GLOBAL_BATCH, skip_steps=skipped, warmup_steps=WARMUP,
                                        autocast_dtype=torch.bfloat16),
            "bf16-mixed-no-skip": reference_run(STEPS, GLOBAL_BATCH, warmup_steps=WARMUP,
                                                autocast_dtype=torch.bfloat16)}


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_every_rank_skips_the_update_and_the_scheduler(world, precision):
    # Updates at steps 1, 3, 5, 6 only: the warm-up factor (k + 1) / 4 after k scheduler steps.
    expected_rates = [LEARNING_RATE * min(1.0, (k + 1) / WARMUP) for k in (1, 1, 2, 2, 3, 4)]
    for rank in world:
        run = rank[precision]
        assert run["changed"] == [True, False, True, False, True, True]
        assert run["adam_steps"] == [1, 1, 2, 2, 3, 4]
        torch.testing.assert_close(torch.tensor(run["learning_rates"]), torch.tensor(expected_rates), rtol=1e-12,
                                   atol=0)
        assert run["skipped_logged"][-1] == 2.0
        assert run["hook_released"]


@pytest.mark.distributed
def test_fp32_losses_equal_a_single_process_run_that_skips_the_same_steps(world, references):
    expected = torch.tensor(references["32-true"]["losses"])
    for rank in world:
        torch.testing.assert_close(torch.tensor(rank["32-true"]["losses"]), expected, rtol=1e-5, atol=0)


@pytest.mark.distributed
def test_bf16_losses_follow_the_skipping_reference_and_reject_the_other(world, references):
    def mean_difference(losses: list[float], reference: list[float]) -> float:
        return sum(abs(a - b) for a, b in zip(losses, reference, strict=True)) / len(losses)

    expected = references["bf16-mixed"]["losses"]
    assert mean_difference(references["bf16-mixed-no-skip"]["losses"], expected) > BF16_LOSS_TOLERANCE
    for rank in world:
        assert mean_difference(rank["bf16-mixed"]["losses"], expected) <= BF16_LOSS_TOLERANCE


@pytest.mark.distributed
def test_consecutive_skips_stop_training_on_every_rank_naming_the_steps(world):
    for rank in world:
        assert rank["stopped"] is not None
        assert "not finite at 2 steps in a row (global_step 1 to 2; 2 skipped in all)" in rank["stopped"]
        assert "training stopped at global_step 2" in rank["stopped"]


@pytest.mark.distributed
def test_fabric_step_is_skipped_on_every_rank(world):
    for rank in world:
        assert rank["fabric"] == {"changed": [False, True], "skipped": 1, "first_returned_none": True}


def test_guard_counts_and_limits_without_a_process_group():
    guard = NonFiniteStepGuard(max_consecutive_skips=2)
    parameter = torch.nn.Parameter(torch.ones(3))
    parameter.grad = torch.ones(3)
    assert not guard.check(torch.tensor(1.0), [parameter], step=0, device=torch.device("cpu"))
    assert guard.check(torch.tensor(float("nan")), [parameter], step=1, device=torch.device("cpu"))
    assert not guard.check(torch.tensor(1.0), [parameter], step=2, device=torch.device("cpu"))  # resets the run
    parameter.grad[1] = float("inf")
    assert guard.check(None, [parameter], step=3, device=torch.device("cpu"))
    with pytest.raises(NonFiniteStepsError, match=r"global_step 3 to 4; 3 skipped in all"):
        guard.check(torch.tensor(1.0), [parameter], step=4, device=torch.device("cpu"))


def test_max_consecutive_skips_must_be_positive():
    with pytest.raises(ValueError, match=r"max_consecutive_skips=0 must be >= 1 .* skip_non_finite_steps=False"):
        ParallelOptions(max_consecutive_skips=0)
