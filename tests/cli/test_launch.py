"""`tp3d run`: torchrun's arguments passed through as they are, the agent's store unshared unless the
environment already decides (the elastic restart it makes work: `tests/strategies/test_elastic.py`)."""

from __future__ import annotations

import os

import pytest
import torch.distributed.run

from lightning_tp3d.cli import main as tp3d
from lightning_tp3d.cli.launch import UNSHARED_STORE_VARIABLE


@pytest.fixture
def torchrun_calls(monkeypatch) -> list[tuple[list[str], str | None]]:
    calls: list[tuple[list[str], str | None]] = []
    monkeypatch.setattr(torch.distributed.run, "main",
                        lambda argv: calls.append((argv, os.environ.get(UNSHARED_STORE_VARIABLE))))
    return calls


def test_torchruns_arguments_pass_through_with_the_store_unshared(torchrun_calls, monkeypatch):
    monkeypatch.delenv(UNSHARED_STORE_VARIABLE, raising=False)
    arguments = ["--nnodes", "1:2", "--nproc-per-node", "4", "--max-restarts", "3", "train.py", "--steps", "5"]
    assert tp3d(["run", *arguments]) == 0
    assert torchrun_calls == [(arguments, "1")]


def test_a_store_setting_in_the_environment_is_kept(torchrun_calls, monkeypatch):
    monkeypatch.setenv(UNSHARED_STORE_VARIABLE, "0")
    assert tp3d(["run", "--help"]) == 0
    assert torchrun_calls == [(["--help"], "0")]
