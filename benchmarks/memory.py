"""Per-rank memory of parameters, gradients and optimizer state against the planner's ledger.

    python benchmarks/memory.py              # every layout below, each in its own CPU/gloo world

Each layout trains two AdamW steps of the benchmark model through `TP3DStrategy`; after the second step
every rank measures the bytes of the storages behind its parameters, gradients (right after the last
backward, before the dp reduction: their peak, which `zero1` frees after its reduce-scatter) and optimizer
state (its local DTensor shards, FSDP2 padding included, each storage counted once) and the parent
compares them with `training_ledger` for that rank's pipeline stage (`32-true`: 4, 4 and 8 bytes per
parameter).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_tp3d import TP3DStrategy
from lightning_tp3d.callbacks.monitor import local_storage_bytes
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.plan.data_parallel import DATA_PARALLEL_MODES
from lightning_tp3d.plan.ledger import TrainingOptions, training_ledger

from common import CONFIG, MACHINE, benchmark_trainer

# (tp, pp, dp, data-parallel mode)
LAYOUTS = [(1, 1, 1, "replicate"), (2, 1, 1, "replicate"), (1, 2, 1, "replicate"), (1, 1, 2, "fsdp"),
           (2, 2, 1, "replicate"), (2, 1, 2, "replicate"), (2, 1, 2, "fsdp"), (2, 2, 2, "replicate"),
           (2, 2, 2, "fsdp"), (1, 1, 2, "zero1"), (2, 2, 2, "zero1")]
SEQ_LEN = 64
KINDS = ("weight_bytes", "gradient_bytes", "optimizer_bytes")


class MemoryProbe(Callback):
    """After the last training step, each rank's parameter, gradient and optimizer-state bytes."""

    def __init__(self) -> None:
        self.per_rank: list[dict[str, int]] = []
        self.gradient_bytes = 0

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.gradient_bytes = local_storage_bytes(p.grad for p in trainer.strategy.network.parameters())

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step < trainer.max_steps:
            return
        parameters = list(trainer.strategy.network.parameters())
        states = [value for optimizer in trainer.optimizers for state in optimizer.state.values()
                  for value in state.values() if isinstance(value, torch.Tensor)]
        measured = {
            "rank": trainer.global_rank,
            "stage": trainer.strategy.layout.coordinates(trainer.global_rank).pp,
            "weight_bytes": local_storage_bytes(parameters),
            "gradient_bytes": self.gradient_bytes,
            "optimizer_bytes": local_storage_bytes(states),
        }
        gathered: list[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(gathered, measured)
        self.per_rank = gathered


def _measure(tp: int, pp: int, dp: int, mode: str, output: Path) -> None:
    """Child process: train at the layout, write the per-rank measurements and the ledger to `output`."""
    torch.set_num_threads(1)
    pipeline = {"num_microbatches": 2} if pp > 1 else {}
    strategy = TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                            data_parallel_mode=mode, **pipeline)
    probe = MemoryProbe()
    trainer = benchmark_trainer(tp * pp * dp, strategy, 2, [probe])
    trainer.fit(CausalLMModule(CONFIG), TokenDataModule(seq_len=SEQ_LEN, batch_size=4))
    if trainer.global_rank == 0:
        ledger = training_ledger(CONFIG, strategy.layout, TrainingOptions(
            seq_len=SEQ_LEN, precision="32-true", data_parallel_mode=mode))
        stages = [{kind: getattr(stage, kind) for kind in KINDS} for stage in ledger.stages]
        output.write_text(json.dumps({"per_rank": probe.per_rank, "ledger": stages}))
    # every rank leaves the group before the interpreter exits: torch's gloo threads, still running at exit,
    # can abort the process ("terminate called without an active exception") after its work is done
    torch.distributed.destroy_process_group()


def _compare(result: dict[str, Any]) -> dict[str, Any]:
    """Measured / ledger per kind, over all ranks: the ratio farthest from 1."""
    worst = {}
    for kind in KINDS:
        ratios = [rank[kind] / result["ledger"][rank["stage"]][kind] for rank in result["per_rank"]]
        worst[kind] = max(ratios, key=lambda ratio: abs(ratio - 1))
    return worst


def _layout(text: str) -> tuple[int, int, int, str]:
    """`tp,pp,dp,mode` as a tuple, or an argparse error that shows the expected form."""
    parts = text.split(",")
    if len(parts) != 4 or not all(part.isdigit() and int(part) > 0 for part in parts[:3]) \
            or parts[3] not in DATA_PARALLEL_MODES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not tp,pp,dp,mode with positive sizes and mode one of {', '.join(DATA_PARALLEL_MODES)},"
            " e.g. 2,1,2,fsdp")
    return int(parts[0]), int(parts[1]), int(parts[2]), parts[3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", type=_layout, default=LAYOUTS,
                        help="tp,pp,dp,mode of each layout to measure (default: eleven layouts up to 2x2x2)")
    parser.add_argument("--layout", type=_layout,
                        help="tp,pp,dp,mode: measure one layout (the parent runs each this way)")
    parser.add_argument("--result", type=Path, help="where a --layout run writes its measurements")
    parser.add_argument("--output", default="benchmarks/memory_cpu.json")
    args = parser.parse_args()
    if args.layout:
        _measure(*args.layout, args.result)
        return
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for tp, pp, dp, mode in args.layouts:
            result_file = Path(folder) / "result.json"
            child = subprocess.run([sys.executable, __file__, "--layout", f"{tp},{pp},{dp},{mode}", "--result",
                                    str(result_file)], capture_output=True, text=True)
            if child.returncode != 0:
                sys.exit(f"tp={tp} pp={pp} dp={dp} {mode} failed:\n{child.stderr[-4000:]}")
            result = json.loads(result_file.read_text())
            result["worst_ratio"] = _compare(result)
            results[f"tp={tp} pp={pp} dp={dp} {mode}"] = result
    print(f"{MACHINE}; measured / ledger per rank, the ratio farthest from 1 over all ranks")
    print(f"{'layout':30s} {'params (MB)':>12s} {'weights':>8s} {'grads':>8s} {'optimizer':>10s}")
    for name, result in results.items():
        largest = max(rank["weight_bytes"] for rank in result["per_rank"]) / 1e6
        worst = result["worst_ratio"]
        print(f"{name:30s} {largest:12.2f} {worst['weight_bytes']:8.4f} {worst['gradient_bytes']:8.4f}"
              f" {worst['optimizer_bytes']:10.4f}")
    Path(args.output).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
