"""The newest complete `last` checkpoint in a set of folders, local or on remote storage (`ckpt_path="last"`).

Lightning resolves `trainer.fit(..., ckpt_path="last")` by listing each `ModelCheckpoint`'s folder for
`last.ckpt`, `last-v1.ckpt`, ... and taking the one the filesystem dates newest. On remote storage both
steps miss a checkpoint folder: fsspec lists `s3://bucket/run` as `bucket/run/last.ckpt`, protocol dropped,
which Lightning then looks for on the local disk, and an object store has no folder to date. Here a
checkpoint's date is its `meta.json`'s, the object uploaded last, once every rank finished, so a save that
never completed is never chosen; a name whose replacement was interrupted (`<name>.partial`, see
`lightning_tp3d.io.folders`) counts by the folder a load of that name reads.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from lightning_tp3d.io.checkpoint_format import META_FILE, checkpoint_folder, is_complete
from lightning_tp3d.io.folders import PARTIAL_SUFFIX
from lightning_tp3d.io.storage import location

__all__ = ["newest_last_checkpoint"]


def newest_last_checkpoint(searches: Iterable[tuple[str, str, str]]) -> str | None:
    """The path (a URL for a remote folder) of the newest complete checkpoint over `searches`, each a
    (folder, last_name, extension) that names `<last_name>[-N]<extension>` checkpoints in `folder` (a path or
    fsspec URL), dated by its `meta.json`; None when there is none. Ties go to the later path, so every
    rank, listing the same store, picks the same one."""
    dated: dict[str, float] = {}
    for folder, last_name, extension in searches:
        root = location(folder)
        if not root.is_dir():
            continue
        pattern = re.compile(rf"{re.escape(last_name)}(-\d+)?{re.escape(extension)}")
        names = {entry.name.removesuffix(PARTIAL_SUFFIX) for entry in root.iterdir()}
        for name in sorted(filter(pattern.fullmatch, names)):
            found = checkpoint_folder(root / name)
            if is_complete(found):
                dated[str(root / name)] = (found / META_FILE).stat().st_mtime
    return max(dated, key=lambda path: (dated[path], path)) if dated else None
