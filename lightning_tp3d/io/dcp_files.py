"""Reading and writing DCP folders without running their code, and with a content hash of every file.

A checkpoint is a file an attacker may have written. torch's DCP keeps its index, `.metadata`, as a
plain pickle (`FileSystemReader.read_metadata` calls `pickle.load`, torch 2.13) and reads every
non-tensor value by `torch.load` with `weights_only=False` (`DefaultLoadPlanner.load_bytes`), so opening a
crafted folder with DCP's own reader runs code. Here:

* `read_dcp_index` unpickles `.metadata` with an unpickler that builds only what DCP metadata is made
  of (the dataclasses of `torch.distributed.checkpoint.metadata`, the storage info, `torch.Size`, dtypes,
  the memory-format encoding, layouts, paths) and refuses anything else, naming it;
* `SafeFileSystemReader` is DCP's file reader with that index and without non-tensor items: a load plan
  that asks for one is refused (this package stores only tensors in DCP, everything else in
  weights-only files);
* `HashingFileSystemWriter` is DCP's file writer that computes the SHA-256 of each file from the bytes
  it writes (no second read); `file_sha256` hashes a file on disk for the check at load.

Folders written by torch's own `dcp.save` open with these too. A folder on remote storage (a `UPath` of
`lightning_tp3d.io.storage`) is read and written through DCP's fsspec filesystem.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import threading
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path, PurePath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType

from lightning_tp3d._compat.torch import fsspec_dcp_filesystem
from lightning_tp3d.io.storage import is_remote, location

__all__ = ["DCP_INDEX_FILE", "HashingFileSystemWriter", "SafeFileSystemReader", "UnsafeCheckpointError",
           "file_sha256", "read_dcp_index"]

DCP_INDEX_FILE = ".metadata"
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "ChunkStorageMetadata",
                                              "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # layouts are pickled as _get_layout("torch.strided")
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
_CHUNK_BYTES = 1 << 22


class UnsafeCheckpointError(RuntimeError):
    """A DCP folder whose index or load plan would make torch unpickle objects."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, source: Path) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self._source} names {module}.{name}, which DCP metadata is not made of: the folder is not a checkpoint"
            " this package (or torch's DCP) wrote, or it was altered after the save. It was not opened (unpickling"
            " it could run code); use a checkpoint from a source you trust."
        )


def read_dcp_index(folder: str | Path) -> Metadata:
    """The DCP index of `folder`, read with the restricted unpickler (see the module docstring)."""
    source = location(folder) / DCP_INDEX_FILE
    with source.open("rb") as file:
        metadata = _MetadataUnpickler(file, source).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{source} holds a {type(metadata).__name__}, not DCP metadata.")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with `read_dcp_index` for its index (or an index read before, `metadata`) and no
    non-tensor items."""

    def __init__(self, path: str | Path, metadata: Metadata | None = None) -> None:
        path = location(path)
        super().__init__(path if not is_remote(path) else ".")
        if is_remote(path):
            self.fs, self.path = fsspec_dcp_filesystem(str(path))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._metadata if self._metadata is not None else read_dcp_index(self.path)
        if getattr(metadata, "storage_meta", None) is None:  # as torch's reader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        values = [item.dest_index.fqn for item in plan.items if item.type == LoadItemType.BYTE_IO]
        if values:
            raise UnsafeCheckpointError(
                f"Loading {values[0]!r} from {self.path} would unpickle a non-tensor value (DCP reads those with"
                " torch.load with weights_only=False); lightning_tp3d loads only tensors from DCP shards."
            )
        return super().read_data(plan, planner)


class _HashingStream(io.RawIOBase):
    """A file opened for writing whose bytes also go into a SHA-256."""

    def __init__(self, raw: Any, digest: Any) -> None:
        self.raw, self.digest = raw, digest

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return self.raw.write(data)

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()


class _HashingFileSystem(FileSystemBase):
    """`files` (DCP's local or fsspec filesystem) with a SHA-256 of every file written through it."""

    def __init__(self, files: FileSystemBase) -> None:
        self.files = files
        self.hashes: dict[str, str] = {}
        self._lock = threading.Lock()  # DCP may write files from several threads

    @contextmanager
    def create_stream(self, path: str | Path, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with self.files.create_stream(path, mode) as stream:
                yield stream
            return
        digest = hashlib.sha256()
        with self.files.create_stream(path, mode) as stream:
            yield _HashingStream(stream, digest)
        name = PurePath(path).name.removesuffix(".tmp")  # DCP writes its index as .metadata.tmp, then renames it
        with self._lock:
            self.hashes[name] = digest.hexdigest()

    def concat_path(self, path: str | Path, suffix: str) -> str | Path:
        return self.files.concat_path(path, suffix)

    def rename(self, path: str | Path, new_path: str | Path) -> None:
        self.files.rename(path, new_path)

    def init_path(self, path: str | Path) -> str | Path:
        return self.files.init_path(path)

    def mkdir(self, path: str | Path) -> None:
        self.files.mkdir(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | Path) -> bool:
        return True

    def exists(self, path: str | Path) -> bool:
        return self.files.exists(path)

    def rm_file(self, path: str | Path) -> None:
        self.files.rm_file(path)


class HashingFileSystemWriter(dcp.FileSystemWriter):
    """DCP's file writer; `file_hashes` maps each file this rank wrote (name in the folder) to its SHA-256.
    On remote storage it writes through DCP's fsspec filesystem, without fsync (an upload is whole)."""

    def __init__(self, path: str | Path) -> None:
        path = location(path)
        remote = is_remote(path)
        super().__init__(path if not remote else ".", sync_files=not remote)
        files: FileSystemBase = FileSystem()
        if remote:
            files, path = fsspec_dcp_filesystem(str(path))
        self.fs = _HashingFileSystem(files)
        self.path = path

    @property
    def file_hashes(self) -> dict[str, str]:
        return dict(self.fs.hashes)


def file_sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
