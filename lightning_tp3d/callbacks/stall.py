"""A stalled rank named by the others, while the job hangs, with its (pp, dp, tp) coordinates.

In a 3D-parallel job one hung or much slower rank stops every rank: each waits for it in the next
collective, and the timeout that fires at last (minutes later) names a collective, not the rank.
`StalledRankMonitor` runs a watcher thread on every rank that publishes a heartbeat into the key-value
store the default process group was created with (a `TCPStore`, which answers while collectives hang):
a beat counter (the process is alive), the training step, and, once this rank has made no step for half
the threshold, where it is: the newest collective it entered on each of its groups (torch's flight
recorder, which the strategy turns on: group, operation, the group's sequence number) and whether it is
waiting for communication (a flight-recorder entry not yet retired, or the main thread blocked in
`torch.distributed`: a collective, a functional collective's wait, a pipeline send or receive, which
gloo's recorder does not record).

When a watcher has seen no step for `factor` x the median step time (and at least `min_seconds`), it
reads every rank's heartbeat and finds the rank holding the others up:

* a rank whose beat stopped: its process died or its interpreter is frozen;
* else a rank that has not joined a collective its group's peers wait in (its sequence number on that
  group is lower) and waits for no communication itself: it is stuck in its own work (compute, data
  loading, I/O), and the others wait for it, directly or through a chain of waits;
* if no rank is such (every rank waits, e.g. inside pipeline transfers, or none is behind), every rank's
  step, newest collectives and wait are listed instead: no rank is named where the evidence does not
  single one out.

Rank 0 reports (rank 1 when rank 0 is the one that stopped), once per stall, as a warning of the
`lightning_tp3d` logger, and keeps it in `reports`. Time is measured on the watcher's own clock, so the
hosts' clocks need not agree. Validation pauses the watch.

Example usage::

    trainer = L.Trainer(strategy=TP3DStrategy(...), callbacks=[StalledRankMonitor(factor=10, min_seconds=120)])
"""

from __future__ import annotations

import json
import logging
import socket
import statistics
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from lightning_tp3d._compat.torch import default_store, recorded_collectives
from lightning_tp3d.plan.layout import ParallelLayout

__all__ = ["StallDiagnosis", "StalledRankMonitor", "communication_wait", "diagnose_stall", "newest_collectives",
           "newest_record"]

log = logging.getLogger("lightning_tp3d")
_OBSERVERS = (0, 1)
_WARM_UP_STEPS = 2  # the first steps (compilation, allocation) are left out of the median
_COMMUNICATION_MODULES = ("torch.distributed.distributed_c10d", "torch.distributed._functional_collectives")
_PIPELINE_MODULES = ("torch.distributed.pipelining", "lightning_tp3d.parallel.pipeline")


def newest_collectives(entries: list[dict[str, Any]], after_record: int = -1) -> dict[str, dict[str, Any]]:
    """From flight-recorder `entries`: per group name, the newest collective this rank entered (its
    sequence number on that group, operation, the group's description, e.g. `mesh_tp`, and whether it
    completed: `retired`). Only entries recorded after `after_record` count: the recorder outlives the
    process groups, and groups created after `destroy_process_group` reuse the names of earlier ones."""
    newest: dict[str, dict[str, Any]] = {}
    for entry in entries:
        if entry.get("record_id", 0) <= after_record:
            continue
        name, description = (entry.get("process_group") or ["?", "?"])[:2]
        sequence = entry.get("collective_seq_id", 0)
        if not entry.get("is_p2p") and sequence and sequence >= newest.get(name, {}).get("seq", 0):
            newest[name] = {"seq": sequence, "op": str(entry.get("profiling_name", "?")).split(":")[-1],
                            "group": description, "retired": bool(entry.get("retired", True))}
    return newest


def newest_record(entries: list[dict[str, Any]]) -> int:
    """The highest flight-recorder `record_id` among `entries` (-1 where there are none)."""
    return max((entry.get("record_id", -1) for entry in entries), default=-1)


