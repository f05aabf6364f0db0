"""Step time of TP3DStrategy against Lightning's own strategies, and pipeline bubbles against theory.

    python benchmarks/step_time.py            # 2 processes, CPU/gloo; prints a table and writes JSON

Side by side in one session, same model, data and optimizer, median step time over the steps after a
warm-up (measured per rank from the start to the end of each training batch, slowest rank), the
strategies alternated over several rounds (median of the rounds):

* data parallel 2: `TP3DStrategy(data_parallel_size=2)` vs `DDPStrategy`;
* tensor parallel 2: `TP3DStrategy(tensor_parallel_size=2)` vs `ModelParallelStrategy` given the same
  DTensor plan (`llama_tp_plan`) through its `parallelize_fn`;
* pipeline parallel 2: the idle fraction of each rank (`TP3DStrategy.pipeline_timing`) for GPipe and
  1F1B at 2, 4 and 8 micro-batches vs the theoretical bubble (p - 1) / (m + p - 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from lightning_tp3d import TP3DStrategy
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.parallel.tensor import apply_tensor_parallel, llama_tp_plan

from common import CONFIG, StepRecorder, benchmark_trainer


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
    return {"median_step_seconds": float(seconds.median()), "idle_fraction": idle}


def _with_parallelize(module: CausalLMModule) -> Any:
    build = module.configure_model

    def configure_model() -> None:
        build()
        _tensor_parallel(module, module.device_mesh)

    return configure_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--output", default="benchmarks/step_time_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    baselines = {
        "ddp": DDPStrategy,
        "tp3d dp=2": TP3DStrategy,
        "ModelParallelStrategy tp=2": lambda: ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
        "tp3d tp=2": lambda: TP3DStrategy(tensor_parallel_size=2),
    }
    # Alternate the strategies over several rounds: on a shared CPU, whichever runs first or during a noisy
    # moment is slower; each figure is the median over rounds of the per-round median step time.
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in baselines}
    for _ in range(args.rounds):
        for name, make in baselines.items():
            rounds[name].append(_run(make(), args.steps, args.batch, args.seq_len))
    runs: dict[str, Any] = {
        name: {"median_step_seconds": statistics.median(r["median_step_seconds"] for r in results),
               "rounds": [r["median_step_seconds"] for r in results], "idle_fraction": None}
        for name, results in rounds.items()
    }
    for schedule in ("gpipe", "1f1b"):
        for microbatches in (2, 4, 8):
            strategy = TP3DStrategy(pipeline_parallel_size=2, pipeline_schedule=schedule,
                                    num_microbatches=microbatches)
            runs[f"tp3d pp=2 {schedule} m={microbatches}"] = _run(strategy, args.steps, args.batch, args.seq_len)
    if torch.distributed.get_rank() != 0:
        return
    runs["ratio tp3d dp=2 / ddp"] = runs["tp3d dp=2"]["median_step_seconds"] / runs["ddp"]["median_step_seconds"]
    runs["ratio tp3d tp=2 / ModelParallelStrategy"] = (runs["tp3d tp=2"]["median_step_seconds"]
                                                      / runs["ModelParallelStrategy tp=2"]["median_step_seconds"])
    for name, result in runs.items():
        if isinstance(result, dict):
            theory = ""
            if result["idle_fraction"] is not None:
                microbatches = int(name.rsplit("=", 1)[1])
                theory = f"  idle {result['idle_fraction']:.1%} (theory {1 / (microbatches + 1):.1%})"
            print(f"{name:32s} {result['median_step_seconds'] * 1e3:8.1f} ms{theory}")
        else:
            print(f"{name:42s} {result:.3f}")
    Path(args.output).write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
