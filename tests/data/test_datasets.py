"""Named corpora (the Python docs, the shipped tiny text), user text and token arrays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_tp3d.data import (
    CORPORA,
    DEFAULT_CORPUS,
    TokenDataModule,
    TokenWindowDataset,
    corpus_text,
    default_corpus,
    load_tokens,
)


def test_windows_are_shifted_next_token_pairs():
    dataset = TokenWindowDataset(torch.arange(10), seq_len=3)
    assert len(dataset) == 3
    assert dataset[1]["input_ids"].tolist() == [3, 4, 5] and dataset[1]["labels"].tolist() == [4, 5, 6]


def test_embedded_corpus_needs_no_download():
    data = TokenDataModule(source="tiny", seq_len=32, batch_size=4)
    data.setup()
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape == (4, 32) and int(batch["input_ids"].max()) < 256


def test_user_text_file_and_token_array(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello world " * 20)
    assert load_tokens(text)[:5].tolist() == list(b"hello")
    array = tmp_path / "tokens.npy"
    np.save(array, np.arange(1000, dtype=np.int32))
    data = TokenDataModule(source=str(array), seq_len=16, batch_size=2, vocab_size=1000)
    data.setup()
    assert data.train_dataset[0]["labels"][0].item() == 1


def test_bad_data_is_refused_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokens(tmp_path / "missing.txt")
    array = tmp_path / "wide.npy"
    np.save(array, np.arange(600))
    with pytest.raises(ValueError, match=r"token id 599 .* is not below the model's vocab_size=256"):
        TokenDataModule(source=str(array), seq_len=8).setup()
    floats = tmp_path / "floats.npy"
    np.save(floats, np.ones(10))
    with pytest.raises(ValueError, match="expected a one-dimensional integer array"):
        load_tokens(floats)
    with pytest.raises(ValueError, match="fewer than one window"):
        TokenWindowDataset(torch.arange(4), seq_len=8)


def test_named_corpora_and_the_default_is_real_size():
    assert DEFAULT_CORPUS == "python-docs" and set(CORPORA) == {"python-docs", "tiny"}
    assert len(corpus_text("python-docs").encode()) > 400_000  # the Python docs' topics, not 2.5 KB
    assert default_corpus() == corpus_text("python-docs")
    data = TokenDataModule(seq_len=64, batch_size=4)
    data.setup()
    assert len(data.train_dataset) > 6_000 and len(data.val_dataset) > 600
    assert 2000 < len(corpus_text("tiny")) < 3000
    with pytest.raises(ValueError, match=r"corpus 'wiki' is not one of \['python-docs', 'tiny'\]"):
        corpus_text("wiki")
