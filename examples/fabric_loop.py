"""A Fabric training loop at tensor parallel 2 x pipeline parallel 2 on 4 CPU processes.

    python examples/fabric_loop.py --steps 20
    python examples/fabric_loop.py --accelerator gpu    # on 4 GPUs (NCCL)

The loop is plain Fabric: `fabric.setup` parallelises the network, `model(input_ids, labels=labels)` returns
the batch loss (under pipelining the schedule's forward and backward run inside that call),
`fabric.backward` and `fabric.clip_gradients` do the rest on every layout.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_tp3d import MODEL_PRESETS, TP3DFabricStrategy
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import LlamaForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accelerator", default="cpu", help="cpu (gloo processes), gpu (NCCL) or auto")
    args = parser.parse_args()
    strategy = TP3DFabricStrategy(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, num_microbatches=2)
    fabric = L.Fabric(accelerator=args.accelerator, devices=args.tp * args.pp * args.dp, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):  # meta device: `setup` materialises each rank's shard only
        network = LlamaForCausalLM(MODEL_PRESETS["tiny"], init_seed=0)
    model = fabric.setup(network)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95)))
    data = TokenDataModule(seq_len=32, batch_size=4)
    data.setup()
    loader = fabric.setup_dataloaders(DataLoader(data.train_dataset, batch_size=4, shuffle=True, drop_last=True))
    step = 0
    while step < args.steps:
        for batch in loader:
            loss = model(batch["input_ids"], labels=batch["labels"])
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 5 == 0:
                fabric.print(f"step {step:4d}  loss {loss.item():.4f}")
            if step == args.steps:
                break


if __name__ == "__main__":
    main()
