"""The session's live worlds (`tests.distributed`): a body runs on live workers as on fresh processes, a body
that fails on one rank fails its call with that rank named, a body that hangs is stopped by its timeout with
its stacks shown, and the call after either runs normally; a job's process groups do not outlive it, and a
job started with `start_distributed` runs while the caller works.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed, start_distributed, worker_pids

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


def redistribute_over_a_mesh() -> int:
    """Fill DTensor's caches with a 2 x 1 mesh's groups: a redistribution plan and the mesh's topology."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp", "tp"))
    tensor = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0), Replicate()])
    return int(tensor.redistribute(mesh, [Replicate(), Replicate()]).to_local().sum().item())


def gloo_threads() -> int:
    """The threads of gloo's contexts (a transport loop and two workers per group) alive in this process."""
    names = []
    for thread in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{thread}/comm") as comm:
            names.append(comm.read().strip())
    return sum(name.startswith(("gloo", "pt_gloo")) for name in names)


def test_a_job_s_process_groups_do_not_outlive_it():
    """DTensor's function caches key on meshes, which hold their groups: the pool clears them after each
    job, so a worker does not collect the gloo threads of every job it ran (each transport thread wakes every
    10 ms, and hundreds of them made later tests several times slower). A worker's first DTensor job leaves
    at most one group's threads (torch keeps its first default group's context), and later jobs none."""
    assert run_distributed(WORLD, "tests.test_distributed:redistribute_over_a_mesh") == [28, 28]
    first = run_distributed(WORLD, "tests.test_distributed:gloo_threads")
    assert all(threads <= 3 for threads in first), first
    for _ in range(3):
        assert run_distributed(WORLD, "tests.test_distributed:redistribute_over_a_mesh") == [28, 28]
    assert run_distributed(WORLD, "tests.test_distributed:gloo_threads") == first


def test_a_started_job_runs_while_the_caller_works_and_its_result_is_taken_once():
    started = time.monotonic()
    running = start_distributed(WORLD, "tests.test_distributed:report")
    assert time.monotonic() - started < 5  # sent, not waited for
    with pytest.raises(RuntimeError, match="is still running on the live workers"):
        run_distributed(WORLD, "tests.test_distributed:report")
    assert [rank["sum"] for rank in running.result()] == [1.0, 1.0]
    with pytest.raises(AssertionError, match="collected once"):
        running.result()
    assert [rank["sum"] for rank in run_distributed(WORLD, "tests.test_distributed:report")] == [1.0, 1.0]


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