def communication_wait(thread_id: int) -> str | None:
    """Where thread `thread_id` waits for communication: the innermost frame of its stack in torch's
    collectives or a pipeline transfer's wait, torch's schedule's or the package's executor's
    (`module.function`), else None."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        module, function = frame.f_globals.get("__name__", ""), frame.f_code.co_name
        if module.startswith(_COMMUNICATION_MODULES) or (
                module.startswith(_PIPELINE_MODULES) and ("wait" in function or "p2p" in function)):
            return f"{module}.{function}"
        frame = frame.f_back
    return None


@dataclass
class StallDiagnosis:
    """Which ranks hold the others up (`culprits`), why (`reasons`, by rank), and every rank's position."""

    culprits: list[int]
    reasons: dict[int, str] = field(default_factory=dict)
    positions: dict[int, str] = field(default_factory=dict)


def diagnose_stall(heartbeats: Mapping[int, Mapping[str, Any]], dead: list[int]) -> StallDiagnosis:
    """The culprits of a stall from every rank's heartbeat (`step`; `groups` as `newest_collectives`
    gives; `waiting`: its communication wait or None) and the ranks whose beat stopped (`dead`); see the
    module docstring."""
    positions = {rank: _position(beat) for rank, beat in heartbeats.items()}
    if dead:
        return StallDiagnosis(sorted(dead), {rank: "its heartbeat stopped: the process died or its interpreter is"
                                             " frozen" for rank in dead}, positions)
    members: dict[str, dict[int, dict[str, Any]]] = {}
    for rank, beat in heartbeats.items():
        for name, newest in beat.get("groups", {}).items():
            members.setdefault(name, {})[rank] = newest
    behind: dict[int, list[str]] = {}
    for ranks in members.values():
        top = max(newest["seq"] for newest in ranks.values())
        waiting = sorted(rank for rank, newest in ranks.items() if newest["seq"] == top)
        joined = ranks[waiting[0]]
        for rank, newest in ranks.items():
            if newest["seq"] < top:
                behind.setdefault(rank, []).append(f"{joined['op']} #{top} on {joined['group']} (ranks {waiting}"
                                                   " wait in it)")
    culprits = sorted(rank for rank in behind if not _waits(heartbeats[rank]))
    reasons = {rank: f"it has not joined {' nor '.join(behind[rank])}, and it waits for no communication itself:"
               " it is stuck in its own work (compute, data loading, I/O)" for rank in culprits}
    return StallDiagnosis(culprits, reasons, positions)


def _waits(beat: Mapping[str, Any]) -> bool:
    return beat.get("waiting") is not None or any(not newest["retired"] for newest in beat.get("groups", {}).values())


def _position(beat: Mapping[str, Any]) -> str:
    collectives = ", ".join(f"{newest['op']} #{newest['seq']} on {newest['group']}"
                            + ("" if newest["retired"] else " (waiting)") for newest in beat.get("groups", {}).values())
    wait = f"; blocked in {beat['waiting']}" if beat.get("waiting") else ""
    return f"step {beat['step']}, newest collectives: {collectives or 'none recorded'}{wait}"


