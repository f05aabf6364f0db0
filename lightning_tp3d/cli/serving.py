"""`tp3d plan --serve`: the serving plan printed (`plan.serving`), for a dense model and for a DeepSeek
mixture-of-experts one (each size twice: tensor- and data-parallel, with vLLM's expert parallelism).

    tp3d plan deepseek-llm-67b --serve --gpu-memory 80GiB --max-model-len 4096 --deploy-tp 4 8
    tp3d plan deepseek-v2-lite --serve --gpu-memory 80GiB --max-model-len 8192 --deploy-tp 2 4
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from lightning_tp3d.plan.serving import ServePlan
from lightning_tp3d.plan.units import parse_size

__all__ = ["OOM_RETRY_UTILIZATION", "print_serving_plan"]

_GIB = 1024**3
OOM_RETRY_UTILIZATION = 0.85  # the design documents' first step when a server does not start


def _server(plan: ServePlan) -> str:
    split = f"dp {plan.data_parallel_size}" if plan.data_parallel_size > 1 else f"tp {plan.tensor_parallel_size}"
    return split + (" + ep" if plan.expert_parallel else "")


def print_serving_plan(args: argparse.Namespace, model: dict[str, Any], plans: list[ServePlan], tokens: int,
                       cache_words: str) -> None:
    """The plans as JSON (`--json`: the model's fields and each plan) or as a table, per GPU, with the vLLM
    commands of those that fit; `cache_words` says what the cache per token holds."""
    if args.json:
        print(json.dumps({"model": model, "serving_plan": [{**asdict(plan), "fits": plan.fits} for plan in plans]},
                         indent=2))
        return
    print(f"serving {args.model} in {args.serve_dtype} on GPUs of {parse_size(args.gpu_memory) / _GIB:.1f} GiB at"
          f" utilization {args.gpu_memory_utilization}, sequences of {tokens} tokens; KV cache: {cache_words}")
    print(f"{'server':>11} {'weights GiB':>12} {'KV B/token':>11} {'KV GiB/seq':>11} {'cache GiB':>10} {'seqs':>6}")
    for plan in plans:
        print(f"{_server(plan):>11} {plan.weight_bytes_per_gpu / _GIB:>12.2f}"
              f" {plan.kv_bytes_per_token_per_gpu:>11,} {plan.kv_bytes_per_sequence_per_gpu / _GIB:>11.3f}"
              f" {plan.kv_budget_bytes_per_gpu / _GIB:>10.2f} {plan.max_num_seqs:>6}"
              + ("" if plan.fits else "  does not fit"))
    print("per GPU (seqs: per GPU's engine; a dp server holds dp x seqs); the cache must also leave room for vLLM's"
          " profiling activations, so the counts are upper bounds")
    for plan in plans:
        if plan.fits:
            print(plan.vllm_command)
    if args.gpu_memory_utilization > OOM_RETRY_UTILIZATION:
        print(f"if vLLM runs out of memory while starting, retry with --gpu-memory-utilization"
              f" {OOM_RETRY_UTILIZATION} (and a lower --max-num-seqs)")
