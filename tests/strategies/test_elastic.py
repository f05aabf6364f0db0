"""A lost node costs a restart, not the run: two torchrun agents of 4 CPU processes each ("nodes" on one
machine, c10d rendezvous, `--nnodes 1:2 --max-restarts 3`), started by the documented command (`tp3d
run`, torchrun's arguments) with nothing set in the environment for it, train `examples/train_elastic.py`
at (tp, pp, dp) = (2, 2, 2), a global batch of 8 (per-rank batches of 2, 2 accumulated), saving `last.ckpt`
every step. Once a checkpoint of step 3 exists, the second agent and its workers are killed (SIGKILL).
The first agent's workers fail in their next collective, it restarts them at a world of 4, and they
resume by themselves (`ckpt_path="last"`) at dp 1, accumulating 4. Once they have logged a step, the
node comes back: a third agent with the same command joins the rendezvous, the first agent restarts its
workers (a membership change), and the world of 8 resumes at dp 2, accumulating 2, to step 12.

Every step's logged loss (Lightning's CSVLogger, one file per attempt) equals the single-process run with
the same global batch (the last accumulated batch's loss, fp32 1e-5), so every step trained on the same
samples: none repeated, none skipped; the final checkpoint's weights are that run's, and its data
position counts 12 x 8 samples.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lightning_tp3d.cli.launch import UNSHARED_STORE_VARIABLE
from lightning_tp3d.io.checkpoint_format import load_model_tensors, read_meta
from tests.helpers import LEARNING_RATE, SEQ_LEN, assert_adam_weights_close, reference_run

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

REPOSITORY = Path(__file__).resolve().parents[2]
STEPS, GLOBAL_BATCH, PER_RANK_BATCH = 12, 8, 2
KILL_AFTER_STEP = 3
TOLERANCE = 1e-5


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and its workers, as when their node fails."""
    parent = psutil.Process(agent.pid)
    for process in parent.children(recursive=True) + [parent]:
        process.kill()


def _wait_until_hosting(agent: subprocess.Popen, port: int, timeout: float = 120) -> None:
    """Wait until `agent` listens on the rendezvous `port`: the c10d backend's store is hosted by the first
    agent that binds the endpoint, and the agent killed below must not be the one hosting it."""
    deadline = time.monotonic() + timeout
    while not any(connection.laddr.port == port and connection.status == psutil.CONN_LISTEN
                  for connection in psutil.Process(agent.pid).net_connections(kind="tcp")):
        assert time.monotonic() < deadline and agent.poll() is None, f"the first agent never bound port {port}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def elastic_run(tmp_path_factory) -> Path:
    output, port = tmp_path_factory.mktemp("elastic"), _free_port()
    command = [sys.executable, "-m", "lightning_tp3d.cli", "run", "--nnodes", "1:2", "--nproc-per-node", "4",
               "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "tp3d-elastic-test",
               "--rdzv-conf", "last_call_timeout=15,keep_alive_interval=1,keep_alive_max_attempt=3",
               "examples/train_elastic.py", "--output", str(output), "--steps", str(STEPS),
               "--global-batch", str(GLOBAL_BATCH), "--batch-size", str(PER_RANK_BATCH), "--data", "tiny",
               "--seq-len", str(SEQ_LEN), "--learning-rate", str(LEARNING_RATE), "--val-fraction", "0.2"]
    # the documented command alone: `tp3d run` unshares torchrun's store, the test sets nothing for it
    environment = {name: value for name, value in os.environ.items() if name != UNSHARED_STORE_VARIABLE}
    environment["OMP_NUM_THREADS"] = "1"
    logs = [open(output / f"agent{index}.log", "w") for index in range(2)]  # noqa: SIM115 - closed below
    agents = []
    try:
        # the first agent hosts the rendezvous store (the node that stays up); the second joins within the
        # first's last call, so that both start in one world
        for log in logs:
            agents.append(subprocess.Popen(command, cwd=REPOSITORY, env=environment, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True))
            _wait_until_hosting(agents[0], port)
        # Lightning saves a step's checkpoint before it logs the step's loss: wait for both, so that the
        # first attempt's log holds every step up to the checkpoint the restart resumes from
        meta, deadline = output / "checkpoints" / "last.ckpt" / "meta.json", time.monotonic() + 300
        while ((json.loads(meta.read_text())["global_step"] if meta.is_file() else -1) < KILL_AFTER_STEP
               or KILL_AFTER_STEP - 1 not in _logged_steps(output)):
            assert time.monotonic() < deadline and all(agent.poll() is None for agent in agents), (
                (output / "agent0.log").read_text()[-3000:])
            time.sleep(0.1)
        _kill_node(agents[1])
        deadline = time.monotonic() + 300
        while len(_logged_attempts(output)) < 2:  # the survivors resumed at dp 1 and logged a step
            assert time.monotonic() < deadline and agents[0].poll() is None, (
                (output / "agent0.log").read_text()[-3000:])
            time.sleep(0.1)
        with open(output / "agent2.log", "w") as log:  # the node comes back
            agents.append(subprocess.Popen(command, cwd=REPOSITORY, env=environment, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True))
        for index in (0, 2):
            assert agents[index].wait(timeout=600) == 0, (output / f"agent{index}.log").read_text()[-5000:]
    finally:
        for agent in agents:
            if agent.poll() is None:
                _kill_node(agent)
        for log in logs:
            log.close()
    return output


