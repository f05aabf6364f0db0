"""The checkpoint format, and reading a checkpoint in one process (no process group needed).

A checkpoint is a folder::

    meta.json           format, layout (tp, pp, dp), step, epoch, consumed samples, model config and
                        library versions; written last
    trainer_state.pt    rank 0: the trainer's state (loops, callbacks, LR schedulers, hyper-parameters)
                        and the optimizers' non-tensor values (learning rate, betas, ...)
    rng/rank_00003.pt   per rank: torch, CUDA, Python and NumPy random states
    .metadata, *.distcp torch.distributed.checkpoint (DCP) shards of every tensor under its global name
                        and global shape: `module.<parameter name>` for the model and
                        `optimizer_<i>.state.<parameter name>.<state>` for the optimizers

The folder may be on remote storage, named by an fsspec URL (`s3://bucket/run/last.ckpt`, see
`lightning_tp3d.io.storage`); it is read there directly.

meta.json records the SHA-256 of every other file (`file_hashes`, computed from the bytes as they were
written) and the rank that wrote it; readers check the files they read against it (`verify_files`).

Because DCP stores each tensor by global name and global shape, and every rank asks only for the
pieces it holds (its pipeline stages, its tp slice, its FSDP shard), a checkpoint written at one
layout loads at any other. The `.pt` files hold only tensors, numbers, strings and containers and are
read with `torch.load(..., weights_only=True)`; the DCP index with a restricted unpickler
(`io.dcp_files`); no value of the checkpoint is unpickled as an object.

`lightning_tp3d.io.checkpoint` saves and loads such folders from running processes.

Example usage::

    meta = read_meta(path)                  # checked meta.json
    weights = load_model_tensors(path)      # one process: whole tensors by parameter name
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_tp3d.io.dcp_files import (
    DCP_INDEX_FILE,
    SafeFileSystemReader,
    UnsafeCheckpointError,
    file_sha256,
    read_dcp_index,
)
from lightning_tp3d.io.folders import PARTIAL_SUFFIX, REPLACED_SUFFIX, recovered_path
from lightning_tp3d.io.storage import location

__all__ = [
    "CheckpointError",
    "CheckpointMeta",
    "META_FILE",
    "MODEL_GROUP",
    "ModelTensorReader",
    "RNG_FOLDER",
    "TRAINER_STATE_FILE",
    "check_shard_files",
    "checkpoint_folder",
    "damaged_files",
    "dcp_single_process_notice_silenced",
    "is_checkpoint_folder",
    "is_complete",
    "load_model_tensors",
    "load_weights_only",
    "model_tensor_shapes",
    "read_index",
    "read_lightning_checkpoint",
    "read_meta",
    "raise_damaged",
    "rng_file_name",
    "verify_files",
]

FORMAT = "lightning_tp3d"
FORMAT_VERSION = 1
META_FILE = "meta.json"
TRAINER_STATE_FILE = "trainer_state.pt"
RNG_FOLDER = "rng"
MODEL_GROUP = "module"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit; the message names the file and the problem."""


def _library_versions() -> dict[str, str]:
    return {"lightning_tp3d": version("lightning-tp3d"), "torch": version("torch"), "lightning": version("lightning")}


@dataclass
class CheckpointMeta:
    """What `meta.json` records. `layout` is `ParallelLayout.to_dict()` of the run that saved.

    `consumed_samples` counts the global samples trained on since the start of the run and
    `consumed_samples_in_epoch` those of the current epoch (a step of per-rank batch b at data-parallel
    size d consumes b x d), which is what lets a resume at another d continue the same sample stream.
    `network_prefix` is the prefix of the network's parameter names inside the module's state, e.g.
    `"model."` for `LightningModule.model`.
    """

    layout: dict[str, Any]
    world_size: int
    global_step: int = 0
    epoch: int = 0
    consumed_samples: int = 0
    consumed_samples_in_epoch: int = 0
    network_prefix: str = ""
    model_config: dict[str, Any] | None = None
    # a PEFT LoRA model: {"prefix": "base_model.model.", "scaling": {layer: {adapter: alpha / r}},
    # "configs": {adapter: its LoraConfig}}, what an export merges (`io.lora`)
    lora: dict[str, Any] | None = None
    # the frozen weights left out of the checkpoint (`save_frozen_weights=False`): {"tensors": count,
    # "sha256": the digest of their names and whole contents, the same at every layout}
    frozen_weights: dict[str, Any] | None = None
    data_parallel_mode: str = "replicate"
    accumulate_grad_batches: int = 1  # batches per optimizer step (a resume at another one converts the counts)
    precision: str | None = None  # Lightning's training precision, e.g. "bf16-mixed"
    loss: float | None = None  # the last training loss (mean over dp replicas) before the save
    loss_mean: float | None = None  # mean and standard deviation of the last steps' losses
    loss_std: float | None = None
    # every other file of the folder -> {"sha256": hex digest, "rank": the rank that wrote it}
    file_hashes: dict[str, dict[str, Any]] | None = None
    versions: dict[str, str] = field(default_factory=_library_versions)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    @property
    def parallel_sizes(self) -> tuple[int, int, int]:
        """(tensor, pipeline, data) parallel sizes of the run that saved."""
        return (self.layout["tensor_parallel_size"], self.layout["pipeline_parallel_size"],
                self.layout["data_parallel_size"])

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True, default=str)


