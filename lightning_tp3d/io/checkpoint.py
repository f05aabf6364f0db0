"""Sharded, atomic, resumable checkpoints that load at any (tp, pp, dp).

A checkpoint is a folder::

    meta.json           format, layout (tp, pp, dp), step, epoch, consumed samples, model config and
                        library versions; written last
    trainer_state.pt    rank 0: the trainer's state (loops, callbacks, LR schedulers, hyper-parameters)
                        and the optimizers' non-tensor values (learning rate, betas, ...)
    rng/rank_00003.pt   per rank: torch, CUDA, Python and NumPy random states
    .metadata, *.distcp torch.distributed.checkpoint (DCP) shards of every tensor under its global name
                        and global shape: `module.<parameter name>` for the model and
                        `optimizer_<i>.state.<parameter name>.<state>` for the optimizers

Because DCP stores each tensor by global name and global shape, and every rank asks only for the
pieces it holds (its pipeline stages, its tp slice, its FSDP shard), a checkpoint written at one
layout loads at any other. The `.pt` files hold only tensors, numbers, strings and containers and are
read with `torch.load(..., weights_only=True)`; no value of the checkpoint is unpickled as an object.

A save writes `<name>.partial` and moves it to `<name>` after every rank has finished, so an
interrupted save never leaves a half-written folder under the checkpoint's name, and an existing
checkpoint of that name is replaced without a moment at which neither exists (or, where the system
cannot swap folders atomically, loading finds the complete one of the two by itself; see
`lightning_tp3d.io.folders`). A save can run asynchronously:
the tensors are copied to CPU memory and written by a background thread while training goes on.

Example usage::

    save_checkpoint(path, {"module": model_state, "optimizer_0": optimizer_state}, trainer_state, meta)
    meta, trainer_state = load_checkpoint(path, {"module": model_state, "optimizer_0": optimizer_state})
    weights = load_model_tensors(path)  # one process: whole tensors by parameter name
"""

from __future__ import annotations

import enum
import json
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from importlib.metadata import version
from pathlib import Path, PurePath
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from lightning_tp3d.io.folders import (
    PARTIAL_SUFFIX,
    REPLACED_SUFFIX,
    finish_interrupted_replacement,
    recovered_path,
    replace_folder,
    staging_folder,
)
from lightning_tp3d.io.random_state import capture_rng_state

