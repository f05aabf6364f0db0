"""`tp3d plan` for a DeepSeek-V2 / V3 mixture-of-experts model: its parameters, each pp rank's memory
(`plan.moe_training`: weights, gradients and optimizer state with the routed experts over E, FSDP2's gathered
units, the activations) and the step's traffic over tp, pp, dp and the expert groups with their times
(`plan.moe_communication`); with `--serve`, vLLM servers with its expert parallelism (`cli.serving`). The
layout advisor (`--gpus`) is `cli.plan`'s, over the expert-parallel sizes too.

    tp3d plan deepseek-v3 --tp 8 --pp 16 --dp 64 --ep 8 --num-microbatches 32 --precision bf16-mixed
    tp3d plan deepseek-v3 --serve --gpu-memory 141GiB --max-model-len 8192 --deploy-tp 8 16
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from lightning_tp3d.cli.communication import GPUS_PER_NODE, communication_lines, given_bandwidths
from lightning_tp3d.cli.memory import memory_lines
from lightning_tp3d.cli.serving import print_serving_plan
from lightning_tp3d.plan.communication import group_bandwidths
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.ledger import TrainingOptions
from lightning_tp3d.plan.moe import MoEModelConfig
from lightning_tp3d.plan.moe_communication import moe_communication_ledger
from lightning_tp3d.plan.moe_training import moe_training_ledger
from lightning_tp3d.plan.serving import serving_plan
from lightning_tp3d.plan.units import parse_size

__all__ = ["run_moe_plan"]


def run_moe_plan(args: argparse.Namespace, config: MoEModelConfig, seq_len: int) -> int:
    """A DeepSeek-V2 / V3 mixture-of-experts model at the layout of `args` (module docstring)."""
    _refuse_what_is_not_planned(args)
    if args.serve:
        return _run_moe_serve_plan(args, config, seq_len)
    layout = ParallelLayout(
        tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, data_parallel_size=args.dp,
        micro_batch_size=args.micro_batch_size, num_microbatches=args.num_microbatches or args.pp,
        gradient_accumulation_steps=args.gradient_accumulation_steps, expert_parallel_size=args.ep)
    options = TrainingOptions(seq_len=seq_len, precision=args.precision, recompute=args.recompute,
                              data_parallel_mode=args.dp_mode, schedule=args.schedule,
                              stages_per_rank=args.stages_per_rank, recompute_method=args.recompute_method,
                              recompute_num_layers=args.recompute_num_layers)
    if args.gpus_per_node is not None:
        layout.validate_cluster(args.gpus_per_node)
    training = moe_training_ledger(config, layout, options)
    communication = moe_communication_ledger(config, layout, options)
    bandwidth = group_bandwidths(layout, args.gpus_per_node or GPUS_PER_NODE, given_gbps=given_bandwidths(args))
    figures = {"parameters": config.num_parameters(), "active_parameters": config.active_parameters(),
               "routed_expert_parameters": config.routed_expert_parameters(),
               "routed_expert_parameters_per_rank": config.routed_expert_parameters_per_rank(args.ep)}
    if args.json:
        print(json.dumps({"model": asdict(config), **figures, "training": training.to_dict(),
                          "communication": communication.to_dict() | {
                              "bandwidth_bytes_per_second": bandwidth,
                              "seconds": [communication.seconds(stage, bandwidth)
                                          for stage in range(len(communication.stages))]}}, indent=2))
        return 0
    print(f"model {args.model} (mixture of experts): {figures['parameters'] / 1e9:.1f}e9 parameters,"
          f" {figures['active_parameters'] / 1e9:.1f}e9 active per token; routed experts"
          f" {figures['routed_expert_parameters'] / 1e9:.1f}e9 in {config.moe_layers} MoE blocks")
    print(f"layout tp={args.tp} pp={args.pp} dp={args.dp} ep={args.ep} -> {layout.world_size} ranks: each rank"
          f" holds {config.n_routed_experts // args.ep} of each block's {config.n_routed_experts} routed experts,"
          f" {figures['routed_expert_parameters_per_rank'] / 1e9:.2f}e9 parameters (FSDP2 shards them, ZeRO-1"
          f" their optimizer state, over the {args.dp // args.ep} replicas of each expert group)")
    recompute = args.recompute if args.recompute == "none" else (
        f"{args.recompute} ({args.recompute_method}, N={args.recompute_num_layers}; selective: self_attn)")
    print(f"micro-batches of {args.micro_batch_size} x {seq_len} tokens, {args.precision}, recompute={recompute},"
          f" dp mode={args.dp_mode}, schedule={args.schedule}; all-to-alls per MoE block and micro-batch: expert"
          " counts, dispatch, combine, and both again in backward (uniform routing)")
    print("\n".join(memory_lines(training)))
    print("\n".join(communication_lines(communication, bandwidth)))
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
    """The flags whose figures this plan does not compute for a mixture-of-experts model: refused, rather
    than a plan that silently ignores them."""
    asked = {"--plot (without --gpus)": args.plot is not None,
             "--lora-rank / --qlora": bool(args.lora_rank) or args.qlora}
    refused = [flag for flag, given in asked.items() if given]
    if refused:
        raise ValueError(f"{', '.join(refused)} with a mixture-of-experts model is not planned yet; plan it without"
                         f" {'them' if len(refused) > 1 else 'it'}.")
