"""torch's private names used by the package (read from torch 2.13)."""

from __future__ import annotations

from importlib.metadata import version

from torch import nn

__all__ = ["TORCH_VERSION", "is_compiled"]

TORCH_VERSION = version("torch")


def is_compiled(module: nn.Module) -> bool:
    """`torch.compile(module)` (an `OptimizedModule` holding `_orig_mod`) or `module.compile()` (in place)."""
    return hasattr(module, "_orig_mod") or getattr(module, "_compiled_call_impl", None) is not None
