"""A process's random-number state as plain tensors and numbers, so it can be saved per rank and read
back with `torch.load(..., weights_only=True)` (no pickled Python or NumPy objects).

Covered: torch's CPU generator, the generator of the rank's own CUDA device (the current device) when
CUDA is initialised, Python's `random` and NumPy's legacy global generator (`np.random.seed` /
`np.random.rand`). Only the rank's own device: a process that sees all 8 GPUs of a node (torchrun) and
one that sees only its own (SLURM, one GPU per task) save and restore the same state.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng_state", "restore_rng_state"]


def capture_rng_state() -> dict[str, Any]:
    version, mersenne_state, gauss_next = random.getstate()
    bit_generator, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": torch.tensor(mersenne_state, dtype=torch.int64),
                   "gauss_next": gauss_next},
        "numpy": {"bit_generator": bit_generator, "keys": torch.from_numpy(keys.astype(np.int64)),
                  "position": int(position), "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss_next"]))
    numpy = state["numpy"]
    np.random.set_state((numpy["bit_generator"], numpy["keys"].numpy().astype(np.uint32), numpy["position"],
                         numpy["has_gauss"], numpy["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], torch.cuda.current_device())