class StalledRankMonitor(Callback):
    """Names the rank that holds a hanging job up (see the module docstring).

    `factor` x the median step time (at least `min_seconds`) without a step counts as a stall; the
    watcher wakes every `poll_seconds`."""

    def __init__(self, factor: float = 10.0, min_seconds: float = 60.0, poll_seconds: float = 1.0) -> None:
        if factor <= 1 or min_seconds < 0 or poll_seconds <= 0:
            raise ValueError(f"StalledRankMonitor needs factor > 1, min_seconds >= 0 and poll_seconds > 0; got"
                             f" factor={factor}, min_seconds={min_seconds}, poll_seconds={poll_seconds}.")
        self.factor, self.min_seconds, self.poll_seconds = factor, min_seconds, poll_seconds
        self.reports: list[str] = []
        self._durations: deque[float] = deque(maxlen=50)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._paused = False

    # ------------------------------------------------------------------ main thread
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.world_size == 1:
            return
        self._layout: ParallelLayout = trainer.strategy.layout
        self._rank, self._world = trainer.global_rank, trainer.world_size
        self._prefix = f"tp3d/heartbeat/{trainer.strategy.broadcast(uuid.uuid4().hex)}/"  # this fit's keys
        self._store = default_store()
        self._first_record = newest_record(recorded_collectives())  # what earlier process groups left
        self._main_thread = threading.get_ident()
        self._step, self._step_time, self._steps_seen = trainer.global_step, time.monotonic(), 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="tp3d-stall-watch", daemon=True)
        self._thread.start()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != getattr(self, "_step", trainer.global_step):
            now = time.monotonic()
            self._steps_seen += 1
            if self._steps_seen > _WARM_UP_STEPS:
                self._durations.append(now - self._step_time)
            self._step, self._step_time = trainer.global_step, now

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._paused = True

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._paused, self._step_time = False, time.monotonic()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._halt()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._halt()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._halt()

    def _halt(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------------ watcher thread
    def threshold(self) -> float | None:
        """Seconds without a step that count as a stall; None until the median step time is known."""
        if not self._durations:
            return None
        return max(self.min_seconds, self.factor * statistics.median(self._durations))

    def _watch(self) -> None:
        host, beat, reported_at = socket.gethostname(), 0, None
        seen: dict[int, tuple[int, float]] = {}  # rank -> (its beat, when this watcher saw it change)
        while not self._stop.wait(self.poll_seconds):
            beat += 1
            threshold, step, stuck = self.threshold(), self._step, time.monotonic() - self._step_time
            watching = threshold is not None and not self._paused and stuck >= threshold / 2
            heartbeat: dict[str, Any] = {"beat": beat, "step": step, "host": host}
            if watching:
                heartbeat["groups"] = newest_collectives(recorded_collectives(), self._first_record)
                heartbeat["waiting"] = communication_wait(self._main_thread)
            self._store.set(f"{self._prefix}{self._rank}", json.dumps(heartbeat))
            if not watching or self._rank not in _OBSERVERS:
                seen.clear()
                continue
            heartbeats, now = self._read_heartbeats(), time.monotonic()
            for rank, other in heartbeats.items():
                if seen.get(rank, (None,))[0] != other["beat"]:
                    seen[rank] = (other["beat"], now)
            if stuck < threshold or reported_at == step:
                continue
            # beats were followed for threshold / 2 by now: one unchanged for a quarter of it has stopped
            silent = max(3 * self.poll_seconds, threshold / 4)
            dead = sorted({rank for rank, (_, changed) in seen.items() if now - changed >= silent}
                          | {rank for rank in range(self._world) if rank not in heartbeats})
            if self._rank == _OBSERVERS[0] or _OBSERVERS[0] in dead:
                self._report(diagnose_stall(heartbeats, dead), heartbeats, stuck, threshold, step)
                reported_at = step

    def _read_heartbeats(self) -> dict[int, dict[str, Any]]:
        keys = [f"{self._prefix}{rank}" for rank in range(self._world)]
        return {rank: json.loads(self._store.get(key)) for rank, key in enumerate(keys) if self._store.check([key])}

    def _report(self, diagnosis: StallDiagnosis, heartbeats: Mapping[int, Mapping[str, Any]], stuck: float,
                threshold: float, step: int) -> None:
        median = statistics.median(self._durations)
        lines = [f"Training has made no step for {stuck:.1f} s after step {step} ({threshold:.1f} s is"
                 f" {self.factor:g} x the median step time {median:.3g} s, at least {self.min_seconds:g} s)."]
        for rank in diagnosis.culprits:
            where = self._layout.coordinates(rank)
            host = heartbeats.get(rank, {}).get("host", "an unknown host")
            lines.append(f"Rank {rank} (pp {where.pp}, dp {where.dp}, tp {where.tp}) on {host} holds the others up:"
                         f" {diagnosis.reasons[rank]}.")
        if not diagnosis.culprits:
            lines.append("No rank is behind its peers while waiting for nothing (every rank waits, e.g. inside"
                         " pipeline transfers, or none is behind); each rank's position:")
            lines += [f"  rank {rank}: {position}" for rank, position in sorted(diagnosis.positions.items())]
        report = "\n".join(lines)
        self.reports.append(report)
        log.warning(report)
