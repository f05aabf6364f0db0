"""Step time of TP3DStrategy against Lightning's own strategies, and pipeline bubbles against theory.

    python benchmarks/step_time.py            # 2 processes, CPU/gloo; prints a table and writes JSON
    python benchmarks/step_time.py --pairs compile --no-pipeline --output benchmarks/compile_cpu.json
    python benchmarks/step_time.py --pairs --output benchmarks/pipeline_idle_cpu.json   # the pipeline table only

Side by side in one session, same model, data and optimizer; a run's figure is its median step time
over the steps after a warm-up (measured per rank from the start to the end of each training batch,
slowest rank). Each comparison runs its baseline and candidate back to back in every round (the order
alternating) and reports the median over rounds of the per-round ratio candidate / baseline:

* data parallel 2: `TP3DStrategy(data_parallel_size=2)` vs `DDPStrategy`;
* tensor parallel 2: `TP3DStrategy(tensor_parallel_size=2)` vs `ModelParallelStrategy` given the same
  DTensor plan (`llama_tp_plan`) through its `parallelize_fn`;
* dp gradient reduction overlapped with backward (the default) vs after it, at data parallel 2, with
  the host time the reduction still takes once backward has ended (exposed);
* activation recompute: `recompute="full"` and `"selective"` vs none, at data parallel 2 (full
  recompute repeats each block's forward in backward: (F + B + F) / (F + B) = 4/3 when B = 2F);
* regional compilation: `compile=True` vs eager at tensor parallel 2 and at pipeline parallel 2 (1F1B,
  4 micro-batches); inductor compiles during the warm-up steps, which the medians leave out;
* pipeline parallel 2: every schedule at 4 and 8 micro-batches, torch's `schedule.step` and the
  package's executor in paired rounds: each rank's idle fraction (`TP3DStrategy.pipeline_timing`: the
  step time outside its stages' compute), its compute / wait / host time per action, against the
  theory `schedule_bubble_fraction` and the bound 1.25 x theory + 0.02.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from lightning_tp3d import TP3DStrategy
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.models.adapter import llama_tp_plan
from lightning_tp3d.parallel.tensor import apply_tensor_parallel
from lightning_tp3d.plan.schedules import PIPELINE_SCHEDULES, schedule_bubble_fraction

from common import CONFIG, MACHINE, StepRecorder, benchmark_trainer

_LOOPED = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble")  # take stages_per_rank=2
_TWO_STAGES = (*_LOOPED, "zbv_zero_bubble", "dualpipev")


def _tensor_parallel(module: CausalLMModule, mesh: Any) -> CausalLMModule:
    apply_tensor_parallel(module.model, mesh["tensor_parallel"], llama_tp_plan())
    return module


def _run(strategy: Any, steps: int, batch: int, seq_len: int) -> dict[str, Any]:
    timer = StepRecorder()
    trainer = benchmark_trainer(2, strategy, steps, [timer])
    module = CausalLMModule(CONFIG)
    if isinstance(strategy, ModelParallelStrategy) and not isinstance(strategy, TP3DStrategy):
        module.configure_model = _with_parallelize(module)
    trainer.fit(module, TokenDataModule(seq_len=seq_len, batch_size=batch))
    seconds = torch.tensor(timer.seconds[3:])  # after warm-up; slowest rank per step
    torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)
    idle = statistics.mean(timer.idle[3:]) if timer.idle else None
    wait = statistics.median(timer.gradient_wait[3:]) if timer.gradient_wait else None
    return {"median_step_seconds": float(seconds.median()), "idle_fraction": idle, "gradient_wait_seconds": wait}


def _with_parallelize(module: CausalLMModule) -> Any:
    build = module.configure_model

    def configure_model() -> None:
        build()
        _tensor_parallel(module, module.device_mesh)

    return configure_model


# name -> (baseline, candidate): each round runs both back to back (order alternating between rounds) and
# the reported ratio is the median over rounds of candidate / baseline within the round.
PAIRS: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "data parallel 2: tp3d / DDPStrategy": (DDPStrategy, TP3DStrategy),
    "tensor parallel 2: tp3d / ModelParallelStrategy": (
        lambda: ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
        lambda: TP3DStrategy(tensor_parallel_size=2)),
    "overlapped / after-backward dp reduction (tp3d dp=2)": (
        lambda: TP3DStrategy(overlap_gradient_reduction=False), TP3DStrategy),
    "recompute full / none (tp3d dp=2)": (TP3DStrategy, lambda: TP3DStrategy(recompute="full")),
    "recompute selective / none (tp3d dp=2)": (TP3DStrategy, lambda: TP3DStrategy(recompute="selective")),
    "compile / eager (tp3d tp=2)": (lambda: TP3DStrategy(tensor_parallel_size=2),
                                    lambda: TP3DStrategy(tensor_parallel_size=2, compile=True)),
    "compile / eager (tp3d pp=2 1f1b m=4)": (
        lambda: TP3DStrategy(pipeline_parallel_size=2, num_microbatches=4),
        lambda: TP3DStrategy(pipeline_parallel_size=2, num_microbatches=4, compile=True)),
}


def _paired_rounds(make_baseline: Callable[[], Any], make_candidate: Callable[[], Any], rounds: int,
                   args: argparse.Namespace) -> dict[str, Any]:
    pairs = []
    for index in range(rounds):
        makers = (make_baseline, make_candidate) if index % 2 == 0 else (make_candidate, make_baseline)
        first, second = (_run(make(), args.steps, args.batch, args.seq_len) for make in makers)
        baseline, candidate = (first, second) if index % 2 == 0 else (second, first)
        pairs.append({"baseline_seconds": baseline["median_step_seconds"],
                      "candidate_seconds": candidate["median_step_seconds"],
                      "ratio": candidate["median_step_seconds"] / baseline["median_step_seconds"],
                      "baseline_gradient_wait_seconds": baseline["gradient_wait_seconds"],
                      "candidate_gradient_wait_seconds": candidate["gradient_wait_seconds"]})
    return {"median_ratio": statistics.median(pair["ratio"] for pair in pairs),
            "median_baseline_seconds": statistics.median(pair["baseline_seconds"] for pair in pairs),
            "median_candidate_seconds": statistics.median(pair["candidate_seconds"] for pair in pairs),
            "rounds": pairs}


class _Executor(Callback):
    """Chooses the pipeline runner's path before the first step: the package's executor or torch's
    `schedule.step` every step (`PipelineRunner.own_executor`)."""

    def __init__(self, own: bool) -> None:
        self.own = own

    def on_train_start(self, trainer: Any, module: Any) -> None:
        trainer.strategy.core.pipeline.own_executor = self.own


def _pipeline_once(schedule: str, microbatches: int, own_executor: bool, args: argparse.Namespace
                   ) -> list[dict[str, float]]:
    """One pp = 2 run; per rank the medians (after warm-up) of the step, its compute (busy), its waits for
    point-to-point data and its compute actions, the idle share and the time per action outside compute."""
    looped = 2 if schedule in _LOOPED else 1
    strategy = TP3DStrategy(pipeline_parallel_size=2, pipeline_schedule=schedule, num_microbatches=microbatches,
                            stages_per_rank=looped)
    timer = StepRecorder()
    trainer = benchmark_trainer(2, strategy, args.steps, [timer, _Executor(own_executor)])
    trainer.fit(CausalLMModule(CONFIG), TokenDataModule(seq_len=args.seq_len, batch_size=args.batch))
    steps = timer.pipeline_steps[3:]
    step, busy, wait = (statistics.median(values[index] for values in steps) for index in range(3))
    actions = steps[0][3]
    part = {"step_seconds": step, "busy_seconds": busy, "wait_seconds": wait, "actions": actions,
            "idle_fraction": max(0.0, 1 - busy / step),
            "compute_ms_per_action": busy / actions * 1e3, "wait_ms_per_action": wait / actions * 1e3,
            "host_ms_per_action": max(0.0, step - busy - wait) / actions * 1e3}
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, part)
    return ranks


def _pipeline_run(schedule: str, microbatches: int, args: argparse.Namespace) -> dict[str, Any]:
    """torch's schedule ("torch") and the package's executor ("executor") in paired rounds (order
    alternating); per path and rank the medians over rounds, the idle share's mean over ranks, and the
    median over rounds of executor / torch step time (slowest rank); the bound the idle must keep:
    1.25 x theory + 0.02."""
    rounds: list[dict[str, list[dict[str, float]]]] = []
    for index in range(args.pipeline_rounds):
        paths = ("torch", "executor") if index % 2 == 0 else ("executor", "torch")
        rounds.append({path: _pipeline_once(schedule, microbatches, path == "executor", args) for path in paths})
    theory = schedule_bubble_fraction(schedule, 2, microbatches)
    result: dict[str, Any] = {"stages_per_rank": 2 if schedule in _TWO_STAGES else 1,
                              "theory_idle_fraction": theory, "bound_idle_fraction": 1.25 * theory + 0.02}
    for path in ("torch", "executor"):
        ranks = [{key: statistics.median(run[path][rank][key] for run in rounds) for key in rounds[0][path][rank]}
                 for rank in range(len(rounds[0][path]))]
        result[path] = {"ranks": ranks, "mean_idle_fraction": statistics.mean(rank["idle_fraction"] for rank in ranks)}
    result["executor_within_bound"] = result["executor"]["mean_idle_fraction"] <= result["bound_idle_fraction"]
    result["step_ratio_executor_over_torch"] = statistics.median(
        max(rank["step_seconds"] for rank in run["executor"]) / max(rank["step_seconds"] for rank in run["torch"])
        for run in rounds)
    result["rounds"] = rounds
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--output", default="benchmarks/step_time_cpu.json")
    parser.add_argument("--pairs", nargs="*", default=None,
                        help="run only the comparisons whose name contains one of these words (default: all)")
    parser.add_argument("--no-pipeline", action="store_true", help="leave out the pipeline idle table")
    parser.add_argument("--pipeline-rounds", type=int, default=3,
                        help="paired rounds of torch's schedule and the package's executor per pipeline row")
    parser.add_argument("--schedules", nargs="*", default=None, help="pipeline schedules to run (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    chosen = {name: makers for name, makers in PAIRS.items()
              if args.pairs is None or any(word in name for word in args.pairs)}
    results: dict[str, Any] = {"command": [sys.executable, *sys.argv], "machine": MACHINE,
                               "paired": {name: _paired_rounds(*makers, args.rounds, args)
                                          for name, makers in chosen.items()},
                               "pipeline": {}}
    for schedule in () if args.no_pipeline else (args.schedules or PIPELINE_SCHEDULES):
        for microbatches in (4, 8):
            results["pipeline"][f"{schedule} m={microbatches}"] = _pipeline_run(schedule, microbatches, args)
    if torch.distributed.get_rank() != 0:
        return
    for name, result in results["paired"].items():
        rounds = ", ".join(f"{pair['ratio']:.3f}" for pair in result["rounds"])
        print(f"{name:48s} {result['median_baseline_seconds'] * 1e3:7.1f} -> "
              f"{result['median_candidate_seconds'] * 1e3:7.1f} ms  ratio {result['median_ratio']:.3f} ({rounds})")
        waits = [(pair["baseline_gradient_wait_seconds"], pair["candidate_gradient_wait_seconds"])
                 for pair in result["rounds"]]
        if all(None not in wait for wait in waits):
            result["median_gradient_wait_seconds"] = [statistics.median(wait[0] for wait in waits),
                                                      statistics.median(wait[1] for wait in waits)]
            print(f"{'':48s} dp reduction after backward: {result['median_gradient_wait_seconds'][0] * 1e3:.2f} ->"
                  f" {result['median_gradient_wait_seconds'][1] * 1e3:.2f} ms")
    for name, run in results["pipeline"].items():
        for path in ("torch", "executor"):
            for rank, part in enumerate(run[path]["ranks"]):
                print(f"pp=2 {name:28s} {path:8s} rank {rank}: step {part['step_seconds'] * 1e3:6.1f} ms, idle"
                      f" {part['idle_fraction']:6.1%}; per action: compute {part['compute_ms_per_action']:.2f},"
                      f" wait {part['wait_ms_per_action']:.2f}, host {part['host_ms_per_action']:.2f} ms")
        print(f"pp=2 {name:28s} mean idle torch {run['torch']['mean_idle_fraction']:.1%}, executor"
              f" {run['executor']['mean_idle_fraction']:.1%} (theory {run['theory_idle_fraction']:.1%}, bound"
              f" {run['bound_idle_fraction']:.1%}); step executor / torch {run['step_ratio_executor_over_torch']:.3f}")
    Path(args.output).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
