"""Hugging Face folders: `config.json`, safetensors files written streaming and read lazily, and the
import of such a folder into a live (sharded) network.

* `hf_config` is the `config.json` of a `LlamaForCausalLM` of a `ModelConfig`'s shape; tensor names
  and their tp split come from `plan.sharding`.
* `write_safetensors` plans the files and their headers from the shapes, then writes each tensor straight
  to its file as it is loaded (a writer thread writes while the next tensor loads), so memory stays near
  twice the largest tensor whatever the model size; files are fsynced. More than one file gets
  `model.safetensors.index.json`, as `transformers` writes it.
* `open_hf_folder` reads tensors (or slices of them) on demand from a single file or an index.
* `load_hf_weights` fills a network, plain or already sharded (DTensor tp / FSDP shards, pruned
  pipeline stages), from such a folder: each rank reads only the slice of each tensor it holds.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from lightning_tp3d.io.hub_names import HubNames
from lightning_tp3d.parallel.materialize import local_region
from lightning_tp3d.plan.config import ModelConfig

__all__ = ["EXPORTED_AS_HELD", "EXPORT_DTYPES", "HFFolder", "SAFETENSORS_DTYPES", "SAFETENSORS_INDEX",
           "exported_as_held", "hf_config", "hf_config_for", "load_hf_weights", "open_hf_folder", "write_safetensors"]

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
SAFETENSORS_INDEX = "model.safetensors.index.json"


def hf_config(config: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """`config.json` of a Hugging Face `LlamaForCausalLM` with this shape."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
        "attention_dropout": config.attention_dropout, "initializer_range": config.initializer_range,
        "torch_dtype": _TORCH_DTYPE_NAMES[dtype],
    }



# `transformers` model types whose tensors are not Llama's: exported under the names their checkpoints have
# on the Hub (`io.hub_names`: the experts one tensor each, as `save_pretrained` writes them), every one of
# them, with no Llama names to check and no deploy shards (whose split table is Llama's).
EXPORTED_AS_HELD = ("deepseek_v3", "qwen3_moe", "mixtral")


def exported_as_held(saved: dict[str, Any]) -> bool:
    """Whether a checkpoint's recorded model config is one of `EXPORTED_AS_HELD`."""
    return saved.get("model_type") in EXPORTED_AS_HELD


def hf_config_for(saved: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """`config.json` for a checkpoint's recorded model config: a `transformers` config (it has a
    `model_type`) is written as it is, with the export's dtype; the reference decoder's shape becomes a
    `LlamaForCausalLM` config (`hf_config`)."""
    if "model_type" not in saved:
        return hf_config(ModelConfig.from_dict(saved), dtype)
    config = dict(saved)
    for key in [key for key in ("torch_dtype", "dtype") if key in config] or ["torch_dtype"]:
        config[key] = _TORCH_DTYPE_NAMES[dtype]
    return config


# ---------------------------------------------------------------------------------------------- write
def write_safetensors(folder: Path, entries: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                       load: Callable[[str], torch.Tensor], max_bytes: int,
                       metadata: dict[str, str] | None = None, stem: str = "model") -> tuple[tuple[str, ...], int]:
    """Write `entries` (name, shape) as safetensors files of at most `max_bytes` each (a larger tensor gets
    a file of its own), loading one tensor at a time with `load` and writing its bytes straight to disk;
    the files are `<stem>.safetensors`, or numbered `<stem>-0000k-of-0000n.safetensors` with an index.

    The files are planned from the shapes before any tensor is read, so every header is known up front
    and no shard is ever held in memory (see `_write_tensors` for the peak). Format: 8-byte
    little-endian header length, the JSON header padded to 8 bytes, then the raw little-endian data.
    """
    element = torch.empty((), dtype=dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...], int]]] = [[]]
    shard_bytes = 0
    for name, shape in entries:
        size = math.prod(shape) * element
        if shards[-1] and shard_bytes + size > max_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, shape, size))
        shard_bytes += size
    count = len(shards)
    names = [f"{stem}.safetensors"] if count == 1 else [f"{stem}-{index:05d}-of-{count:05d}.safetensors"
                                                         for index in range(1, count + 1)]
    header_metadata = {"format": "pt", **(metadata or {})}
    largest = max(size for shard in shards for _, _, size in shard)
    total, weight_map = 0, {}
    for file_name, shard in zip(names, shards):
        header: dict[str, Any] = {"__metadata__": header_metadata}
        offset = 0
        for name, shape, size in shard:
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[name] = file_name
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(folder / file_name, "wb") as file:
            file.write(struct.pack("<Q", len(encoded)))
            file.write(encoded)
            _write_tensors(file, shard, dtype, load, largest)
            file.flush()
            os.fsync(file.fileno())  # on disk before the folder is renamed into place
        total += offset
    if count > 1:
        index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index_file, indent=2))
    return tuple(names), total


