"""Train -> deploy: merged Hugging Face weights from a checkpoint of any layout, deploy-TP shards, import.

* `export_checkpoint` writes a folder that `transformers.AutoModelForCausalLM.from_pretrained` and vLLM
  load as is: `config.json` (`LlamaForCausalLM`) and `model.safetensors`, or numbered shards
  `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`. It streams: the files and
  their headers are planned from the checkpoint's shapes, then each tensor is merged from the
  checkpoint's shards alone (`ModelTensorReader`), converted and written straight to its file (by a
  writer thread, while the next tensor is read), so memory stays near twice the largest tensor whatever
  the model size (no shard is buffered). Files are fsynced, the folder is written as `<out>.partial`
  and moved under its name when complete, replacing an earlier export in one step; a folder that is
  not an earlier export of this package is refused unless `overwrite=True` (`lightning_tp3d.io.folders`).
* `write_deploy_shards` splits such a folder for an N-way tensor-parallel server with the training
  plan's rules (one ledger from training to serving): column-parallel weights (q, k, v, gate, up and
  the head) along dim 0, row-parallel ones (o, down) along dim 1, the vocab-parallel embedding along dim 0
  (vocabulary), norms copied. With N above the kv-head count k, k/v are replicated as vLLM does: rank r
  holds kv head r x k / N.
* `load_hf_weights` fills a network, plain or already sharded (DTensor tp / FSDP shards, pruned
  pipeline stages), from such a folder: each rank reads only the slice of each tensor it holds.

Example usage::

    export_checkpoint("checkpoints/last.ckpt", "export/hf", dtype="bf16", max_shard_size="5GB")
    write_deploy_shards("export/hf", tensor_parallel_size=2)   # export/hf-deploy-tp2/rank-00/...
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_tp3d.io.checkpoint import CheckpointError, ModelTensorReader
from lightning_tp3d.io.folders import check_output_folder, replace_folder, staging_folder
from lightning_tp3d.parallel.materialize import local_region
from lightning_tp3d.plan.config import ModelConfig
from lightning_tp3d.plan.ledger import deploy_problem
from lightning_tp3d.plan.units import parse_size

__all__ = [
    "EXPORT_DTYPES",
    "ExportResult",
    "deploy_folder",
    "deploy_split_dim",
    "export_checkpoint",
    "hf_config",
    "hf_tensor_names",
    "load_hf_weights",
    "open_hf_folder",
    "write_deploy_shards",
]

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
_KV_PROJECTIONS = ("self_attn.k_proj.weight", "self_attn.v_proj.weight")
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_SAFETENSORS_TORCH_DTYPES = {value: key for key, value in _SAFETENSORS_DTYPES.items()}
SAFETENSORS_INDEX = "model.safetensors.index.json"
HF_EXPORT, DEPLOY_SHARDS = "hf-export", "deploy-shards"  # kinds of folder this module writes


@dataclass(frozen=True)
class ExportResult:
    folder: Path
    files: tuple[str, ...]
    total_bytes: int
    deploy_folder: Path | None = None


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


def hf_tensor_names(config: ModelConfig) -> list[str]:
    """Hugging Face Llama tensor names in file order (embedding, layers, final norm, head)."""
    names = ["model.embed_tokens.weight"]
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        names += [prefix + "input_layernorm.weight"]
        names += [f"{prefix}{projection}.weight" for projection in _COLUMN_PARALLEL[:3] + ("self_attn.o_proj",)]
        names += [prefix + "post_attention_layernorm.weight"]
        names += [f"{prefix}{projection}.weight" for projection in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    names.append("model.norm.weight")
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def deploy_split_dim(name: str) -> int | None:
    """The dim along which tensor parallelism splits `name` (None: replicated), as in the training plan."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0
    module = name.removesuffix(".weight")
    if module.endswith(_COLUMN_PARALLEL):
        return 0
    if module.endswith(_ROW_PARALLEL):
        return 1
    return None