__all__ = [
    "CheckpointError",
    "CheckpointMeta",
    "MODEL_GROUP",
    "ModelTensorReader",
    "checkpoint_folder",
    "PendingSave",
    "load_checkpoint",
    "load_model_tensors",
    "load_rng_state",
    "model_tensor_shapes",
    "read_meta",
    "save_checkpoint",
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
    data_parallel_mode: str = "replicate"
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


# ---------------------------------------------------------------------------------------------- save
def save_checkpoint(
    path: str | Path,
    state: Mapping[str, Mapping[str, Any]],
    trainer_state: Mapping[str, Any],
    meta: CheckpointMeta,
    asynchronous: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> PendingSave:
    """Write a checkpoint folder at `path`; a collective: every rank calls it with its own shards.

    `state` maps a group name (`"module"`, `"optimizer_0"`, ...) to a flat state dict whose tensors may be
    DTensors (sharded over tp / dp) or plain tensors (a pipeline stage's own, or replicated ones).
    Non-tensor entries (an optimizer's learning rate) are gathered to rank 0 with `trainer_state`.

    Synchronous by default: the returned `PendingSave` is already finished. With `asynchronous=True` the
    tensors are first copied to CPU memory (so training may change the parameters right away), then
    written by a background thread whose collectives run on `process_group` (a group of its own, e.g.
    `dist.new_group(backend="gloo")`, since they overlap with training's); the checkpoint appears under
    `path` when `PendingSave.finish()` is called, on every rank, after that.
    """
    path = Path(path)
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tensors, values = _split_tensors(state)
    values = _merge_on_rank_zero(values)
    if rank == 0:
        finish_interrupted_replacement(path, _is_complete)
        staging_folder(path, "checkpoint")
        (partial / RNG_FOLDER).mkdir()
    _barrier()
    _save_synced(capture_rng_state(), partial / RNG_FOLDER / _rng_file_name(rank))
    if rank == 0:
        _save_synced({"trainer": _plain(trainer_state, "trainer_state"), "values": values},
                     partial / TRAINER_STATE_FILE)
    if asynchronous:
        stager = _pinned_stager() if any(_on_cuda(tensor) for tensor in tensors.values()) else None
        shards_written = dcp.async_save(tensors, checkpoint_id=partial, process_group=process_group,
                                        async_stager=stager)
        return PendingSave(path, meta, shards_written, stager)
    with _single_process_notice_silenced():
        dcp.save(tensors, checkpoint_id=partial, no_dist=not dist.is_initialized())
    pending = PendingSave(path, meta)
    pending.finish()
    return pending


def _on_cuda(tensor: torch.Tensor) -> bool:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).is_cuda


def _pinned_stager() -> Any:
    """Copies GPU shards into page-locked host memory with non-blocking copies (DCP's default stager
    copies into pageable memory, at a fraction of the PCIe bandwidth)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=True))


class PendingSave:
    """A checkpoint whose shards are being written; `finish()` (a collective) waits for them, writes
    `meta.json` and renames `<name>.partial` to `<name>`."""

    def __init__(self, path: Path, meta: CheckpointMeta, shards_written: Any = None, stager: Any = None) -> None:
        self.path = path
        self._meta = meta
        self._shards_written = shards_written
        self._stager = stager
        self._finished = False

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        if self._shards_written is not None:
            self._shards_written.result()
        if self._stager is not None:
            self._stager.close()
        _barrier()
        if not dist.is_initialized() or dist.get_rank() == 0:
            partial = self.path.with_name(self.path.name + PARTIAL_SUFFIX)
            with open(partial / META_FILE, "w", encoding="utf-8") as file:  # last: it marks a whole folder
                file.write(self._meta.to_json())
                file.flush()
                os.fsync(file.fileno())
            replace_folder(partial, self.path)
        _barrier()


def _split_tensors(state: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors, values = {}, {}
    for group, entries in state.items():
        for key, value in entries.items():
            (tensors if isinstance(value, torch.Tensor) else values)[f"{group}.{key}"] = value
    return tensors, values


def _merge_on_rank_zero(values: dict[str, Any]) -> dict[str, Any]:
    """Each pipeline stage holds the optimizer values of its own parameters: rank 0 gets the union."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    gathered: list[dict[str, Any]] | None = [{} for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.gather_object(values, gathered, dst=0)
    merged: dict[str, Any] = {}
    for rank_values in gathered or []:
        merged.update(rank_values)
    return merged


def _is_complete(folder: Path) -> bool:
    return (folder / META_FILE).is_file()  # written last, after every rank finished


def checkpoint_folder(path: str | Path) -> Path:
    """The folder holding the checkpoint saved as `path`: `path`, or the complete folder of a replacement of
    it that was interrupted between its two renames (see `lightning_tp3d.io.folders`)."""
    return recovered_path(Path(path), _is_complete)


def _save_synced(value: Any, file: Path) -> None:
    with open(file, "wb") as handle:
        torch.save(value, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _plain(value: Any, where: str) -> Any:
    """`value` as containers of tensors, numbers and strings, the types `weights_only=True` reads back.

    Mappings (e.g. Lightning's `AttributeDict` of hyper-parameters) become dicts, paths and enums their
    string or value; anything else is stored as its `repr` with a warning, since unpickling arbitrary
    objects is exactly what loading must not do.
    """
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.Tensor, torch.dtype, torch.Size)):
        return value
    if isinstance(value, Mapping):
        return {key: _plain(item, f"{where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(item, f"{where}[{index}]") for index, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, (set, frozenset)):
        return [_plain(item, where) for item in value]
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, enum.Enum):
        return _plain(value.value, where)
    if hasattr(value, "item") and hasattr(value, "dtype"):  # NumPy scalars and arrays
        return torch.as_tensor(value) if getattr(value, "ndim", 0) else value.item()
    rank_zero_warn(f"{where} is a {type(value).__name__}, which a checkpoint cannot hold without pickling; its"
                   " repr() is saved instead.")
    return repr(value)


@contextmanager
def _single_process_notice_silenced() -> Iterator[None]:
    """DCP warns that it assumes one process when no process group exists, which is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rng_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


# ---------------------------------------------------------------------------------------------- load
def read_meta(path: str | Path) -> CheckpointMeta:
    """Read and check `meta.json`; every way a path can fail to be a whole checkpoint has its own message."""
    path = Path(path)
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


def load_checkpoint(
    path: str | Path, state: Mapping[str, dict[str, Any]], strict: bool = True
) -> tuple[CheckpointMeta, dict[str, Any]]:
    """Fill `state` (the same structure `save_checkpoint` takes, holding this rank's tensors at the current
    layout) from the checkpoint in place; return its meta and trainer state. A collective.

    Before reading any tensor the shard files are checked against the DCP index (missing or truncated
    files) and every requested tensor against the stored names and global shapes (another model).
    With `strict=False` model tensors missing from the checkpoint keep their values.
    """
    meta = read_meta(path)
    path = checkpoint_folder(path)
    metadata = _read_index(path)
    _check_shard_files(path, metadata)
    tensors, _ = _split_tensors(state)
    missing = _check_tensors_match(path, metadata, tensors, strict)
    for key in missing:
        del tensors[key]
    try:
        with _single_process_notice_silenced():
            dcp.load(tensors, checkpoint_id=path, no_dist=not dist.is_initialized())
    except Exception as error:  # noqa: BLE001 - DCP's own errors name neither the file nor the cause
        raise CheckpointError(f"Reading the tensors of {path} failed ({type(error).__name__}: {error}).") from error
    saved = _load_weights_only(path / TRAINER_STATE_FILE)
    for group, entries in state.items():
        for key, value in entries.items():
            if not isinstance(value, torch.Tensor) and f"{group}.{key}" in saved["values"]:
                entries[key] = saved["values"][f"{group}.{key}"]
    return meta, saved["trainer"]


def load_rng_state(path: str | Path, rank: int) -> dict[str, Any]:
    return _load_weights_only(checkpoint_folder(path) / RNG_FOLDER / _rng_file_name(rank))


def _read_index(path: Path) -> Metadata:
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as error:  # noqa: BLE001
        raise CheckpointError(
            f"The DCP index {path / '.metadata'} cannot be read ({type(error).__name__}: {error}); the checkpoint"
            " is damaged."
        ) from None


def _check_shard_files(path: Path, metadata: Metadata) -> None:
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


def _check_tensors_match(path: Path, metadata: Metadata, tensors: Mapping[str, torch.Tensor],
                         strict: bool) -> list[str]:
    """Compare the requested tensors with the stored ones; return the model keys allowed to be missing."""
    stored = metadata.state_dict_metadata
    missing, differences = [], []
    for key, tensor in tensors.items():
        entry = stored.get(key)
        if entry is None:
            missing.append(key)
        elif not isinstance(entry, TensorStorageMetadata):
            differences.append(f"{key} is not a tensor in the checkpoint")
        elif tuple(entry.size) != tuple(tensor.shape):
            differences.append(f"{key} has shape {list(entry.size)} in the checkpoint, {list(tensor.shape)} here")
    optional = [key for key in missing if not strict and key.startswith(MODEL_GROUP + ".")]
    required = [key for key in missing if key not in optional]
    if differences or required:
        problems = differences[:3] + [f"{key} is missing from the checkpoint" for key in required[:3]]
        more = len(differences) + len(required) - len(problems)
        raise CheckpointError(
            f"Checkpoint {path} does not fit this model and optimizer: {'; '.join(problems)}"
            + (f" (and {more} more)" if more else "")
            + ". It was saved from a different model or optimizer; load it into the configuration it was"
            " trained with."
        )
    return optional


def _load_weights_only(file: Path) -> Any:
    if not file.is_file():
        raise CheckpointError(f"{file} is missing; the checkpoint is incomplete.")
    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except Exception as error:  # noqa: BLE001 - a truncated file, or one holding pickled objects
        raise CheckpointError(f"{file} cannot be read safely ({type(error).__name__}: {error}).") from None


# ---------------------------------------------------------------------------------------------- consolidate
class _IndexedReader(dcp.FileSystemReader):
    """A DCP reader that hands out an index read before, instead of unpickling `.metadata` per load."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata


class ModelTensorReader:
    """Whole model tensors of a checkpoint, merged from every shard, in this process alone.

    The checkpoint is checked and its DCP index read once (meta.json, index, shard files); `load` then
    reads only the requested tensors, so a caller asking for one name at a time streams the model
    (export does) without paying for the index on every call.
    """

    def __init__(self, path: str | Path) -> None:
        self.meta = read_meta(path)
        self.path = checkpoint_folder(path)
        metadata = _read_index(self.path)
        _check_shard_files(self.path, metadata)
        self._metadata = metadata
        prefix = MODEL_GROUP + "."
        self.shapes: dict[str, tuple[torch.Size, torch.dtype]] = {
            key.removeprefix(prefix): (entry.size, entry.properties.dtype)
            for key, entry in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}

    def load(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        names = list(self.shapes) if names is None else list(names)
        unknown = [name for name in names if name not in self.shapes]
        if unknown:
            raise CheckpointError(f"Checkpoint {self.path} has no model tensor {unknown[0]!r}.")
        tensors = {f"{MODEL_GROUP}.{name}": torch.empty(self.shapes[name][0], dtype=self.shapes[name][1])
                   for name in names}
        with _single_process_notice_silenced():
            dcp.load(tensors, storage_reader=_IndexedReader(self.path, self._metadata), no_dist=True)
        return {key.removeprefix(MODEL_GROUP + "."): tensor for key, tensor in tensors.items()}


def model_tensor_shapes(path: str | Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Whole (global) shape and dtype of every model tensor, by parameter name of the saved module."""
    return ModelTensorReader(path).shapes


def load_model_tensors(path: str | Path, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Whole model tensors (all, or `names`) merged from every shard, in this process alone."""
    return ModelTensorReader(path).load(names)
