"""LoRA in the ledgers: the factors a LoRA fine-tune adds to each block, on one tp rank, before anything runs.

A LoRA target is a block's linear layer (`plan.sharding.LAYER_WEIGHTS`: q, k, v, o, gate, up, down) with
weight W (out x in); rank r adds A (r x in) and B (out x r), sharded with W (`models.lora`): a column-parallel
W keeps A whole and splits B's rows over t, a row-parallel W splits A's columns and keeps B whole. So on a tp
rank a target holds r (in + out / t) (column) or r (in / t + out) (row) trainable parameters, while the
block's own weights are frozen: they keep their bytes but no gradient and no optimizer state. Backward
needs A x, r values per token and target (the input x is the base layer's own).
"""

from __future__ import annotations

from lightning_tp3d.plan.config import ModelConfig
from lightning_tp3d.plan.sharding import LAYER_WEIGHTS

__all__ = ["DEFAULT_LORA_TARGETS", "LORA_TARGETS", "check_lora_options", "lora_layer_shapes"]

LORA_TARGETS = tuple(weight.module.rpartition(".")[2] for weight in LAYER_WEIGHTS if weight.split != "replicated")
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def check_lora_options(rank: int, targets: tuple[str, ...]) -> None:
    if rank < 0:
        raise ValueError(f"lora_rank={rank} must be >= 0 (0: no LoRA, every parameter trains).")
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown or (rank and not targets):
        raise ValueError(f"lora_targets {unknown or '[]'} must be among {list(LORA_TARGETS)} (a block's linear"
                         " layers; the ledger does not model LoRA on the embedding or the head).")


def lora_layer_shapes(config: ModelConfig, tp: int, rank: int, targets: tuple[str, ...]
                      ) -> list[tuple[tuple[int, int], int | None]]:
    """One block's LoRA factors on a tp rank, A then B per target in registration order: (local shape, the
    dim tp splits or None)."""
    factors: list[tuple[tuple[int, int], int | None]] = []
    for weight in LAYER_WEIGHTS:
        if weight.module.rpartition(".")[2] not in targets or not rank:
            continue
        out, inp = weight.shape(config)
        if weight.split == "column":
            factors += [((rank, inp), None), ((out // tp, rank), 0 if tp > 1 else None)]
        else:
            factors += [((rank, inp // tp), 1 if tp > 1 else None), ((out, rank), None)]
    return factors
