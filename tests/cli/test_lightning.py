"""`tp3d fit --config` through LightningCLI at (tp, pp, dp) = (2, 2, 2) on 8 CPU processes, with the
registered name plus the `tp3d:` section and with the strategy's class_path / init_args: both runs log the
losses of the single-process reference within 1e-5 (and the same losses as each other)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import LEARNING_RATE, SEQ_LEN, reference_run

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

REPOSITORY = Path(__file__).resolve().parents[2]
EXAMPLES = REPOSITORY / "examples"
STEPS = 3
OVERRIDES = ["--trainer.max_steps", str(STEPS), "--trainer.log_every_n_steps", "1", "--trainer.limit_val_batches",
             "0", "--data.init_args.seq_len", str(SEQ_LEN), "--data.init_args.batch_size", "4",
             "--data.init_args.val_fraction", "0.2", "--data.init_args.source", "tiny",
             "--model.init_args.learning_rate", str(LEARNING_RATE),
             # Lightning's default logger is TensorBoard's when tensorboard(X) is installed; read the CSV one.
             "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", "."]


def _fit(config: str, directory: Path) -> list[float]:
    process = subprocess.run([sys.executable, "-m", "lightning_tp3d.cli", "fit", "--config", str(EXAMPLES / config),
                              *OVERRIDES], cwd=directory, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "OMP_NUM_THREADS": "1",
                                  "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY),
                                                                              os.environ.get("PYTHONPATH")]))})
    assert process.returncode == 0, process.stderr[-4000:]
    assert "step    1  loss " in process.stdout  # the example's PrintLosses callback
    (metrics,) = directory.glob("lightning_logs/version_*/metrics.csv")
    with open(metrics) as file:
        return [float(row["train_loss"]) for row in csv.DictReader(file) if row.get("train_loss")]


@pytest.mark.parametrize("config", ["tiny_2x2x2.yaml", "tiny_2x2x2_class_path.yaml"])
def test_yaml_run_at_2x2x2_matches_single_process(config, tmp_path):
    losses = _fit(config, tmp_path)
    reference = reference_run(STEPS, global_batch_size=8)["losses"]
    assert len(losses) == STEPS
    assert max(abs(a - b) for a, b in zip(losses, reference)) <= 1e-5
