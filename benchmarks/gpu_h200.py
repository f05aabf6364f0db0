"""One GPU (an H200): parity with a plain PyTorch loop over NCCL, then bf16 throughput and MFU of a ~1B decoder.

    python benchmarks/gpu_h200.py                       # one CUDA GPU: nccl process group, bf16-mixed
    python benchmarks/gpu_h200.py --accelerator cpu --model tiny --seq-len 64 --micro-batch 2 --steps 4

1. Parity: the `tiny` model in fp32, `--parity-steps` AdamW steps through `TP3DStrategy` on one process
   (on a GPU its process groups are NCCL) and the same steps in a plain PyTorch loop on the same device:
   the largest loss difference (fp32 target: 1e-5).
2. Throughput: `--model` (default `1b`: the TinyLlama-1.1B shape, hidden 2048, MLP 5632, 22 layers,
   32 heads, 4 kv heads, vocabulary 32,000) under `--precision` on random tokens of `--seq-len`; the
   median step time after `--warmup` steps (device-synchronised), tokens per second, model FLOPs per
   token from `ledger.training_flops_per_token` (6 x matmul parameters + 12 x layers x hidden x
   sequence), MFU against `--peak-tflops` (989 for an H200's dense bf16; MFU is left out on a CPU
   unless given), and the peak allocated memory against `training_ledger`'s total for this layout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common import StepRecorder, benchmark_trainer

from lightning_tp3d import ModelConfig, TP3DStrategy
from lightning_tp3d.config import resolve_model_config
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.layout import ParallelLayout
from lightning_tp3d.ledger import TrainingOptions, training_flops_per_token, training_ledger
from lightning_tp3d.models import CausalLMModule

ONE_BILLION = ModelConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                          num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)
H200_BF16_DENSE_TFLOPS = 989.0


def parity(accelerator: str, steps: int) -> dict[str, Any]:
    """TP3DStrategy at (1, 1, 1) vs a plain loop: the same initial weights (the module's seeded CPU init,
    then moved), the batches the Trainer trained on, the same AdamW."""
    recorder = StepRecorder(keep_batches=True)
    trainer = benchmark_trainer(1, TP3DStrategy(), steps, [recorder], accelerator, precision="32-true")
    trainer.fit(CausalLMModule("tiny"), TokenDataModule(seq_len=64, batch_size=4))
    device = trainer.strategy.root_device
    reference = CausalLMModule("tiny")
    reference.configure_model()
    network = reference.model.to(device)
    optimizer = reference.configure_optimizers()
    losses = []
    for batch in recorder.batches:
        optimizer.zero_grad()
        loss = network(batch["input_ids"].to(device), labels=batch["labels"].to(device))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"backend": torch.distributed.get_backend(), "tp3d_losses": recorder.losses, "reference_losses": losses,
            "max_loss_difference": max(abs(a - b) for a, b in zip(recorder.losses, losses))}


def _model_config(name: str) -> ModelConfig:
    return ONE_BILLION if name == "1b" else resolve_model_config(name)


def throughput(args: argparse.Namespace, token_file: Path) -> dict[str, Any]:
    config = _model_config(args.model)
    recorder = StepRecorder()
    trainer = benchmark_trainer(1, TP3DStrategy(), args.warmup + args.steps, [recorder], args.accelerator,
                                precision=args.precision)
    data = TokenDataModule(source=str(token_file), seq_len=args.seq_len, batch_size=args.micro_batch,
                           vocab_size=config.vocab_size)
    if args.accelerator == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(CausalLMModule(config), data)
    step_seconds = statistics.median(recorder.seconds[args.warmup:])
    tokens_per_second = args.micro_batch * args.seq_len / step_seconds
    flops_per_token = training_flops_per_token(config, args.seq_len)
    ledger = training_ledger(config, ParallelLayout(micro_batch_size=args.micro_batch),
                             TrainingOptions(seq_len=args.seq_len, precision=args.precision))
    result: dict[str, Any] = {
        "parameters": config.num_parameters(), "precision": args.precision, "seq_len": args.seq_len,
        "micro_batch": args.micro_batch, "median_step_seconds": step_seconds, "tokens_per_second": tokens_per_second,
        "flops_per_token": flops_per_token, "model_tflops_per_second": tokens_per_second * flops_per_token / 1e12,
        "losses": recorder.losses, "ledger_peak_bytes": ledger.peak_stage.total_bytes,
    }
    peak_tflops = args.peak_tflops or (H200_BF16_DENSE_TFLOPS if args.accelerator == "cuda" else None)
    if peak_tflops:
        result["mfu"] = result["model_tflops_per_second"] / peak_tflops
    if args.accelerator == "cuda":
        result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        result["peak / ledger"] = result["peak_allocated_bytes"] / ledger.peak_stage.total_bytes
        result["device"] = torch.cuda.get_device_name()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--model", default="1b", help="`1b` or a preset name / config.json path")
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "bf16-true", "32-true"])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--parity-steps", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: H200 bf16)")
    parser.add_argument("--output", default="benchmarks/gpu_h200.json")
    args = parser.parse_args()
    results: dict[str, Any] = {"torch": torch.__version__, "parity": parity(args.accelerator, args.parity_steps)}
    print(f"parity ({results['parity']['backend']}): max loss difference {results['parity']['max_loss_difference']:.2e}")
    with tempfile.TemporaryDirectory() as folder:
        token_file = Path(folder) / "tokens.npy"
        tokens_needed = (args.warmup + args.steps + 1) * args.micro_batch * (args.seq_len + 1) * 2
        vocab = _model_config(args.model).vocab_size
        np.save(token_file, np.random.default_rng(0).integers(0, vocab, tokens_needed, dtype=np.int64))
        results["throughput"] = throughput(args, token_file)
    run = results["throughput"]
    print(f"{run['parameters'] / 1e6:,.1f}M parameters, {args.precision}, b={args.micro_batch} s={args.seq_len}:"
          f" {run['median_step_seconds'] * 1e3:.1f} ms/step, {run['tokens_per_second']:,.0f} tokens/s,"
          f" {run['model_tflops_per_second']:.1f} model TFLOP/s" + (f", MFU {run['mfu']:.1%}" if "mfu" in run else ""))
    if "peak_allocated_bytes" in run:
        print(f"peak allocated {run['peak_allocated_bytes'] / 2**30:.1f} GiB, ledger {run['ledger_peak_bytes'] / 2**30:.1f}"
              f" GiB (ratio {run['peak / ledger']:.3f})")
    Path(args.output).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
