"""GPU acceptance: everything a run needs, on one GPU in under 10 minutes, through `TP3DStrategy` over NCCL.

    python benchmarks/gpu_acceptance.py                                # one CUDA GPU, writes gpu_acceptance.json
    torchrun --nproc-per-node 8 benchmarks/gpu_acceptance.py --layout 2 2 2   # the same at (tp, pp, dp)
    python benchmarks/gpu_acceptance.py --accelerator cpu --model tiny --seq-len 64 --micro-batch 2 \
        --warmup 1 --steps 2 --parity-steps 2                          # CPU smoke run (CI)

Stages (each records `passed` in the JSON, with its figures):

1. parity: the `tiny` model in fp32, `--parity-steps` AdamW steps through the strategy (NCCL groups on a
   GPU) against a plain PyTorch loop on one device from the same initial weights (target: 1e-5 on every
   loss; at a layout with tp or pp > 1 the reduction order differs: 1e-4).
2. autocast: `bf16-mixed` and `16-mixed` (TP3DPrecision, the model-parallel GradScaler) proven by the dtype
   a forward hook sees at a q projection's output (bf16 / fp16, not fp32).
3. lifecycle: fit 3 steps with a checkpoint at step 2, resume from it (step 3 must repeat the
   uninterrupted run's loss exactly), validate, predict, `tp3d export` of the checkpoint and `tp3d check` of the export
   against the checkpoint.
4. timing: `DeviceInterval` (the clock of the doctor and pipeline timings) against `torch.cuda.Event`
   around the same matmuls, and the host clock without synchronisation (what the timings would be
   without events); the doctor's table when the world has more than one rank.
5. throughput: `--model` (default `1b`: the TinyLlama-1.1B shape, hidden 2048, MLP 5632, 22 layers, 32
   heads, 4 kv heads, vocabulary 32,000) under `--precision` on random tokens of `--seq-len`; the median
   step time after `--warmup` steps (device-synchronised), tokens per second, model FLOPs per token
   (`ledger.training_flops_per_token`), MFU against the device's dense peak for that precision
   (`dense_peak_tflops`: H100 / H200 SXM or NVL by device name, or `--peak-tflops`), and the peak
   allocated memory against `training_ledger`'s total for this layout.
6. compile: `TP3DStrategy(compile=True)` (each block through `torch.compile`, inductor): the `tiny` model
   in fp32 for `--parity-steps` steps compiled against the same steps eager through the strategy (target:
   1e-4 on every loss, the compiled parity suite's bound) with no graph break (dynamo's counters); then the
   throughput stage's model compiled: its figures, and compiled / eager median step time (issue target on
   one H200: MFU >= 45% for the 1.1B model in bf16-mixed, peak / ledger <= 1.05).
7. float8: the throughput model with `float8="tensorwise"` and compiled blocks (torchao's Float8Linear;
   FP8 matmuls need compute capability 8.9): its figures and FP8 / bf16 tokens per second against the
   compile stage (issue target on one H200: >= 1.3x).
8. overhead (one device only): `--overhead-rounds` paired rounds of the throughput model under
   Lightning's own single-device strategy and under `TP3DStrategy` at (1, 1, 1), order alternating; the
   median of the per-round ratios of median step times (tp3d / Lightning).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_tp3d import ModelConfig, TP3DStrategy
from lightning_tp3d._compat.torch import dynamo_counters
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.diagnostics.consistency import exact_fp32_matmuls
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.parallel.timing import DeviceInterval
from lightning_tp3d.plan.config import resolve_model_config
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.ledger import TrainingOptions, training_flops_per_token, training_ledger
from lightning_tp3d.strategies.precision import TP3DPrecision

from common import StepRecorder, benchmark_trainer

ONE_BILLION = ModelConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                          num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)
# Dense (no sparsity) tensor-core peaks in TFLOP/s from NVIDIA's data sheets; "32-true" runs fp32 matmuls
# on TF32 tensor cores only when allowed, so its peak is the plain fp32 one.
_DENSE_PEAKS = {
    "H200 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
}


def dense_peak_tflops(device_name: str, precision: str) -> float | None:
    """The dense peak of `device_name` (as torch names it) for `precision`, or None when unknown."""
    kind = "fp32" if precision == "32-true" else "fp16" if precision.startswith("16") else "bf16"
    for part, peaks in _DENSE_PEAKS.items():  # the most specific names come first
        if part in device_name:
            return peaks[kind]
    return None


def _strategy(args: argparse.Namespace, compiled: bool = False, float8: str | None = None) -> TP3DStrategy:
    tp, pp, dp = args.layout
    return TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp, compile=compiled,
                        float8=float8)


def _devices(args: argparse.Namespace) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", math.prod(args.layout)))


def parity(args: argparse.Namespace) -> dict[str, Any]:
    """The strategy against a plain loop: the same initial weights (layout-independent seeded init), the
    batches the Trainer trained on, the same AdamW. Only at (1, 1, 1): elsewhere each rank sees part of
    the batch."""
    if math.prod(args.layout) > 1:
        return {"skipped": "parity runs at layout (1, 1, 1); run the script on one GPU for it"}
    recorder = StepRecorder(keep_batches=True)
    trainer = benchmark_trainer(1, _strategy(args), args.parity_steps, [recorder], args.accelerator,
                                precision="32-true")
    trainer.fit(CausalLMModule("tiny"), TokenDataModule(seq_len=64, batch_size=4))
    device = trainer.strategy.root_device
    reference = CausalLMModule("tiny")
    reference.configure_model()
    network = reference.model.to(device)
    optimizer = reference.configure_optimizers()
    losses = []
    with exact_fp32_matmuls():
        for batch in recorder.batches:
            optimizer.zero_grad()
            loss = network(batch["input_ids"].to(device), labels=batch["labels"].to(device))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    difference = max(abs(a - b) for a, b in zip(recorder.losses, losses))
    return {"backend": torch.distributed.get_backend(), "tp3d_losses": recorder.losses, "reference_losses": losses,
            "max_loss_difference": difference, "passed": difference <= 1e-5}


class _OutputDtype(Callback):
    """The dtype of the first layer's q projection output in the first training step."""

    def __init__(self) -> None:
        self.dtypes: list[str] = []

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        for name, submodule in trainer.strategy.network.named_modules():
            if name.endswith("self_attn.q_proj"):
                submodule.register_forward_hook(lambda _m, _i, output: self.dtypes.append(str(output.dtype)))
                return


