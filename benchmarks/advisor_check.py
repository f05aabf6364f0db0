"""The layout advisor's ranking against measured step times, on CPU processes (gloo).

    python benchmarks/advisor_check.py           # 2 processes, writes benchmarks/advisor_check_cpu.json

The cluster is this machine as the advisor sees `--gpus` GPUs in one node: for each layout the advisor
proposes for the benchmark model (every tp x pp x dp, dp mode and recompute; a global batch of 8
sequences of 128 tokens in micro-batches of 2), the layout trains `--steps` steps, `tp3d doctor`'s
measurement runs in its world first (each group's latency at 4 KiB and bandwidth at 1 MiB), and the
median step time after 3 warm-up steps is recorded. The advisor then predicts every layout with the
measured links (per group, the median over all runs), `overlap=False` (gloo's collectives run on the
cores that compute), and one compute rate calibrated on the first layout ((1, 1, d) replicate, no
recompute: its measured step minus its predicted communication). Reported: the rank correlation
(Spearman) between predicted and measured step times, where the measured best ranks in the
prediction, and each layout's pair.

Run with as many processes as cores (2 here): with more, a process that waits (a pipeline bubble, a
collective) hands its core to another, which no GPU does, and the comparison says nothing about GPUs.
A performance claim is a ratio or a ranking from this JSON, never a unit test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_tp3d import TP3DStrategy
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.diagnostics.doctor import run_doctor
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.plan.advisor import Cluster, LayoutCandidate, advise, evaluate_layout
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.ledger import TrainingOptions

from common import CONFIG, MACHINE, StepRecorder, benchmark_trainer

GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN, WARMUP = 8, 2, 128, 3
PRECISION = "32-true"


def _options(candidate: LayoutCandidate) -> TrainingOptions:
    return candidate.options(SEQ_LEN, PRECISION)


def _layout(candidate: LayoutCandidate) -> ParallelLayout:
    return ParallelLayout(tensor_parallel_size=candidate.tensor_parallel_size,
                          pipeline_parallel_size=candidate.pipeline_parallel_size,
                          data_parallel_size=candidate.data_parallel_size, micro_batch_size=MICRO_BATCH,
                          num_microbatches=candidate.num_microbatches,
                          gradient_accumulation_steps=candidate.gradient_accumulation_steps)


class _Links(Callback):
    """`tp3d doctor`'s measurement in the run's world, before training: per group, the latency of a 4 KiB
    message and the bandwidth at 1 MiB."""

    def __init__(self) -> None:
        self.latency_seconds: dict[str, float] = {}
        self.group_gbps: dict[str, float] = {}

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        report = run_doctor(trainer.strategy.layout, trainer.strategy.device_mesh, sizes=(4096, 2**20), iterations=5)
        for row in report.measurements:
            if row.bytes == 4096:
                self.latency_seconds[row.dimension] = max(self.latency_seconds.get(row.dimension, 0.0),
                                                          row.latency_seconds)
            else:
                self.group_gbps[row.dimension] = min(self.group_gbps.get(row.dimension, float("inf")),
                                                     row.bandwidth_gbps)


def _measure(candidate: LayoutCandidate, gpus: int, steps: int) -> dict[str, Any]:
    """Train the layout; the slowest rank's median step time and the doctor's figures per group."""
    options = _options(candidate)
    strategy = TP3DStrategy(tensor_parallel_size=candidate.tensor_parallel_size,
                            pipeline_parallel_size=candidate.pipeline_parallel_size,
                            num_microbatches=candidate.num_microbatches, data_parallel_mode=options.data_parallel_mode,
                            fsdp_reshard_after_forward=options.fsdp_reshard_after_forward, recompute=options.recompute)
    recorder, links = StepRecorder(), _Links()
    trainer = benchmark_trainer(gpus, strategy, steps, [links, recorder], precision=PRECISION,
                                accumulate_grad_batches=candidate.gradient_accumulation_steps)
    batch = MICRO_BATCH * (candidate.num_microbatches if candidate.pipeline_parallel_size > 1 else 1)
    trainer.fit(CausalLMModule(CONFIG), TokenDataModule(seq_len=SEQ_LEN, batch_size=batch))
    per_step = recorder.seconds[WARMUP * candidate.gradient_accumulation_steps:]
    # an accumulating step is k batches: add them up per optimizer step
    k = candidate.gradient_accumulation_steps
    steps_seconds = torch.tensor([sum(per_step[i:i + k]) for i in range(0, len(per_step) - k + 1, k)])
    torch.distributed.all_reduce(steps_seconds, op=torch.distributed.ReduceOp.MAX)
    return {"median_step_seconds": float(steps_seconds.median()), "group_gbps": links.group_gbps,
            "latency_seconds": links.latency_seconds}


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
    parser.add_argument("--gpus", type=int, default=2, help="processes, at most one per core (see above)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per layout (3 are warm-up)")
    parser.add_argument("--output", default="benchmarks/advisor_check_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cluster = Cluster(args.gpus, 2**40, gpus_per_node=args.gpus, overlap=False)
    candidates = advise(CONFIG, cluster, GLOBAL_BATCH, SEQ_LEN, PRECISION, MICRO_BATCH)
    candidates.sort(key=lambda candidate: (  # the calibration layout, (1, 1, d) replicate without recompute, first
        (candidate.data_parallel_size, candidate.data_parallel_mode, candidate.recompute) != (args.gpus, "replicate",
                                                                                              "none"),
        candidate.tensor_parallel_size, candidate.pipeline_parallel_size, candidate.data_parallel_mode,
        bool(candidate.fsdp_reshard_after_forward), candidate.recompute))
    measured = [_measure(candidate, args.gpus, args.steps) for candidate in candidates]
    if torch.distributed.get_rank() != 0:
        return
    # The links: per group, the median over every run's doctor measurement (one noisy run moves nothing).
    links = {key: {group: statistics.median(run[key][group] for run in measured if group in run[key])
                   for group in {group for run in measured for group in run[key]}}
             for key in ("group_gbps", "latency_seconds")}
    cluster = replace(cluster, **links)
    # One compute rate for all: the calibration layout's measured step minus its predicted communication.
    calibration = candidates[0]
    reference = evaluate_layout(CONFIG, cluster, _layout(calibration), _options(calibration), GLOBAL_BATCH)
    communication = sum(reference.exposed_seconds.values())
    compute_seconds = measured[0]["median_step_seconds"] - communication
    rate = reference.compute_seconds * cluster.peak_tflops * cluster.mfu / compute_seconds  # TFLOP/s per process
    calibrated = replace(cluster, peak_tflops=rate, mfu=1.0)
    rows = []
    for candidate, measurement in zip(candidates, measured):
        predicted = evaluate_layout(CONFIG, calibrated, _layout(candidate), _options(candidate), GLOBAL_BATCH)
        rows.append({"layout": predicted.name, "measured_seconds": measurement["median_step_seconds"],
                     "predicted_seconds": predicted.step_seconds, "predicted_parts": predicted.parts(),
                     "group_gbps": measurement["group_gbps"], "latency_seconds": measurement["latency_seconds"]})
    measured_times = [row["measured_seconds"] for row in rows]
    predicted_times = [row["predicted_seconds"] for row in rows]
    best = min(range(len(rows)), key=measured_times.__getitem__)
    result = {"command": [sys.executable, *sys.argv], "machine": MACHINE, "calibration_layout": rows[0]["layout"],
              "links": links,
              "tflops_per_process": rate, "spearman": spearman(measured_times, predicted_times),
              "measured_best": rows[best]["layout"],
              "measured_best_predicted_rank": 1 + sorted(predicted_times).index(predicted_times[best]),
              "predicted_best": rows[min(range(len(rows)), key=predicted_times.__getitem__)]["layout"],
              "layouts": rows}
    print(f"{MACHINE}; {args.gpus} processes, global batch {GLOBAL_BATCH} x {SEQ_LEN}, micro-batch {MICRO_BATCH};"
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