def is_complete(folder: Path) -> bool:
    return (folder / META_FILE).is_file()  # written last, after every rank finished


def checkpoint_folder(path: str | Path) -> Path:
    """The folder holding the checkpoint saved as `path`: `path`, or the complete folder of a replacement of
    it that was interrupted between its two renames (see `lightning_tp3d.io.folders`)."""
    return recovered_path(location(path), is_complete)


@contextmanager
def dcp_single_process_notice_silenced() -> Iterator[None]:
    """DCP warns that it assumes one process when no process group exists, which is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def rng_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


# ---------------------------------------------------------------------------------------------- read
def read_meta(path: str | Path) -> CheckpointMeta:
    """Read and check `meta.json`; every way a path can fail to be a whole checkpoint has its own message."""
    path = location(path)
    if path.name.endswith(PARTIAL_SUFFIX):
        raise CheckpointError(
            f"{path} is an unfinished save (interrupted before every rank had written); load"
            f" {path.name.removesuffix(PARTIAL_SUFFIX)} or another complete checkpoint instead."
        )
    path = checkpoint_folder(path)
    if not path.exists():
        siblings = (path.with_name(path.name + PARTIAL_SUFFIX), path.with_name(path.name + REPLACED_SUFFIX))
        hints = [f" {sibling} exists: a save to this name was interrupted" for sibling in siblings if sibling.exists()]
        raise CheckpointError(f"Checkpoint {path} does not exist.{';'.join(hints)}")
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is a file, but a lightning_tp3d checkpoint is a folder ({META_FILE} + DCP shards); a single-file"
            " checkpoint of another strategy cannot be resumed with TP3DStrategy."
        )
    meta_file = path / META_FILE
    if not meta_file.is_file():
        raise CheckpointError(
            f"{path} has no {META_FILE}: it is not a lightning_tp3d checkpoint, or the save that wrote it did not"
            " complete."
        )
    try:
        values = json.loads(meta_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{meta_file} is not valid JSON ({error}); the checkpoint is damaged.") from None
    if not isinstance(values, dict) or values.get("format") != FORMAT:
        raise CheckpointError(f"{meta_file} does not describe a lightning_tp3d checkpoint (format is not {FORMAT!r}).")
    if values.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {values['format_version']}, newer than this lightning_tp3d reads"
            f" ({FORMAT_VERSION}); upgrade lightning_tp3d."
        )
    known = {item.name for item in fields(CheckpointMeta)}
    return CheckpointMeta(**{key: value for key, value in values.items() if key in known})


def read_index(path: Path) -> Metadata:
    """The DCP index, read with the restricted unpickler (`io.dcp_files.read_dcp_index`)."""
    try:
        return read_dcp_index(path)
    except UnsafeCheckpointError as error:
        raise CheckpointError(str(error)) from None
    except Exception as error:  # noqa: BLE001
        raise CheckpointError(
            f"The DCP index {path / '.metadata'} cannot be read ({type(error).__name__}: {error}); the checkpoint"
            " is damaged."
        ) from None


def check_shard_files(path: Path, metadata: Metadata) -> None:
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"Shard {file} is missing; the checkpoint is incomplete. Use another checkpoint.")
        actual = file.stat().st_size
        if actual < size:
            raise CheckpointError(
                f"Shard {file} is truncated: {actual} bytes on disk, the DCP index needs at least {size}. The"
                " file was cut short after the save; restore it or use another checkpoint."
            )


def load_weights_only(file: Path) -> Any:
    if not file.is_file():
        raise CheckpointError(f"{file} is missing; the checkpoint is incomplete.")
    try:
        with file.open("rb") as handle:
            return torch.load(handle, weights_only=True, map_location="cpu")
    except Exception as error:  # noqa: BLE001 - a truncated file, or one holding pickled objects
        raise CheckpointError(f"{file} cannot be read safely ({type(error).__name__}: {error}).") from None


def damaged_files(folder: Path, meta: CheckpointMeta, names: Iterable[str] | None = None) -> list[str]:
    """What is wrong with the recorded files among `names` (default: all of them): each missing file, and
    each whose SHA-256 is not the one recorded when it was written; empty when all are whole."""
    recorded = meta.file_hashes or {}
    selected = sorted(recorded if names is None else set(names) & set(recorded))

    def problem(name: str) -> str | None:
        expected, rank, file = recorded[name]["sha256"], recorded[name]["rank"], folder / name
        if not file.is_file():
            return f"{file} (written by rank {rank}) is missing"
        found = file_sha256(file)
        if found != expected:
            return (f"{file} (written by rank {rank}) does not match the SHA-256 recorded when it was saved"
                    f" ({expected[:16]}... recorded, {found[:16]}... on disk)")
        return None

    # hashlib releases the GIL on large buffers: the files are hashed on every core at once.
    with ThreadPoolExecutor(max_workers=min(len(selected), os.cpu_count() or 1) or 1) as pool:
        return [found for found in pool.map(problem, selected) if found is not None]


def raise_damaged(folder: Path, problems: list[str]) -> None:
    if problems:
        raise CheckpointError(
            f"Checkpoint {folder} is damaged: {'; '.join(problems[:3])}"
            + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
            + ". The files were altered or damaged after the save: restore them or use another checkpoint"
            " (TP3DStrategy(verify_checkpoints=False) or `tp3d export --no-verify` load it unchecked)."
        )


def verify_files(folder: Path, meta: CheckpointMeta, names: Iterable[str] | None = None) -> None:
    """Refuse the checkpoint when one of the files `names` (default: all) is missing or not as written; a
    checkpoint written before files were hashed is loaded unchecked, with a warning."""
    if meta.file_hashes is None:
        warnings.warn(f"Checkpoint {folder} records no file hashes (written by an earlier lightning_tp3d): its files"
                      " are loaded unchecked.", stacklevel=2)
        return
    raise_damaged(folder, damaged_files(folder, meta, names))


# ---------------------------------------------------------------------------------------------- consolidate
class ModelTensorReader:
    """Whole model tensors of a checkpoint, merged from every shard, in this process alone.

    The checkpoint is checked and its DCP index read once (meta.json, the index's recorded hash unless
    `verify=False`, shard files); `load` then reads only the requested tensors, so a caller asking for one
    name at a time streams the model (export does) without paying for the index on every call. The shards
    holding model tensors are checked against their hashes before the first tensor is read (not for the
    shapes alone).
    """

    def __init__(self, path: str | Path, verify: bool = True) -> None:
        self.meta = read_meta(path)
        self.path = checkpoint_folder(path)
        if verify:
            verify_files(self.path, self.meta, [DCP_INDEX_FILE])
        metadata = read_index(self.path)
        check_shard_files(self.path, metadata)
        self._metadata = metadata
        prefix = MODEL_GROUP + "."
        self.shapes: dict[str, tuple[torch.Size, torch.dtype]] = {
            key.removeprefix(prefix): (entry.size, entry.properties.dtype)
            for key, entry in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
        self._shards_checked = not verify

    def load(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        names = list(self.shapes) if names is None else list(names)
        unknown = [name for name in names if name not in self.shapes]
        if unknown:
            raise CheckpointError(f"Checkpoint {self.path} has no model tensor {unknown[0]!r}.")
        if not self._shards_checked:
            model_files = {info.relative_path for index, info in (self._metadata.storage_data or {}).items()
                           if index.fqn.startswith(MODEL_GROUP + ".")}
            raise_damaged(self.path, damaged_files(self.path, self.meta, model_files))
            self._shards_checked = True
        tensors = {f"{MODEL_GROUP}.{name}": torch.empty(self.shapes[name][0], dtype=self.shapes[name][1])
                   for name in names}
        with dcp_single_process_notice_silenced():
            dcp.load(tensors, storage_reader=SafeFileSystemReader(self.path, self._metadata), no_dist=True)
        return {key.removeprefix(MODEL_GROUP + "."): tensor for key, tensor in tensors.items()}


def model_tensor_shapes(path: str | Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Whole (global) shape and dtype of every model tensor, by parameter name of the saved module."""
    return ModelTensorReader(path).shapes


