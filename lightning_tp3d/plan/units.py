"""Byte sizes written the way people write them: `"5GB"`, `"500MB"`, `"80GiB"`."""

from __future__ import annotations

import re

__all__ = ["parse_size"]

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
               "GIB": 2**30, "TIB": 2**40}


def parse_size(size: str | int) -> int:
    """`"5GB"` -> 5 x 10^9 bytes (`GB` decimal as in Hugging Face, `GiB` binary as nvidia-smi); ints are bytes."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)\s*", size, flags=re.IGNORECASE)
    if match is None or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"{size!r} is not a size like '5GB', '500MB' or '80GiB'.")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
