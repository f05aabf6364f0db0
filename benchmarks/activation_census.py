"""What one decoder layer keeps for backward, tensor by tensor, under autocast on this device.

    python benchmarks/activation_census.py --device cuda       # writes activation_census_cuda.json
    python benchmarks/activation_census.py --device cpu --seq-len 256

One `DecoderLayer` of the 1.1B model (`gpu_acceptance.ONE_BILLION`) runs forward on one sequence under
`--precision`; every tensor autograd saves is recorded through `saved_tensors_hooks` (each storage once)
with its shape and dtype. Tensors shaped like a weight are autocast's
16-bit weight copies, not activations. The total of the rest, per sequence, is what the memory ledger's
per-layer activation term (`plan.ledger`) should equal; the same run on the CPU and on a GPU shows what
each device's autocast keeps.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from census import by_shape, saved_storages, write_census

from lightning_tp3d.models.llama import DecoderLayer
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.ledger import PRECISIONS, TrainingOptions, training_ledger
from lightning_tp3d.plan.loss import loss_activation_bytes

from gpu_acceptance import ONE_BILLION

_AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def census(device: str, seq_len: int, precision: str) -> dict[str, Any]:
    layer = DecoderLayer(ONE_BILLION).to(device)
    weight_shapes = {tuple(parameter.shape) for parameter in layer.parameters()}
    hidden = torch.randn(1, seq_len, ONE_BILLION.hidden_size, device=device, requires_grad=True)
    autocast = torch.autocast(device, dtype=_AUTOCAST[precision]) if precision in _AUTOCAST else torch.autocast(
        device, enabled=False)

    def forward() -> None:
        with autocast:
            layer(hidden)

    tensors = saved_storages(layer, forward)
    for tensor in tensors:  # a 16-bit tensor shaped like a weight is autocast's copy of it
        tensor["weight_copy"] = tuple(tensor["shape"]) in weight_shapes and tensor["dtype"] != "float32"
    activations = sum(tensor["bytes"] for tensor in tensors if not tensor["weight_copy"])
    ledger = training_ledger(ONE_BILLION, ParallelLayout(micro_batch_size=1),
                             TrainingOptions(seq_len=seq_len, precision=precision)).stages[0]
    logits = loss_activation_bytes(seq_len, ONE_BILLION.vocab_size, PRECISIONS[precision][3])  # not a layer's
    ledger_layer = (ledger.activation_bytes - logits) / ONE_BILLION.num_hidden_layers
    return {"activation_bytes": activations, "ledger_layer_bytes": ledger_layer,
            "ratio": activations / ledger_layer,
            "weight_copy_bytes": sum(tensor["bytes"] for tensor in tensors if tensor["weight_copy"]),
            "by_shape": by_shape([tensor for tensor in tensors if not tensor["weight_copy"]]), "tensors": tensors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "16-mixed", "32-true"])
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    result = {"command": [sys.executable, *sys.argv], "torch": torch.__version__, "device": args.device,
              "seq_len": args.seq_len, "precision": args.precision,
              **census(args.device, args.seq_len, args.precision)}
    write_census(result, f"{args.device} {args.precision} s={args.seq_len}: one layer keeps"
                         f" {result['activation_bytes'] / 1e6:.1f} MB per sequence, the ledger"
                         f" {result['ledger_layer_bytes'] / 1e6:.1f} MB ({result['ratio']:.3f}x); 16-bit weight"
                         f" copies {result['weight_copy_bytes'] / 1e6:.1f} MB",
                 args.output or f"activation_census_{args.device}.json")


if __name__ == "__main__":
    main()
