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
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

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
    skipped = {parameter.untyped_storage().data_ptr() for parameter in layer.parameters()}  # not activations
    seen: dict[int, dict[str, Any]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen and storage.data_ptr() not in skipped:
            seen[storage.data_ptr()] = {
                "shape": list(tensor.shape), "dtype": str(tensor.dtype), "bytes": storage.nbytes(),
                "weight_copy": tuple(tensor.shape) in weight_shapes and tensor.dtype != torch.float32}
        return tensor

    autocast = torch.autocast(device, dtype=_AUTOCAST[precision]) if precision in _AUTOCAST else torch.autocast(
        device, enabled=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast:
        layer(hidden)
    tensors = list(seen.values())
    by_shape: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # "shape dtype" -> [tensors, bytes]
    for tensor in tensors:
        if not tensor["weight_copy"]:
            entry = by_shape[f"{tuple(tensor['shape'])} {tensor['dtype'].removeprefix('torch.')}"]
            entry[0] += 1
            entry[1] += tensor["bytes"]
    activations = sum(tensor["bytes"] for tensor in tensors if not tensor["weight_copy"])
    ledger = training_ledger(ONE_BILLION, ParallelLayout(micro_batch_size=1),
                             TrainingOptions(seq_len=seq_len, precision=precision)).stages[0]
    logits = loss_activation_bytes(seq_len, ONE_BILLION.vocab_size, PRECISIONS[precision][3])  # not a layer's
    ledger_layer = (ledger.activation_bytes - logits) / ONE_BILLION.num_hidden_layers
    return {"activation_bytes": activations, "ledger_layer_bytes": ledger_layer,
            "ratio": activations / ledger_layer,
            "weight_copy_bytes": sum(tensor["bytes"] for tensor in tensors if tensor["weight_copy"]),
            "by_shape": dict(sorted(by_shape.items(), key=lambda item: -item[1][1])), "tensors": tensors}


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
    print(f"{args.device} {args.precision} s={args.seq_len}: one layer keeps {result['activation_bytes'] / 1e6:.1f} MB"
          f" per sequence, the ledger {result['ledger_layer_bytes'] / 1e6:.1f} MB ({result['ratio']:.3f}x);"
          f" 16-bit weight copies {result['weight_copy_bytes'] / 1e6:.1f} MB")
    for name, (count, size) in result["by_shape"].items():
        print(f"  {count:3d} x {name:40s} {size / 1e6:9.1f} MB")
    Path(args.output or f"activation_census_{args.device}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
