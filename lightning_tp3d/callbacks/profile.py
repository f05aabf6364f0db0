"""`StepProfiler`: where each training step's time goes, per rank, beside the advisor's prediction.

    trainer = L.Trainer(strategy=TP3DStrategy(...), max_steps=10,
                        callbacks=[StepProfiler("profile", warmup_steps=2, steps=3)])

After `warmup_steps` optimizer steps (the first ones build FSDP2's, DTensor's and the schedules' state)
the next `steps` run under `torch.profiler`, with every collective named by its mesh group
(`parallel.labels.CommunicationLabels`), Lightning's profiler actions (data loading, training_step,
backward, optimizer_step) as ranges on the same timeline, and the traffic recorder counting each
group's bytes. Every rank then splits its steps into the components of `diagnostics.breakdown`, and
rank 0 writes into `output`:

* `breakdown.json`: per rank its coordinates, the host clock's step seconds, the components (means
  over the profiled steps, and each step's), the pipeline's own busy / idle timing of the same steps,
  the dp bytes per step and the communication ledger's; the advisor's prediction for the layout; the
  rules-of-thumb warnings;
* `trace_rank<r>.json` (written by every rank): torch's Chrome / Perfetto trace of the profiled steps;
* `timeline.png` (each rank's activity over the last profiled step, coloured by component) and
  `breakdown.png` (the components stacked per rank, the advisor's beside them), with matplotlib;
* a table on standard output (`diagnostics.profile_report.report_table`).

The breakdown is of each rank's host timeline. On a GPU, kernels run after the host queued them: a
component is then the host's time in that phase, which a synchronising collective or wait ends.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import Profiler
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.autograd.profiler import record_function

from lightning_tp3d.diagnostics.breakdown import TimedRange, component_of, exclusive_segments, step_components
from lightning_tp3d.diagnostics.profile_report import build_report, report_table
from lightning_tp3d.diagnostics.traffic import TrafficRecorder
from lightning_tp3d.models.lora import lora_shape
from lightning_tp3d.parallel.labels import STEP, CommunicationLabels
from lightning_tp3d.plan.config import ModelConfig
from lightning_tp3d.plan.ledger import TrainingOptions
from lightning_tp3d.plan.lora import DEFAULT_LORA_TARGETS, LORA_TARGETS
from lightning_tp3d.plan.moe import MoEModelConfig, planner_config

__all__ = ["StepProfiler"]


class _ActionRanges(Profiler):
    """Passes every action on to the Trainer's own profiler and, while `recording`, opens a range on torch's
    timeline for each action the breakdown counts."""

    def __init__(self, inner: Profiler) -> None:
        super().__init__()
        self.inner = inner
        self.recording = False
        self._open: dict[str, list[record_function]] = {}

    def start(self, action_name: str) -> None:
        self.inner.start(action_name)
        if self.recording and component_of(action_name) is not None:
            timed = record_function(action_name)
            timed.__enter__()
            self._open.setdefault(action_name, []).append(timed)

    def stop(self, action_name: str) -> None:
        opened = self._open.get(action_name)
        if opened:
            opened.pop().__exit__(None, None, None)
        self.inner.stop(action_name)

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        self.inner.setup(stage, local_rank, log_dir)

    def teardown(self, stage: str | None) -> None:
        self.inner.teardown(stage)

    def describe(self) -> None:
        self.inner.describe()

    def summary(self) -> str:
        return self.inner.summary()


class StepProfiler(Callback):
    """Profile optimizer steps `warmup_steps + 1` to `warmup_steps + steps` of a fit with `TP3DStrategy`,
    counted from where the fit starts (a resumed one too), and write the breakdown into `output` (see the
    module docstring); a fit that ends before the last of them warns that no profile was written.

    The advisor's prediction runs on a cluster of this run's world: `peak_tflops` x `mfu` is the compute
    rate (default on a GPU: `plan.advisor.Cluster`'s H100 / H200 figures; on a CPU, which has no known
    peak, the rate is calibrated from the measured compute, so the prediction checks the bubble and the
    communication), `link_gbps` the bandwidth per group ({"tp": 5.0, ...}, e.g. `tp3d doctor`'s; default
    the doctor's floors for NVLink and InfiniBand). `command` is recorded in breakdown.json (default: this
    process's command line)."""

    def __init__(self, output: str | Path = "profile", warmup_steps: int = 2, steps: int = 3, *,
                 peak_tflops: float | None = None, mfu: float | None = None,
                 link_gbps: dict[str, float] | None = None, plots: bool = True,
                 command: Sequence[str] | None = None) -> None:
        if warmup_steps < 1 or steps < 1:
            raise ValueError(f"StepProfiler needs warmup_steps >= 1 (the first step builds the parallel state) and"
                             f" steps >= 1; got warmup_steps={warmup_steps}, steps={steps}.")
        self.output = Path(output)
        self.warmup_steps, self.steps = warmup_steps, steps
        self.cluster_options = {"peak_tflops": peak_tflops, "mfu": mfu, "link_gbps": dict(link_gbps or {})}
        self.plots = plots
        self.command = list(command) if command is not None else None
        self.report: dict[str, Any] | None = None  # rank 0's breakdown.json, once written
        self.local: dict[str, Any] | None = None  # this rank's part of it
        self._actions: _ActionRanges | None = None
        self._profile: torch.profiler.profile | None = None
        self._recorders: list[Any] = []
        self._step_range: record_function | None = None
        self._first_step: int | None = None
        self._last_step, self._step_started = -1, (0.0, 0.0)
        self._host_seconds: list[float] = []
        self._clock_uncertainty: list[float] = []
        self._pipeline: list[dict[str, float]] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning_tp3d.strategies.trainer import TP3DStrategy

        if stage != "fit":
            return
        if not isinstance(trainer.strategy, TP3DStrategy):
            raise ValueError(f"StepProfiler profiles a fit with TP3DStrategy; this Trainer's strategy is"
                             f" {type(trainer.strategy).__name__}. Pass strategy=TP3DStrategy(...) (or \"tp3d\").")
        last = self.warmup_steps + self.steps
        if 0 <= trainer.max_steps < last:
            raise ValueError(f"StepProfiler profiles steps {self.warmup_steps + 1} to {last}, but max_steps="
                             f"{trainer.max_steps} ends the fit before; raise max_steps to at least {last} or"
                             " profile fewer steps.")
        self._actions = _ActionRanges(trainer.profiler)
        trainer.profiler = self._actions

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._stop_recording()
        if self._actions is not None and trainer.profiler is self._actions:
            trainer.profiler = self._actions.inner
        if stage == "fit" and self._first_step is not None and self.local is None:
            rank_zero_warn(f"StepProfiler wrote no profile: the fit ended after {max(self._last_step, 0)} of the"
                           f" {self.warmup_steps + self.steps} steps it needs (warmup_steps + steps); run it longer"
                           " or profile fewer steps.")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._first_step = trainer.global_step  # a resumed fit starts at its checkpoint's step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step - (self._first_step or 0)
        if step == self._last_step:  # an accumulating batch: the step goes on
            return
        self._last_step = step
        if step == self.warmup_steps:
            self._start(trainer)
        elif self._profile is not None:
            end = _bracketed(lambda: self._step_range.__exit__(None, None, None))
            self._host_seconds.append(end[0] - self._step_started[0])
            self._clock_uncertainty.append((end[1] + self._step_started[1]) / 2)
            timing = trainer.strategy.pipeline_timing
            if timing is not None:
                self._pipeline.append({"step_seconds": timing.step_seconds, "busy_seconds": timing.busy_seconds,
                                       "idle_seconds": timing.step_seconds - timing.busy_seconds})
            if step == self.warmup_steps + self.steps:
                self._finish(trainer, batch)
                return
            self._open_step()

    def _open_step(self) -> None:
        self._step_range = record_function(STEP)
        self._step_started = _bracketed(self._step_range.__enter__)

    def _start(self, trainer: L.Trainer) -> None:
        mesh = trainer.strategy.device_mesh
        self._recorders = [CommunicationLabels(mesh).__enter__(), TrafficRecorder(mesh).__enter__()]
        activities = [torch.profiler.ProfilerActivity.CPU]
        if trainer.strategy.root_device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.__enter__()
        self._actions.recording = True
        self._open_step()

    def _stop_recording(self) -> dict[str, dict[str, int]]:
        if self._actions is not None:
            self._actions.recording = False
        if self._profile is not None:
            self._profile.__exit__(None, None, None)
        traffic: dict[str, dict[str, int]] = {}
        for recorder in reversed(self._recorders):
            recorder.__exit__(None, None, None)
            if isinstance(recorder, TrafficRecorder):
                traffic = recorder.per_group()
        self._recorders = []
        return traffic

    def _finish(self, trainer: L.Trainer, batch: Any) -> None:
        traffic = self._stop_recording()
        profile, self._profile = self._profile, None
        rank = trainer.global_rank
        self.output.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(self.output / f"trace_rank{rank}.json"))
        steps, timeline = _breakdown(profile)
        self.local = {
            "rank": rank, "host": socket.gethostname(),
            "coordinates": dict(zip(("pp", "dp", "tp"), trainer.strategy.layout.coordinates(rank), strict=True)),
            "step_seconds": sum(self._host_seconds) / len(self._host_seconds),
            "components": {name: sum(step[name] for step in steps) / len(steps) for name in steps[0]},
            "steps": [{"host_seconds": host, "clock_uncertainty_seconds": uncertainty,
                       "traced_seconds": sum(step.values()), "components": step}
                      for host, uncertainty, step in zip(self._host_seconds, self._clock_uncertainty, steps,
                                                         strict=True)],
            "pipeline_timing": self._pipeline or None,
            "dp_bytes_per_step": traffic.get("dp", {}).get("payload_bytes", 0) / self.steps,
            "timeline": timeline,
        }
        gathered: list[Any] | None = [None] * trainer.world_size if rank == 0 else None
        dist.gather_object(self.local, gathered, dst=0)
        if rank != 0:
            return
        timelines = [(rank["rank"], rank["coordinates"], rank["timeline"]) for rank in gathered]
        self.report = build_report(gathered, **_run_description(trainer, batch), cluster_options=self.cluster_options,
                                   warmup_steps=self.warmup_steps, steps=self.steps,
                                   command=self.command if self.command is not None else _command_line())
        (self.output / "breakdown.json").write_text(json.dumps(self.report, indent=2) + "\n")
        print(report_table(self.report))
        if self.plots:
            from lightning_tp3d.diagnostics.profile_plots import plot_breakdown, plot_timeline

            plot_timeline(timelines, self.output / "timeline.png")
            plot_breakdown(self.report, self.output / "breakdown.png")


