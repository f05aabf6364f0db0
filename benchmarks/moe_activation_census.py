"""What one DeepSeek mixture-of-experts block keeps for backward, tensor by tensor, against the MoE ledger.

    python benchmarks/moe_activation_census.py --precision bf16-mixed    # writes moe_activation_census_cpu.json
    python benchmarks/moe_activation_census.py --device cuda --precision bf16-mixed

One block of transformers' `DeepseekV3ForCausalLM` with `--model`'s shapes (a `plan.moe.MOE_PRESETS` name;
its first MoE block, or with `--dense` its first block, dense; the experts in transformers' default
implementation) runs forward on one sequence under `--precision` with SDPA attention; every tensor autograd
saves is recorded through `saved_tensors_hooks` (each storage once), the parameters and autocast's 16-bit
weight copies (a storage of a weight's size, often transposed) apart: the default `--seq-len` 600 is none
of the model's dims, so no activation has a weight's size. The total per token is compared with
`plan.moe_training.block_activations` at tp 1. Attention matrices ([1, a, s, s]) are reported apart: SDPA's
math path keeps the softmax probabilities, which it takes on the CPU when the value head dim differs from
the query's (DeepSeek's 128 and 192; it also keeps q, k and v in float32 under autocast there); a GPU's
fused kernels keep none, as the ledger counts.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import transformers
from census import by_shape, saved_storages, write_census

from lightning_tp3d.plan.moe import MOE_PRESETS
from lightning_tp3d.plan.moe_training import block_activations

_AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def census(model: str, device: str, seq_len: int, precision: str, dense: bool) -> dict[str, Any]:
    shape = MOE_PRESETS[model]
    config = transformers.DeepseekV3Config(
        **{key: value for key, value in vars(shape).items() if value is not None},
        num_key_value_heads=shape.num_attention_heads,
        n_group=1, topk_group=1, attn_implementation="sdpa")
    # the blocks up to the first MoE one; the vocabulary is not a block's
    config.num_hidden_layers, config.vocab_size = shape.first_k_dense_replace + 1, 256
    layer = 0 if dense else shape.first_k_dense_replace
    with torch.device(device):
        network = transformers.DeepseekV3ForCausalLM(config)  # its blocks with the experts implementation chosen
        block, rotary = network.model.layers[layer], network.model.rotary_emb
        hidden = torch.randn(1, seq_len, shape.hidden_size, requires_grad=True)
        positions = torch.arange(seq_len)[None]
    weight_sizes = {parameter.numel() for parameter in block.parameters()}
    autocast = torch.autocast(device, dtype=_AUTOCAST.get(precision, torch.bfloat16), enabled=precision in _AUTOCAST)

    def forward() -> None:
        with autocast:
            block(hidden, position_embeddings=rotary(hidden, positions), position_ids=positions, use_cache=False)

    tensors = saved_storages(block, forward)
    for tensor in tensors:  # a 16-bit storage of a weight's size is autocast's copy of it; [1, a, s, s] attention
        tensor["weight_copy"] = tensor["elements"] in weight_sizes and tensor["dtype"] != "float32"
        tensor["attention_matrix"] = len(tensor["shape"]) == 4 and tensor["shape"][-2:] == [seq_len, seq_len]
    kept = [tensor for tensor in tensors if not tensor["weight_copy"] and not tensor["attention_matrix"]]
    measured = sum(tensor["bytes"] for tensor in kept)
    terms = block_activations(shape, layer, 1, precision)
    ledger = sum(terms.values()) * seq_len
    return {"block": layer, "activation_bytes": measured, "ledger_bytes": ledger, "ratio": measured / ledger,
            "ledger_terms_per_token": terms,
            "attention_matrix_bytes": sum(tensor["bytes"] for tensor in tensors if tensor["attention_matrix"]),
            "weight_copy_bytes": sum(tensor["bytes"] for tensor in tensors if tensor["weight_copy"]),
            "by_shape": by_shape(kept)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek-v2-lite", choices=sorted(MOE_PRESETS))
    parser.add_argument("--device", default="cpu", choices=["cuda", "cpu"])
    parser.add_argument("--seq-len", type=int, default=600)
    parser.add_argument("--precision", default="32-true", choices=["bf16-mixed", "16-mixed", "32-true"])
    parser.add_argument("--dense", action="store_true", help="the dense first block instead of an MoE block")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    result = {"command": [sys.executable, *sys.argv], "torch": torch.__version__,
              "transformers": transformers.__version__, "model": args.model, "device": args.device,
              "seq_len": args.seq_len, "precision": args.precision,
              **census(args.model, args.device, args.seq_len, args.precision, args.dense)}
    write_census(result, f"{args.model} block {result['block']} {args.device} {args.precision} s={args.seq_len}:"
                         f" keeps {result['activation_bytes'] / 1e6:.1f} MB per sequence, the ledger"
                         f" {result['ledger_bytes'] / 1e6:.1f} MB ({result['ratio']:.3f}x); attention matrices apart"
                         f" {result['attention_matrix_bytes'] / 1e6:.1f} MB",
                 args.output or f"moe_activation_census_{args.device}.json")


if __name__ == "__main__":
    main()
