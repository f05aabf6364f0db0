"""`tp3d plan` for a DeepSeek-V2 / V3 mixture-of-experts model (`plan.moe`): its parameters, what each rank
holds (the routed experts apart) with its weights, gradients and optimizer state per stage, and the
expert-parallel all-to-alls per step with their times; with `--serve`, vLLM servers with its expert
parallelism (`cli.serving`).

    tp3d plan deepseek-v3 --tp 8 --pp 16 --dp 64 --ep 8 --num-microbatches 32 --precision bf16-mixed
    tp3d plan deepseek-v3 --serve --gpu-memory 141GiB --max-model-len 8192 --deploy-tp 8 16
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from lightning_tp3d.cli.communication import GPUS_PER_NODE, communication_lines, given_bandwidths
from lightning_tp3d.cli.serving import print_serving_plan
from lightning_tp3d.plan.communication import EXPERT_GROUP, group_bandwidths
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.moe import MoEModelConfig, expert_ledger, expert_model_memory
from lightning_tp3d.plan.serving import serving_plan
from lightning_tp3d.plan.units import parse_size

__all__ = ["run_moe_plan"]

_GIB = 1024**3


def run_moe_plan(args: argparse.Namespace, config: MoEModelConfig, seq_len: int) -> int:
    """A DeepSeek-V2 / V3 mixture-of-experts model: its parameters, each stage's weights, gradients and
    optimizer state per rank, and the expert-parallel all-to-alls (`plan.moe`); its activations and tp / pp
    / dp traffic are not computed yet (the dense ledgers are Llama-shaped)."""
    _refuse_what_is_not_planned(args)
    if args.serve:
        return _run_moe_serve_plan(args, config, seq_len)
    layout = ParallelLayout(
        tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, data_parallel_size=args.dp,
        micro_batch_size=args.micro_batch_size, num_microbatches=args.num_microbatches or args.pp,
        gradient_accumulation_steps=args.gradient_accumulation_steps, expert_parallel_size=args.ep)
    ledger = expert_ledger(config, layout, seq_len, args.precision, args.schedule, args.stages_per_rank)
    memory = expert_model_memory(config, layout, args.precision, args.dp_mode, args.schedule, args.stages_per_rank)
    bandwidth = group_bandwidths(layout, args.gpus_per_node or GPUS_PER_NODE, given_gbps=given_bandwidths(args))
    figures = {"parameters": config.num_parameters(), "active_parameters": config.active_parameters(),
               "routed_expert_parameters": config.routed_expert_parameters(),
               "routed_expert_parameters_per_rank": config.routed_expert_parameters_per_rank(args.ep)}
    if args.json:
        ranks = [asdict(stage) | {"layers": [[layers.start, layers.stop] for layers in stage.layers],
                                  "total_bytes": stage.total_bytes} for stage in memory]
        print(json.dumps({"model": asdict(config), "layout": layout.to_dict(), **figures, "memory": ranks,
                          "expert_communication": ledger.to_dict() | {
                              "bandwidth_bytes_per_second": {EXPERT_GROUP: bandwidth[EXPERT_GROUP]},
                              "seconds": [ledger.seconds(stage, bandwidth) for stage in range(len(ledger.stages))]}},
                         indent=2))
        return 0
    print(f"model {args.model} (mixture of experts): {figures['parameters'] / 1e9:.1f}e9 parameters,"
          f" {figures['active_parameters'] / 1e9:.1f}e9 active per token; routed experts"
          f" {figures['routed_expert_parameters'] / 1e9:.1f}e9 in {config.moe_layers} MoE blocks")
    print(f"layout tp={args.tp} pp={args.pp} dp={args.dp} ep={args.ep} -> {layout.world_size} ranks: each rank"
          f" holds {config.n_routed_experts // args.ep} of each block's {config.n_routed_experts} routed experts,"
          f" {figures['routed_expert_parameters_per_rank'] / 1e9:.2f}e9 parameters (FSDP2 shards them, ZeRO-1"
          f" their optimizer state, over the {args.dp // args.ep} replicas of each expert group)")
    print(f"micro-batches of {args.micro_batch_size} x {seq_len} tokens, {args.precision}; all-to-alls per MoE"
          " block and micro-batch: expert counts, dispatch, combine, and both again in backward (uniform routing)")
    print(f"memory per rank, {args.dp_mode} (weights, gradients, optimizer state; plan.moe.expert_model_memory)")
    print(f"{'stage':>5} {'layers':>9} {'params/rank':>14} {'experts/rank':>14} {'weights':>9} {'grads':>9}"
          f" {'optim':>9} {'total GiB':>9}")
    for stage in memory:
        layers = ",".join(f"{layers.start}-{layers.stop - 1}" for layers in stage.layers)
        print(f"{stage.stage:>5} {layers:>9} {stage.parameters:>14,} {stage.expert_parameters:>14,}"
              f" {stage.weight_bytes / _GIB:>9.2f} {stage.gradient_bytes / _GIB:>9.2f}"
              f" {stage.optimizer_bytes / _GIB:>9.2f} {stage.total_bytes / _GIB:>9.2f}")
    for line in communication_lines(ledger, bandwidth):
        print(line)
    print("not computed yet for mixture-of-experts models: activations and gathered FSDP2 units in memory, the"
          " tp / pp / dp traffic, the layout advisor")
    return 0


def _run_moe_serve_plan(args: argparse.Namespace, config: MoEModelConfig, seq_len: int) -> int:
    """vLLM servers with expert parallelism over each size of `--deploy-tp` (`plan.serving.serving_plan`)."""
    positions = config.max_position_embeddings or seq_len
    tokens = args.max_model_len or min(seq_len, positions)
    plans = serving_plan(config, args.model_path or args.model, parse_size(args.gpu_memory),
                         args.gpu_memory_utilization, tokens, args.serve_dtype,
                         tuple(args.deploy_tp) if args.deploy_tp else None)
    print_serving_plan(args, asdict(config), plans, tokens,
                       "one latent per layer (kv_lora_rank + qk_rope_head_dim), whole on every GPU")
    return 0


def _refuse_what_is_not_planned(args: argparse.Namespace) -> None:
    """The flags whose figures this plan does not compute for a mixture-of-experts model yet: refused,
    rather than a plan that silently ignores them."""
    asked = {"--gpus (the advisor)": args.gpus is not None, "--plot": args.plot is not None,
             "--lora-rank / --qlora": bool(args.lora_rank) or args.qlora, "--recompute": args.recompute != "none"}
    refused = [flag for flag, given in asked.items() if given]
    if refused:
        raise ValueError(f"{', '.join(refused)} with a mixture-of-experts model is not planned yet; plan it without"
                         f" {'them' if len(refused) > 1 else 'it'}.")
