"""Checkpoint save / load throughput, and export throughput against the fastest writer of the same bytes.

    python benchmarks/checkpoint_io.py       # 2 CPU processes at tensor parallel 2, ~160M parameters

A model of about 160M parameters (640 MB in fp32, 1.9 GB with AdamW's moments) trains one step at
tp = 2; then, in the same session:

* save: `trainer.save_checkpoint` (DCP shards of every rank, RNG and trainer state, every file fsynced
  and hashed (SHA-256) as it is written, the folder renamed into place), checkpoint bytes / seconds;
* load: `strategy.load_checkpoint` of that folder into the live model and optimizer, every file checked
  against its recorded hash first (the files are in the page cache, so this measures hashing,
  deserialisation and resharding, not the disk);
* the cost of the hashes: each round also saves with a plain DCP writer (no hashes) and loads with
  `verify_checkpoints=False`, back to back with the hashed ones in alternating order; the ratio is the
  median of the per-round paired ratios (unhashed seconds / hashed seconds = hashed throughput / unhashed);
* export, in one process: `export_checkpoint` to one fp32 safetensors file (fsynced), with the files it
  reads checked against their hashes and without (`verify=False`), against two baselines writing the same
  bytes: the raw disk (pre-made bytes in 64 MB writes, then fsync) and
  `safetensors.torch.save_file` of the merged tensors already in memory (then fsync).

Save and load alternate over the rounds; export and its baselines take turns, in an order rotated each
round; each figure is the median, and the export's ratio is the median of the per-round ratios against
the baseline that was fastest (by median) in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import Callback
from safetensors.torch import save_file

import lightning_tp3d.io.checkpoint as checkpoint_io
from lightning_tp3d import TP3DStrategy
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.io.checkpoint_format import load_model_tensors
from lightning_tp3d.io.export import export_checkpoint
from lightning_tp3d.models import CausalLMModule

from common import CONFIG_160M as CONFIG
from common import MACHINE, benchmark_trainer

_CHUNK = 64 * 2**20


def _folder_bytes(folder: Path) -> int:
    return sum(file.stat().st_size for file in folder.rglob("*") if file.is_file())


def _fsync(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


class _UnhashedWriter(dcp.FileSystemWriter):
    """DCP's own writer, for the rounds without hashes (the package always hashes)."""

    file_hashes: dict[str, str] = {}


class SaveLoadTimer(Callback):
    """At the end of training: save and load the checkpoint `rounds` times with the files hashed and
    checked, and as many times without, the two back to back in alternating order, timed between barriers."""

    def __init__(self, folder: Path, rounds: int) -> None:
        self.folder, self.rounds = folder, rounds
        self.seconds: dict[str, list[float]] = {name: [] for name in ("save", "load", "save unhashed",
                                                                      "load unchecked")}
        self.checkpoint_bytes = 0

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy = trainer.strategy
        path = self.folder / "benchmark.ckpt"
        checked, unchecked = strategy.core.options, replace(strategy.core.options, verify_checkpoints=False)

        def hashed() -> None:
            strategy.core.options = checked
            self.seconds["save"].append(_between_barriers(strategy, lambda: trainer.save_checkpoint(path)))
            self.seconds["load"].append(_between_barriers(strategy, lambda: strategy.load_checkpoint(path)))

        def unhashed() -> None:
            checkpoint_io.HashingFileSystemWriter, writer = _UnhashedWriter, checkpoint_io.HashingFileSystemWriter
            try:
                self.seconds["save unhashed"].append(_between_barriers(strategy, lambda: trainer.save_checkpoint(path)))
            finally:
                checkpoint_io.HashingFileSystemWriter = writer
            strategy.core.options = unchecked
            self.seconds["load unchecked"].append(_between_barriers(strategy, lambda: strategy.load_checkpoint(path)))
            strategy.core.options = checked

        for round_index in range(self.rounds):
            for run in (hashed, unhashed) if round_index % 2 == 0 else (unhashed, hashed):
                run()
        hashed()  # leave a hashed checkpoint for the export rounds
        self.checkpoint_bytes = _folder_bytes(path)


def _between_barriers(strategy: Any, action: Callable[[], Any]) -> float:
    strategy.barrier()
    started = time.perf_counter()
    action()
    strategy.barrier()
    return time.perf_counter() - started


def _raw_write(path: Path, total: int, chunk: memoryview) -> None:
    with open(path, "wb") as file:
        for start in range(0, total, _CHUNK):
            file.write(chunk[: min(_CHUNK, total - start)])
        file.flush()
        os.fsync(file.fileno())


