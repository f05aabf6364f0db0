"""The step profiler's report: every rank's breakdown, the advisor's prediction beside it, the warnings.

`build_report` assembles breakdown.json from the ranks' own breakdowns (`callbacks.profile`):

    {"command": [...], "layout": {...}, "warmup_steps": W, "steps": N, "components": [...],
     "ranks": [{"rank": r, "coordinates": {"pp", "dp", "tp"}, "host", "step_seconds",
                "components": {name: seconds}, "steps": [...], "pipeline_timing": [...],
                "dp_bytes_per_step", "ledger_dp_bytes"}],
     "prediction": {"components": {name: seconds}, "compute_rate": ..., "cluster": {...}},
     "warnings": [...]}

Seconds are means over the profiled steps. The prediction is `plan.advisor.evaluate_layout` for the
run's layout, options and global batch on a cluster of its world (`prediction_cluster`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from lightning_tp3d.diagnostics.breakdown import COMPONENTS, predicted_components, rules_of_thumb
from lightning_tp3d.plan.advisor import Cluster, evaluate_layout, plan_ledgers
from lightning_tp3d.plan.config import ModelConfig
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.ledger import TrainingOptions
from lightning_tp3d.plan.moe import MoEModelConfig
from lightning_tp3d.plan.schedules import bubble_fraction

__all__ = ["build_report", "prediction_cluster", "report_table"]

_LOTS_OF_MEMORY = 1 << 60  # the prediction is about time; every layout "fits"


def prediction_cluster(world_size: int, gpus_per_node: int, device_type: str, cluster_options: dict[str, Any],
                       measured_compute: float, config: ModelConfig | MoEModelConfig, layout: ParallelLayout,
                       options: TrainingOptions, global_batch: int) -> tuple[Cluster, str]:
    """The cluster the advisor predicts this run on, and how its compute rate was chosen: `peak_tflops` x
    `mfu` as given (defaults: `Cluster`'s), or on a CPU without a given peak, the rate at which the advisor's
    compute equals `measured_compute` (the ranks' mean)."""
    links = cluster_options.get("link_gbps") or {}
    cluster = Cluster(gpus=world_size, gpu_memory_bytes=_LOTS_OF_MEMORY, gpus_per_node=gpus_per_node,
                      group_gbps=dict(links), overlap=device_type == "cuda")
    peak, mfu = cluster_options.get("peak_tflops"), cluster_options.get("mfu")
    if peak is not None or device_type == "cuda":
        cluster = replace(cluster, peak_tflops=peak or cluster.peak_tflops, mfu=mfu or cluster.mfu)
        return cluster, f"given: {cluster.peak_tflops:g} TFLOP/s peak x {cluster.mfu:g} MFU"
    unit = evaluate_layout(config, replace(cluster, peak_tflops=1.0, mfu=1.0), layout, options, global_batch)
    rate = unit.compute_seconds / measured_compute if measured_compute > 0 else 1.0
    return (replace(cluster, peak_tflops=rate, mfu=1.0),
            f"calibrated: {rate * 1e3:.3g} GFLOP/s per rank makes the predicted compute the measured one"
            " (no peak is known for a CPU)")


def _mean_components(ranks: Sequence[dict[str, Any]]) -> dict[str, float]:
    return {name: statistics.fmean(rank["components"][name] for rank in ranks) for name in COMPONENTS}


def build_report(ranks: Sequence[dict[str, Any]], *, config: ModelConfig | MoEModelConfig | None,
                 layout: ParallelLayout, options: TrainingOptions, global_batch: int, schedule: str,
                 device_type: str, backend: str, gpus_per_node: int, cluster_options: dict[str, Any],
                 warmup_steps: int, steps: int, command: Sequence[str]) -> dict[str, Any]:
    """breakdown.json (see the module docstring) from every rank's breakdown, ordered by rank."""
    ranks = sorted((dict(rank) for rank in ranks), key=lambda rank: rank["rank"])
    for rank in ranks:
        rank.pop("timeline", None)
    report: dict[str, Any] = {
        "command": list(command),
        "layout": {"tp": layout.tensor_parallel_size, "pp": layout.pipeline_parallel_size,
                   "dp": layout.data_parallel_size, "micro_batch_size": layout.micro_batch_size,
                   "num_microbatches": layout.num_microbatches,
                   "gradient_accumulation_steps": layout.gradient_accumulation_steps, "schedule": schedule,
                   "data_parallel_mode": options.data_parallel_mode, "recompute": options.recompute,
                   "precision": options.precision, "seq_len": options.seq_len, "global_batch": global_batch},
        "device": device_type, "warmup_steps": warmup_steps, "steps": steps, "components": list(COMPONENTS),
        "ranks": ranks, "prediction": None, "warnings": [],
    }
    prediction = None
    if config is not None:
        measured = _mean_components(ranks)["compute"]
        cluster, rate = prediction_cluster(len(ranks), gpus_per_node, device_type, cluster_options, measured,
                                           config, layout, options, global_batch)
        candidate = evaluate_layout(config, cluster, layout, options, global_batch)
        prediction = predicted_components(candidate)
        ledger = plan_ledgers(config, layout, options, backend)[1]
        for rank in ranks:
            rank["ledger_dp_bytes"] = ledger.totals(rank["coordinates"]["pp"])["dp"]["payload_bytes"]
        report["prediction"] = {"components": prediction, "step_seconds": candidate.step_seconds,
                                "compute_rate": rate,
                                "cluster": {key: value for key, value in asdict(cluster).items()
                                            if key != "gpu_memory_bytes"}}
    pp, m = layout.pipeline_parallel_size, layout.num_microbatches
    theory = bubble_fraction(pp, m) if pp > 1 else None
    by_cause: dict[str, tuple[list[int], str]] = {}  # one warning per cause: its ranks, the first one's words
    for rank in ranks:
        for cause, warning in rules_of_thumb(rank["components"], rank["step_seconds"], theory, prediction):
            by_cause.setdefault(cause, ([], warning))[0].append(rank["rank"])
    report["warnings"] = [f"{_ranks(shown)}: {warning}" for shown, warning in by_cause.values()]
    return report


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} (words from rank {ranks[0]})"


def report_table(report: dict[str, Any]) -> str:
    """Per component over the ranks: mean seconds per step and share of the step, min, max (and the rank
    with the max), and the advisor's prediction."""
    ranks, layout = report["ranks"], report["layout"]
    prediction = (report.get("prediction") or {}).get("components", {})
    step = statistics.fmean(rank["step_seconds"] for rank in ranks)
    lines = [f"step-time breakdown at tp={layout['tp']} pp={layout['pp']} dp={layout['dp']} ({layout['schedule']},"
             f" m={layout['num_microbatches']}, {layout['data_parallel_mode']}): {report['steps']} steps after"
             f" {report['warmup_steps']} warm-up steps, seconds per step over {len(ranks)} ranks",
             f"{'component':<20} {'mean':>9} {'share':>6} {'min':>9} {'max':>9} {'rank':>5} {'advisor':>9}"]
    for name in COMPONENTS:
        values = [rank["components"][name] for rank in ranks]
        worst = max(range(len(ranks)), key=lambda index: values[index])
        predicted = f"{prediction[name]:9.4f}" if name in prediction else f"{'-':>9}"
        lines.append(f"{name:<20} {statistics.fmean(values):9.4f} {statistics.fmean(values) / step:6.1%}"
                     f" {min(values):9.4f} {max(values):9.4f} {ranks[worst]['rank']:>5} {predicted}")
    steps = [rank["step_seconds"] for rank in ranks]
    advisor = report.get("prediction") or {}
    total = f"{advisor['step_seconds']:9.4f}" if advisor else f"{'-':>9}"
    lines.append(f"{'step (host clock)':<20} {step:9.4f} {1:6.1%} {min(steps):9.4f} {max(steps):9.4f}"
                 f" {ranks[max(range(len(ranks)), key=lambda index: steps[index])]['rank']:>5} {total}")
    if advisor:
        lines.append(f"advisor's compute rate: {advisor['compute_rate']}")
    lines += [f"warning: {warning}" for warning in report["warnings"]]
    return "\n".join(lines)
