"""Sharded, atomic, resumable checkpoints that load at any (tp, pp, dp).

Saving and loading from running processes: every rank writes and reads only the pieces it holds (its
pipeline stages, its tp slice, its FSDP shard), under global names and shapes, so a checkpoint written
at one layout loads at any other. The folder's format (meta.json, DCP shards, weights-only `.pt`
files) and reading it in one process are described in `lightning_tp3d.io.checkpoint_format`, whose
names are importable from here too.

Every file's SHA-256 is computed from the bytes as they are written and recorded in meta.json with the
rank that wrote it; a load checks the files against it first (each rank hashing a share of them) and
refuses a damaged checkpoint naming the file and the rank (`verify=False` skips the check).

A save writes `<name>.partial` and moves it to `<name>` after every rank has finished, so an
interrupted save never leaves a half-written folder under the checkpoint's name, and an existing
checkpoint of that name is replaced without a moment at which neither exists (or, where the system
cannot swap folders atomically, loading finds the complete one of the two by itself; see
`lightning_tp3d.io.folders`). A save can run asynchronously:
the tensors are copied to CPU memory and written by a background thread while training goes on.

`path` may be an fsspec URL (`s3://bucket/run/step=100.ckpt`, `lightning_tp3d.io.storage`): the shards
are uploaded through DCP's fsspec writer and the folder is committed by its `meta.json`, written last, as
that storage has no rename (`lightning_tp3d.io.folders`); an asynchronous save uploads in the background.

Example usage::

    save_checkpoint(path, {"module": model_state, "optimizer_0": optimizer_state}, trainer_state, meta)
    meta, trainer_state = load_checkpoint(path, {"module": model_state, "optimizer_0": optimizer_state})
    weights = load_model_tensors(path)  # one process: whole tensors by parameter name
"""

from __future__ import annotations

import enum
import hashlib
import io
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from lightning_tp3d.io.checkpoint_format import (
    META_FILE,
    MODEL_GROUP,
    RNG_FOLDER,
    TRAINER_STATE_FILE,
    CheckpointError,
    CheckpointMeta,
    check_shard_files,
    checkpoint_folder,
    damaged_files,
    dcp_single_process_notice_silenced,
    is_complete,
    load_weights_only,
    raise_damaged,
    read_index,
    read_meta,
    rng_file_name,
    verify_files,
)
from lightning_tp3d.io.dcp_files import DCP_INDEX_FILE, HashingFileSystemWriter, SafeFileSystemReader
from lightning_tp3d.io.folders import finish_interrupted_replacement, replace_folder, staging_folder
from lightning_tp3d.io.random_state import capture_rng_state
from lightning_tp3d.io.storage import is_remote, location, make_folder, write_file

