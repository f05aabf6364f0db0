"""Run a function on N local processes (gloo on CPU) and collect what each rank returns.

The processes are started once per test session and kept: a pool of workers where worker `r` is always rank
`r`, a world of size N being the first N workers. A call sends the job to them and each runs it as a newly
started process would: in the caller's environment of the moment, with a new rendezvous port, its
`WORLD_SIZE` and a timeout. After each job every worker puts back what a body may have changed (process
groups, the environment, working directory, default dtype, grad and anomaly modes, matmul precision,
determinism, thread count, warning filters, torch's default seed, compiled graphs, DTensor's caches), so a
test pays for its work and not for starting processes and importing torch (about 20 s for 8 processes on
two cores).

A body that raises fails its test with every failing rank named and its traceback. A body that hangs is
stopped after its timeout: each silent rank's stacks are dumped (faulthandler) into the error, the world's
processes are killed, and the next call starts new ones, so one broken test does not take the rest with it.
`fresh=True` runs a body on newly started processes that exit afterwards, for one that must not share them.
`start_distributed` sends a job and returns at once, so that the test's own process computes its one-process
reference on the cores the ranks leave idle, before it takes the ranks' results.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import importlib
import io
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["PendingRun", "released_process_groups", "results_by_name", "run_distributed", "shutdown_workers",
           "start_distributed", "worker_pids"]

# after the first rank fails, how long the others have to finish (or fail) before they count as stuck
GRACE_SECONDS = 10.0
# how long past its own faulthandler deadline a silent rank is waited for (the dump takes a moment)
DUMP_SECONDS = 5.0
# a worker whose resident memory grew past this (compiled code, caches) is replaced after its job
RECYCLE_BYTES = 2 * 1024**3
# ... and one left with more threads than this: each gloo context a job leaves alive keeps a transport thread
# that wakes every 10 ms, which on two cores costs every later test its share of the CPU
RECYCLE_THREADS = 48
# the tail of a failing worker's output shown with its error
LOG_TAIL_CHARS = 6000


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _ProcessState:
    """What a job may change in a worker's process: taken before the first job, put back after each."""

    def __init__(self) -> None:
        import torch

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.dtype = torch.get_default_dtype()
        self.seed = torch.initial_seed()
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.deterministic = torch.are_deterministic_algorithms_enabled()

    def restore(self) -> None:
        import torch

        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if "torch._dynamo" in sys.modules:
            torch.compiler.reset()
        _clear_dtensor_caches()
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        torch.autograd.set_detect_anomaly(False)
        torch.set_float32_matmul_precision(self.matmul_precision)
        torch.use_deterministic_algorithms(self.deterministic)
        torch.set_num_threads(1)
        torch.manual_seed(self.seed)
        gc.collect()