def autocast(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for precision, expected in (("bf16-mixed", "torch.bfloat16"), ("16-mixed", "torch.float16")):
        probe = _OutputDtype()
        trainer = benchmark_trainer(_devices(args), _strategy(args), 2, [probe], args.accelerator,
                                    plugins=[TP3DPrecision(precision)])
        trainer.fit(CausalLMModule("tiny"), TokenDataModule(seq_len=64, batch_size=4))
        result[precision] = {"q_proj_output_dtypes": sorted(set(probe.dtypes)),
                             "passed": bool(probe.dtypes) and set(probe.dtypes) == {expected}}
    result["passed"] = all(entry["passed"] for entry in result.values())
    return result


def _lifecycle_trainer(args: argparse.Namespace, steps: int, callbacks: list[Callback]) -> L.Trainer:
    return L.Trainer(accelerator=args.accelerator, devices=_devices(args), strategy=_strategy(args), max_steps=steps,
                     logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                     limit_val_batches=2, num_sanity_val_steps=1)


def lifecycle(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """fit (checkpoint at step 2) -> exact resume from step 2 -> validate -> predict -> export -> check."""
    from lightning_tp3d.cli import main as tp3d

    def data() -> TokenDataModule:
        return TokenDataModule(seq_len=32, batch_size=2)

    straight = StepRecorder()
    saver = ModelCheckpoint(dirpath=folder, filename="step2", every_n_train_steps=2, save_top_k=1, monitor=None)
    _lifecycle_trainer(args, 3, [straight, saver]).fit(CausalLMModule("tiny"), data())
    checkpoint = folder / "step2.ckpt"
    resumed = StepRecorder()
    trainer = _lifecycle_trainer(args, 3, [resumed])
    module = CausalLMModule("tiny")
    trainer.fit(module, data(), ckpt_path=checkpoint)
    validation = trainer.validate(module, data(), verbose=False)[0]["val_loss"]
    predictions = trainer.predict(module, data())
    result: dict[str, Any] = {
        "straight_losses": straight.losses, "resumed_losses": resumed.losses,
        "validation_loss": validation, "predicted_batches": len(predictions),
        "prediction_shape": list(predictions[0].shape),
    }
    result["exact_resume"] = result["straight_losses"][2:] == result["resumed_losses"]  # step 3 after step 2
    export = folder / "export"
    result["export_exit_code"] = tp3d(["export", str(checkpoint), str(export)]) if trainer.is_global_zero else 0
    result["check_exit_code"] = tp3d(["check", str(export), "--checkpoint", str(checkpoint)]) \
        if trainer.is_global_zero else 0
    result["passed"] = (result["exact_resume"] and math.isfinite(validation) and result["export_exit_code"] == 0
                        and result["check_exit_code"] == 0)
    return result


def timing(args: argparse.Namespace) -> dict[str, Any]:
    """`DeviceInterval` against CUDA events and the unsynchronised host clock on the same matmuls."""
    device = torch.device("cuda" if args.accelerator == "cuda" else "cpu")
    a = torch.randn(2048, 2048, device=device)
    a @ a  # warm up the kernels
    interval = DeviceInterval(device.type)
    started = time.perf_counter()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    for _ in range(20):
        a = (a @ a) / 2048**0.5
    host_seconds = time.perf_counter() - started
    interval.stop()
    result: dict[str, Any] = {"device_interval_seconds": interval.seconds, "host_clock_seconds": host_seconds}
    if device.type == "cuda":
        end.record()
        end.synchronize()
        result["cuda_event_seconds"] = start.elapsed_time(end) / 1e3
        result["passed"] = abs(result["device_interval_seconds"] / result["cuda_event_seconds"] - 1) < 0.05
    else:
        result["passed"] = result["device_interval_seconds"] >= host_seconds
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        from lightning_tp3d.diagnostics.doctor import run_doctor
        from lightning_tp3d.parallel.mesh import build_device_mesh

        layout = ParallelLayout.resolve(world_size=torch.distributed.get_world_size(),
                                        tensor_parallel_size=args.layout[0], pipeline_parallel_size=args.layout[1])
        result["doctor"] = run_doctor(layout, build_device_mesh(layout, device.type)).to_dict()
    return result


def _model_config(name: str) -> ModelConfig:
    return ONE_BILLION if name == "1b" else resolve_model_config(name)


def _timed_fit(args: argparse.Namespace, strategy: Any, token_file: Path, warmup: int, steps: int) -> StepRecorder:
    """Fit the `--model` for `warmup + steps` steps on the random tokens; the recorder holds each step."""
    config = _model_config(args.model)
    recorder = StepRecorder()
    trainer = benchmark_trainer(_devices(args), strategy, warmup + steps, [recorder], args.accelerator,
                                precision=args.precision)
    data = TokenDataModule(source=str(token_file), seq_len=args.seq_len, batch_size=args.micro_batch,
                           vocab_size=config.vocab_size)
    trainer.fit(CausalLMModule(config), data)
    return recorder


def throughput(args: argparse.Namespace, token_file: Path, compiled: bool = False,
               float8: str | None = None) -> dict[str, Any]:
    config = _model_config(args.model)
    if args.accelerator == "cuda":
        torch.cuda.reset_peak_memory_stats()
    recorder = _timed_fit(args, _strategy(args, compiled, float8), token_file, args.warmup, args.steps)
    step_seconds = statistics.median(recorder.seconds[args.warmup:])
    tokens_per_second = args.micro_batch * args.seq_len / step_seconds
    flops_per_token = training_flops_per_token(config, args.seq_len)
    tp, pp, dp = args.layout
    layout = ParallelLayout(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                            micro_batch_size=args.micro_batch)
    ledger = training_ledger(config, layout, TrainingOptions(seq_len=args.seq_len, precision=args.precision))
    result: dict[str, Any] = {
        "parameters": config.num_parameters(), "precision": args.precision, "seq_len": args.seq_len,
        "micro_batch": args.micro_batch, "median_step_seconds": step_seconds,
        "tokens_per_second_per_rank": tokens_per_second, "flops_per_token": flops_per_token,
        "model_tflops_per_second_per_rank": tokens_per_second * flops_per_token / 1e12 / (tp * pp),
        "losses": recorder.losses, "ledger_peak_bytes": ledger.peak_stage.total_bytes,
    }
    peak_tflops = args.peak_tflops
    if args.accelerator == "cuda":
        result["device"] = torch.cuda.get_device_name()
        peak_tflops = peak_tflops or dense_peak_tflops(result["device"], args.precision)
        result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        result["peak / ledger"] = result["peak_allocated_bytes"] / ledger.peak_stage.total_bytes
    if peak_tflops:
        result["peak_tflops"] = peak_tflops
        result["mfu"] = result["model_tflops_per_second_per_rank"] / peak_tflops
    result["passed"] = all(math.isfinite(loss) for loss in recorder.losses)
    return result


def compiled(args: argparse.Namespace, token_file: Path, eager: dict[str, Any]) -> dict[str, Any]:
    """Compiled against eager through the strategy: parity on the tiny model, then the throughput model."""
    losses = {}
    dynamo_counters().clear()
    for compiled_blocks in (False, True):
        recorder = StepRecorder()
        trainer = benchmark_trainer(_devices(args), _strategy(args, compiled_blocks), args.parity_steps, [recorder],
                                    args.accelerator, precision="32-true")
        trainer.fit(CausalLMModule("tiny"), TokenDataModule(seq_len=64, batch_size=4))
        losses[compiled_blocks] = recorder.losses
    graph_breaks = dict(dynamo_counters()["graph_break"])
    relative = max(abs(a - b) / abs(b) for a, b in zip(losses[True], losses[False], strict=True))
    run = throughput(args, token_file, compiled=True)
    run.update({"parity_eager_losses": losses[False], "parity_compiled_losses": losses[True],
                "parity_max_relative_difference": relative, "graph_breaks": graph_breaks,
                "compiled / eager step": run["median_step_seconds"] / eager["median_step_seconds"]})
    run["passed"] = run["passed"] and relative <= 1e-4 and not graph_breaks
    return run


def float8(args: argparse.Namespace, token_file: Path, compiled_run: dict[str, Any]) -> dict[str, Any]:
    """The throughput model in FP8 (tensorwise, compiled) against the compiled run in `--precision`."""
    if args.accelerator == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        return {"skipped": f"{torch.cuda.get_device_name()} has no FP8 matmuls (compute capability < 8.9)"}
    run = throughput(args, token_file, compiled=True, float8="tensorwise")
    run["float8 / compiled tokens per second"] = (run["tokens_per_second_per_rank"]
                                                  / compiled_run["tokens_per_second_per_rank"])
    return run


def overhead(args: argparse.Namespace, token_file: Path) -> dict[str, Any]:
    """Paired rounds: Lightning's single-device strategy and `TP3DStrategy` at (1, 1, 1) back to back."""
    if _devices(args) > 1 or args.overhead_rounds == 0:
        return {"skipped": "paired against Lightning's single-device strategy on one device only"}
    rounds = []
    for index in range(args.overhead_rounds):
        runs = {}
        order = ("lightning", "tp3d") if index % 2 == 0 else ("tp3d", "lightning")
        for name in order:
            strategy = "auto" if name == "lightning" else _strategy(args)
            recorder = _timed_fit(args, strategy, token_file, 3, args.overhead_steps)
            runs[name] = statistics.median(recorder.seconds[3:])
        rounds.append({"lightning_seconds": runs["lightning"], "tp3d_seconds": runs["tp3d"],
                       "ratio": runs["tp3d"] / runs["lightning"]})
    ratio = statistics.median(entry["ratio"] for entry in rounds)
    return {"median_ratio": ratio, "rounds": rounds}  # a measurement, reported beside the pass / fail stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--layout", type=int, nargs=3, default=[1, 1, 1], metavar=("TP", "PP", "DP"),
                        help="(tp, pp, dp); a world above 1 is launched with torchrun")
    parser.add_argument("--model", default="1b", help="`1b` or a preset name / config.json path")
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "bf16-true", "32-true"])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--parity-steps", type=int, default=5)
    parser.add_argument("--overhead-rounds", type=int, default=2, help="paired rounds against Lightning (0: skip)")
    parser.add_argument("--overhead-steps", type=int, default=8, help="timed steps per run in those rounds")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: by name)")
    parser.add_argument("--output", default="gpu_acceptance.json")
    args = parser.parse_args()
    results: dict[str, Any] = {"command": sys.argv, "torch": torch.__version__, "layout": args.layout}
    results["parity"] = parity(args)
    results["autocast"] = autocast(args)
    with tempfile.TemporaryDirectory() as folder:
        results["lifecycle"] = lifecycle(args, Path(folder))
        results["timing"] = timing(args)
        token_file = Path(folder) / "tokens.npy"
        steps = max(args.warmup + args.steps, 3 + args.overhead_steps) + 1
        tokens_needed = steps * args.micro_batch * (args.seq_len + 1) * 2 * args.layout[2]
        vocab = _model_config(args.model).vocab_size
        np.save(token_file, np.random.default_rng(0).integers(0, vocab, tokens_needed, dtype=np.int64))
        results["throughput"] = throughput(args, token_file)
        results["compile"] = compiled(args, token_file, results["throughput"])
        results["float8"] = float8(args, token_file, results["compile"])
        results["overhead"] = overhead(args, token_file)
    stages = [name for name in ("parity", "autocast", "lifecycle", "timing", "throughput", "compile", "float8",
                                "overhead")
              if "passed" in results[name]]
    results["passed"] = all(results[name]["passed"] for name in stages)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        for name in stages:
            print(f"{name:<10} {'PASS' if results[name]['passed'] else 'FAIL'}")
        run = results["throughput"]
        print(f"{run['parameters'] / 1e6:,.1f}M parameters, {args.precision}: {run['median_step_seconds'] * 1e3:.1f}"
              f" ms/step, {run['tokens_per_second_per_rank']:,.0f} tokens/s per rank"
              + (f", MFU {run['mfu']:.1%}" if "mfu" in run else ""))
        run = results["compile"]
        print(f"compiled: {run['median_step_seconds'] * 1e3:.1f} ms/step ({run['compiled / eager step']:.3f} of eager)"
              + (f", MFU {run['mfu']:.1%}" if "mfu" in run else "")
              + (f", peak / ledger {run['peak / ledger']:.3f}" if "peak / ledger" in run else ""))
        if "passed" in results["float8"]:
            run = results["float8"]
            print(f"float8: {run['median_step_seconds'] * 1e3:.1f} ms/step, FP8 / compiled tokens per second"
                  f" {run['float8 / compiled tokens per second']:.3f}"
                  + (f", MFU {run['mfu']:.1%}" if "mfu" in run else ""))
        if "median_ratio" in results["overhead"]:
            print(f"step time tp3d / Lightning single device: {results['overhead']['median_ratio']:.3f} (rounds "
                  + ", ".join(f"{entry['ratio']:.3f}" for entry in results["overhead"]["rounds"]) + ")")
        Path(args.output).write_text(json.dumps(results, indent=2))
    sys.exit(0 if results["passed"] else 1)


if __name__ == "__main__":
    main()
