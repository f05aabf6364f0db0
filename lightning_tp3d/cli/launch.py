"""`tp3d run`: torchrun, with what its elastic restarts need.

    tp3d run --nnodes 1:2 --nproc-per-node 4 --max-restarts 3 --rdzv-backend c10d \
        --rdzv-endpoint HOST:29400 --rdzv-id my-run examples/train_elastic.py --output runs/elastic

Every argument is torchrun's (`torch.distributed.run`); what it adds is that the agent does not share
its rendezvous store with the workers (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, unless the environment
sets that variable). torch 2.5 to 2.13 keep the shared store for the agent's whole life, so a restarted
world's gloo or NCCL ranks find the previous attempt's addresses under the keys they wait on and
connect to processes that are gone: after a lost rank or node the new process group never forms
(pytorch/pytorch#135712). Unshared, every attempt's rank 0 hosts a store of its own, empty.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["UNSHARED_STORE_VARIABLE", "run_torchrun"]

UNSHARED_STORE_VARIABLE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def run_torchrun(argv: Sequence[str]) -> int:
    """Run torchrun with `argv` in this process, the agent's store unshared; 0 when every worker succeeded
    (a failure raises torchrun's own `ChildFailedError`, with each failed rank's error)."""
    os.environ.setdefault(UNSHARED_STORE_VARIABLE, "1")
    from torch.distributed.run import main as torchrun

    torchrun(list(argv))
    return 0
