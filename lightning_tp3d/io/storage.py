"""Where a checkpoint lives: a folder on the local disk, or one on remote storage named by an fsspec URL.

`location(path)` turns what a user passes (a `str`, a `Path`, `file:///...`, `s3://bucket/run/last.ckpt`)
into a path with pathlib's interface: a `Path` for the local disk (`file://` URLs included) and a
`upath.UPath` (universal_pathlib, over fsspec) for any other protocol, whose filesystem package (s3fs for
`s3://`, gcsfs for `gs://`, ...) must be installed; credentials and endpoints come from that package's
usual environment (`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT_URL`, ...). The checkpoint code reads and writes
through that interface and through the few operations below that pathlib does not have.

A remote store differs from a local disk in what the checkpoint's guarantees rest on: an object appears
whole when its upload completes (there is nothing to fsync), and there is no rename of a folder, so a
folder is committed by a marker file written last (`lightning_tp3d.io.folders`). fsspec caches listings
per process: `location` drops that cache, because a listing made before another rank wrote its files is
stale.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

__all__ = ["LOCAL_PROTOCOLS", "copy_folder", "is_remote", "location", "make_folder", "remove_folder", "write_file"]

LOCAL_PROTOCOLS = ("file", "local")


def location(path: str | os.PathLike[str]) -> Path:
    """`path` as a `Path` (local disk) or a `UPath` (any other fsspec protocol), with fresh listings."""
    if isinstance(path, Path) or is_remote(path):
        return path
    text = os.fspath(path)
    protocol, separator, rest = text.partition("://")
    if not separator:
        return Path(text)
    if protocol in LOCAL_PROTOCOLS:
        return Path(rest)
    try:
        from upath import UPath
    except ImportError:
        raise ImportError(
            f"{text} is on remote storage ({protocol}://), which lightning_tp3d reaches through fsspec with"
            f" universal_pathlib: `pip install universal_pathlib` and the filesystem package of {protocol}://"
            " (s3fs for s3://, gcsfs for gs://, adlfs for az://)."
        ) from None
    remote = UPath(text)
    remote.fs.invalidate_cache()
    return remote


def is_remote(path: Any) -> bool:
    """Whether `path` (from `location`) is on remote storage."""
    return type(path).__module__.split(".")[0] == "upath"


def write_file(file: Path, data: bytes | memoryview) -> None:
    """Write `data` to `file` durably: flushed and fsynced on a local disk, one whole upload remotely."""
    if is_remote(file):
        file.write_bytes(bytes(data))
        return
    with open(file, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def make_folder(folder: Path) -> None:
    """Create `folder` and its parents on a local disk; a remote store's folders exist by their files."""
    if not is_remote(folder):
        folder.mkdir(parents=True, exist_ok=True)


def remove_folder(folder: Path) -> None:
    """Remove `folder` and everything in it (callers remove only folders this package wrote)."""
    if is_remote(folder):
        _filesystem(folder).rm(folder.path, recursive=True)
    else:
        shutil.rmtree(folder)


def copy_folder(source: Path, target: Path, last: str) -> None:
    """Copy every file of the remote folder `source` into `target` (server-side where the store can), the
    file named `last` after all the others: a reader seeing `last` in `target` sees every file. The caller
    drops fsspec's listing cache first (`source` was written by other processes)."""
    filesystem = _filesystem(source)
    root = source.path.rstrip("/") + "/"
    names = sorted(file.removeprefix(root) for file in filesystem.find(source.path))
    for name in [name for name in names if name != last] + [name for name in names if name == last]:
        filesystem.copy(root + name, f"{target.path.rstrip('/')}/{name}")


def _filesystem(path: Path) -> Any:
    return path.fs  # a UPath's fsspec filesystem