def _bracketed(mark: Callable[[], Any]) -> tuple[float, float]:
    """The host clock at the moment `mark` puts on the trace: (the midpoint of the readings just before and
    after it, their distance). A process descheduled in between widens the bracket instead of moving the
    reading; garbage collection is held off for the few statements."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        before = time.perf_counter()
        mark()
        after = time.perf_counter()
    finally:
        if enabled:
            gc.enable()
    return (before + after) / 2, after - before


def _breakdown(profile: torch.profiler.profile) -> tuple[list[dict[str, float]], list[list]]:
    """Each profiled step's components on this rank's main thread, and the last step's timeline
    ([start, end, component] from the step's start, adjacent pieces of one component merged)."""
    events = [event for event in profile.events() if component_of(event.name) is not None]
    main = next(event.thread for event in events if event.name == STEP)
    ranges = [TimedRange(event.name, event.time_range.start / 1e6, event.time_range.end / 1e6)
              for event in events if event.thread == main]
    windows = sorted((timed.start, timed.end) for timed in ranges if timed.name == STEP)
    segments = exclusive_segments(ranges)
    steps = [step_components(segments, start, end) for start, end in windows]
    start, end = windows[-1]
    timeline: list[list] = []
    for first, last, name in sorted(segments):
        first, last, component = max(first, start) - start, min(last, end) - start, component_of(name) or "rest"
        if last <= first:
            continue
        if timeline and timeline[-1][2] == component and abs(timeline[-1][1] - first) < 1e-9:
            timeline[-1][1] = last
        else:
            timeline.append([first, last, component])
    return steps, timeline


def _run_description(trainer: L.Trainer, batch: Any) -> dict[str, Any]:
    """What the advisor and the ledgers need to know of this run: the model's shape (None where the
    network's config has not the decoder's shape fields), the layout with this batch's micro-batch size,
    the ledger's options and the global batch."""
    strategy, options = trainer.strategy, trainer.strategy.core.options
    per_rank, seq_len = _token_shape(batch)
    layout = strategy.layout
    layout = replace(layout, micro_batch_size=max(per_rank // layout.num_microbatches, 1),
                     gradient_accumulation_steps=trainer.accumulate_grad_batches)
    lora_rank, lora_targets = lora_shape(strategy.network)
    training = TrainingOptions(
        seq_len=max(seq_len, 1), precision=str(trainer.precision), recompute=options.recompute,
        data_parallel_mode=options.data_parallel_mode, schedule=options.pipeline_schedule,
        stages_per_rank=options.stages_per_rank, recompute_method=options.recompute_method,
        recompute_num_layers=options.recompute_num_layers,
        fsdp_reshard_after_forward=options.fsdp_reshard_after_forward,
        overlap_gradient_reduction=options.overlap_gradient_reduction, lora_rank=lora_rank,
        lora_targets=tuple(target for target in lora_targets if target in LORA_TARGETS) or DEFAULT_LORA_TARGETS)
    return {"config": _model_config(strategy) if seq_len else None, "layout": layout, "options": training,
            "global_batch": per_rank * layout.data_parallel_size * trainer.accumulate_grad_batches,
            "schedule": options.pipeline_schedule, "device_type": strategy.root_device.type,
            "backend": dist.get_backend(), "gpus_per_node": trainer.num_devices}


def _token_shape(batch: Any) -> tuple[int, int]:
    """(sequences, tokens per sequence) of a batch's token ids (its `input_ids`, or its first tensor); (1, 0)
    when it holds no 2-D tensor."""
    if isinstance(batch, dict):
        batch = batch.get("input_ids", next(iter(batch.values()), None))
    if isinstance(batch, (list, tuple)):
        batch = batch[0] if batch else None
    if isinstance(batch, torch.Tensor) and batch.dim() == 2:
        return int(batch.shape[0]), int(batch.shape[1])
    return 1, 0


def _model_config(strategy: Any) -> ModelConfig | MoEModelConfig | None:
    """The network's shape as the planner reads it (the checkpoint's record of it, `plan.moe.planner_config`);
    None where the network has no shape the planner models."""
    record = strategy.core.model_adapter_of(strategy.network).config_record(strategy.network)
    return planner_config(record) if record else None


def _command_line() -> list[str]:
    import sys

    return [os.path.basename(sys.argv[0]), *sys.argv[1:]] if sys.argv else []
