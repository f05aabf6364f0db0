"""The layout advisor's ranking against measured step times, on 4 CPU processes (gloo).

    python benchmarks/advisor_check.py           # writes benchmarks/advisor_check_cpu.json

The cluster is this machine as the advisor would see 4 GPUs in one node: for each layout the advisor
proposes for the benchmark model (every tp x pp x dp of 4 processes, every dp mode, no recompute; a
global batch of 8 sequences of 128 tokens in micro-batches of 2), the layout trains `--steps` steps
with `TP3DStrategy(preflight=True)`, whose doctor measures each group's bandwidth in that world, and
the median step time after 3 warm-up steps is recorded. The advisor then predicts every layout with
those measured bandwidths and one compute rate, calibrated on the first layout ((1, 1, 4) replicate:
its measured step minus its predicted communication), and the script reports the rank correlation
(Spearman) between predicted and measured step times, and where the measured best layout ranks in the
prediction. A performance claim is a ratio or a ranking from this JSON, never a unit test.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from lightning_tp3d import TP3DStrategy
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.plan.advisor import Cluster, LayoutCandidate, advise, evaluate_layout
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.ledger import TrainingOptions

from common import CONFIG, MACHINE, StepRecorder, benchmark_trainer

GPUS, GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN, WARMUP = 4, 8, 2, 128, 3
PRECISION = "32-true"


def _options(candidate: LayoutCandidate) -> TrainingOptions:
    mode = candidate.data_parallel_mode.removesuffix("-reshard")
    reshard = candidate.data_parallel_mode.endswith("-reshard")
    return TrainingOptions(seq_len=SEQ_LEN, precision=PRECISION, data_parallel_mode=mode,
                           fsdp_reshard_after_forward=True if reshard else None)


def _layout(candidate: LayoutCandidate) -> ParallelLayout:
    return ParallelLayout(tensor_parallel_size=candidate.tensor_parallel_size,
                          pipeline_parallel_size=candidate.pipeline_parallel_size,
                          data_parallel_size=candidate.data_parallel_size, micro_batch_size=MICRO_BATCH,
                          num_microbatches=candidate.num_microbatches,
                          gradient_accumulation_steps=candidate.gradient_accumulation_steps)


def _measure(candidate: LayoutCandidate, steps: int) -> dict[str, Any]:
    """Train the layout; the slowest rank's median step time and the doctor's bandwidth per group."""
    options = _options(candidate)
    strategy = TP3DStrategy(tensor_parallel_size=candidate.tensor_parallel_size,
                            pipeline_parallel_size=candidate.pipeline_parallel_size,
                            num_microbatches=candidate.num_microbatches, data_parallel_mode=options.data_parallel_mode,
                            fsdp_reshard_after_forward=options.fsdp_reshard_after_forward, preflight=True)
    recorder = StepRecorder()
    trainer = benchmark_trainer(GPUS, strategy, steps, [recorder], precision=PRECISION,
                                accumulate_grad_batches=candidate.gradient_accumulation_steps)
    batch = MICRO_BATCH * (candidate.num_microbatches if candidate.pipeline_parallel_size > 1 else 1)
    trainer.fit(CausalLMModule(CONFIG), TokenDataModule(seq_len=SEQ_LEN, batch_size=batch))
    per_step = recorder.seconds[WARMUP * candidate.gradient_accumulation_steps:]
    # an accumulating step is k batches: add them up per optimizer step
    k = candidate.gradient_accumulation_steps
    steps_seconds = torch.tensor([sum(per_step[i:i + k]) for i in range(0, len(per_step) - k + 1, k)])
    torch.distributed.all_reduce(steps_seconds, op=torch.distributed.ReduceOp.MAX)
    bandwidth: dict[str, float] = {}
    for row in strategy.preflight_report.measurements:
        bandwidth[row.dimension] = min(bandwidth.get(row.dimension, float("inf")), row.bandwidth_gbps)
    return {"median_step_seconds": float(steps_seconds.median()), "group_gbps": bandwidth}


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    for position, index in enumerate(order):
        ranks[index] = position + 1.0
    return ranks


def spearman(first: list[float], second: list[float]) -> float:
    """Rank correlation: Pearson's r of the ranks (no ties among measured or predicted times here)."""
    a, b = _ranks(first), _ranks(second)
    mean = (len(a) + 1) / 2
    covariance = sum((x - mean) * (y - mean) for x, y in zip(a, b))
    return covariance / sum((x - mean) ** 2 for x in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per layout (3 are warm-up)")
    parser.add_argument("--output", default="benchmarks/advisor_check_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cluster = Cluster(GPUS, 2**40, gpus_per_node=GPUS)
    candidates = [candidate for candidate in advise(CONFIG, cluster, GLOBAL_BATCH, SEQ_LEN, PRECISION, MICRO_BATCH)
                  if candidate.recompute == "none"]
    candidates.sort(key=lambda candidate: (  # the calibration layout, (1, 1, 4) replicate, first
        (candidate.data_parallel_size, candidate.data_parallel_mode) != (GPUS, "replicate"),
        candidate.tensor_parallel_size, candidate.pipeline_parallel_size, candidate.data_parallel_mode))
    measured = [_measure(candidate, args.steps) for candidate in candidates]
    if torch.distributed.get_rank() != 0:
        return
    # One compute rate for all: the calibration layout's measured step minus its predicted communication.
    calibration = candidates[0]
    reference = evaluate_layout(CONFIG, replace(cluster, group_gbps=measured[0]["group_gbps"]), _layout(calibration),
                                _options(calibration), GLOBAL_BATCH)
    communication = sum(reference.exposed_seconds.values())
    compute_seconds = measured[0]["median_step_seconds"] - communication
    rate = reference.compute_seconds * cluster.peak_tflops * cluster.mfu / compute_seconds  # TFLOP/s per process
    calibrated = replace(cluster, peak_tflops=rate, mfu=1.0)
    rows = []
    for candidate, measurement in zip(candidates, measured):
        predicted = evaluate_layout(CONFIG, replace(calibrated, group_gbps=measurement["group_gbps"]),
                                    _layout(candidate), _options(candidate), GLOBAL_BATCH)
        rows.append({"layout": predicted.name, "measured_seconds": measurement["median_step_seconds"],
                     "predicted_seconds": predicted.step_seconds, "predicted_parts": predicted.parts(),
                     "group_gbps": measurement["group_gbps"]})
    measured_times = [row["measured_seconds"] for row in rows]
    predicted_times = [row["predicted_seconds"] for row in rows]
    best = min(range(len(rows)), key=measured_times.__getitem__)
    result = {"command": [sys.executable, *sys.argv], "machine": MACHINE, "calibration_layout": rows[0]["layout"],
              "tflops_per_process": rate, "spearman": spearman(measured_times, predicted_times),
              "measured_best": rows[best]["layout"],
              "measured_best_predicted_rank": 1 + sorted(predicted_times).index(predicted_times[best]),
              "predicted_best": rows[min(range(len(rows)), key=predicted_times.__getitem__)]["layout"],
              "layouts": rows}
    print(f"{MACHINE}; {GPUS} processes, global batch {GLOBAL_BATCH} x {SEQ_LEN}, micro-batch {MICRO_BATCH};"
          f" compute calibrated on {result['calibration_layout']}: {rate * 1e3:.2f} GFLOP/s per process")
    print(f"{'layout':52s} {'measured ms':>12s} {'predicted ms':>13s} {'rank m/p':>9s}")
    measured_ranks, predicted_ranks = _ranks(measured_times), _ranks(predicted_times)
    for row, m_rank, p_rank in zip(rows, measured_ranks, predicted_ranks):
        print(f"{row['layout']:52s} {row['measured_seconds'] * 1e3:12.1f} {row['predicted_seconds'] * 1e3:13.1f}"
              f" {int(m_rank):>4d}/{int(p_rank):<4d}")
    print(f"Spearman rank correlation {result['spearman']:.3f}; measured best {result['measured_best']} is"
          f" predicted #{result['measured_best_predicted_rank']}")
    Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
