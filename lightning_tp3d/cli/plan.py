"""`tp3d plan`: validate a layout against a model and print its ledgers, or size a server, or advise a layout.

    tp3d plan deepseek-llm-7b --tp 8 --pp 4 --dp 2 --num-microbatches 8 --seq-len 4096
    tp3d plan deepseek-llm-7b --tp 8 --pp 4 --dp 2 --bandwidth tp=150GB pp=25GB dp=25GB --json
    tp3d plan deepseek-llm-67b --serve --gpu-memory 80GiB --max-model-len 4096 --deploy-tp 4 8
    tp3d plan deepseek-v3 --tp 8 --pp 16 --dp 64 --ep 8 --num-microbatches 32 --precision bf16-mixed

Training: the per-rank memory ledger (`plan.ledger`), the pipeline bubble and the communication ledger
(`plan.communication`: calls and bytes per step for each of the tp, pp and dp groups, with times on the
given links). Serving (`--serve`, `cli.serving`): weights and KV cache per GPU for each deploy
tensor-parallel size and the vLLM command line. A DeepSeek mixture-of-experts model (`--ep`): its parameters
and the expert-parallel all-to-alls, or its servers with vLLM's expert parallelism (`cli.plan_experts`).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from dataclasses import asdict

from lightning_tp3d.cli.communication import GPUS_PER_NODE, communication_lines, given_bandwidths
from lightning_tp3d.cli.memory import byte_unit, memory_lines
from lightning_tp3d.cli.plan_experts import run_moe_plan
from lightning_tp3d.cli.serving import print_serving_plan
from lightning_tp3d.plan.advisor import Cluster, advise
from lightning_tp3d.plan.communication import (
    EXPERT_DATA_GROUP,
    EXPERT_GROUP,
    GROUPS,
    communication_ledger,
    group_bandwidths,
)
from lightning_tp3d.plan.config import MODEL_PRESETS, ModelConfig, resolve_model_config
from lightning_tp3d.plan.data_parallel import DATA_PARALLEL_MODES
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.ledger import PRECISIONS, TrainingOptions, training_ledger
from lightning_tp3d.plan.lora import DEFAULT_LORA_TARGETS, LORA_TARGETS
from lightning_tp3d.plan.moe import MOE_PRESETS, MoEModelConfig, resolve_moe_config
from lightning_tp3d.plan.qlora import NF4_FORMAT, NF4Format
from lightning_tp3d.plan.schedules import BUBBLE_FORMULAS, PIPELINE_SCHEDULES, schedule_bubble_fraction
from lightning_tp3d.plan.serving import serving_ledger, serving_plan
from lightning_tp3d.plan.units import parse_size

__all__ = ["SERVING_DTYPE", "plan_parser"]

_GIB = 1024**3
_DEFAULT_SEQ_LEN = 4096
# The serving dtype that matches each training precision ("serve in the precision you trained in").
SERVING_DTYPE = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "bf16-true": "bf16",
                 "16-mixed": "fp16"}
_MICROBATCHES_PER_STAGE = 4  # m >= 4 x pp keeps the GPipe / 1F1B bubble under 20%


def _sequence_length(args: argparse.Namespace, config: ModelConfig) -> tuple[int, str]:
    """`--seq-len`, or 4096 capped to the model's positions; with the sentence that says which."""
    positions = config.max_position_embeddings
    if args.seq_len is None:
        length = min(_DEFAULT_SEQ_LEN, positions)
        capped = length < _DEFAULT_SEQ_LEN
        return length, f"\n(the model's {positions} positions; --seq-len to choose)" if capped else ""
    if args.seq_len > positions:
        raise ValueError(f"--seq-len {args.seq_len} is longer than the model's max_position_embeddings={positions};"
                         " train at most that many tokens per sequence.")
    return args.seq_len, ""


