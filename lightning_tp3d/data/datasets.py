"""Token data that needs no download: a named corpus, a user's text file or token array.

Named corpora (`CORPORA`): `"python-docs"`, the default, is the Python documentation's topic pages that
every CPython installation carries (`pydoc_data.topics`: 466 KB of English prose and code on CPython
3.11, so a short run sees each window about once and its held-out loss measures learning, not
memorisation); `"tiny"` is the 2.5 KB text shipped with the package, for fast tests.

Text is tokenised at the byte level (token id = UTF-8 byte, vocabulary 256), which the `tiny`
preset matches. Token arrays (`.npy`) carry ids of any tokenizer; they are read with
`allow_pickle=False`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["CORPORA", "DEFAULT_CORPUS", "TokenWindowDataset", "TokenDataModule", "byte_tokens", "corpus_text",
           "default_corpus", "load_tokens"]

BYTE_VOCAB_SIZE = 256
DEFAULT_CORPUS = "python-docs"


def _tiny_corpus() -> str:
    """The small English text shipped with the package: repetitive enough that the loss visibly falls."""
    return resources.files("lightning_tp3d.data").joinpath("corpus.txt").read_text(encoding="utf-8")


def _python_docs_corpus() -> str:
    """The topic pages of the Python documentation (`pydoc_data.topics`), in sorted topic order; the
    shipped `tiny` text, with a warning, where the installation lacks them."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        warnings.warn("pydoc_data is not installed with this Python: using the 2.5 KB 'tiny' corpus instead.",
                      stacklevel=3)
        return _tiny_corpus()
    return "\n\n".join(topics[name] for name in sorted(topics))


CORPORA: dict[str, Callable[[], str]] = {"python-docs": _python_docs_corpus, "tiny": _tiny_corpus}


def corpus_text(name: str) -> str:
    if name not in CORPORA:
        raise ValueError(f"corpus {name!r} is not one of {sorted(CORPORA)}.")
    return CORPORA[name]()


def default_corpus() -> str:
    """The text `TokenDataModule()` trains on (`DEFAULT_CORPUS`)."""
    return corpus_text(DEFAULT_CORPUS)


def byte_tokens(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def load_tokens(path: str | Path) -> torch.Tensor:
    """Token ids from a `.txt` file (bytes) or a one-dimensional integer `.npy` array."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Token source {path} does not exist or is not a file.")
    if path.suffix == ".npy":
        array = np.load(path, allow_pickle=False)
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(
                f"{path} holds a {array.ndim}-d {array.dtype} array; expected a one-dimensional integer array of"
                " token ids."
            )
        return torch.from_numpy(array.astype(np.int64))
    return byte_tokens(path.read_text(encoding="utf-8"))


class TokenWindowDataset(Dataset):
    """Non-overlapping windows of a token stream: item i is tokens[i*L : i*L + L + 1], split into
    `input_ids = window[:-1]` and `labels = window[1:]` (L = `seq_len`)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}.")
        if tokens.numel() < seq_len + 1:
            raise ValueError(
                f"the token stream has {tokens.numel()} tokens, fewer than one window of seq_len + 1 = {seq_len + 1};"
                " use a shorter seq_len or more data."
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = index * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1]
        return {"input_ids": window[:-1], "labels": window[1:]}


class TokenDataModule(L.LightningDataModule):
    """Train/validation windows over one token stream; the last `val_fraction` of it is held out.

    Args:
        source: a named corpus (`"python-docs"`, the default, or `"tiny"`; see `CORPORA`), or the path of a
            `.txt` / `.npy` file.
        seq_len: tokens per sample.
        batch_size: samples per data-parallel rank and step (Lightning's per-process batch size).
        val_fraction: share of the stream used for validation.
        vocab_size: when given, token ids are checked to be below it.
        shuffle: shuffle training windows (the strategy's sampler shards them by data-parallel rank).
    """

    def __init__(
        self,
        source: str | None = DEFAULT_CORPUS,
        seq_len: int = 64,
        batch_size: int = 4,
        val_fraction: float = 0.1,
        vocab_size: int | None = BYTE_VOCAB_SIZE,
        shuffle: bool = False,
    ) -> None:
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}.")
        self.source = source
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.vocab_size = vocab_size
        self.shuffle = shuffle

    def _tokens(self) -> torch.Tensor:
        source = self.source or DEFAULT_CORPUS
        tokens = byte_tokens(corpus_text(source)) if source in CORPORA else load_tokens(source)
        if self.vocab_size is not None and int(tokens.max()) >= self.vocab_size:
            raise ValueError(
                f"token id {int(tokens.max())} in {source} is not below the model's"
                f" vocab_size={self.vocab_size}; use a model with a larger vocabulary or re-tokenise the data."
            )
        return tokens

    def setup(self, stage: str | None = None) -> None:
        tokens = self._tokens()
        split = int(tokens.numel() * (1.0 - self.val_fraction))
        self.train_dataset = TokenWindowDataset(tokens[:split], self.seq_len)
        self.val_dataset = TokenWindowDataset(tokens[split:], self.seq_len) if self.val_fraction else None

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_dataset, batch_size=self.batch_size, shuffle=self.shuffle, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        if self.val_dataset is None:
            return []
        return DataLoader(self.val_dataset, batch_size=self.batch_size, shuffle=False, drop_last=True)

    def test_dataloader(self) -> DataLoader:
        """The held-out split (the corpus has no third one)."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """The held-out split's windows; predictions are their logits."""
        return self.val_dataloader()
