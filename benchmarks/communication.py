"""What each rank sends per group (tp, pp, dp) in a real training step, against the communication ledger.

    python benchmarks/communication.py      # 4 processes, CPU/gloo; prints a table and writes JSON

The tiny decoder (4 layers, hidden 64, vocabulary 256), 8 sequences of 16 tokens per dp rank and step.
Each layout trains 2 steps; the second is recorded on every rank (`callbacks.RecordTraffic`: torch's
flight recorder for collectives, wrapped sends for pipeline transfers) and compared with
`plan.communication.communication_ledger` for that rank's stage, group by group: calls and payload
bytes (gloo: FSDP2's reduce-scatter runs as an all-reduce of the same payload, `backend="gloo"`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_tp3d import TP3DStrategy
from lightning_tp3d.callbacks import RecordTraffic
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.plan.communication import GROUPS, communication_ledger
from lightning_tp3d.plan.config import resolve_model_config
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.ledger import TrainingOptions

from common import MACHINE, benchmark_trainer

BATCH, SEQ_LEN = 8, 16
# (tp, pp, dp, num_microbatches, dp mode, precision, recompute): every dp mode, pp 2 at m = 2 and 8;
# "fsdp-reshard" / "fsdp-keep": FSDP with fsdp_reshard_after_forward=True / False.
LAYOUTS = [
    (2, 1, 2, 1, "replicate", "32-true", "none"),
    (2, 1, 2, 1, "fsdp", "32-true", "none"),
    (1, 1, 4, 1, "fsdp", "32-true", "none"),
    (2, 2, 1, 2, "replicate", "32-true", "none"),
    (2, 2, 1, 8, "replicate", "32-true", "full"),
    (1, 2, 2, 2, "replicate", "32-true", "none"),
    (1, 2, 2, 2, "fsdp", "32-true", "none"),
    (1, 2, 2, 8, "fsdp", "32-true", "none"),
    (1, 2, 2, 2, "fsdp-reshard", "32-true", "none"),
    (1, 1, 4, 1, "fsdp-keep", "32-true", "none"),
    (2, 2, 1, 2, "replicate", "bf16-mixed", "none"),
    (2, 1, 2, 1, "zero1", "32-true", "none"),
    (1, 1, 4, 1, "zero1", "32-true", "none"),
    (1, 2, 2, 2, "zero1", "32-true", "none"),
]


def _measure(tp: int, pp: int, dp: int, m: int, mode: str, precision: str, recompute: str) -> dict[str, Any]:
    record = RecordTraffic()
    reshard = {"-reshard": True, "-keep": False}.get(mode[mode.find("-"):] if "-" in mode else "")
    mode = mode.split("-")[0]
    strategy = TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, num_microbatches=m,
                            data_parallel_mode=mode, fsdp_reshard_after_forward=reshard, recompute=recompute)
    trainer = benchmark_trainer(4, strategy, 2, [record], precision=precision, log_every_n_steps=1)
    trainer.fit(CausalLMModule("tiny"), TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=BATCH))
    layout = ParallelLayout(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                            micro_batch_size=BATCH // m, num_microbatches=m)
    options = TrainingOptions(seq_len=SEQ_LEN, precision=precision, data_parallel_mode=mode, recompute=recompute,
                              fsdp_reshard_after_forward=reshard)
    ledger = communication_ledger(resolve_model_config("tiny"), layout, options, backend="gloo")
    stage = trainer.strategy.layout.coordinates(trainer.global_rank).pp
    expected, measured = ledger.totals(stage), record.recorder.per_group()
    groups = {}
    for group in GROUPS:
        planned = {key: expected[group][key] for key in ("calls", "payload_bytes")}
        found = measured.get(group, {"calls": 0, "payload_bytes": 0})
        if planned["calls"] or found["calls"]:
            ratio = found["payload_bytes"] / planned["payload_bytes"] if planned["payload_bytes"] else float("inf")
            groups[group] = {"ledger": planned, "measured": found, "bytes_ratio": ratio}
    exact = record.recorder.transfers == ledger.calls_by_transfer(stage)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, {"rank": trainer.global_rank, "stage": stage, "groups": groups,
                                                   "every_transfer_equal": exact})
    return {"layout": {"tp": tp, "pp": pp, "dp": dp, "num_microbatches": m,
                       "dp_mode": mode + {True: "-reshard", False: "-keep", None: ""}[reshard],
                       "precision": precision, "recompute": recompute}, "ranks": gathered}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="benchmarks/communication_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [_measure(*layout) for layout in LAYOUTS]
    if torch.distributed.get_rank() != 0:
        return
    worst = max(abs(group["bytes_ratio"] - 1) for result in results for rank in result["ranks"]
                for group in rank["groups"].values())
    print(f"{MACHINE}; measured / ledger payload bytes per rank and group (worst over ranks)")
    for result in results:
        layout = result["layout"]
        name = (f"{layout['tp']}x{layout['pp']}x{layout['dp']} m={layout['num_microbatches']} {layout['dp_mode']}"
                f" {layout['precision']} recompute={layout['recompute']}")
        cells = []
        for group in GROUPS:
            rows = [rank["groups"][group] for rank in result["ranks"] if group in rank["groups"]]
            if rows:
                row = max(rows, key=lambda row: abs(row["bytes_ratio"] - 1))
                cells.append(f"{group} {row['measured']['calls']}/{row['ledger']['calls']} calls"
                             f" {row['measured']['payload_bytes']:,}/{row['ledger']['payload_bytes']:,} B")
        exact = all(rank["every_transfer_equal"] for rank in result["ranks"])
        print(f"{name:52s} {'; '.join(cells)}  every transfer equal: {exact}")
    print(f"largest deviation: {worst:.2%}")
    Path(args.output).write_text(json.dumps({"command": [sys.executable, *sys.argv], "machine": MACHINE,
                                             "largest_deviation": worst, "layouts": results}, indent=2))


if __name__ == "__main__":
    main()