def plan_parser(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser("plan", help="validate a layout and print the memory ledger")
    plan.add_argument("model", help=f"a preset ({', '.join([*MODEL_PRESETS, *MOE_PRESETS])}) or a Hugging Face"
                                    " config.json path")
    plan.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    plan.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    plan.add_argument("--dp", type=int, default=1, help="data parallel size")
    plan.add_argument("--ep", type=int, default=1,
                      help="expert parallel size, carved out of dp (a mixture-of-experts model: deepseek-v3, ...)")
    plan.add_argument("--micro-batch-size", type=int, default=1)
    plan.add_argument("--num-microbatches", type=int, default=None, help="per step (default: pp)")
    plan.add_argument("--gradient-accumulation-steps", type=int, default=1)
    plan.add_argument("--seq-len", type=int, default=None,
                      help=f"tokens per sequence (default {_DEFAULT_SEQ_LEN}, or the model's positions if fewer)")
    plan.add_argument("--precision", choices=sorted(PRECISIONS), default="32-true",
                      help="the Trainer's precision (default 32-true, as the Trainer's; GPUs train bf16-mixed)")
    plan.add_argument("--recompute", choices=["none", "full", "selective"], default="none")
    plan.add_argument("--recompute-method", choices=["uniform", "block"], default="uniform",
                      help="uniform: every N-th layer; block: the first N layers of each stage")
    plan.add_argument("--recompute-num-layers", type=int, default=1, metavar="N")
    plan.add_argument("--dp-mode", choices=list(DATA_PARALLEL_MODES), default="replicate")
    plan.add_argument("--lora-rank", type=int, default=0, metavar="R",
                      help="a LoRA fine-tune of rank R: only the factors train (default 0: every weight trains)")
    plan.add_argument("--lora-targets", nargs="+", choices=LORA_TARGETS, default=list(DEFAULT_LORA_TARGETS),
                      metavar="NAME", help=f"the blocks' layers LoRA adapts (default {' '.join(DEFAULT_LORA_TARGETS)};"
                                           f" any of {' '.join(LORA_TARGETS)})")
    plan.add_argument("--qlora", action="store_true",
                      help="QLoRA (with --lora-rank): the blocks' projections frozen in 4-bit NF4 (blocks of 64"
                           " weights, 256 scales per factor), tp 1")
    plan.add_argument("--schedule", choices=list(PIPELINE_SCHEDULES), default="1f1b",
                      help="the pipeline schedule (TP3DStrategy's pipeline_schedule); all but gpipe and looped_bfs"
                           " need num_microbatches >= pp, dualpipev 2 x pp")
    plan.add_argument("--stages-per-rank", type=int, default=2, metavar="V",
                      help="stages on each rank for interleaved_1f1b, looped_bfs and interleaved_zero_bubble"
                           " (default 2; the V-shaped zbv_zero_bubble and dualpipev always run 2)")
    plan.add_argument("--gpus-per-node", type=int, default=None,
                      help="GPUs in a node: tp must divide it (tp groups stay on a node's NVLink)")
    plan.add_argument("--serve-seq-len", type=int, default=None, help="serving sequence length (default: --seq-len)")
    plan.add_argument("--serve-num-seqs", type=int, default=1, help="concurrent serving sequences")
    plan.add_argument("--serve-dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    serve = plan.add_argument_group("serving plan (--serve)")
    serve.add_argument("--serve", action="store_true", help="print the serving plan instead of the training ledger")
    serve.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU (default 80GiB)")
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    serve.add_argument("--max-model-len", type=int, default=None, help="tokens per sequence (default: --seq-len)")
    serve.add_argument("--deploy-tp", type=int, nargs="+", default=None, metavar="N",
                       help="deploy tensor-parallel sizes to plan (default: every valid one of 1 2 4 8 16)")
    serve.add_argument("--model-path", default=None, help="model name or folder in the vLLM command (default: MODEL)")
    links = plan.add_argument_group("communication times")
    links.add_argument("--bandwidth", nargs="+", default=[], metavar="GROUP=GB/s",
                       help="bus bandwidth of a group's links, e.g. tp=150 dp=25 (default: the doctor's floors,"
                            " 100 GB/s inside a node, 10 GB/s across nodes)")
    links.add_argument("--doctor-report", default=None, metavar="JSON",
                       help="take each group's bandwidth from a `tp3d doctor --json` report (largest message)")
    advisor = plan.add_argument_group("layout advisor (--gpus)")
    advisor.add_argument("--gpus", type=int, default=None,
                         help="rank every layout of this many GPUs (with --gpu-memory, --gpus-per-node)")
    advisor.add_argument("--global-batch-size", type=int, default=None, metavar="B",
                         help="sequences per optimizer step, over all dp ranks (required: the batch of your run)")
    advisor.add_argument("--gpu-tflops", type=float, default=989.0, help="dense peak of one GPU (default 989)")
    advisor.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation assumed (default 0.4)")
    advisor.add_argument("--top", type=int, default=8, help="layouts to print (default 8)")
    advisor.add_argument("--wide", action="store_true",
                         help="also print each layout's compute, bubble and exposed tp / pp / dp seconds")
    plan.add_argument("--plot", default=None, metavar="FILE.png",
                      help="also draw the memory ledger per stage and per deploy tp size against --gpu-memory (or,"
                           " with --gpus, every layout's step time against its memory); needs matplotlib")
    plan.set_defaults(run=_run_plan)
    plan.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _run_serve_plan(args: argparse.Namespace, config: ModelConfig) -> int:
    # An explicit --max-model-len above the model's positions is refused; the default stays within them.
    tokens = args.max_model_len or min(args.seq_len, config.max_position_embeddings)
    plans = serving_plan(config, args.model_path or args.model, parse_size(args.gpu_memory),
                         args.gpu_memory_utilization, tokens, args.serve_dtype,
                         tuple(args.deploy_tp) if args.deploy_tp else None)
    print_serving_plan(args, config.to_dict(), plans, tokens,
                       "2 x layers x kv heads x head dim, kv heads split over tp (replicated beyond their count)")
    return 0


_EXPERTS_LEGEND = "ep: the routed experts split over that many dp ranks;"
_ADVISOR_LEGEND = (
    "m: micro-batches per pipeline pass; k: gradient-accumulation steps; reshard: FSDP frees a block's gathered"
    " weights after its forward (fsdp_reshard_after_forward); GiB: the fullest rank's memory (the ledger); step s:"
    " predicted seconds per step = compute + bubble + communication overlap cannot hide (--wide shows each);"
    " why: how much slower than #1 and the columns that differ from it (--wide: also the part of the step that"
    " grows most, and #1's costs beyond compute) (lightning_tp3d.plan.advisor)"
)


def _run_advisor(args: argparse.Namespace, config: ModelConfig | MoEModelConfig) -> int:
    if args.global_batch_size is None:
        raise ValueError("the advisor needs --global-batch-size B: the sequences of one optimizer step over all dp"
                         " ranks (per-rank batch_size x dp x accumulate_grad_batches in your run).")
    cluster = Cluster(args.gpus, parse_size(args.gpu_memory), args.gpus_per_node or GPUS_PER_NODE,
                      args.gpu_tflops, args.mfu, group_gbps=given_bandwidths(args))
    candidates = advise(config, cluster, args.global_batch_size, args.seq_len, args.precision, args.micro_batch_size,
                        args.lora_rank, tuple(args.lora_targets), _qlora(args))
    fitting = [candidate for candidate in candidates if candidate.fits]
    if args.plot:
        from lightning_tp3d.cli.plots import plot_advisor

        plot_advisor(candidates, cluster.gpu_memory_bytes, args.plot,
                     f"{args.model} on {args.gpus} GPUs, global batch {args.global_batch_size} x {args.seq_len}")
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps([asdict(candidate) | {"step_seconds": candidate.step_seconds, "reshard": candidate.reshards,
                                               "why": candidate.compared_with(fitting[0]) if candidate.fits else None}
                          for candidate in candidates], indent=2))
        return 0 if fitting else 1
    print(f"{args.model} on {args.gpus} GPUs of {cluster.gpu_memory_bytes / _GIB:.0f} GiB"
          f" ({cluster.gpus_per_node} per node), global batch {args.global_batch_size} x {args.seq_len} tokens")
    words = f"{args.precision}{_lora_words(args)}, {args.gpu_tflops:g} TFLOPS at MFU {args.mfu}:"
    separator = " " if len(words) < 50 else "\n"  # a LoRA description pushes the counts to their own line
    print(f"{words}{separator}{len(candidates)} layouts, {len(fitting)} fit in"
          f" {cluster.usable_fraction:.0%} of the memory")
    if not fitting:
        print("no layout fits: add GPUs, use fsdp or recompute, or a shorter sequence")
        return 1
    experts = isinstance(config, MoEModelConfig)  # an ep column, and the ep / edp groups' seconds
    groups = GROUPS + ((EXPERT_GROUP, EXPERT_DATA_GROUP) if experts else ())
    wide = f" {'compute':>8} {'bubble':>7}" + "".join(f" {group:>6}" for group in groups) if args.wide else ""
    print(f"{'#':>2} {'tp':>3} {'pp':>3} {'dp':>3}{' ep' if experts else ''} {'dp mode':>9} {'reshard':>7}"
          f" {'recompute':>9} {'m':>4} {'k':>3} {'GiB':>6}{wide} {'step s':>7}  why (vs #1)")
    for index, candidate in enumerate(fitting[: args.top], 1):
        exposed = candidate.exposed_seconds
        times = (f" {candidate.compute_seconds:>8.3f} {candidate.bubble_seconds:>7.3f}"
                 + "".join(f" {exposed.get(group, 0.0):>6.3f}" for group in groups)) if args.wide else ""
        reshard = {None: "-", True: "yes", False: "no"}[candidate.reshards]
        ep = f" {candidate.expert_parallel_size:>2}" if experts else ""
        print(f"{index:>2} {candidate.tensor_parallel_size:>3} {candidate.pipeline_parallel_size:>3}"
              f" {candidate.data_parallel_size:>3}{ep} {candidate.data_parallel_mode:>9} {reshard:>7}"
              f" {candidate.recompute:>9} {candidate.num_microbatches:>4} {candidate.gradient_accumulation_steps:>3}"
              f" {candidate.peak_bytes / _GIB:>6.1f}{times} {candidate.step_seconds:>7.3f}"
              f"  {candidate.compared_with(fitting[0], costs=args.wide)}")
    print("\n".join(textwrap.wrap(f"{_EXPERTS_LEGEND} {_ADVISOR_LEGEND}" if experts else _ADVISOR_LEGEND, 100)))
    return 0


def _lora_words(args: argparse.Namespace) -> str:
    kind = "QLoRA (NF4 base)" if args.qlora else "LoRA"
    return f", {kind} r {args.lora_rank} on {' '.join(args.lora_targets)}" if args.lora_rank else ""


def _qlora(args: argparse.Namespace) -> NF4Format | None:
    if args.qlora and not args.lora_rank:
        raise ValueError("--qlora needs --lora-rank R: QLoRA trains LoRA factors on the frozen 4-bit base.")
    return NF4_FORMAT if args.qlora else None


def _run_plan(args: argparse.Namespace) -> int:
    experts = resolve_moe_config(args.model)
    if experts is not None:
        args.seq_len = args.seq_len or _DEFAULT_SEQ_LEN
        if args.gpus is not None and not args.serve:
            return _run_advisor(args, experts)
        return run_moe_plan(args, experts, args.seq_len)
    config = resolve_model_config(args.model)
    if args.ep != 1:
        raise ValueError(f"--ep {args.ep} splits routed experts, but {args.model} has none; use --ep 1, or a"
                         f" mixture-of-experts model ({', '.join(MOE_PRESETS)} or a DeepSeek config.json).")
    args.seq_len, seq_len_note = _sequence_length(args, config)
    if args.serve:
        return _run_serve_plan(args, config)
    if args.gpus is not None:
        return _run_advisor(args, config)
    layout = ParallelLayout(
        tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, data_parallel_size=args.dp,
        micro_batch_size=args.micro_batch_size, num_microbatches=args.num_microbatches or args.pp,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
    )
    options = TrainingOptions(seq_len=args.seq_len, precision=args.precision, recompute=args.recompute,
                              data_parallel_mode=args.dp_mode, schedule=args.schedule,
                              stages_per_rank=args.stages_per_rank, recompute_method=args.recompute_method,
                              recompute_num_layers=args.recompute_num_layers,
                              lora_rank=args.lora_rank, lora_targets=tuple(args.lora_targets), qlora=_qlora(args))
    if args.gpus_per_node is not None:
        layout.validate_cluster(args.gpus_per_node)
    training = training_ledger(config, layout, options)
    serving = serving_ledger(config, args.serve_seq_len or args.seq_len, args.serve_num_seqs, args.serve_dtype)
    bubble = schedule_bubble_fraction(args.schedule, layout.pipeline_parallel_size, layout.num_microbatches,
                                      args.stages_per_rank)
    communication = communication_ledger(config, layout, options)
    bandwidth = group_bandwidths(layout, args.gpus_per_node or GPUS_PER_NODE, given_gbps=given_bandwidths(args))
    if args.plot:
        from lightning_tp3d.cli.plots import plot_memory, schedule_timeline

        timeline = (schedule_timeline(args.schedule, layout.pipeline_parallel_size, layout.num_microbatches,
                                      args.stages_per_rank) if layout.pipeline_parallel_size > 1 else ())
        plot_memory(training, serving, parse_size(args.gpu_memory), args.plot,
                    f"{args.model} at tp={args.tp} pp={args.pp} dp={args.dp}, {args.precision}, {args.seq_len} tokens",
                    timeline=timeline, schedule=args.schedule)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps({"model": config.to_dict(), "training": training.to_dict(), "serving": serving.to_dict(),
                          "pipeline_bubble_fraction": bubble,
                          "communication": communication.to_dict() | {
                              "bandwidth_bytes_per_second": bandwidth,
                              "seconds": [communication.seconds(stage, bandwidth)
                                          for stage in range(len(communication.stages))]}}, indent=2))
        return 0
    count = config.num_parameters()
    print(f"model {args.model}: {count:,} parameters"
          f" ({f'{count / 1e9:.2f}e9' if count >= 1e9 else f'{count / 1e6:.2f}e6'})")
    print(f"layout tp={layout.tensor_parallel_size} pp={layout.pipeline_parallel_size} dp={layout.data_parallel_size}"
          f" -> {layout.world_size} ranks; global batch {layout.global_batch_size} sequences of {args.seq_len} tokens"
          f"{seq_len_note}")
    recompute = args.recompute if args.recompute == "none" else (
        f"{args.recompute} ({args.recompute_method}, N={args.recompute_num_layers})")
    print(f"training {args.precision}, recompute={recompute}, dp mode={args.dp_mode}, schedule={args.schedule}")
    if args.lora_rank:
        trainable = ", ".join(f"stage {stage.stage} {stage.trainable_parameters:,}" for stage in training.stages)
        base = " in 4-bit NF4" if args.qlora else ""
        print(f"{_lora_words(args)[2:]}: trainable parameters per rank {trainable}; the rest frozen{base}"
              " (weights only, no gradients or optimizer state)")
    print("\n".join(memory_lines(training)))
    pp, m = layout.pipeline_parallel_size, layout.num_microbatches
    if pp > 1:
        more = _MICROBATCHES_PER_STAGE * pp
        print(f"pipeline bubble in theory ({args.schedule}): {BUBBLE_FORMULAS[args.schedule]}\n"
              f"  = {bubble:.0%} of each step")
        if m < more:
            print(f"  num_microbatches >= {_MICROBATCHES_PER_STAGE} x pp = {more} brings it to"
                  f" {schedule_bubble_fraction(args.schedule, pp, more, args.stages_per_rank):.0%}")
    print("\n".join(communication_lines(communication, bandwidth)))
    unit, scale = byte_unit(max(serving.kv_bytes_total, *(option.weight_bytes_per_gpu for option in serving.options
                                                       if option.valid)))
    print(f"serving {serving.dtype}, pipeline stages merged:\nKV cache {serving.kv_bytes_per_token:,} B/token,"
          f" {serving.kv_bytes_per_sequence / scale:.2f} {unit} per {serving.seq_len}-token sequence,"
          f" {serving.kv_bytes_total / scale:.2f} {unit} for {serving.num_seqs} sequences")
    print(f"{'deploy tp':>9} {'weights/GPU ' + unit:>16} {'KV B/token/GPU':>15}  note")
    for option in serving.options:
        if option.valid:
            print(f"{option.tensor_parallel_size:>9} {option.weight_bytes_per_gpu / scale:>16.2f}"
                  f" {option.kv_bytes_per_token_per_gpu:>15,}  ok")
        else:
            print(f"{option.tensor_parallel_size:>9} {'-':>16} {'-':>15}  invalid: {option.reason}")
    return 0
