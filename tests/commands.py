"""A script or a `tp3d` command run on every rank of one of the session's live worlds, as torchrun starts it.

Each rank of the world (`tests.distributed`) gets `RANK`, `LOCAL_RANK`, `WORLD_SIZE` and `MASTER_*`, so
Lightning's `Trainer(devices=N)` and `Fabric(devices=N)` find their processes already started, as under
`torchrun --nproc-per-node N`, and do not start N new ones that import Lightning again (about 5 s of CPU
each on the test machine). What a user runs with `python script.py` or `tp3d fit` then runs the same code
with the same ranks; the launcher itself is exercised where it is the subject (`tests/test_examples.py`,
`tests/strategies/test_elastic.py`, the one-line refusal in `tests/cli/test_lightning.py`).
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import sys
from collections.abc import Sequence

from tests.distributed import run_distributed

__all__ = ["command_on_world", "script_on_world"]


def _run_script(script: str, directory: str) -> None:
    """Rank body: `python script` in `directory` (its folder first on `sys.path`, run as `__main__`)."""
    os.chdir(directory)
    folder, argv = os.path.dirname(os.path.abspath(script)), sys.argv
    sys.path.insert(0, folder)
    sys.argv = [script]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.path.remove(folder)
        sys.argv = argv


def _run_command(argv: Sequence[str], directory: str) -> tuple[int, str, str]:
    """Rank body: `tp3d argv` in `directory`: (exit status, standard output, standard error)."""
    from lightning_tp3d.cli import main

    os.chdir(directory)
    out, err, program_argv = io.StringIO(), io.StringIO(), sys.argv
    sys.argv = ["tp3d", *argv]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(list(argv))
    finally:
        sys.argv = program_argv
    return status, out.getvalue(), err.getvalue()


def script_on_world(world_size: int, script: str, directory: str, timeout: float = 900.0) -> None:
    """`python script` in `directory` on `world_size` live ranks; a rank that raises fails the call."""
    run_distributed(world_size, "tests.commands:_run_script", script, directory, timeout=timeout)


def command_on_world(world_size: int, argv: Sequence[str], directory: str, timeout: float = 600.0) -> list[str]:
    """`tp3d argv` in `directory` on `world_size` live ranks: each rank's standard output. A rank whose exit
    status is not 0 fails the call, named with its status and the tail of its standard error."""
    results = run_distributed(world_size, "tests.commands:_run_command", list(argv), directory, timeout=timeout)
    failed = [f"rank {rank}: exit {status}\n{err[-4000:]}" for rank, (status, _, err) in enumerate(results) if status]
    assert not failed, f"tp3d {' '.join(argv)}\n" + "\n".join(failed)
    return [out for _, out, _ in results]