def _clear_dtensor_caches() -> None:
    """DTensor's sharding-propagation and redistribution caches (torch 2.13's private names) compare meshes
    by shape and dimension names, not by process groups: a result cached in an earlier job would hand back
    a mesh of its destroyed groups ("Could not resolve the process group registered under the name N")."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # Python's and the C++ fast path's, "the recommended way to clear all"
    clear_redistribute_planner_cache()
    for cache in _distributed_caches():
        cache.cache_clear()


@contextlib.contextmanager
def released_process_groups() -> Iterator[None]:
    """Destroy the process groups the block creates (each fit's device mesh is new gloo groups) when it ends
    without raising, after a barrier of the world (also a decorator, per call). A group's gloo context keeps
    transport threads that wake every 10 ms while it lives, so a job running many fits would otherwise pile
    up hundreds of them on two cores (every one kept until the default group goes at the job's end).
    DTensor's caches, which hold meshes, go too."""
    from torch.distributed import distributed_c10d

    before = set(distributed_c10d._world.pg_map)  # torch 2.13's private registry of live groups
    yield  # a block that raises leaves its groups to the job's end: a barrier now would hide its traceback
    if distributed_c10d.is_initialized():
        distributed_c10d.barrier()
        world = distributed_c10d._get_default_group()  # kept: the job's end destroys it
        for group in [group for group in distributed_c10d._world.pg_map if group not in before | {world}]:
            distributed_c10d.destroy_process_group(group)
    _clear_dtensor_caches()


def _distributed_caches() -> Iterator[Any]:
    """The `functools` caches of torch.distributed's modules and of their classes (DTensor's transform plans,
    `MeshTopoInfo.build_from_mesh`, ...). Their keys hold device meshes, and a mesh holds its process groups:
    left filled, they keep every job's gloo contexts (three threads each) alive for the worker's life."""
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed"):
            continue
        for value in list(vars(module).values()):
            members = [value]
            if isinstance(value, type) and value.__module__ == name:
                members += [getattr(member, "__func__", member) for member in vars(value).values()]
            # `functools.lru_cache` / `functools.cache` wrappers (the only objects with `cache_parameters`)
            yield from (member for member in members if not isinstance(member, type)
                        and callable(getattr(member, "cache_parameters", None)))


def _thread_count() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def _resident_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _run_job(target: str, args: tuple) -> tuple[str, Any]:
    try:
        with warnings.catch_warnings():  # filters and once-registries as they were, after the job
            module_name, _, function_name = target.partition(":")
            result = getattr(importlib.import_module(module_name), function_name)(*args)
            # bytes rather than tensors: tensors sent between processes live in shared memory
            buffer = io.BytesIO()
            import torch

            torch.save(result, buffer)
            return "ok", buffer.getvalue()
    except BaseException:  # noqa: BLE001 - the traceback goes back to the test
        return "error", traceback.format_exc()


def _serve(rank: int, connection: Connection, log_path: str) -> None:
    """Worker `rank`: run the jobs sent on `connection` until it sends None; all output goes to `log_path`."""
    log = open(log_path, "a", buffering=1)  # noqa: SIM115 - the worker's output for its whole life
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    rank_variables = {"MASTER_ADDR": "127.0.0.1", "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0",
                      "OMP_NUM_THREADS": "1"}
    os.environ.update(rank_variables)
    import torch

    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR2, file=log, all_threads=True)  # the pool asks for stacks before a kill
    state = _ProcessState()
    while (job := connection.recv()) is not None:
        target, args, environment, world_size, port, timeout = job
        os.environ.update({**environment, **rank_variables, "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size)})
        print(f"=== {target} on {world_size} ranks", flush=True)
        faulthandler.dump_traceback_later(timeout, exit=True, file=log)
        status, value = _run_job(target, args)
        faulthandler.cancel_dump_traceback_later()
        keep = True
        try:
            state.restore()
        except BaseException:  # noqa: BLE001 - a worker that cannot be put back is replaced
            if status == "ok":
                status, value = "error", ""
            value += "\nputting the worker back after the job failed:\n" + traceback.format_exc()
            keep = False
        sys.stdout.flush()
        sys.stderr.flush()
        connection.send((status, value, keep and _resident_bytes() < RECYCLE_BYTES
                         and _thread_count() <= RECYCLE_THREADS))


@dataclass
class _Worker:
    rank: int
    process: Any
    connection: Connection
    log_path: str

    def log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, errors="replace") as log:
                log.seek(offset)
                return log.read()[-LOG_TAIL_CHARS:]
        except OSError:
            return ""

    def log_size(self) -> int:
        return os.path.getsize(self.log_path)

    def stop(self, graceful: bool) -> None:
        if graceful and self.process.is_alive():
            try:
                self.connection.send(None)
            except OSError:
                pass
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.connection.close()


@dataclass
class _Job:
    """A job sent to the first `world_size` workers and not collected yet."""

    target: str
    world_size: int
    timeout: float
    workers: list[_Worker]
    offsets: dict[int, int]  # each worker's log size when the job was sent
    started: float


class _Pool:
    """Workers by rank, started when a world first needs them and replaced when one is killed or recycled."""

    def __init__(self) -> None:
        self.workers: dict[int, _Worker] = {}
        self.pending: _Job | None = None
        self.log_directory = tempfile.mkdtemp(prefix="tp3d-workers-")

    def start(self, ranks: Iterable[int]) -> None:
        context = multiprocessing.get_context("spawn")
        for rank in ranks:
            if rank in self.workers:
                continue
            ours, theirs = context.Pipe()
            log_path = os.path.join(self.log_directory, f"rank{rank}-{time.monotonic_ns()}.log")
            open(log_path, "w").close()
            process = context.Process(target=_serve, args=(rank, theirs, log_path), daemon=True,
                                      name=f"tp3d-rank{rank}")
            process.start()
            theirs.close()
            self.workers[rank] = _Worker(rank, process, ours, log_path)

    def drop(self, ranks: Iterable[int], graceful: bool = False) -> None:
        for rank in ranks:
            worker = self.workers.pop(rank, None)
            if worker is not None:
                worker.stop(graceful)

    def shutdown(self) -> None:
        self.pending = None
        self.drop(list(self.workers), graceful=True)
        shutil.rmtree(self.log_directory, ignore_errors=True)

    def submit(self, world_size: int, target: str, args: tuple, timeout: float) -> _Job:
        """Send the job to ranks 0 .. world_size - 1 and return at once; `collect` waits for its results."""
        if self.pending is not None:
            raise RuntimeError(f"{self.pending.target} is still running on the live workers; collect its"
                               " results before sending another job")
        self.start(range(world_size))
        workers = [self.workers[rank] for rank in range(world_size)]
        offsets = {worker.rank: worker.log_size() for worker in workers}
        # the caller's environment as it is now (a test's monkeypatched variables), as a new process inherits it
        job = (target, args, dict(os.environ), world_size, _free_port(), timeout)
        started = time.monotonic()  # before any worker starts its own clock
        for worker in workers:
            worker.connection.send(job)
        self.pending = _Job(target, world_size, timeout, workers, offsets, started)
        return self.pending

    def run(self, world_size: int, target: str, args: tuple, timeout: float) -> list[Any]:
        return self.collect(self.submit(world_size, target, args, timeout))

    def collect(self, job: _Job) -> list[Any]:
        """Wait for `job`'s replies; its results by rank, or the error naming each failing or silent rank."""
        assert job is self.pending, "a job is collected once, by the pool that sent it"
        self.pending = None
        target, world_size, timeout, workers, offsets, started = (job.target, job.world_size, job.timeout,
                                                                   job.workers, job.offsets, job.started)
        replies: dict[int, tuple[str, Any, bool]] = {}
        waiting = {worker.connection: worker for worker in workers}
        dead: list[int] = []
        deadline = started + timeout + DUMP_SECONDS
        while waiting:
            ready = wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for connection in ready:
                worker = waiting.pop(connection)
                try:
                    replies[worker.rank] = connection.recv()
                except (EOFError, OSError):  # the worker exited (killed, faulthandler) without a reply
                    dead.append(worker.rank)
                if worker.rank in dead or replies[worker.rank][0] == "error":
                    deadline = min(deadline, time.monotonic() + GRACE_SECONDS)
        if time.monotonic() - started >= timeout:  # faulthandler ended them at their deadline
            waiting.update({self.workers[rank].connection: self.workers[rank] for rank in dead})
            dead = []
        silent = sorted(worker.rank for worker in waiting.values())
        for worker in waiting.values():
            if worker.process.is_alive():
                os.kill(worker.process.pid, signal.SIGUSR2)
        if any(worker.process.is_alive() for worker in waiting.values()):
            time.sleep(1.0)  # the stacks are written by the workers themselves
        failed = sorted(rank for rank, reply in replies.items() if reply[0] == "error")
        self.drop(silent + dead + [rank for rank, reply in replies.items() if not reply[2]])
        if not (silent or dead or failed):
            import torch

            return [torch.load(io.BytesIO(replies[rank][1]), weights_only=True) for rank in range(world_size)]
        sections = [f"rank {rank} raised:\n{replies[rank][1]}" for rank in failed]
        sections += [f"rank {worker.rank} exited without a result; its output:\n"
                     f"{worker.log_since(offsets[worker.rank])}" for worker in workers if worker.rank in dead]
        stopped = (f"still running {GRACE_SECONDS:g} s after a rank failed, stopped" if failed or dead
                   else f"timed out after {timeout:g} s")
        sections += [f"rank {worker.rank} {stopped}; its output and stacks:\n{worker.log_since(offsets[worker.rank])}"
                     for worker in workers if worker.rank in silent]
        summary = f"{target} on {world_size} ranks: " + "; ".join(
            part for part in (f"ranks {failed} raised" if failed else "", f"ranks {dead} died" if dead else "",
                              f"ranks {silent} {stopped}" if silent else "") if part)
        error = TimeoutError if silent and not failed else AssertionError
        raise error(summary + "\n" + "\n".join(sections))


_POOL = _Pool()
atexit.register(_POOL.shutdown)


def run_distributed(world_size: int, target: str, *args: Any, timeout: float = 600.0, fresh: bool = False
                    ) -> list[Any]:
    """Call `target` ("package.module:function") with `args` on `world_size` ranks; return results by rank.

    A rank that raises fails the call (AssertionError naming every failing rank, with tracebacks); ranks that
    give no result within `timeout` seconds are killed and named (TimeoutError, with their stacks). The
    ranks are the session's live workers unless `fresh`, which starts new processes and ends them after.
    """
    if not fresh:
        return _POOL.run(world_size, target, args, timeout)
    pool = _Pool()
    try:
        return pool.run(world_size, target, args, timeout)
    finally:
        pool.shutdown()


class PendingRun:
    """A `run_distributed` call sent to the live workers and running while the caller works on: `result()`
    waits for it and returns (or raises) what `run_distributed` would have."""

    def __init__(self, job: _Job) -> None:
        self._job = job

    def result(self) -> list[Any]:
        return _POOL.collect(self._job)


def start_distributed(world_size: int, target: str, *args: Any, timeout: float = 600.0) -> PendingRun:
    """`run_distributed(world_size, target, *args)` on the live workers, returned at once: the caller's own
    process meanwhile does single-process work (a test's one-process reference) on the cores the ranks
    leave idle. No other call may use the workers until its `result()` is taken."""
    return PendingRun(_POOL.submit(world_size, target, args, timeout))


def worker_pids(world_size: int) -> list[int | None]:
    """The process ids of the live workers of ranks 0 .. world_size - 1 (None where none is running)."""
    return [_POOL.workers[rank].process.pid if rank in _POOL.workers else None for rank in range(world_size)]


def shutdown_workers() -> None:
    """End the session's workers (the next call starts new ones)."""
    _POOL.shutdown()


def results_by_name(world_sizes: Iterable[int], target: str, *args: Any, with_world: bool = True
                    ) -> dict[str, list[Any]]:
    """Run `target` once per world size (as `target(world_size, *args)`, or `target(*args)` without
    `with_world`); each rank returns {name: result}. Returns name -> the ranks' results, in rank order."""
    results: dict[str, list[Any]] = {}
    for world_size in world_sizes:
        per_rank = run_distributed(world_size, target, *((world_size, *args) if with_world else args))
        for name in per_rank[0]:
            results[name] = [rank_result[name] for rank_result in per_rank]
    return results
