"""`ExportCallback` refuses, when fit starts, what would fail when it ends."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_tp3d.callbacks import ExportCallback
from lightning_tp3d.strategies.options import ParallelOptions


def test_a_merged_export_of_checkpoints_without_their_frozen_weights_is_refused_before_training(tmp_path):
    core = SimpleNamespace(options=ParallelOptions(save_frozen_weights=False))
    trainer = SimpleNamespace(strategy=SimpleNamespace(core=core))
    with pytest.raises(ValueError, match=r"save_frozen_weights=False.*tp3d export CKPT OUT --adapter"):
        ExportCallback(tmp_path / "export").on_fit_start(trainer, None)
