"""What each rank sends per group in a real training step equals the communication ledger, exactly.

On 4 processes, the second training step of the tiny model (b = 8 per dp rank, s = 16, fp32) is
recorded (`RecordTraffic`: flight recorder + wrapped sends) at (tp, pp, dp) = (2, 1, 2) replicate and
(1, 2, 2) FSDP with m = 2 and m = 8, (2, 2, 1) interleaved 1F1B, (1, 2, 2) DualPipeV, interleaved 1F1B
with FSDP2 and ZBV with ZeRO-1 (two stages per rank; the V's turn is handed over on its rank, unsent), and
compared with `communication_ledger` for the rank's stage
(gloo: FSDP2's reduce-scatter is an all-reduce of the same payload): every (group, operation, payload,
element size) with its number of calls. Under pipelining FSDP2 gathers each unit once per step, so the
parameter all-gathers are the same at m = 2 and m = 8 while the pp sends grow with m; with
`fsdp_reshard_after_forward=True` (m = 2) they are m + 1 per unit.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest

from lightning_tp3d import TP3DStrategy
from lightning_tp3d.callbacks import RecordTraffic
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.plan.communication import CommunicationLedger, communication_ledger
from lightning_tp3d.plan.config import resolve_model_config
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.ledger import TrainingOptions
from tests.distributed import run_distributed
from tests.helpers import SEQ_LEN, trainer_kwargs

BATCH = 8  # per dp rank and step
# tp, pp, dp, m, dp mode ("fsdp-reshard": fsdp_reshard_after_forward=True), pipeline schedule
LAYOUTS = [(2, 1, 2, 1, "replicate", "1f1b"), (1, 2, 2, 2, "fsdp", "1f1b"), (1, 2, 2, 8, "fsdp", "1f1b"),
           (1, 2, 2, 2, "fsdp-reshard", "1f1b"), (2, 1, 2, 1, "zero1", "1f1b"),
           (2, 2, 1, 2, "replicate", "interleaved_1f1b"), (1, 2, 2, 4, "replicate", "dualpipev"),
           (1, 2, 2, 4, "fsdp", "interleaved_1f1b"), (1, 2, 2, 4, "zero1", "zbv_zero_bubble")]


def _measure(tp: int, pp: int, dp: int, m: int, mode: str, schedule: str) -> dict[str, Any]:
    record = RecordTraffic()
    trainer = L.Trainer(**trainer_kwargs(
        devices=4, max_steps=2, logger=False, callbacks=[record],
        strategy=TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, num_microbatches=m,
                              pipeline_schedule=schedule, data_parallel_mode=mode.removesuffix("-reshard"),
                              fsdp_reshard_after_forward=mode.endswith("-reshard") or None)))
    trainer.fit(CausalLMModule("tiny"), TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=BATCH))
    return {"stage": trainer.strategy.layout.coordinates(trainer.global_rank).pp,
            "transfers": dict(record.recorder.transfers)}


def run_world() -> list[dict[str, Any]]:
    return [_measure(*layout) for layout in LAYOUTS]


@pytest.fixture(scope="module")
def measured() -> list[list[dict[str, Any]]]:
    return run_distributed(4, "tests.diagnostics.test_traffic:run_world")


def _ledger(tp: int, pp: int, dp: int, m: int, mode: str, schedule: str) -> CommunicationLedger:
    layout = ParallelLayout(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                            micro_batch_size=BATCH // m, num_microbatches=m)
    options = TrainingOptions(seq_len=SEQ_LEN, precision="32-true", data_parallel_mode=mode.removesuffix("-reshard"),
                              schedule=schedule,
                              fsdp_reshard_after_forward=mode.endswith("-reshard") or None)
    return communication_ledger(resolve_model_config("tiny"), layout, options, backend="gloo")


@pytest.mark.distributed
@pytest.mark.parametrize("index", range(len(LAYOUTS)),
                         ids=[f"{t}x{p}x{d} m={m} {mode} {schedule}" for t, p, d, m, mode, schedule in LAYOUTS])
def test_measured_traffic_equals_the_ledger_on_every_rank(measured, index):
    expected = _ledger(*LAYOUTS[index])
    for rank in measured:
        run = rank[index]
        assert run["transfers"] == expected.calls_by_transfer(run["stage"]), (LAYOUTS[index], run["stage"])


@pytest.mark.distributed
def test_fsdp_under_pipelining_gathers_once_per_step_whatever_the_micro_batches(measured):
    def calls(run: dict[str, Any], group: str, operation: str) -> int:
        return sum(count for key, count in run["transfers"].items() if key[:2] == (group, operation))

    for rank in measured:
        two, eight, resharding = rank[1], rank[2], rank[3]
        assert calls(two, "dp", "all_gather") == calls(eight, "dp", "all_gather") == 3  # 2 blocks + the stage root
        assert calls(eight, "pp", "send") == 4 * calls(two, "pp", "send")
        # The selectable alternative: resharding after each forward gathers every unit per micro-batch, + 1.
        assert calls(resharding, "dp", "all_gather") == (2 + 1) * 3
