"""GPU memory against the ledger, term by term, on one GPU (what `gpu_acceptance.py` found 1.21x over).

    python benchmarks/gpu_memory.py                    # one CUDA GPU, writes gpu_memory.json

The 1.1B model of `gpu_acceptance.py` trains 3 steps under `TP3DStrategy` at (1, 1, 1) in `--precision` at
micro-batches of 2, 4 and 8 sequences of `--seq-len` (each fit's figures net of what was allocated before
it). After the last step the memory still allocated is
the static part (weights, gradients, AdamW state: the ledger's weight + gradient + optimizer bytes);
the peak minus that is what a step adds, whose slope over the micro-batch size is the activations per
sequence (the ledger's activation term / b) and whose intercept is what does not grow with the batch.

With `--precision 32-true` it first checks the model's fp32 attention on CUDA (k, v repeated per q head so
SDPA's memory-efficient kernel runs, `models.llama.Attention.core_attention`) against SDPA's grouped-query
call on the same inputs: the largest difference and each one's peak memory for a forward and backward.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from lightning_tp3d import TP3DStrategy
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.models.llama import Attention
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.ledger import TrainingOptions, training_ledger

from common import benchmark_trainer
from gpu_acceptance import ONE_BILLION


class _Allocated(Callback):
    """The memory allocated after the last step (gradients zeroed) and the peak of the last step."""

    def __init__(self) -> None:
        self.static = self.peak = 0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated()
        self.static = torch.cuda.memory_allocated()


def _run(micro_batch: int, args: argparse.Namespace, token_file: Path) -> dict[str, Any]:
    gc.collect()  # the previous fit's trainer, module and optimizer are reference cycles
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    probe = _Allocated()
    trainer = benchmark_trainer(1, TP3DStrategy(), 3, [probe], "cuda", precision=args.precision)
    data = TokenDataModule(source=str(token_file), seq_len=args.seq_len, batch_size=micro_batch,
                           vocab_size=ONE_BILLION.vocab_size)
    trainer.fit(CausalLMModule(ONE_BILLION), data)
    stage = training_ledger(ONE_BILLION, ParallelLayout(micro_batch_size=micro_batch),
                            TrainingOptions(seq_len=args.seq_len, precision=args.precision)).stages[0]
    result = {"micro_batch": micro_batch, "peak_bytes": probe.peak - before, "static_bytes": probe.static - before,
              "ledger": {"weights": stage.weight_bytes, "gradients": stage.gradient_bytes,
                         "optimizer": stage.optimizer_bytes, "activations": stage.activation_bytes,
                         "total": stage.total_bytes}}
    return result


def _attention_check(seq_len: int) -> dict[str, Any]:
    """fp32 grouped-query attention, TinyLlama-1.1B's heads (32 q, 4 kv, d 64), one sequence."""
    attention = Attention(ONE_BILLION).cuda()
    generator = torch.Generator("cuda").manual_seed(0)
    shapes = {"q": 32, "k": 4, "v": 4}
    inputs = {name: torch.randn(1, heads, seq_len, 64, device="cuda", generator=generator)
              for name, heads in shapes.items()}
    result: dict[str, Any] = {}
    for name, attend in (("repeated_kv", attention.core_attention),
                         ("grouped_query", lambda q, k, v: F.scaled_dot_product_attention(
                             q, k, v, is_causal=True, enable_gqa=True))):
        tensors = {key: value.clone().requires_grad_() for key, value in inputs.items()}
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        output = attend(tensors["q"], tensors["k"], tensors["v"])
        output.sum().backward()
        torch.cuda.synchronize()
        result[name] = {"output": output.detach(), "q_grad": tensors["q"].grad,
                        "peak_bytes": torch.cuda.max_memory_allocated() - before}
    difference = max((result["repeated_kv"][key] - result["grouped_query"][key]).abs().max().item()
                     for key in ("output", "q_grad"))
    return {"max_difference": difference, "repeated_kv_peak_bytes": result["repeated_kv"]["peak_bytes"],
            "grouped_query_peak_bytes": result["grouped_query"]["peak_bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "32-true", "bf16-true"])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--output", default="gpu_memory.json")
    args = parser.parse_args()
    attention = _attention_check(args.seq_len) if args.precision == "32-true" else None
    if attention is not None:
        print(f"fp32 attention, s={args.seq_len}: repeated k/v vs SDPA grouped-query max difference"
              f" {attention['max_difference']:.2e}; peak {attention['repeated_kv_peak_bytes'] / 1e6:.0f} MB vs"
              f" {attention['grouped_query_peak_bytes'] / 1e6:.0f} MB")
    token_file = Path("/tmp/gpu_memory_tokens.npy")
    needed = 4 * max(args.micro_batches) * (args.seq_len + 1) * 2
    np.save(token_file, np.random.default_rng(0).integers(0, ONE_BILLION.vocab_size, needed, dtype=np.int64))
    runs = [_run(micro_batch, args, token_file) for micro_batch in args.micro_batches]
    batches = np.array([run["micro_batch"] for run in runs], dtype=float)
    added = np.array([run["peak_bytes"] - run["static_bytes"] for run in runs], dtype=float)
    slope, intercept = np.polyfit(batches, added, 1)
    ledger_slope = runs[-1]["ledger"]["activations"] / runs[-1]["micro_batch"]
    static_ledger = sum(runs[-1]["ledger"][kind] for kind in ("weights", "gradients", "optimizer"))
    result = {"command": [sys.executable, *sys.argv], "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "precision": args.precision, "seq_len": args.seq_len, "runs": runs,
              "activation_bytes_per_sequence": slope, "ledger_activation_bytes_per_sequence": ledger_slope,
              "activation_ratio": slope / ledger_slope, "step_intercept_bytes": intercept,
              "static_bytes": runs[-1]["static_bytes"], "ledger_static_bytes": static_ledger,
              "static_ratio": runs[-1]["static_bytes"] / static_ledger, "attention_check": attention}
    print(f"{result['device']}, {args.precision}, s={args.seq_len}")
    for run in runs:
        print(f"b={run['micro_batch']}: peak {run['peak_bytes'] / 1e9:.2f} GB (ledger"
              f" {run['ledger']['total'] / 1e9:.2f}), static {run['static_bytes'] / 1e9:.2f} GB")
    print(f"static {result['static_bytes'] / 1e9:.2f} GB vs ledger {static_ledger / 1e9:.2f} GB"
          f" ({result['static_ratio']:.3f}x); activations {slope / 1e9:.3f} GB per sequence vs ledger"
          f" {ledger_slope / 1e9:.3f} ({result['activation_ratio']:.3f}x); per-step constant {intercept / 1e9:.2f} GB")
    Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
