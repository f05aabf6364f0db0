"""The memory table `tp3d plan` prints: one row per pp rank of a `plan.ledger.TrainingLedger` (its blocks,
parameters, weights, gradients, optimizer state, activations and total), for dense and MoE models alike."""

from __future__ import annotations

from lightning_tp3d.plan.ledger import TrainingLedger

__all__ = ["byte_unit", "memory_lines"]

_GIB = 1024**3


def byte_unit(largest: int) -> tuple[str, int]:
    """GiB for figures of a GiB or more, else MiB (a tiny model's ledger is not 0.00 everywhere)."""
    return ("GiB", _GIB) if largest >= _GIB else ("MiB", 1024**2)


def memory_lines(training: TrainingLedger) -> list[str]:
    """The ledger's rows, their legend and the peak rank."""
    unit, scale = byte_unit(training.peak_stage.total_bytes)
    layers = {stage.stage: stage.layers_text for stage in training.stages}
    width = max(9, *map(len, layers.values()))
    lines = [f"{'stage':>5} {'layers':>{width}} {'params/rank':>14} {'weights':>9} {'grads':>9} {'optim':>9} "
             f"{'activ':>9} {'total ' + unit:>9} {'mb':>5}"]
    for stage in training.stages:
        sizes = (stage.weight_bytes, stage.gradient_bytes, stage.optimizer_bytes, stage.activation_bytes,
                 stage.total_bytes)
        lines.append(f"{stage.stage:>5} {layers[stage.stage]:>{width}} {stage.parameters:>14,} "
                     + " ".join(f"{size / scale:9.2f}" for size in sizes) + f" {stage.in_flight_microbatches:>5g}")
    lines.append("(stage: a pp rank and its blocks; mb: the micro-batches whose activations it holds at once)")
    lines.append(f"peak per rank: {training.peak_stage.total_bytes / scale:.2f} {unit} (stage"
                 f" {training.peak_stage.stage})")
    return lines