__all__ = ["PendingSave", "load_checkpoint", "load_rng_state", "save_checkpoint"]

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
    path = location(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tensors, values = _split_tensors(state)
    values = _merge_on_rank_zero(values)
    staged = None
    if rank == 0:
        finish_interrupted_replacement(path, is_complete, META_FILE)
        # Remote storage has no rename: a new checkpoint is written in place, committed by meta.json.
        staged = staging_folder(path, "checkpoint", in_place=is_remote(path) and not is_complete(path))
        make_folder(staged / RNG_FOLDER)
    staged = path.with_name(_from_rank_zero(staged.name if staged is not None else None))
    hashes = {f"{RNG_FOLDER}/{rng_file_name(rank)}": _save_synced(capture_rng_state(),
                                                                  staged / RNG_FOLDER / rng_file_name(rank))}
    if rank == 0:
        hashes[TRAINER_STATE_FILE] = _save_synced({"trainer": _plain(trainer_state, "trainer_state"), "values": values},
                                                  staged / TRAINER_STATE_FILE)
    writer = HashingFileSystemWriter(staged)
    if asynchronous:
        stager = _pinned_stager() if any(_on_cuda(tensor) for tensor in tensors.values()) else None
        shards_written = dcp.async_save(tensors, storage_writer=writer, process_group=process_group,
                                        async_stager=stager)
        return PendingSave(path, staged, meta, hashes, writer, shards_written, stager)
    with dcp_single_process_notice_silenced():
        dcp.save(tensors, storage_writer=writer, no_dist=not dist.is_initialized())
    pending = PendingSave(path, staged, meta, hashes, writer)
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
    """A checkpoint whose shards are being written into `staged`; `finish()` (a collective) waits for them,
    gathers every rank's file hashes into `meta.json`, writes it and moves `staged` (`<name>.partial`) to
    `<name>` (nothing to move where the folder was written in place)."""

    def __init__(self, path: Path, staged: Path, meta: CheckpointMeta, hashes: dict[str, str],
                 writer: HashingFileSystemWriter, shards_written: Any = None, stager: Any = None) -> None:
        self.path = path
        self.staged = staged
        self._meta = meta
        self._hashes = hashes
        self._writer = writer
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
        rank = dist.get_rank() if dist.is_initialized() else 0
        mine = {name: {"sha256": digest, "rank": rank} for name, digest in {**self._hashes,
                                                                          **self._writer.file_hashes}.items()}
        self._meta.file_hashes = _merge_on_rank_zero(mine)
        _barrier()
        if rank == 0:
            write_file(self.staged / META_FILE, self._meta.to_json().encode())  # last: it marks a whole folder
            if self.staged != self.path:
                replace_folder(self.staged, self.path, META_FILE)
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


def _from_rank_zero(value: Any) -> Any:
    """Rank 0's `value` on every rank (after rank 0 computed it: also a barrier)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _save_synced(value: Any, file: Path) -> str:
    """Write `value` with `torch.save` durably (`io.storage.write_file`); returns the SHA-256 of its bytes."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    write_file(file, buffer.getbuffer())
    return hashlib.sha256(buffer.getbuffer()).hexdigest()


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


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ---------------------------------------------------------------------------------------------- load
def load_checkpoint(
    path: str | Path, state: Mapping[str, dict[str, Any]], strict: bool = True, verify: bool = True
) -> tuple[CheckpointMeta, dict[str, Any]]:
    """Fill `state` (the same structure `save_checkpoint` takes, holding this rank's tensors at the current
    layout) from the checkpoint in place; return its meta and trainer state. A collective.

    Before reading any tensor every file is checked against the hash recorded when it was written (unless
    `verify=False`), the shard files against the DCP index (missing or truncated files) and every
    requested tensor against the stored names and global shapes (another model). With `strict=False`
    model tensors missing from the checkpoint keep their values.
    """
    meta = read_meta(path)
    path = checkpoint_folder(path)
    if verify:
        verify_files(path, meta, [DCP_INDEX_FILE])
    metadata = read_index(path)
    check_shard_files(path, metadata)
    if verify:
        _verify_in_shares(path, meta)
    tensors, _ = _split_tensors(state)
    missing = _check_tensors_match(path, metadata, tensors, strict)
    for key in missing:
        del tensors[key]
    try:
        with dcp_single_process_notice_silenced():
            dcp.load(tensors, storage_reader=SafeFileSystemReader(path, metadata), no_dist=not dist.is_initialized())
    except Exception as error:  # noqa: BLE001 - DCP's own errors name neither the file nor the cause
        raise CheckpointError(f"Reading the tensors of {path} failed ({type(error).__name__}: {error}).") from error
    saved = load_weights_only(path / TRAINER_STATE_FILE)
    for group, entries in state.items():
        for key, value in entries.items():
            if not isinstance(value, torch.Tensor) and f"{group}.{key}" in saved["values"]:
                entries[key] = saved["values"][f"{group}.{key}"]
    return meta, saved["trainer"]


def _verify_in_shares(folder: Path, meta: CheckpointMeta) -> None:
    """Each rank hashes its share of the recorded files but the index, checked before (the i-th on rank i
    mod world); the problems are gathered, so that every rank refuses a damaged checkpoint together."""
    if meta.file_hashes is None:  # an earlier checkpoint: the index check already warned
        return
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problems = damaged_files(folder, meta, sorted(set(meta.file_hashes) - {DCP_INDEX_FILE})[rank::world])
    if world > 1:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, problems)
        problems = [problem for share in gathered for problem in share]
    raise_damaged(folder, problems)


def load_rng_state(path: str | Path, rank: int) -> dict[str, Any]:
    return load_weights_only(checkpoint_folder(path) / RNG_FOLDER / rng_file_name(rank))


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


