"""The README's main job runs as the README says: `python examples/train_tiny.py` trains at 2 x 2 x 2 on 8
CPU processes and its loss falls from and to the figures the README quotes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

REPOSITORY = Path(__file__).resolve().parent.parent


def test_main_job_loss_falls_as_the_readme_says():
    quoted = re.search(r"printing a falling loss \((\d+\.\d+) -> (\d+\.\d+)", (REPOSITORY / "README.md").read_text())
    assert quoted, "the README quotes the main job's first and last loss"
    first, last = (float(value) for value in quoted.groups())
    process = subprocess.run([sys.executable, "examples/train_tiny.py"], cwd=REPOSITORY, capture_output=True,
                             text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert process.returncode == 0, process.stderr[-3000:]
    losses = {int(step): float(loss) for step, loss in re.findall(r"step\s+(\d+)\s+loss\s+(\d+\.\d+)", process.stdout)}
    assert abs(losses[1] - first) < 5e-3, (losses[1], first)
    assert abs(losses[max(losses)] - last) < 5e-3, (losses[max(losses)], last)
    assert len(losses) >= 8 and losses[max(losses)] < losses[1] - 2.0
