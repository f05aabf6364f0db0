"""Datasets that need no download."""

from lightning_tp3d.data.datasets import (
    TokenDataModule,
    TokenWindowDataset,
    byte_tokens,
    default_corpus,
    load_tokens,
)

__all__ = ["TokenDataModule", "TokenWindowDataset", "byte_tokens", "default_corpus", "load_tokens"]
