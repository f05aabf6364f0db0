"""`tp3d plan` for a DeepSeek-V2 / V3 mixture-of-experts model (`plan.moe`): its parameters, what each rank
holds (the routed experts apart) with its weights, gradients and optimizer state per stage, and the
expert-parallel all-to-alls per step with their times.

    tp3d plan deepseek-v3 --tp 8 --pp 16 --dp 64 --ep 8 --num-microbatches 32 --precision bf16-mixed
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from lightning_tp3d.cli.communication import GPUS_PER_NODE, communication_lines, given_bandwidths
from lightning_tp3d.plan.communication import EXPERT_GROUP, group_bandwidths
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.moe import MoEModelConfig, expert_ledger, expert_model_memory

__all__ = ["run_moe_plan"]

_GIB = 1024**3


def run_moe_plan(args: argparse.Namespace, config: MoEModelConfig, seq_len: int) -> int:
    """A DeepSeek-V2 / V3 mixture-of-experts model: its parameters, each stage's weights, gradients and
    optimizer state per rank, and the expert-parallel all-to-alls (`plan.moe`); its activations and tp / pp
    / dp traffic are not computed yet (the dense ledgers are Llama-shaped)."""
    _refuse_what_is_not_planned(args)
    layout = ParallelLayout(
        tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, data_parallel_size=args.dp,
        micro_batch_size=args.micro_batch_size, num_microbatches=args.num_microbatches or args.pp,
        gradient_accumulation_steps=args.gradient_accumulation_steps, expert_parallel_size=args.ep)
    ledger = expert_ledger(config, layout, seq_len, args.precision)
    memory = expert_model_memory(config, layout, args.precision, args.dp_mode)
    bandwidth = group_bandwidths(layout, args.gpus_per_node or GPUS_PER_NODE, given_gbps=given_bandwidths(args))
    figures = {"parameters": config.num_parameters(), "active_parameters": config.active_parameters(),
               "routed_expert_parameters": config.routed_expert_parameters(),
               "routed_expert_parameters_per_rank": config.routed_expert_parameters_per_rank(args.ep)}
    if args.json:
        print(json.dumps({"model": asdict(config), "layout": layout.to_dict(), **figures,
                          "memory": [asdict(stage) | {"layers": [stage.layers.start, stage.layers.stop],
                                                      "total_bytes": stage.total_bytes} for stage in memory],
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
        layers = f"{stage.layers.start}-{stage.layers.stop - 1}"
        print(f"{stage.stage:>5} {layers:>9} {stage.parameters:>14,} {stage.expert_parameters:>14,}"
              f" {stage.weight_bytes / _GIB:>9.2f} {stage.gradient_bytes / _GIB:>9.2f}"
              f" {stage.optimizer_bytes / _GIB:>9.2f} {stage.total_bytes / _GIB:>9.2f}")
    for line in communication_lines(ledger, bandwidth):
        print(line)
    print("not computed yet for mixture-of-experts models: activations and gathered FSDP2 units in memory, the"
          " tp / pp / dp traffic, the layout advisor")
    return 0


def _refuse_what_is_not_planned(args: argparse.Namespace) -> None:
    """The flags whose figures this plan does not compute for a mixture-of-experts model yet: refused,
    rather than a plan that silently ignores them."""
    asked = {"--serve": args.serve, "--gpus (the advisor)": args.gpus is not None, "--plot": args.plot is not None,
             "--lora-rank / --qlora": bool(args.lora_rank) or args.qlora, "--recompute": args.recompute != "none",
             f"--schedule {args.schedule}": args.schedule not in ("1f1b", "gpipe")}
    refused = [flag for flag, given in asked.items() if given]
    if refused:
        raise ValueError(f"{', '.join(refused)} with a mixture-of-experts model is not planned yet; plan it without"
                         " (one pipeline stage per rank: --schedule 1f1b or gpipe).")