def _timed(action: Callable[[], Any]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _export_rounds(checkpoint: Path, folder: Path, rounds: int) -> dict[str, Any]:
    """Export and its two baselines over `rounds`, the order rotated each round (on a shared disk the
    writer that follows another is often slower); every output is removed after it is timed."""
    output, raw, merged = folder / "export", folder / "raw.bin", folder / "merged.safetensors"
    export_bytes = export_checkpoint(checkpoint, output).total_bytes
    shutil.rmtree(output)
    tensors = load_model_tensors(checkpoint)
    chunk = memoryview(torch.randint(0, 256, (_CHUNK,), dtype=torch.uint8).numpy())
    writers: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "raw disk write": (lambda: _raw_write(raw, export_bytes, chunk), raw.unlink),
        "safetensors save_file": (lambda: (save_file(tensors, str(merged)), _fsync(merged)), merged.unlink),
        "export_checkpoint": (lambda: export_checkpoint(checkpoint, output), lambda: shutil.rmtree(output)),
        "export_checkpoint unchecked": (lambda: export_checkpoint(checkpoint, output, verify=False),
                                        lambda: shutil.rmtree(output)),
    }
    names = list(writers)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            write, remove = writers[name]
            seconds[name].append(_timed(write))
            remove()
    return {name: {"median_seconds": statistics.median(values), "rounds": values,
                   "bytes_per_second": export_bytes / statistics.median(values)}
            for name, values in seconds.items()} | {"bytes": export_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-layers", type=int, default=CONFIG.num_hidden_layers,
                        help="decoder layers (a smaller run)")
    parser.add_argument("--folder", type=Path, default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--output", default="benchmarks/checkpoint_io_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = replace(CONFIG, num_hidden_layers=args.num_layers)
    folder = Path(args.folder or tempfile.mkdtemp(prefix="tp3d-io-"))
    timer = SaveLoadTimer(folder, args.rounds)
    trainer = benchmark_trainer(2, TP3DStrategy(tensor_parallel_size=2), 1, [timer])
    trainer.fit(CausalLMModule(config), TokenDataModule(seq_len=32, batch_size=2))
    if trainer.global_rank != 0:
        return
    gigabyte = 1e9
    results: dict[str, Any] = {
        "command": [sys.executable, *sys.argv], "machine": MACHINE, "parameters": config.num_parameters(),
        "checkpoint_bytes": timer.checkpoint_bytes,
    }
    for name, rounds in timer.seconds.items():
        rounds = rounds[:args.rounds]
        results[name] = {"median_seconds": statistics.median(rounds), "rounds": rounds,
                         "bytes_per_second": timer.checkpoint_bytes / statistics.median(rounds)}
    for name, baseline in (("save", "save unhashed"), ("load", "load unchecked")):
        paired = [plain / hashed for plain, hashed in zip(results[baseline]["rounds"], results[name]["rounds"])]
        results[f"{name} hashed / {baseline}"] = {"median_ratio": statistics.median(paired), "rounds": paired}
    save, load = results["save"]["median_seconds"], results["load"]["median_seconds"]
    results["export"] = _export_rounds(folder / "benchmark.ckpt", folder, args.rounds)
    export = results["export"]
    # Against the fastest baseline measured, as the median of the per-round paired ratios (throughput of
    # the export / throughput of the baseline in the same round = baseline seconds / export seconds).
    fastest = min(("raw disk write", "safetensors save_file"), key=lambda name: export[name]["median_seconds"])
    paired = [baseline / exported for baseline, exported in zip(export[fastest]["rounds"],
                                                                 export["export_checkpoint"]["rounds"])]
    results["export / fastest baseline"] = {"baseline": fastest, "median_ratio": statistics.median(paired),
                                            "rounds": paired}
    # The files' hashes: an export reads (and checks) every shard holding model tensors, optimizer state too.
    paired = [unchecked / checked for unchecked, checked in zip(export["export_checkpoint unchecked"]["rounds"],
                                                                 export["export_checkpoint"]["rounds"])]
    results["export checked / export unchecked"] = {"median_ratio": statistics.median(paired), "rounds": paired}
    print(f"{MACHINE}; {config.num_parameters() / 1e6:.0f}M parameters")
    print(f"checkpoint save  {timer.checkpoint_bytes / gigabyte:5.2f} GB  {save:6.2f} s"
          f"  {results['save']['bytes_per_second'] / gigabyte:5.2f} GB/s")
    print(f"checkpoint load  {timer.checkpoint_bytes / gigabyte:5.2f} GB  {load:6.2f} s"
          f"  {results['load']['bytes_per_second'] / gigabyte:5.2f} GB/s")
    for name in ("save hashed / save unhashed", "load hashed / load unchecked"):
        print(f"{name}: throughput ratio {results[name]['median_ratio']:.3f} (median of paired rounds)")
    for name in ("raw disk write", "safetensors save_file", "export_checkpoint", "export_checkpoint unchecked"):
        print(f"{name:22s} {export['bytes'] / gigabyte:5.2f} GB  {export[name]['median_seconds']:6.2f} s"
              f"  {export[name]['bytes_per_second'] / gigabyte:5.2f} GB/s")
    ratio = results["export / fastest baseline"]
    print(f"export / {ratio['baseline']} (fastest baseline), median of paired rounds: {ratio['median_ratio']:.2f}")
    checked = results["export checked / export unchecked"]["median_ratio"]
    print(f"export checked / unchecked: throughput ratio {checked:.3f} (median of paired rounds)")
    Path(args.output).write_text(json.dumps(results, indent=2))
    if args.folder is None:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
