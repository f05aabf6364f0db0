"""A `transformers` model's tensors under the names its checkpoints have on the Hub, as `save_pretrained`
writes them, for the merged export.

transformers 5 holds a mixture-of-experts block's routed experts fused (`mlp.experts.gate_up_proj` of
shape [E, 2I, h], `mlp.experts.down_proj` [E, h, I]) and Mixtral's `block_sparse_moe` as `mlp`, converting
the Hub's per-expert tensors (`mlp.experts.<e>.gate_proj.weight` [I, h], `up_proj`, `down_proj` [h, I];
Mixtral's `w1`, `w3`, `w2`) while loading. vLLM reads only the Hub's names, and transformers reads both, so
the export writes the Hub's: each held tensor becomes the tensors `save_pretrained` would write for it
(transformers' own reverse conversion, `_compat.transformers.saved_tensors`; gate_up_proj[e] = [gate; up]
along dim 0 of the expert's slice). The names and shapes are planned on the meta device before any value is
read; each held tensor is then read once, and its pieces are handed out as the writer asks for them (one
held tensor's pieces in memory at a time). A family without a conversion keeps its names: the mapping is
the identity.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_tp3d._compat.transformers import meta_causal_lm, saved_tensors

__all__ = ["HubNames"]


class HubNames:
    """The Hub's names of the tensors `entries` ((held name, shape), in the order the model holds them) of
    the `transformers` model whose `config.json` is `config`. `entries` are the Hub's (name, shape), held
    tensor by held tensor; `load(name, load_held)` gives the Hub's tensor `name`, reading its held tensor
    with `load_held` once for all of its pieces."""

    def __init__(self, config: dict[str, Any], entries: list[tuple[str, tuple[int, ...]]]) -> None:
        self._model = meta_causal_lm(config)
        self._source: dict[str, str] = {}
        self.entries: list[tuple[str, tuple[int, ...]]] = []
        for held, shape in entries:
            for name, piece in saved_tensors(self._model, {held: torch.empty(shape, device="meta")}).items():
                self.entries.append((name, tuple(piece.shape)))
                self._source[name] = held
        self._pieces: dict[str, torch.Tensor] = {}

    def load(self, name: str, load_held: Callable[[str], torch.Tensor]) -> torch.Tensor:
        if name not in self._pieces:
            held = self._source[name]
            self._pieces = saved_tensors(self._model, {held: load_held(held)})
        return self._pieces.pop(name)
