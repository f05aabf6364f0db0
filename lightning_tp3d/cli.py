"""The `tp3d` command.

    tp3d plan deepseek-llm-7b --tp 8 --pp 4 --dp 2 --micro-batch-size 1 --num-microbatches 8
    tp3d plan path/to/config.json --tp 2 --json

`plan` validates a layout against a model (a preset or a Hugging Face config.json) and prints the
per-rank memory ledger for training and the serving alignment, without starting any process.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from lightning_tp3d.config import MODEL_PRESETS, resolve_model_config
from lightning_tp3d.layout import LayoutError, ParallelLayout
from lightning_tp3d.ledger import PRECISIONS, TrainingOptions, serving_ledger, training_ledger

__all__ = ["main"]

_GIB = 1024**3


def _gib(value: int) -> str:
    return f"{value / _GIB:9.2f}"


def _plan_parser(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser("plan", help="validate a layout and print the memory ledger")
    plan.add_argument("model", help=f"a preset ({', '.join(MODEL_PRESETS)}) or a Hugging Face config.json path")
    plan.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    plan.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    plan.add_argument("--dp", type=int, default=1, help="data parallel size")
    plan.add_argument("--micro-batch-size", type=int, default=1)
    plan.add_argument("--num-microbatches", type=int, default=None, help="per step (default: pp)")
    plan.add_argument("--gradient-accumulation-steps", type=int, default=1)
    plan.add_argument("--seq-len", type=int, default=4096)
    plan.add_argument("--precision", choices=sorted(PRECISIONS), default="bf16-mixed")
    plan.add_argument("--recompute", choices=["none", "full", "selective"], default="none")
    plan.add_argument("--recompute-method", choices=["uniform", "block"], default="uniform",
                      help="uniform: every N-th layer; block: the first N layers of each stage")
    plan.add_argument("--recompute-num-layers", type=int, default=1, metavar="N")
    plan.add_argument("--dp-mode", choices=["replicate", "fsdp"], default="replicate")
    plan.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    plan.add_argument("--serve-seq-len", type=int, default=None, help="serving sequence length (default: --seq-len)")
    plan.add_argument("--serve-num-seqs", type=int, default=1, help="concurrent serving sequences")
    plan.add_argument("--serve-dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    plan.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _run_plan(args: argparse.Namespace) -> int:
    config = resolve_model_config(args.model)
    layout = ParallelLayout(
        tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, data_parallel_size=args.dp,
        micro_batch_size=args.micro_batch_size, num_microbatches=args.num_microbatches or args.pp,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
    )
    options = TrainingOptions(seq_len=args.seq_len, precision=args.precision, recompute=args.recompute,
                              data_parallel_mode=args.dp_mode, schedule=args.schedule,
                              recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers)
    training = training_ledger(config, layout, options)
    serving = serving_ledger(config, args.serve_seq_len or args.seq_len, args.serve_num_seqs, args.serve_dtype)
    if args.json:
        print(json.dumps({"model": config.to_dict(), "training": training.to_dict(), "serving": serving.to_dict()},
                         indent=2))
        return 0
    print(f"model {args.model}: {config.num_parameters():,} parameters ({config.num_parameters() / 1e9:.2f}e9)")
    print(f"layout tp={layout.tensor_parallel_size} pp={layout.pipeline_parallel_size} dp={layout.data_parallel_size}"
          f" -> {layout.world_size} ranks; global batch {layout.global_batch_size} sequences of {args.seq_len} tokens")
    recompute = args.recompute if args.recompute == "none" else (
        f"{args.recompute} ({args.recompute_method}, N={args.recompute_num_layers})")
    print(f"training {args.precision}, recompute={recompute}, dp mode={args.dp_mode}, schedule={args.schedule}")
    print(f"{'stage':>5} {'layers':>9} {'params/rank':>14} {'weights':>9} {'grads':>9} {'optim':>9} "
          f"{'activ':>9} {'total GiB':>9}")
    for stage in training.stages:
        layers = f"{stage.first_layer}-{stage.first_layer + stage.num_layers - 1}"
        print(f"{stage.stage:>5} {layers:>9} {stage.parameters:>14,} {_gib(stage.weight_bytes)}"
              f" {_gib(stage.gradient_bytes)} {_gib(stage.optimizer_bytes)} {_gib(stage.activation_bytes)}"
              f" {_gib(stage.total_bytes)}")
    print(f"peak per rank: {training.peak_stage.total_bytes / _GIB:.2f} GiB (stage {training.peak_stage.stage})")
    print(f"serving {serving.dtype}, pipeline stages merged: KV cache {serving.kv_bytes_per_token:,} B/token,"
          f" {serving.kv_bytes_per_sequence / _GIB:.2f} GiB per {serving.seq_len}-token sequence,"
          f" {serving.kv_bytes_total / _GIB:.2f} GiB for {serving.num_seqs} sequences")
    print(f"{'deploy tp':>9} {'weights/GPU GiB':>16} {'KV B/token/GPU':>15}  note")
    for option in serving.options:
        if option.valid:
            print(f"{option.tensor_parallel_size:>9} {_gib(option.weight_bytes_per_gpu):>16}"
                  f" {option.kv_bytes_per_token_per_gpu:>15,}  ok")
        else:
            print(f"{option.tensor_parallel_size:>9} {'-':>16} {'-':>15}  invalid: {option.reason}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tp3d", description="3-D parallel training for Lightning")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _plan_parser(subparsers)
    args = parser.parse_args(argv)
    try:
        return _run_plan(args)
    except (LayoutError, ValueError, FileNotFoundError) as error:
        print(f"tp3d {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
