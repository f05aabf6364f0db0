"""Run a function on N local processes (gloo on CPU) and collect what each rank returns.

Each world size is spawned once per test module and runs many checks inside, because process start-up
(importing torch on two cores) dominates. A short collective timeout and a traceback dump make a bug
fail fast instead of hanging.
"""

from __future__ import annotations

import faulthandler
import importlib
import io
import multiprocessing
import os
import queue
import socket
import traceback
from collections.abc import Iterable
from typing import Any

__all__ = ["results_by_name", "run_distributed"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, target: str, args: tuple, results: Any, timeout: float) -> None:
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
        "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0", "OMP_NUM_THREADS": "1",
    })
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        import torch

        torch.set_num_threads(1)
        module_name, _, function_name = target.partition(":")
        function = getattr(importlib.import_module(module_name), function_name)
        # Bytes rather than tensors: queued tensors live in shared memory that dies with this process.
        buffer = io.BytesIO()
        torch.save(function(*args), buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - the traceback goes back to the test
        results.put((rank, "error", traceback.format_exc()))


def run_distributed(world_size: int, target: str, *args: Any, timeout: float = 600.0) -> list[Any]:
    """Call `target` ("package.module:function") with `args` on `world_size` ranks; return results by rank."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [
        context.Process(target=_worker, args=(rank, world_size, port, target, args, results, timeout), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    collected: dict[int, Any] = {}
    errors: list[str] = []
    try:
        while len(collected) + len(errors) < world_size:
            try:
                rank, status, value = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"{target} on {world_size} ranks produced no result within {timeout} s") from None
            if status == "ok":
                import torch

                collected[rank] = torch.load(io.BytesIO(value), weights_only=True)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for process in processes:
            process.join(timeout=5 if not errors else 1)
            if process.is_alive():
                process.kill()
    if errors:
        raise AssertionError(f"{target} failed on {world_size} ranks:\n" + "\n".join(errors))
    return [collected[rank] for rank in range(world_size)]


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
