"""Main job: train the tiny reference decoder on the Python documentation with TP x PP x DP on CPU processes.

    python examples/train_tiny.py                    # tp=2 x pp=2 x dp=2 on 8 processes, 40 steps
    python examples/train_tiny.py --tp 2 --pp 1 --dp 2 --steps 20
    python examples/train_tiny.py --accelerator gpu      # on 8 GPUs (NCCL)

Lightning launches the processes (gloo on CPU); rank 0 prints the training loss, which falls from about 5.5,
and the loss on held-out text (the last 10% of the corpus, 16 batches) every 20 steps.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402

from lightning_tp3d import TP3DStrategy  # noqa: E402
from lightning_tp3d.callbacks import PrintLosses  # noqa: E402
from lightning_tp3d.data import TokenDataModule  # noqa: E402
from lightning_tp3d.models import CausalLMModule  # noqa: E402
from lightning_tp3d.plan.data_parallel import DATA_PARALLEL_MODES  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel size")
    parser.add_argument("--pp", type=int, default=2, help="pipeline parallel size")
    parser.add_argument("--dp", type=int, default=2, help="data parallel size")
    parser.add_argument("--schedule", default="1f1b", help="pipeline schedule (gpipe, 1f1b, interleaved_1f1b, ...)")
    parser.add_argument("--dp-mode", choices=list(DATA_PARALLEL_MODES), default="replicate")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per data-parallel rank and step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--data", default="python-docs",
                        help="a named corpus (python-docs, tiny) or a .txt / .npy token file")
    parser.add_argument("--accelerator", default="cpu", help="cpu (gloo processes), gpu (NCCL) or auto")
    args = parser.parse_args()

    L.seed_everything(0)
    strategy = TP3DStrategy(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, data_parallel_size=args.dp,
                            data_parallel_mode=args.dp_mode, pipeline_schedule=args.schedule)
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.tp * args.pp * args.dp, strategy=strategy, max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=16, val_check_interval=20, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        callbacks=[PrintLosses(every_n_steps=5)],
    )
    trainer.fit(CausalLMModule("tiny"), TokenDataModule(source=args.data, seq_len=args.seq_len,
                                                        batch_size=args.batch_size))


if __name__ == "__main__":
    main()
