"""The GPU acceptance script runs end to end on the CPU (`--accelerator cpu`), so it works the day a GPU
comes; its figures are checked, not only its exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

REPOSITORY = Path(__file__).resolve().parents[2]
SMOKE = ["--accelerator", "cpu", "--model", "tiny", "--seq-len", "64", "--micro-batch", "2", "--warmup", "1",
         "--steps", "2", "--parity-steps", "2", "--overhead-rounds", "1", "--overhead-steps", "1"]


def test_acceptance_script_passes_every_stage_on_the_cpu(tmp_path):
    output = tmp_path / "acceptance.json"
    process = subprocess.run([sys.executable, "benchmarks/gpu_acceptance.py", *SMOKE, "--output", str(output)],
                             cwd=REPOSITORY, capture_output=True, text=True, timeout=900,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert process.returncode == 0, process.stdout[-2000:] + process.stderr[-3000:]
    results = json.loads(output.read_text())
    assert results["command"][0].endswith("gpu_acceptance.py")
    assert results["parity"]["max_loss_difference"] <= 1e-5 and len(results["parity"]["tp3d_losses"]) == 2
    assert results["autocast"]["bf16-mixed"]["q_proj_output_dtypes"] == ["torch.bfloat16"]
    compiled = results["compile"]
    assert compiled["passed"] and compiled["graph_breaks"] == {} and len(compiled["parity_compiled_losses"]) == 2
    assert compiled["parity_max_relative_difference"] <= 1e-4 and compiled["compiled / eager step"] > 0
    assert results["float8"]["passed"] and results["float8"]["float8 / compiled tokens per second"] > 0
    assert results["autocast"]["16-mixed"]["q_proj_output_dtypes"] == ["torch.float16"]
    lifecycle = results["lifecycle"]
    assert lifecycle["resumed_losses"] == lifecycle["straight_losses"][2:]
    assert lifecycle["export_exit_code"] == 0 and lifecycle["check_exit_code"] == 0
    assert lifecycle["prediction_shape"] == [2, 32, 256]
    assert results["throughput"]["parameters"] > 0 and results["passed"]
    overhead = results["overhead"]["rounds"][0]
    assert overhead["ratio"] == overhead["tp3d_seconds"] / overhead["lightning_seconds"] > 0


def test_dense_peaks_follow_the_device_name_and_precision():
    sys.path.insert(0, str(REPOSITORY / "benchmarks"))
    try:
        from gpu_acceptance import dense_peak_tflops
    finally:
        sys.path.remove(str(REPOSITORY / "benchmarks"))
    assert dense_peak_tflops("NVIDIA H200", "bf16-mixed") == 989.0
    assert dense_peak_tflops("NVIDIA H200 NVL", "bf16-mixed") == 835.0
    assert dense_peak_tflops("NVIDIA H200", "32-true") == 67.0
    assert dense_peak_tflops("NVIDIA H100 PCIe", "16-mixed") == 756.0
    assert dense_peak_tflops("Tesla T4", "bf16-mixed") is None