def _write_tensors(file: Any, shard: list[tuple[str, tuple[int, ...], int]], dtype: torch.dtype,
                   load: Callable[[str], torch.Tensor], in_flight_limit: int) -> None:
    """Write the shard's tensors in order, a writer thread writing while this one loads the next tensor.

    The tensors handed to the writer and not yet written plus the one being loaded stay within
    `in_flight_limit` bytes (the largest tensor). Loading a tensor of s bytes briefly holds it twice (the
    read bytes and the result), so the peak is at most limit - s + 2 s <= 2 x limit, the serial bound."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tp3d-export") as writer:
        pending: deque[tuple[Future[None], int]] = deque()
        for name, shape, size in shard:
            while pending and sum(queued for _, queued in pending) + size > in_flight_limit:
                pending.popleft()[0].result()
            tensor = load(name).to(dtype).contiguous()
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{name}: expected shape {list(shape)}, got {list(tensor.shape)}.")
            pending.append((writer.submit(_write_tensor, file, tensor), size))
        for future, _ in pending:
            future.result()


def _write_tensor(file: Any, tensor: torch.Tensor) -> None:
    file.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    _start_writeback(file)


def _start_writeback(file: Any) -> None:
    """Have the kernel start writing what `file` holds so far to disk while the next tensor is read
    (Linux: POSIX_FADV_DONTNEED writes dirty pages back asynchronously, then drops them from the cache),
    so the final fsync finds little left to do. Elsewhere the fsync does all the writing."""
    if hasattr(os, "posix_fadvise"):
        file.flush()
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


# ---------------------------------------------------------------------------------------------- read
class HFFolder:
    """Tensors of a Hugging Face safetensors folder (single file or index), opened lazily by name."""

    def __init__(self, folder: Path, stack: ExitStack) -> None:
        index = folder / SAFETENSORS_INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (folder / "model.safetensors").is_file():
            with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
                weight_map = dict.fromkeys(handle.keys(), "model.safetensors")
        else:
            raise FileNotFoundError(f"{folder} has neither model.safetensors nor {SAFETENSORS_INDEX}.")
        self.folder, self.weight_map = folder, weight_map
        self._stack = stack
        self._handles: dict[str, Any] = {}

    def _handle(self, name: str) -> Any:
        if name not in self.weight_map:
            raise KeyError(f"{self.folder} has no tensor {name!r}.")
        file_name = self.weight_map[name]
        if file_name not in self._handles:
            opened = safe_open(str(self.folder / file_name), framework="pt")
            self._handles[file_name] = self._stack.enter_context(opened)
        return self._handles[file_name]

    def tensor(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def slice(self, name: str) -> Any:
        return self._handle(name).get_slice(name)


@contextmanager
def open_hf_folder(folder: str | Path) -> Iterator[HFFolder]:
    """`with open_hf_folder(path) as hf: hf.tensor(name)`: tensors read from the files on demand."""
    with ExitStack() as stack:
        yield HFFolder(Path(folder), stack)


# ---------------------------------------------------------------------------------------------- import
def _holds_hub_conversions(network: nn.Module) -> bool:
    """Whether `network` is a `transformers` model of `EXPORTED_AS_HELD` (held under other names than the
    Hub's: `io.hub_names`)."""
    return getattr(getattr(network, "config", None), "model_type", None) in EXPORTED_AS_HELD


@torch.no_grad()
def load_hf_weights(network: nn.Module, hf_folder: str | Path) -> int:
    """Copy a Hugging Face folder's tensors into `network`'s parameters and persistent buffers, each rank
    reading only its own slice (DTensor local shard; a pruned pipeline stage has only its own tensors).
    Returns the number of tensors loaded; names must match (the reference decoder uses Hugging Face names),
    but for a mixture of experts' fused experts (and Mixtral's renamed block), read from the Hub's per-expert
    tensors, each rank only its experts' (`io.hub_names.HubNames.held_region`)."""
    hf_folder = Path(hf_folder)
    loaded = 0
    with open_hf_folder(hf_folder) as hf:
        persistent = set(network.state_dict(keep_vars=True))
        targets = dict(network.named_parameters())  # tied parameters appear once, under their first name
        targets.update({name: buffer for name, buffer in network.named_buffers() if name in persistent})
        absent = {name: tuple(target.shape) for name, target in targets.items() if name not in hf.weight_map}
        hub = HubNames(network, list(absent.items())) if absent and _holds_hub_conversions(network) else None
        # the folder's tensors (name, expected shape) each target is read from
        sources = {name: [(name, tuple(target.shape))] if name not in absent else hub.pieces[name] if hub else []
                   for name, target in targets.items()}
        missing = [name for name, pieces in sources.items()
                   if not pieces or any(piece not in hf.weight_map for piece, _ in pieces)]
        if missing:
            raise ValueError(
                f"{hf_folder} has no tensor for {len(missing)} of the network's parameters, e.g. {missing[0]!r};"
                " the folder must hold the network's names (Hugging Face Llama names for the reference decoder, a"
                " mixture of experts' per-expert names as save_pretrained writes them)."
            )
        for name, target in targets.items():
            for piece, shape in sources[name]:
                held_shape = tuple(hf.slice(piece).get_shape())
                if held_shape != shape:
                    raise ValueError(f"{piece}: {hf_folder} holds shape {list(held_shape)}, the network expects"
                                     f" {list(shape)}.")
            local, region = local_region(target)
            if local.numel():
                local.copy_(hf.slice(name)[region] if name not in absent
                            else hub.held_region(name, tuple(target.shape), region, hf.slice))
            loaded += 1
    return loaded