def load_model_tensors(path: str | Path, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Whole model tensors (all, or `names`) merged from every shard, in this process alone."""
    return ModelTensorReader(path).load(names)


def is_checkpoint_folder(path: str | Path) -> bool:
    """Whether `path` (a path or an fsspec URL) is a folder holding a complete checkpoint of this package;
    False for a web address (Lightning downloads those as one file) and for a URL whose protocol no
    installed fsspec filesystem reads."""
    if str(path).startswith(("http://", "https://")):
        return False
    try:
        folder = location(path)
        return folder.is_dir() and is_complete(checkpoint_folder(folder))
    except (ImportError, ValueError):
        return False


def read_lightning_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint as Lightning's one-file checkpoint dict, in this process alone: the saved trainer state
    (hyper-parameters, loops, callbacks, LR schedulers) with `state_dict` holding the whole model tensors
    under the LightningModule's names. It is what `LightningModule.load_from_checkpoint(folder)` reads; the
    optimizer states, which loading a module does not need, are left out."""
    reader = ModelTensorReader(path)
    raise_damaged(reader.path, damaged_files(reader.path, reader.meta, [TRAINER_STATE_FILE]))
    trainer_state = load_weights_only(reader.path / TRAINER_STATE_FILE)["trainer"]
    return {**trainer_state, "state_dict": reader.load()}
