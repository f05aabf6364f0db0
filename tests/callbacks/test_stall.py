"""`StalledRankMonitor`: while one rank of 4 stalls (it sleeps 10 s inside step 5), the others wait for it
in collectives and pipeline transfers, and rank 0 reports that rank, with its (pp, dp, tp) coordinates
and host, once, and the run then finishes: at (tp, pp, dp) = (2, 1, 2) with rank 3 stalling (its tp
peer waits in a tp collective, the others in dp ones), with rank 0 itself stalling (its own watcher
names it), and at (1, 2, 2) with rank 2 stalling (rank 0, its pipeline peer, waits in a transfer and is
not blamed). The diagnosis itself is checked by hand on heartbeats: a chain of waits, a dead rank, and
no culprit where every rank waits.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback

from lightning_tp3d import TP3DStrategy
from lightning_tp3d.callbacks.stall import (
    StalledRankMonitor,
    communication_wait,
    diagnose_stall,
    newest_collectives,
    newest_record,
)
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from tests.distributed import run_distributed
from tests.helpers import SEQ_LEN, trainer_kwargs, world_size

STALL_SECONDS = 10.0
STALL_STEP = 4  # the global step before which the stalling rank sleeps (inside the 5th step)
STEPS = 7
# stalls: 5 x the median step time and at least 5 s, far above a tiny model's step on the CPU and below the
# 10 s stall; a backup observer takes rank 0 for dead after a quarter of it without a beat (1.25 s), which a
# watcher thread on an oversubscribed CPU can miss at 3 s (0.75 s: a run beside the suite did once)
MONITOR = {"factor": 5.0, "min_seconds": 5.0, "poll_seconds": 0.1}


class Stall(Callback):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == STALL_STEP:
            time.sleep(STALL_SECONDS)


def run_stall_world() -> dict[str, Any]:
    results = {}
    for tp, pp, culprit in ((2, 1, 3), (2, 1, 0), (1, 2, 2)):
        monitor = StalledRankMonitor(**MONITOR)
        strategy = TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, num_microbatches=2)
        trainer = L.Trainer(**trainer_kwargs(devices=world_size(), strategy=strategy, max_steps=STEPS, logger=False,
                                             callbacks=[monitor, Stall(culprit)]))
        trainer.fit(CausalLMModule("tiny"), TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=2))
        results[(tp, pp, culprit)] = {"reports": monitor.reports, "steps": trainer.global_step}
    return results


@pytest.fixture(scope="module")
def stalls() -> list[dict[str, Any]]:
    return run_distributed(4, "tests.callbacks.test_stall:run_stall_world")


@pytest.mark.distributed
@pytest.mark.parametrize(("layout", "coordinates"), [((2, 1, 3), "pp 0, dp 1, tp 1"), ((2, 1, 0), "pp 0, dp 0, tp 0"),
                                                     ((1, 2, 2), "pp 1, dp 0, tp 0")])
def test_the_stalled_rank_is_named_once_by_rank_zero(stalls, layout, coordinates):
    culprit = layout[2]
    reports = stalls[0][layout]["reports"]
    assert len(reports) == 1, reports
    assert (f"Rank {culprit} ({coordinates}) on {socket.gethostname()} holds the others up: it has not joined"
            in reports[0]), reports[0]
    assert "it waits for no communication itself: it is stuck in its own work" in reports[0]
    assert reports[0].count("holds the others up") == 1  # no rank waiting for it is blamed
    assert all(not rank[layout]["reports"] for rank in stalls[1:])
    assert all(rank[layout]["steps"] == STEPS for rank in stalls)  # the run went on after the stall


def _beat(step: int, waiting: str | None = None, **groups: tuple[int, bool]) -> dict[str, Any]:
    return {"step": step, "waiting": waiting,
            "groups": {name: {"seq": seq, "op": "all_reduce", "group": f"mesh_{name[:2]}", "retired": retired}
                       for name, (seq, retired) in groups.items()}}


def test_a_chain_of_waits_leads_to_the_rank_waiting_for_nothing():
    heartbeats = {
        0: _beat(4, dp0=(10, False), tp0=(30, True)),  # waits in dp for rank 2
        1: _beat(4, dp1=(10, False), tp0=(30, True)),  # waits in dp for rank 3
        2: _beat(4, "torch.distributed._functional_collectives.wait_tensor", dp0=(9, True), tp1=(31, True)),
        3: _beat(4, dp1=(9, True), tp1=(30, True)),  # behind on tp1 and dp1, waiting for nothing
    }
    diagnosis = diagnose_stall(heartbeats, dead=[])
    assert diagnosis.culprits == [3]
    assert diagnosis.reasons[3].startswith("it has not joined all_reduce #10 on mesh_dp (ranks [1] wait in it) nor"
                                           " all_reduce #31 on mesh_tp (ranks [2] wait in it), and it waits for no")


def test_a_rank_that_stopped_beating_is_named_first():
    heartbeats = {0: _beat(4, dp0=(10, False)), 1: _beat(4, dp0=(9, True))}
    diagnosis = diagnose_stall(heartbeats, dead=[1])
    assert diagnosis.culprits == [1] and "heartbeat stopped" in diagnosis.reasons[1]


def test_no_rank_is_named_when_every_rank_waits():
    heartbeats = {0: _beat(4, "torch.distributed.pipelining.schedules._wait_batch_p2p", dp0=(9, True)),
                  1: _beat(4, dp0=(10, False))}
    diagnosis = diagnose_stall(heartbeats, dead=[])
    assert diagnosis.culprits == []
    assert "blocked in torch.distributed.pipelining.schedules._wait_batch_p2p" in diagnosis.positions[0]
    assert "all_reduce #10 on mesh_dp (waiting)" in diagnosis.positions[1]


def test_newest_collective_per_group_from_the_flight_recorder():
    entries = [
        {"process_group": ["3", "mesh_tp"], "collective_seq_id": 7, "profiling_name": "gloo:all_reduce",
         "retired": True},
        {"process_group": ["3", "mesh_tp"], "collective_seq_id": 8, "profiling_name": "gloo:all_gather",
         "retired": False},
        {"process_group": ["5", "mesh_pp"], "collective_seq_id": 0, "p2p_seq_id": 4, "is_p2p": True},
    ]
    assert newest_collectives(entries) == {"3": {"seq": 8, "op": "all_gather", "group": "mesh_tp", "retired": False}}


def test_entries_of_earlier_process_groups_with_the_same_names_are_left_out():
    # a group destroyed, then a new one under the same name: its sequence numbers start again
    entries = [
        {"record_id": 0, "process_group": ["3", "mesh_tp"], "collective_seq_id": 40, "profiling_name": "gloo:broadcast",
         "retired": False},
        {"record_id": 1, "process_group": ["3", "mesh_tp"], "collective_seq_id": 2, "profiling_name": "gloo:all_reduce",
         "retired": True},
    ]
    assert newest_record(entries[:1]) == 0 and newest_record([]) == -1
    assert newest_collectives(entries, after_record=newest_record(entries[:1])) == {
        "3": {"seq": 2, "op": "all_reduce", "group": "mesh_tp", "retired": True}}
    assert newest_collectives(entries)["3"]["seq"] == 40  # without the mark, the stale entry would win


def test_a_thread_outside_communication_waits_for_nothing():
    started, release = threading.Event(), threading.Event()

    def work() -> None:
        started.set()
        release.wait()

    thread = threading.Thread(target=work)
    thread.start()
    started.wait()
    try:
        assert communication_wait(thread.ident) is None
    finally:
        release.set()
        thread.join()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match=r"factor > 1"):
        StalledRankMonitor(factor=1.0)
