"""A `transformers` model's tensors under the names its checkpoints have on the Hub, as `save_pretrained`
writes them: for the merged export, and back for loading such a folder into a sharded network.

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

Loading goes the other way, a region at a time (`held_region`): a rank that holds experts [a, b) of a
fused tensor (expert parallelism, FSDP2 shards: both cut dim 0) reads the pieces of those experts only
and joins each expert's pieces along the one dim where they add up to the held expert's size, in the order
the reverse conversion lists them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_tp3d._compat.transformers import meta_causal_lm, saved_tensors

__all__ = ["HubNames"]

_EXPERT = re.compile(r"\.experts\.(\d+)\.")


class HubNames:
    """The Hub's names of the tensors `entries` ((held name, shape), in the order the model holds them) of
    the `transformers` model `model` (any module of the family, the meta device's will do; `for_config`
    builds one). `entries` are the Hub's (name, shape), held tensor by held tensor; `load(name, load_held)`
    gives the Hub's tensor `name`, reading its held tensor with `load_held` once for all of its pieces;
    `held_region` assembles a region of a held tensor from the Hub's."""

    def __init__(self, model: nn.Module, entries: list[tuple[str, tuple[int, ...]]]) -> None:
        self._model = model
        self._source: dict[str, str] = {}
        self.pieces: dict[str, list[tuple[str, tuple[int, ...]]]] = {}  # held name -> the Hub's, in order
        self.entries: list[tuple[str, tuple[int, ...]]] = []
        for held, shape in entries:
            pieces = saved_tensors(model, {held: torch.empty(shape, device="meta")})
            self.pieces[held] = [(name, tuple(piece.shape)) for name, piece in pieces.items()]
            self.entries += self.pieces[held]
            self._source.update(dict.fromkeys(pieces, held))
        self._loaded: dict[str, torch.Tensor] = {}

    @classmethod
    def for_config(cls, config: dict[str, Any], entries: list[tuple[str, tuple[int, ...]]]) -> HubNames:
        """For a checkpoint's recorded `config.json` (a model of it is built on the meta device)."""
        return cls(meta_causal_lm(config), entries)

    def load(self, name: str, load_held: Callable[[str], torch.Tensor]) -> torch.Tensor:
        if name not in self._loaded:
            held = self._source[name]
            self._loaded = saved_tensors(self._model, {held: load_held(held)})
        return self._loaded.pop(name)

    def held_region(self, held: str, shape: tuple[int, ...], region: tuple[slice, ...],
                    open_piece: Callable[[str], Any]) -> torch.Tensor:
        """`region` of the held tensor `held` (of `shape`) from the Hub's tensors, each opened with
        `open_piece` (anything indexed like a tensor: a safetensors slice reads only what is indexed): a
        renamed tensor is its one piece, read at `region`; a fused experts tensor is the stack over the
        experts in `region[0]` (at least one) of each expert's pieces joined along the dim where their sizes
        add up."""
        pieces = self.pieces[held]
        if len(pieces) == 1 and not _EXPERT.search(pieces[0][0]):
            return open_piece(pieces[0][0])[region]
        by_expert: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
        for name, piece_shape in pieces:
            by_expert.setdefault(int(_EXPERT.search(name).group(1)), []).append((name, piece_shape))
        expert_shape = shape[1:]
        dim = _joined_dim([piece_shape for _, piece_shape in by_expert[0]], expert_shape, held)
        experts = []
        for expert in range(*region[0].indices(shape[0])):
            parts = [open_piece(name)[:] for name, _ in by_expert[expert]]
            whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
            experts.append(whole[region[1:]])
        return torch.stack(experts)


def _joined_dim(shapes: list[tuple[int, ...]], expert_shape: tuple[int, ...], held: str) -> int:
    """The dim along which one expert's pieces (`shapes`) join into `expert_shape`."""
    if len(shapes) == 1 and shapes[0] == expert_shape:
        return 0
    for dim in range(len(expert_shape)):
        others_match = all(shape[:dim] + shape[dim + 1:] == expert_shape[:dim] + expert_shape[dim + 1:]
                           for shape in shapes)
        if others_match and sum(shape[dim] for shape in shapes) == expert_shape[dim]:
            return dim
    raise ValueError(f"{held}: the Hub's per-expert tensors of shapes {shapes} do not join into {expert_shape}.")