def _logged_steps(output: Path) -> set[int]:
    """The steps logged so far (a file being written may end in a partial line: read again later)."""
    try:
        return {step for attempt in _losses_by_attempt(output) for step in attempt}
    except ValueError:
        return set()


def _logged_attempts(output: Path) -> list[dict[int, float]]:
    """The attempts that have logged a step so far."""
    try:
        return [attempt for attempt in _losses_by_attempt(output) if attempt]
    except ValueError:
        return []


def _losses_by_attempt(output: Path) -> list[dict[int, float]]:
    attempts = sorted((output / "logs").glob("version_*/metrics.csv"), key=lambda path: int(path.parent.name[8:]))
    return [{int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(path.open()) if row["train_loss"]}
            for path in attempts]


def test_the_surviving_node_resumes_at_dp_1_and_the_returning_node_grows_dp_back(elastic_run):
    first, *restarted = [attempt for attempt in _losses_by_attempt(elastic_run) if attempt]
    assert len(restarted) == 2, f"attempts that logged steps after the first: {restarted}"
    shrunk, grown = restarted
    # the survivors' failure names the group and the cause, not a timeout
    assert "a rank of that group closed its connection" in (elastic_run / "agent0.log").read_text()
    # each attempt resumed from a checkpoint: no step before the previous attempt's last, none missing
    assert min(shrunk) >= KILL_AFTER_STEP and min(grown) > min(shrunk) and max(grown) == STEPS - 1
    assert set(first) | set(shrunk) | set(grown) == set(range(STEPS))
    by_two, by_four = (reference_run(STEPS, GLOBAL_BATCH, accumulate=k) for k in (2, 4))
    for attempt, reference in ((first, by_two), (shrunk, by_four), (grown, by_two)):  # dp 2, 1, 2
        for step, loss in attempt.items():
            assert abs(loss - reference["last_batch_losses"][step]) <= TOLERANCE, step
    meta = read_meta(elastic_run / "checkpoints" / "last.ckpt")
    assert meta.global_step == STEPS and meta.parallel_sizes == (2, 2, 2) and meta.world_size == 8
    assert meta.accumulate_grad_batches == 2 and meta.consumed_samples == STEPS * GLOBAL_BATCH
    weights = load_model_tensors(elastic_run / "checkpoints" / "last.ckpt")
    for name, expected in by_two["final_params"].items():
        assert_adam_weights_close(weights[f"model.{name}"], expected, name)
