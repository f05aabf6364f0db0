"""The README's main job runs as the README says: `python examples/train_tiny.py` trains at 2 x 2 x 2 on 8
CPU processes, its training and held-out losses fall from and to the figures the README quotes, and it
prints no warning of the package's own making."""

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
    readme = (REPOSITORY / "README.md").read_text()
    quoted = re.search(r"training loss \((\d+\.\d+) -> (\d+\.\d+)\) and a held-out loss \((\d+\.\d+) -> (\d+\.\d+)\)",
                       readme)
    assert quoted, "the README quotes the main job's first and last training and held-out losses"
    first, last, first_val, last_val = (float(value) for value in quoted.groups())
    process = subprocess.run([sys.executable, "examples/train_tiny.py"], cwd=REPOSITORY, capture_output=True,
                             text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert process.returncode == 0, process.stderr[-3000:]
    # nothing on stderr of the package's own making: no warning raised in its code, no deprecated setting it made
    own = [line for line in process.stderr.splitlines()
           if "lightning_tp3d" in line or "TORCH_NCCL_TRACE_BUFFER_SIZE" in line]
    assert own == [], own
    # nor the noise it used to trigger: transformers' modelling module (and through it torchao's CUDA-kernel
    # loading messages) imported to ask whether the network is a transformers model; Lightning's LeafSpec
    triggered = [line for line in process.stderr.splitlines() if "Failed to load" in line or "LeafSpec" in line]
    assert triggered == [], triggered
    losses = {int(step): float(loss) for step, loss in re.findall(r"step\s+(\d+)\s+loss\s+(\d+\.\d+)", process.stdout)}
    val_losses = [float(loss) for loss in re.findall(r"step\s+\d+\s+val_loss\s+(\d+\.\d+)", process.stdout)]
    assert abs(losses[1] - first) < 5e-3, (losses[1], first)
    assert abs(losses[max(losses)] - last) < 5e-3, (losses[max(losses)], last)
    assert len(val_losses) == 2 and abs(val_losses[0] - first_val) < 5e-3 and abs(val_losses[-1] - last_val) < 5e-3
    assert len(losses) >= 8 and losses[max(losses)] < losses[1] - 1.5 and val_losses[-1] < val_losses[0]
