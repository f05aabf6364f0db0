"""Host synchronisations in a training step: only the one the step needs.

A value read on the host (`.item()`, `.tolist()`, `bool(t)`, `float(t)`, `int(t)`, `.cpu()`, `.numpy()`)
waits on a GPU for every kernel queued before it, so a step that reads several stalls several times. A
`TorchFunctionMode` sees every such call between `on_train_batch_start` and `on_train_batch_end` (the
forward, the pipeline schedule, backward, the dp reduction, clipping, the optimizer step) and attributes
it to the innermost calling frame outside torch; the package's own are counted per place. On the CPU
nothing waits, so the count is the measure (a GPU checks the same with `torch.cuda.set_sync_debug_mode`).

Expected, at (2, 2, 1) 1F1B, (1, 2, 2) FSDP2 and (2, 1, 2) with the overlapped all-reduce, from the
second step on (the first infers the pipeline's shapes): exactly one per step, the non-finite guard's
read of its all-reduced flag (`strategies/non_finite.py`), which decides whether the optimizer steps; none
with `skip_non_finite_steps=False`.
"""

from __future__ import annotations

import collections
import inspect
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.overrides import TorchFunctionMode

import lightning_tp3d
from lightning_tp3d import MODEL_PRESETS, TP3DStrategy
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from tests.distributed import run_distributed
from tests.helpers import LEARNING_RATE, SEQ_LEN, trainer_kwargs, world_size

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

PACKAGE = Path(lightning_tp3d.__file__).parent
TORCH = Path(torch.__file__).parent
READS = {"item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy"}
STEPS = 3
LAYOUTS = {"tp2-pp2-1f1b": (2, 2, "replicate"), "pp2-dp2-fsdp": (1, 2, "fsdp"), "tp2-dp2-overlap": (2, 1, "replicate")}


class _HostReads(TorchFunctionMode):
    """Counts host reads by the package's place (`file:function`) that made them, for one step at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[collections.Counter] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "__name__", None) in READS:
            place = _caller_outside_torch()
            if place is not None:
                self.steps[-1][place] += 1
        return func(*args, **(kwargs or {}))


def _caller_outside_torch() -> str | None:
    """The innermost frame outside torch, as `path in the package:function`; None when it is not ours."""
    for frame in inspect.stack(context=0)[2:]:
        path = Path(frame.filename)
        if path.is_relative_to(TORCH):
            continue
        return f"{path.relative_to(PACKAGE)}:{frame.function}" if path.is_relative_to(PACKAGE) else None
    return None


class CountHostReads(Callback):
    def __init__(self) -> None:
        self.mode = _HostReads()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.mode.steps.append(collections.Counter())
        self.mode.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.mode.__exit__(None, None, None)


def _fit(tp: int, pp: int, mode: str, guard: bool) -> list[dict[str, int]]:
    L.seed_everything(7)
    counter = CountHostReads()
    strategy = TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, num_microbatches=2,
                            data_parallel_mode=mode, skip_non_finite_steps=guard)
    trainer = L.Trainer(**trainer_kwargs(devices=world_size(), strategy=strategy, max_steps=STEPS,
                                         callbacks=[counter], gradient_clip_val=1.0))
    dp = world_size() // (tp * pp)
    trainer.fit(CausalLMModule(MODEL_PRESETS["tiny"], learning_rate=LEARNING_RATE),
                TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=8 // dp))
    return [dict(step) for step in counter.mode.steps]


def run_world() -> dict[str, Any]:
    results = {(name, True): _fit(*layout, guard=True) for name, layout in LAYOUTS.items()}
    results["tp2-pp2-1f1b", False] = _fit(*LAYOUTS["tp2-pp2-1f1b"], guard=False)
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(4, "tests.strategies.test_host_syncs:run_world")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_step_reads_the_host_once_for_the_non_finite_decision(runs, name):
    for rank in runs:
        steps = rank[name, True]
        assert len(steps) == STEPS
        for step in steps[1:]:
            assert step == {"strategies/non_finite.py:check": 1}, (name, step)


def test_without_the_guard_a_step_reads_nothing_on_the_host(runs):
    for rank in runs:
        for step in rank["tp2-pp2-1f1b", False][1:]:
            assert step == {}, step