# ---------------------------------------------------------------------------------------------- export
def export_checkpoint(
    checkpoint: str | Path,
    output: str | Path,
    dtype: str = "fp32",
    max_shard_size: str | int = "5GB",
    deploy_tp: int | None = None,
    overwrite: bool = False,
) -> ExportResult:
    """Merge a checkpoint of any (tp, pp, dp) into a Hugging Face folder, in this process alone.

    `output` may be new, empty or an earlier export (replaced whole once the new one is complete);
    a folder holding anything else is refused unless `overwrite=True`, which replaces it."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(EXPORT_DTYPES)}.")
    checkpoint, output = Path(checkpoint), Path(output)
    check_output_folder(output, HF_EXPORT, overwrite)
    if deploy_tp is not None:
        check_output_folder(deploy_folder(output, deploy_tp), DEPLOY_SHARDS, overwrite)
    reader = ModelTensorReader(checkpoint)  # checked once, then read one tensor at a time
    meta = reader.meta
    if meta.model_config is None:
        raise CheckpointError(
            f"{checkpoint} records no model config (its network has no `config` with Hugging Face names), so the"
            " Hugging Face config.json cannot be written."
        )
    config = ModelConfig.from_dict(meta.model_config)
    if deploy_tp is not None:
        _check_deploy_tp(config, deploy_tp)
    names = hf_tensor_names(config)
    prefix = meta.network_prefix
    shapes = {name.removeprefix(prefix): tuple(shape) for name, (shape, _) in reader.shapes.items()
              if name.startswith(prefix)}
    missing = [name for name in names if name not in shapes]
    if missing:
        raise CheckpointError(
            f"{checkpoint} lacks {len(missing)} tensor(s) of a Llama model with its config, e.g. {missing[0]!r};"
            " it was not saved from a network with Hugging Face Llama names."
        )

    def load(name: str) -> torch.Tensor:
        return reader.load([prefix + name])[prefix + name]

    result = _write_hf_folder(output, config, [(name, shapes[name]) for name in names], load,
                              EXPORT_DTYPES[dtype], parse_size(max_shard_size))
    if deploy_tp is not None:
        deploy = write_deploy_shards(output, deploy_tp, max_shard_size=max_shard_size, overwrite=overwrite)
        result = ExportResult(result.folder, result.files, result.total_bytes, deploy)
    return result


def _write_hf_folder(output: Path, config: ModelConfig, entries: list[tuple[str, tuple[int, ...]]],
                     load: Callable[[str], torch.Tensor], dtype: torch.dtype, max_shard_bytes: int) -> ExportResult:
    partial = staging_folder(output, HF_EXPORT)
    files, total = _write_safetensors(partial, entries, dtype, load, max_shard_bytes)
    (partial / "config.json").write_text(json.dumps(hf_config(config, dtype), indent=2))
    replace_folder(partial, output)
    return ExportResult(output, files, total)


def _write_safetensors(folder: Path, entries: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                       load: Callable[[str], torch.Tensor], max_bytes: int,
                       metadata: dict[str, str] | None = None) -> tuple[tuple[str, ...], int]:
    """Write `entries` (name, shape) as safetensors files of at most `max_bytes` each (a larger tensor gets
    a file of its own), loading one tensor at a time with `load` and writing its bytes straight to disk.

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
    names = ["model.safetensors"] if count == 1 else [f"model-{index:05d}-of-{count:05d}.safetensors"
                                                       for index in range(1, count + 1)]
    header_metadata = {"format": "pt", **(metadata or {})}
    largest = max(size for shard in shards for _, _, size in shard)
    total, weight_map = 0, {}
    for file_name, shard in zip(names, shards):
        header: dict[str, Any] = {"__metadata__": header_metadata}
        offset = 0
        for name, shape, size in shard:
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
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
        (folder / SAFETENSORS_INDEX).write_text(json.dumps(index_file, indent=2))
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
class _HFFolder:
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
def open_hf_folder(folder: str | Path) -> Iterator[_HFFolder]:
    """`with open_hf_folder(path) as hf: hf.tensor(name)`: tensors read from the files on demand."""
    with ExitStack() as stack:
        yield _HFFolder(Path(folder), stack)


