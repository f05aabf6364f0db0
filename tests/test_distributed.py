"""The session's live worlds (`tests.distributed`): a body runs on live workers as on fresh processes, a body
that fails on one rank fails its call with that rank named, a body that hangs is stopped by its timeout with
its stacks shown, and the call after either runs normally.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed, worker_pids

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

WORLD = 2


def report() -> dict[str, Any]:
    """What a fresh process would see, and the sum of the ranks over a new process group."""
    before = {"initialized": dist.is_initialized(), "marker": os.environ.get("TP3D_TEST_MARKER"),
              "caller": os.environ.get("TP3D_TEST_CALLER"),
              "dtype": str(torch.get_default_dtype()), "cwd": os.getcwd(), "grad": torch.is_grad_enabled(),
              "first_random": torch.rand(1).item(), "pid": os.getpid(), "world": os.environ["WORLD_SIZE"]}
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return {**before, "rank": dist.get_rank(), "sum": total.item()}


def change_everything(directory: str) -> int:
    """Leave a process group, an environment variable, a dtype, a directory and grad mode behind."""
    dist.init_process_group("gloo")
    dist.barrier()  # every rank connected before any leaves
    os.environ["TP3D_TEST_MARKER"] = "left behind"
    torch.set_default_dtype(torch.float64)
    os.chdir(directory)
    torch.set_grad_enabled(False)
    torch.rand(5)
    return dist.get_rank()


def fail_on_rank_one() -> int:
    if int(os.environ["RANK"]) == 1:
        raise ValueError("rank one's own failure")
    return 0


def hang_on_rank_zero() -> int:
    if int(os.environ["RANK"]) == 0:
        time.sleep(3600)
    return 0


def fail_on_rank_one_while_rank_zero_waits() -> int:
    if int(os.environ["RANK"]) == 1:
        raise RuntimeError("rank one fails while rank zero waits for it")
    time.sleep(3600)  # as a rank waiting for its failed peer without a timeout would
    return 0


def test_a_live_world_runs_bodies_as_fresh_processes_would(tmp_path, monkeypatch):
    run_distributed(WORLD, "tests.test_distributed:report")  # the workers start before the variable is set
    monkeypatch.setenv("TP3D_TEST_CALLER", "set by the test")
    assert [rank["caller"] for rank in run_distributed(WORLD, "tests.test_distributed:report")] == [
        "set by the test"] * WORLD
    monkeypatch.delenv("TP3D_TEST_CALLER")
    first = run_distributed(WORLD, "tests.test_distributed:report")
    assert [rank["rank"] for rank in first] == [0, 1] and all(rank["sum"] == 1.0 for rank in first)
    assert run_distributed(WORLD, "tests.test_distributed:change_everything", str(tmp_path)) == [0, 1]
    second = run_distributed(WORLD, "tests.test_distributed:report")
    assert [rank["pid"] for rank in second] == worker_pids(WORLD) == [rank["pid"] for rank in first]  # reused
    fresh = run_distributed(WORLD, "tests.test_distributed:report", fresh=True)
    assert {rank["pid"] for rank in fresh}.isdisjoint(worker_pids(WORLD))
    own = ("pid", "first_random")  # a fresh process seeds torch at random; a worker re-seeds with its own seed
    assert [rank["first_random"] for rank in second] == [rank["first_random"] for rank in first]
    for reused, new in zip(second, fresh):  # what the previous body changed was put back
        assert {key: value for key, value in reused.items() if key not in own} == {
            key: value for key, value in new.items() if key not in own}
        assert not reused["initialized"] and reused["marker"] is None and reused["grad"]
        assert reused["dtype"] == "torch.float32" and reused["world"] == str(WORLD)


def test_a_body_that_fails_on_one_rank_fails_its_call_with_the_rank_named_and_the_next_call_runs():
    pids = worker_pids(WORLD)
    with pytest.raises(AssertionError, match=r"on 2 ranks: ranks \[1\] raised") as failure:
        run_distributed(WORLD, "tests.test_distributed:fail_on_rank_one")
    assert "rank 1 raised:" in str(failure.value) and "ValueError: rank one's own failure" in str(failure.value)
    assert "rank 0 raised" not in str(failure.value)
    after = run_distributed(WORLD, "tests.test_distributed:report")
    assert [rank["sum"] for rank in after] == [1.0, 1.0]
    assert [rank["pid"] for rank in after] == pids or None in pids  # a failing body does not cost the world


def test_a_body_that_hangs_times_out_with_its_stacks_and_the_next_call_runs():
    run_distributed(WORLD, "tests.test_distributed:report")
    survivor = worker_pids(WORLD)[1]
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\] timed out after 3 s") as hang:
        run_distributed(WORLD, "tests.test_distributed:hang_on_rank_zero", timeout=3)
    assert time.monotonic() - started < 3 + 10
    assert "hang_on_rank_zero" in str(hang.value)  # the hanging rank's stack, from faulthandler
    after = run_distributed(WORLD, "tests.test_distributed:report")
    assert [rank["sum"] for rank in after] == [1.0, 1.0]
    assert after[1]["pid"] == survivor and after[0]["pid"] != survivor  # only the hanging rank was replaced


def test_a_rank_left_waiting_by_a_failed_peer_is_stopped_after_the_grace_period():
    started = time.monotonic()
    stopped = r"ranks \[1\] raised; ranks \[0\] still running 10 s after a rank failed, stopped"
    with pytest.raises(AssertionError, match=stopped) as failure:
        run_distributed(WORLD, "tests.test_distributed:fail_on_rank_one_while_rank_zero_waits", timeout=60)
    assert time.monotonic() - started < 60  # the grace period, not the body's timeout
    assert "rank one fails while rank zero waits for it" in str(failure.value)
    assert "fail_on_rank_one_while_rank_zero_waits" in str(failure.value).split("rank 0 still running")[1]  # stack
    assert [rank["sum"] for rank in run_distributed(WORLD, "tests.test_distributed:report")] == [1.0, 1.0]
