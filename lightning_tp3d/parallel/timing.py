"""Timing device work honestly: CUDA events on a GPU, the host clock on a CPU.

CUDA kernels and NCCL collectives are queued asynchronously; a host clock around them measures how long
queueing took, not the work. `DeviceInterval` records a CUDA event at start and stop on the current
stream (a blocking collective makes that stream wait for the communication stream, so the stop event
follows the transfer) and reads the elapsed time only when asked, so timing adds no host
synchronisation to a step that nobody reads.
"""

from __future__ import annotations

import time

import torch

__all__ = ["DeviceInterval"]


class DeviceInterval:
    """Elapsed seconds between construction and `stop()` of work on a `device_type` device."""

    def __init__(self, device_type: str) -> None:
        self._cuda = device_type == "cuda"
        self._end: torch.cuda.Event | float | None = None
        if self._cuda:
            self._start: torch.cuda.Event | float = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> DeviceInterval:
        if self._cuda:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record()
        else:
            self._end = time.perf_counter()
        return self

    @property
    def seconds(self) -> float:
        """The interval's length (waits for the stop event on CUDA); 0 before `stop()`."""
        if self._end is None:
            return 0.0
        if self._cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return self._end - self._start
