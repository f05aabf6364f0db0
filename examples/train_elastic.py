"""Elastic training under torchrun: a lost node costs a restart, not the run.

Run the same command on every node; here two "nodes" of 4 CPU processes on one machine:

    torchrun --nnodes 1:2 --nproc-per-node 4 --max-restarts 3 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29400 --rdzv-id tiny-elastic \\
        --rdzv-conf last_call_timeout=15,keep_alive_interval=1,keep_alive_max_attempt=3 \\
        examples/train_elastic.py --output runs/elastic

tp x pp stay 2 x 2 and dp is what the world leaves: 2 with both nodes, 1 with one. Every step trains on
`--global-batch` samples whatever dp is (`TP3DStrategy(global_batch_size=...)` accumulates), and every step
saves `last.ckpt`. When a node is lost, the other agent's workers fail in their next collective, the agent
restarts them at the world the rendezvous now has, and they resume from the newest complete checkpoint
(`ckpt_path="last"`) on the same sample stream. When the node comes back, the next restart grows dp again.
Losses go to `OUTPUT/logs/version_<attempt>/metrics.csv` (Lightning's CSVLogger).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from lightning_tp3d import TP3DStrategy  # noqa: E402
from lightning_tp3d.data import TokenDataModule  # noqa: E402
from lightning_tp3d.models import CausalLMModule  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="folder of the checkpoints and logs")
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel size")
    parser.add_argument("--pp", type=int, default=2, help="pipeline parallel size")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--global-batch", type=int, default=8, help="samples per optimizer step, at any dp")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per data-parallel rank and batch")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--data", default="python-docs", help="a named corpus (python-docs, tiny) or a token file")
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--accelerator", default="cpu", help="cpu (gloo processes) or gpu (NCCL)")
    args = parser.parse_args()

    strategy = TP3DStrategy(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                            global_batch_size=args.global_batch)
    trainer = L.Trainer(
        accelerator=args.accelerator, strategy=strategy, max_steps=args.steps,
        # torchrun's view of this attempt: processes on this node, nodes in the rendezvous
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)),
        callbacks=[ModelCheckpoint(dirpath=os.path.join(args.output, "checkpoints"), every_n_train_steps=1,
                                   save_top_k=0, save_last=True)],
        logger=CSVLogger(args.output, name="logs", flush_logs_every_n_steps=1), log_every_n_steps=1,
        limit_val_batches=0, num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(CausalLMModule("tiny", learning_rate=args.learning_rate),
                TokenDataModule(source=args.data, seq_len=args.seq_len, batch_size=args.batch_size,
                                val_fraction=args.val_fraction),
                ckpt_path="last")


if __name__ == "__main__":
    main()
