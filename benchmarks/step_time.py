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
* pipeline parallel 2: each rank's idle fraction (`TP3DStrategy.pipeline_timing`: the step time outside
  its stages' compute) for every schedule at 4 and 8 micro-batches, against the theoretical bubble
  (p - 1) / (v m + p - 1) where it has that closed form (GPipe, 1F1B; interleaved 1F1B and looped BFS with
  v = 2 stages per rank); the zero-bubble schedules' idle is reported without a theory.
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
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from lightning_tp3d import TP3DStrategy
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.models.adapter import llama_tp_plan
from lightning_tp3d.parallel.tensor import apply_tensor_parallel
from lightning_tp3d.plan.schedules import PIPELINE_SCHEDULES, bubble_fraction

from common import CONFIG, MACHINE, StepRecorder, benchmark_trainer


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


def _pipeline_run(schedule: str, microbatches: int, args: argparse.Namespace) -> dict[str, Any]:
    """One pp = 2 run; per rank the medians (after warm-up) of the step and of its busy time, and the idle
    share they give."""
    looped = 2 if schedule in ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble") else 1
    strategy = TP3DStrategy(pipeline_parallel_size=2, pipeline_schedule=schedule, num_microbatches=microbatches,
                            stages_per_rank=looped)
    timer = StepRecorder()
    trainer = benchmark_trainer(2, strategy, args.steps, [timer])
    trainer.fit(CausalLMModule(CONFIG), TokenDataModule(seq_len=args.seq_len, batch_size=args.batch))
    steps = timer.pipeline_steps[3:]
    step = statistics.median(seconds for seconds, _ in steps)
    busy = statistics.median(busy for _, busy in steps)
    part = {"step_seconds": step, "busy_seconds": busy, "idle_fraction": max(0.0, 1 - busy / step)}
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, part)
    closed_form = schedule in ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs")
    return {"ranks": ranks, "stages_per_rank": looped,
            "theory_idle_fraction": bubble_fraction(2, microbatches, looped) if closed_form else None}


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
    args = parser.parse_args()
    torch.set_num_threads(1)
    chosen = {name: makers for name, makers in PAIRS.items()
              if args.pairs is None or any(word in name for word in args.pairs)}
    results: dict[str, Any] = {"command": [sys.executable, *sys.argv], "machine": MACHINE,
                               "paired": {name: _paired_rounds(*makers, args.rounds, args)
                                          for name, makers in chosen.items()},
                               "pipeline": {}}
    for schedule in () if args.no_pipeline else PIPELINE_SCHEDULES:
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
        theory = run["theory_idle_fraction"]
        for rank, part in enumerate(run["ranks"]):
            print(f"pp=2 {name:28s} rank {rank}: {part['step_seconds'] * 1e3:6.1f} ms, busy"
                  f" {part['busy_seconds'] * 1e3:6.1f} ms, idle {part['idle_fraction']:6.1%}"
                  f" (theory {'-' if theory is None else f'{theory:.1%}'})")
    Path(args.output).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
