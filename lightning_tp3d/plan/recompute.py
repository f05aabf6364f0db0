"""Which blocks activation recompute covers: the options and the layer arithmetic (no torch).

Granularity (Megatron's names): `full` recomputes whole blocks, `selective` only the part of each block
named by the target (by default the attention core, `self_attn.core_attention`). Which blocks
(`method`, `num_layers` = N): `uniform` every N-th block by global layer index (N = 1: every block), as
torchtitan's layer option; `block` the first N blocks of each pipeline stage, as Megatron's block method.
`lightning_tp3d.parallel.recompute` applies the choice to a network; the ledger counts its memory.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DEFAULT_SELECTIVE_TARGET", "RECOMPUTE_GRANULARITIES", "RECOMPUTE_METHODS", "check_recompute_options",
           "recomputed_layers"]

RECOMPUTE_GRANULARITIES = ("none", "full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
DEFAULT_SELECTIVE_TARGET = "self_attn.core_attention"


def check_recompute_options(granularity: str, method: str, num_layers: int) -> None:
    if granularity not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"recompute={granularity!r} is not one of {list(RECOMPUTE_GRANULARITIES)}.")
    if method not in RECOMPUTE_METHODS:
        raise ValueError(f"recompute_method={method!r} is not one of {list(RECOMPUTE_METHODS)}.")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"recompute_num_layers must be a positive integer, got {num_layers!r}.")


def recomputed_layers(stage_layers: Sequence[Sequence[int]], method: str, num_layers: int) -> list[int]:
    """Global indices of the recomputed blocks, given the global layer indices of each stage."""
    if method == "uniform":
        return [layer for layers in stage_layers for layer in layers if layer % num_layers == 0]
    return [layer for layers in stage_layers for layer in list(layers)[:num_layers]]
