"""A collective that one rank never joins fails within the strategy's timeout, naming group and operation.

At tp = 2 on 2 processes with `TP3DStrategy(timeout=3 s)`, rank 1 stalls for 12 s in its second training
step while rank 0 enters the step's tensor-parallel collectives: rank 0 must fail after about 3 s with a
`CollectiveTimeoutError` that names the tp group and the operation, not hang.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch

from lightning_tp3d import TP3DStrategy
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.parallel.collectives import CollectiveTimeoutError, describe_failed_collective
from tests.distributed import run_distributed
from tests.helpers import SEQ_LEN, trainer_kwargs, world_size

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

TIMEOUT_SECONDS = 3
STALL_SECONDS = 12


class StallingModule(CausalLMModule):
    """Rank 1 stops answering collectives in the second step (as a rank stuck elsewhere would)."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == 1 and self.global_rank == 1:
            time.sleep(STALL_SECONDS)
        return super().training_step(batch, batch_idx)


def run_stalled_world() -> dict[str, Any]:
    strategy = TP3DStrategy(tensor_parallel_size=2, timeout=timedelta(seconds=TIMEOUT_SECONDS))
    trainer = L.Trainer(**trainer_kwargs(devices=world_size(), strategy=strategy, max_steps=3))
    started = time.monotonic()
    try:
        trainer.fit(StallingModule("tiny"), TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=4))
    except Exception as error:  # noqa: BLE001 - the error is the result
        return {"type": type(error).__name__, "message": str(error), "seconds": time.monotonic() - started}
    return {"type": None, "message": "", "seconds": time.monotonic() - started}


@pytest.fixture(scope="module")
def stalled() -> list[dict[str, Any]]:
    return run_distributed(2, "tests.parallel.test_collectives:run_stalled_world", timeout=120)


def test_stuck_collective_fails_in_time_and_names_the_group(stalled):
    waiting = stalled[0]
    assert waiting["type"] == "CollectiveTimeoutError", waiting["message"]
    assert "on the tp group (ranks [0, 1]) did not complete within 0:00:03 on rank 0" in waiting["message"]
    assert waiting["message"].split(" on the tp group")[0] in ("all_reduce", "allreduce", "all_gather",
                                                               "allgather", "reduce_scatter", "broadcast")
    # rank 0 took one normal step (well under a second) before waiting TIMEOUT_SECONDS; rank 1 stalled longer
    assert waiting["seconds"] < STALL_SECONDS


def test_a_gloo_group_is_destroyed_before_the_interpreter_finalises():
    # handlers run last-registered first: the script's own, registered before, sees what ours left
    script = """
import atexit
import torch.distributed as dist
atexit.register(lambda: print("initialized at exit:", dist.is_initialized()))
from lightning_tp3d.parallel.collectives import destroy_gloo_groups_at_exit
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
destroy_gloo_groups_at_exit()
destroy_gloo_groups_at_exit()  # registered once
print("initialized:", dist.is_initialized())
"""
    process = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert process.returncode == 0, process.stderr
    assert process.stdout.split() == ["initialized:", "True", "initialized", "at", "exit:", "False"]


def test_other_errors_are_not_renamed():
    assert describe_failed_collective(ValueError("a bad shape"), None, None) is None
    assert issubclass(CollectiveTimeoutError, RuntimeError)


def test_recording_turns_on_both_flight_recorders_and_the_nccl_timeout_dump_without_overriding(monkeypatch):
    from lightning_tp3d._compat.torch import FLIGHT_RECORDER_VARIABLES
    from lightning_tp3d.parallel.collectives import enable_collective_recording

    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                 "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    enable_collective_recording()
    assert {name: os.environ.get(name) for name in FLIGHT_RECORDER_VARIABLES} == dict.fromkeys(
        FLIGHT_RECORDER_VARIABLES, "2000")
    # the deprecated name is set only where NCCL reads nothing else (before torch 2.13)
    old_name = "TORCH_NCCL_TRACE_BUFFER_SIZE"
    assert (old_name in os.environ) == (old_name in FLIGHT_RECORDER_VARIABLES)
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/tmp/tp3d_nccl_trace_rank_"
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")  # the user's choice, under the old name, stays
    enable_collective_recording()
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ and os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50"