# ---------------------------------------------------------------------------------------------- deploy
def _check_deploy_tp(config: ModelConfig, tensor_parallel_size: int) -> None:
    problem = deploy_problem(config, tensor_parallel_size)
    if problem is None and config.vocab_size % tensor_parallel_size:
        padded = -(-config.vocab_size // tensor_parallel_size) * tensor_parallel_size
        problem = (f"{tensor_parallel_size} does not divide vocab_size={config.vocab_size} (pad the vocabulary to"
                   f" {padded})")
    if problem is not None:
        raise ValueError(f"--deploy-tp {tensor_parallel_size} is not valid for this model: {problem}.")


def deploy_folder(hf_folder: Path, tensor_parallel_size: int) -> Path:
    """Where `write_deploy_shards` writes by default: `<export>-deploy-tp<N>` beside the export."""
    return hf_folder.with_name(f"{hf_folder.name}-deploy-tp{tensor_parallel_size}")


def write_deploy_shards(hf_folder: str | Path, tensor_parallel_size: int, output: str | Path | None = None,
                        max_shard_size: str | int = "5GB", overwrite: bool = False) -> Path:
    """Per-rank folders `rank-00` ... for an N-way tensor-parallel server, plus `sharding.json` stating
    each tensor's split dim (null: copied) and whether k/v heads are replicated. `output` follows the
    rules of `export_checkpoint`'s (new, empty or an earlier set of deploy shards, else `overwrite`)."""
    hf_folder = Path(hf_folder)
    config = ModelConfig.from_json(hf_folder / "config.json")
    _check_deploy_tp(config, tensor_parallel_size)
    output = Path(output) if output is not None else deploy_folder(hf_folder, tensor_parallel_size)
    check_output_folder(output, DEPLOY_SHARDS, overwrite)
    partial = staging_folder(output, DEPLOY_SHARDS)
    kv_replicated = tensor_parallel_size > config.num_key_value_heads
    names = hf_tensor_names(config)
    with open_hf_folder(hf_folder) as hf:
        dtype = hf.slice(names[0]).get_dtype()
        for rank in range(tensor_parallel_size):
            folder = partial / f"rank-{rank:02d}"
            folder.mkdir()
            shapes = [(name, _rank_piece_shape(hf, name, tensor_parallel_size, config, kv_replicated))
                      for name in names]
            _write_safetensors(folder, shapes, _SAFETENSORS_TORCH_DTYPES[dtype],
                               lambda name, rank=rank: _rank_piece(hf, name, rank, tensor_parallel_size, config,
                                                                   kv_replicated),
                               parse_size(max_shard_size),
                               {"tensor_parallel_size": str(tensor_parallel_size), "rank": str(rank)})
            shutil.copy(hf_folder / "config.json", folder / "config.json")
    sharding = {"tensor_parallel_size": tensor_parallel_size, "kv_heads_replicated": kv_replicated,
                "split_dim": {name: deploy_split_dim(name) for name in names}}
    (partial / "sharding.json").write_text(json.dumps(sharding, indent=2))
    replace_folder(partial, output)
    return output


def _pieces(name: str, rank: int, tp: int, config: ModelConfig, kv_replicated: bool) -> tuple[int, int]:
    """(number of equal pieces along the split dim, the piece rank `rank` holds)."""
    if kv_replicated and name.endswith(_KV_PROJECTIONS):
        return config.num_key_value_heads, rank * config.num_key_value_heads // tp
    return tp, rank


def _rank_piece_shape(hf: _HFFolder, name: str, tp: int, config: ModelConfig, kv_replicated: bool) -> tuple[int, ...]:
    shape = list(hf.slice(name).get_shape())
    dim = deploy_split_dim(name)
    if dim is not None:
        shape[dim] //= _pieces(name, 0, tp, config, kv_replicated)[0]
    return tuple(shape)


def _rank_piece(hf: _HFFolder, name: str, rank: int, tp: int, config: ModelConfig, kv_replicated: bool) -> torch.Tensor:
    dim = deploy_split_dim(name)
    if dim is None:
        return hf.tensor(name)
    pieces, index = _pieces(name, rank, tp, config, kv_replicated)
    view = hf.slice(name)
    size = view.get_shape()[dim] // pieces
    selection = [slice(None)] * len(view.get_shape())
    selection[dim] = slice(index * size, (index + 1) * size)
    return view[tuple(selection)]


# ---------------------------------------------------------------------------------------------- import
@torch.no_grad()
def load_hf_weights(network: nn.Module, hf_folder: str | Path) -> int:
    """Copy a Hugging Face folder's tensors into `network`'s parameters and persistent buffers, each rank
    reading only its own slice (DTensor local shard; a pruned pipeline stage has only its own tensors).
    Returns the number of tensors loaded; names must match (the reference decoder uses Hugging Face names)."""
    hf_folder = Path(hf_folder)
    loaded = 0
    with open_hf_folder(hf_folder) as hf:
        persistent = set(network.state_dict(keep_vars=True))
        targets = dict(network.named_parameters())  # tied parameters appear once, under their first name
        targets.update({name: buffer for name, buffer in network.named_buffers() if name in persistent})
        missing = [name for name in targets if name not in hf.weight_map]
        if missing:
            raise ValueError(
                f"{hf_folder} has no tensor for {len(missing)} of the network's parameters, e.g. {missing[0]!r};"
                " the network must use Hugging Face Llama names."
            )
        for name, target in targets.items():
            view = hf.slice(name)
            if tuple(view.get_shape()) != tuple(target.shape):
                raise ValueError(
                    f"{name}: {hf_folder} holds shape {list(view.get_shape())}, the network expects"
                    f" {list(target.shape)}."
                )
            if isinstance(target, DTensor):
                local, region = local_region(target)
                local.copy_(view[region] if local.numel() else local)
            else:
                target.copy_(view[:])
            loaded += 1
    return loaded

