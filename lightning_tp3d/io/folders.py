"""Folders written whole or not at all, replaced without a moment at which none exists, and never a
folder this package did not write deleted.

A folder (checkpoint, export, deploy shards) is written as `<name>.partial` beside its final name and
moved under the name once complete. An earlier folder of that name is replaced in one step where the
system allows it: on Linux the two directory entries are swapped atomically (`renameat2` with
`RENAME_EXCHANGE`) and the old folder, now under `<name>.partial`, is removed. Elsewhere the old folder
is first renamed `<name>.replaced`; a process that dies between the two renames leaves the name
missing, and `recovered_path` finds the complete folder of the two (the new one if it was complete,
else the old one), so loading recovers by itself and the next save puts it back under its name.

On remote storage (`lightning_tp3d.io.storage`), which has no rename, a folder is complete when its
commit file (a checkpoint's `meta.json`, written last) is there. A replacement removes the earlier
folder's commit file first, then the rest of it, copies the complete `<name>.partial` in (server-side),
its commit file last, and removes `<name>.partial`: at every moment one of the two names holds a
complete folder, and `recovered_path` reads `<name>.partial` while `<name>` is incomplete. Where no
complete folder is under the name (a new checkpoint), the folder is written in place, without the copy.

Folders of this package carry a marker file (`MARKER_FILE`, or the checkpoint's `meta.json`); an output
folder that exists, is not empty and has no marker of the same kind is refused unless the caller
passes `overwrite=True`.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

from lightning_tp3d.io.storage import copy_folder, is_remote, make_folder, remove_folder

__all__ = [
    "MARKER_FILE",
    "PARTIAL_SUFFIX",
    "REPLACED_SUFFIX",
    "check_output_folder",
    "finish_interrupted_replacement",
    "recovered_path",
    "replace_folder",
    "staging_folder",
]

PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"
MARKER_FILE = ".lightning_tp3d.json"

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _exchange(first: Path, second: Path) -> bool:
    """Swap two existing directory entries atomically; False where the system or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # glibc < 2.28 or another C library
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(code, os.strerror(code), str(first), str(second))


def replace_folder(staged: Path, path: Path, commit_file: str = MARKER_FILE) -> None:
    """Move the complete folder `staged` to `path`. An earlier folder at `path` is swapped out atomically
    where possible (else renamed `<name>.replaced` first) and removed only once `staged` is in place; on
    remote storage it is replaced by a copy whose `commit_file` comes last (see the module docstring)."""
    # What is removed here is only ever the earlier folder at `path` (for exports and deploy shards
    # `check_output_folder` has vetted it: ours, empty, or `overwrite`; for checkpoints it is the name the
    # caller saves to, as Lightning overwrites a checkpoint of the same name), a link or file at that name
    # (Lightning's `save_last="link"`), and `<name>.replaced`, a name only this module creates.
    if is_remote(path):
        _replace_on_store(staged, path, commit_file)
        return
    if path.is_symlink() or path.is_file():
        path.unlink()
    if not path.exists():
        staged.rename(path)
        return
    if _exchange(staged, path):
        remove_folder(staged)  # now the earlier folder
        return
    replaced = _sibling(path, REPLACED_SUFFIX)
    if replaced.exists():
        remove_folder(replaced)
    path.rename(replaced)
    staged.rename(path)
    remove_folder(replaced)


def _replace_on_store(staged: Path, path: Path, commit_file: str) -> None:
    path.fs.invalidate_cache()  # other ranks wrote into `staged` since this process listed it
    if path.exists() and _marker_kind(path) is None:
        raise FileExistsError(f"{path} exists and was not written by lightning_tp3d; nothing was replaced. Move it"
                              f" away or save under another name (the new checkpoint is complete in {staged}).")
    if (path / commit_file).exists():
        (path / commit_file).unlink()  # the earlier folder is incomplete from here on, `staged` complete
    if path.exists():
        remove_folder(path)
    copy_folder(staged, path, last=commit_file)
    remove_folder(staged)


def recovered_path(path: Path, is_complete: Callable[[Path], bool]) -> Path:
    """`path`, or where its folder is after a replacement that was interrupted: the new folder
    (`<name>.partial`) if it is complete, else the earlier one (`<name>.replaced`). On remote storage,
    where a replacement copies into `path`, `path` counts once it is complete."""
    found = is_complete(path) if is_remote(path) else path.exists()
    if found:
        return path
    for candidate in (_sibling(path, PARTIAL_SUFFIX), _sibling(path, REPLACED_SUFFIX)):
        if candidate.is_dir() and is_complete(candidate):
            state = "incomplete" if path.exists() else "missing"
            warnings.warn(f"{path} is {state}: a save replacing it was interrupted; reading the complete folder"
                          f" {candidate.name} instead (the next save to {path.name} moves it back).", stacklevel=3)
            return candidate
    return path


def finish_interrupted_replacement(path: Path, is_complete: Callable[[Path], bool], commit_file: str) -> None:
    """Put the folder `recovered_path` would read back under `path` (before a new save to `path`)."""
    found = recovered_path(path, is_complete)
    if found != path:
        if is_remote(path):
            _replace_on_store(found, path, commit_file)
            return
        found.rename(path)
    replaced = _sibling(path, REPLACED_SUFFIX)
    if path.exists() and replaced.is_dir() and is_complete(replaced):
        remove_folder(replaced)


def _marker_kind(folder: Path) -> str | None:
    try:
        return json.loads((folder / MARKER_FILE).read_text(encoding="utf-8")).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def check_output_folder(path: Path, kind: str, overwrite: bool = False) -> None:
    """Refuse to write a `kind` folder at `path` when something that is not an earlier `kind` folder of
    this package is there (a file, or a non-empty folder without the marker), unless `overwrite`."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_dir() and not path.is_symlink() and (_marker_kind(path) == kind or not any(path.iterdir())):
        return
    if overwrite and path.is_dir():
        return
    held = ", ".join(sorted(entry.name for entry in path.iterdir())[:3]) if path.is_dir() else ""
    found = f"a folder holding {held}" if path.is_dir() else "a file"
    hint = "" if not path.is_dir() else " or pass overwrite=True (`--overwrite`) to replace it and everything in it"
    raise FileExistsError(
        f"{path} is {found}, not an earlier {kind} of lightning_tp3d; nothing was written. Choose a new or empty"
        f" folder{hint}."
    )


def staging_folder(path: Path, kind: str, in_place: bool = False) -> Path:
    """A fresh `<name>.partial` beside `path` (with `in_place`, `path` itself: a folder committed by a file
    written last, where nothing complete is there to keep), marked as a `kind` folder. A stale one is
    removed only if this package wrote it (it carries the marker); anything else under that name is
    refused."""
    staged = path if in_place else _sibling(path, PARTIAL_SUFFIX)
    if staged.exists() or staged.is_symlink():
        if not staged.is_dir() or _marker_kind(staged) != kind:
            raise FileExistsError(f"{staged} exists and was not written by lightning_tp3d; move it away and retry.")
        remove_folder(staged)
    make_folder(staged)
    (staged / MARKER_FILE).write_text(json.dumps({"kind": kind}))
    return staged
