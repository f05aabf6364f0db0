"""Datasets that need no download."""

from lightning_tp3d.data.datasets import (
    CORPORA,
    DEFAULT_CORPUS,
    TokenDataModule,
    TokenWindowDataset,
    byte_tokens,
    corpus_text,
    default_corpus,
    load_tokens,
)

__all__ = ["CORPORA", "DEFAULT_CORPUS", "TokenDataModule", "TokenWindowDataset", "byte_tokens", "corpus_text",
           "default_corpus", "load_tokens"]
