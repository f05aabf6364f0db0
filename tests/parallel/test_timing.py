"""`DeviceInterval` on the CPU (the CUDA path uses events; see benchmarks/gpu_acceptance.py)."""

from __future__ import annotations

import time

from lightning_tp3d.parallel.pipeline import StageTiming
from lightning_tp3d.parallel.timing import DeviceInterval


def test_an_interval_measures_between_start_and_stop_and_is_zero_before_stop():
    interval = DeviceInterval("cpu")
    assert interval.seconds == 0.0
    time.sleep(0.05)
    assert 0.05 <= interval.stop().seconds < 1.0


def test_stage_timing_sums_chunks_within_the_step():
    timing = StageTiming("cpu")
    timing.start_step()
    for _ in range(2):
        chunk = timing.chunk()
        time.sleep(0.02)
        chunk.stop()
    time.sleep(0.04)
    timing.stop_step()
    assert 0.04 <= timing.busy_seconds < timing.step_seconds
    assert 0.2 < timing.idle_fraction < 0.9
