"""The frozen base of a checkpoint saved without it (`save_frozen_weights=False`, or a QLoRA base), read back
from the Hugging Face folder it was built from, for the merged export (`tp3d export CKPT OUT --base FOLDER`).

Such a checkpoint records a fingerprint of the frozen weights instead of them (`frozen_fingerprint`: the
SHA-256 of each whole tensor's dtype, shape and bytes by name, hashed in name order; the strategy computes
it at save over every stage and tp / dp part, `strategies.checkpointing`). `FrozenBase` names the folder's
tensors as the trained network named them (a PEFT LoRA layer's weight is `<layer>.base_layer.weight` under
the PEFT prefix, `io.lora`), gives a QLoRA base's quantised weights the values training saw,
dequant(quant(W)) in the recorded NF4 format (`parallel.nf4.round_trip`), and refuses a folder whose
fingerprint is not the recorded one: the export is then the trained model, or nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lightning_tp3d.io.checkpoint_format import CheckpointError, CheckpointMeta
from lightning_tp3d.io.hf import HFFolder, open_hf_folder
from lightning_tp3d.parallel.nf4 import round_trip
from lightning_tp3d.plan.qlora import NF4Format

__all__ = ["FrozenBase", "frozen_fingerprint", "open_frozen_base", "tensor_digest"]


def tensor_digest(tensor: torch.Tensor) -> str:
    """`dtype(shape):sha256` of a whole plain tensor's bytes."""
    data = tensor.detach().cpu().contiguous().flatten().view(torch.uint8).numpy()
    return f"{tensor.dtype}{tuple(tensor.shape)}:{hashlib.sha256(data).hexdigest()}"


def frozen_fingerprint(digests: Mapping[str, str]) -> dict[str, Any]:
    """The recorded fingerprint of the frozen weights from each one's `tensor_digest`, by name."""
    text = "".join(f"{name}={digest}\n" for name, digest in sorted(digests.items()))
    return {"tensors": len(digests), "sha256": hashlib.sha256(text.encode()).hexdigest()}


class FrozenBase:
    """The frozen tensors of `meta`'s checkpoint from `folder`, named as the checkpoint names its tensors
    (network prefix removed); `trained` are the names the checkpoint holds itself."""

    def __init__(self, folder: HFFolder, meta: CheckpointMeta, trained: set[str]) -> None:
        lora = meta.lora or {}
        prefix, layers = lora.get("prefix", ""), set(lora.get("scaling", {}))
        quantized = lora.get("quantized_base")
        self._folder, self._quantized = folder, quantized
        self._quantized_names = set(quantized["names"]) if quantized is not None else set()
        self.sources: dict[str, str] = {}  # the checkpoint's name -> the folder's
        for name in folder.weight_map:
            layer, _, parameter = name.rpartition(".")
            own = f"{prefix}{layer}.base_layer.{parameter}" if layer in layers else prefix + name
            if own not in trained:
                self.sources[own] = name
        self.shapes = {own: tuple(folder.slice(name).get_shape()) for own, name in self.sources.items()}
        self._check(meta, folder.folder)

    def load(self, name: str) -> torch.Tensor:
        """The frozen tensor `name` as training held it."""
        tensor = self._folder.tensor(self.sources[name])
        if name in self._quantized_names:
            tensor = round_trip(tensor, NF4Format(self._quantized["block_size"], self._quantized["scaler_block_size"]))
        return tensor

    def _check(self, meta: CheckpointMeta, folder: Path) -> None:
        recorded = meta.frozen_weights
        found = frozen_fingerprint({meta.network_prefix + name: tensor_digest(self.load(name))
                                    for name in self.sources})
        if found != recorded:
            raise CheckpointError(
                f"the weights of {folder} ({found['tensors']} tensors, sha256 {found['sha256'][:12]}...) differ from"
                f" the ones the checkpoint was trained on ({recorded.get('tensors')} tensors, sha256"
                f" {str(recorded.get('sha256'))[:12]}...): pass the folder the base model was loaded from, in the"
                " dtype it was trained in."
            )


@contextmanager
def open_frozen_base(folder: str | Path, meta: CheckpointMeta, trained: set[str]) -> Iterator[FrozenBase]:
    """`with open_frozen_base(path, meta, trained) as base: base.load(name)`, checked against `meta`."""
    with open_hf_folder(folder) as hf:
        yield FrozenBase(hf, meta, trained)
