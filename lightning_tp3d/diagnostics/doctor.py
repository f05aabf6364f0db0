"""Preflight doctor: measure what each mesh dimension's links deliver before a run is launched.

For the launched world and a layout it reports the backend, the hosts each tp / dp / pp group spans,
and per group the latency and bandwidth at a few message sizes: all-reduce for tp and dp (bus bandwidth
as nccl-tests defines it, 2 (n - 1) / n x bytes / time), send/recv to the next pipeline stage for pp
(bytes / time). Every group of a dimension is measured at once, as training loads them. `diagnose`
turns the figures into warnings with the fix: a tp group across hosts, a group far slower than the
others of its dimension, tensor parallelism on slower links than data parallelism, NCCL settings that
disable the fast transports.

Run it with the launcher of the job (`torchrun --nproc-per-node 8 -m lightning_tp3d.cli doctor --tp 8
--pp 4`), or at strategy setup with `TP3DStrategy(preflight=True)`.
"""

from __future__ import annotations

import os
import socket
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp3d.parallel.mesh import mesh_device
from lightning_tp3d.parallel.timing import DeviceInterval
from lightning_tp3d.plan.layout import ParallelLayout

__all__ = ["DEFAULT_SIZES", "DoctorReport", "Measurement", "diagnose", "run_doctor"]

DEFAULT_SIZES = (4 * 1024, 1024**2, 16 * 1024**2)
_SLOW_FRACTION = 0.5


@dataclass(frozen=True)
class Measurement:
    dimension: str  # "tp", "dp" or "pp"
    ranks: tuple[int, ...]  # the group (for pp: this stage's rank and the next stage's)
    hosts: tuple[str, ...]
    operation: str  # "all_reduce" or "send_recv"
    bytes: int
    latency_seconds: float  # median over the iterations, slowest member of the group
    bandwidth_gbps: float  # bus bandwidth for all_reduce, link bandwidth for send_recv (GB/s, 10^9)


@dataclass
class DoctorReport:
    backend: str
    world_size: int
    layout: dict[str, Any]
    hosts: list[str]
    measurements: list[Measurement] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        layout = self.layout
        lines = [f"backend {self.backend}, {self.world_size} ranks on {len(set(self.hosts))} host(s);"
                 f" tp={layout['tensor_parallel_size']} pp={layout['pipeline_parallel_size']}"
                 f" dp={layout['data_parallel_size']}",
                 f"{'dim':>3} {'group':<22} {'hosts':>5} {'op':<10} {'bytes':>10} {'latency us':>11} {'GB/s':>9}"]
        for row in self.measurements:
            group = ",".join(map(str, row.ranks))
            lines.append(f"{row.dimension:>3} {group:<22} {len(set(row.hosts)):>5} {row.operation:<10}"
                         f" {row.bytes:>10,} {row.latency_seconds * 1e6:>11.1f} {row.bandwidth_gbps:>9.3f}")
        lines += [f"warning: {warning}" for warning in self.warnings] or ["no warnings"]
        return "\n".join(lines)


def _timed(operation: Any, iterations: int, warmup: int, group: dist.ProcessGroup, device_type: str) -> float:
    """Median seconds of `operation` on the device's clock (CUDA events on a GPU, see `DeviceInterval`)."""
    for _ in range(warmup):
        operation()
    samples = []
    for _ in range(iterations):
        dist.barrier(group=group)
        interval = DeviceInterval(device_type)
        operation()
        samples.append(interval.stop().seconds)
    return statistics.median(samples)


def _measure_dimension(mesh: DeviceMesh, dimension: str, size: int, iterations: int, warmup: int,
                       device: torch.device) -> tuple[tuple[int, ...], str, float] | None:
    group = mesh[dimension].get_group()
    ranks = tuple(mesh[dimension].mesh.flatten().tolist())
    if len(ranks) == 1:
        return None
    buffer = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
    if dimension != "pp":
        seconds = _timed(lambda: dist.all_reduce(buffer, group=group), iterations, warmup, group, device.type)
        return ranks, "all_reduce", seconds
    position = ranks.index(dist.get_rank())
    next_rank, previous_rank = ranks[(position + 1) % len(ranks)], ranks[position - 1]
    received = torch.empty_like(buffer)

    def send_recv() -> None:
        operations = [dist.P2POp(dist.isend, buffer, next_rank, group), dist.P2POp(dist.irecv, received, previous_rank,
                                                                                    group)]
        for request in dist.batch_isend_irecv(operations):
            request.wait()

    seconds = _timed(send_recv, iterations, warmup, group, device.type)
    return (dist.get_rank(), next_rank), "send_recv", seconds


def run_doctor(layout: ParallelLayout, mesh: DeviceMesh, sizes: Sequence[int] = DEFAULT_SIZES, iterations: int = 5,
               warmup: int = 2, environment: Mapping[str, str] | None = None) -> DoctorReport:
    """Measure every mesh dimension; a collective over all ranks, which all receive the whole report."""
    device = mesh_device(mesh)
    world = dist.get_world_size()
    hosts: list[str] = [""] * world
    dist.all_gather_object(hosts, socket.gethostname())
    rows = []
    for dimension in ("tp", "dp", "pp"):
        for size in sizes:
            result = _measure_dimension(mesh, dimension, size, iterations, warmup, device)
            if result is not None:
                rows.append((dimension, *result, size))
    gathered: list[list[tuple]] = [[] for _ in range(world)]
    dist.all_gather_object(gathered, rows)
    slowest: dict[tuple, tuple] = {}
    for rank_rows in gathered:
        for dimension, ranks, operation, seconds, size in rank_rows:
            key = (dimension, tuple(sorted(ranks)) if operation == "all_reduce" else ranks, size)
            if key not in slowest or seconds > slowest[key][3]:
                slowest[key] = (dimension, key[1], operation, seconds, size)
    measurements = []
    for dimension, ranks, operation, seconds, size in sorted(slowest.values(), key=lambda row: (
            ("tp", "dp", "pp").index(row[0]), row[4], row[1])):
        factor = 2 * (len(ranks) - 1) / len(ranks) if operation == "all_reduce" else 1.0
        measurements.append(Measurement(dimension, ranks, tuple(hosts[rank] for rank in ranks), operation, size,
                                        seconds, factor * size / seconds / 1e9))
    report = DoctorReport(dist.get_backend(), world, layout.to_dict(), hosts, measurements)
    report.warnings = diagnose(report, dict(os.environ) if environment is None else environment,
                               uses_gpus=mesh.device_type == "cuda")
    return report


def diagnose(report: DoctorReport, environment: Mapping[str, str], uses_gpus: bool) -> list[str]:
    """Warnings, each with its fix, from a report's figures, its hosts and the NCCL / gloo settings."""
    warnings = []
    multi_host = len(set(report.hosts)) > 1
    for row in report.measurements:
        if row.dimension == "tp" and len(set(row.hosts)) > 1 and row.bytes == report.measurements[0].bytes:
            warnings.append(
                f"tp group {list(row.ranks)} spans hosts {sorted(set(row.hosts))}: tensor parallelism all-reduces"
                " every layer and needs the fastest links; keep tensor_parallel_size <= processes per node (tp is"
                " the innermost mesh dimension, so its ranks are consecutive and share a node when it fits)."
            )
    largest = max((row.bytes for row in report.measurements), default=0)
    by_dimension: dict[str, list[Measurement]] = {}
    for row in report.measurements:
        if row.bytes == largest:
            by_dimension.setdefault(row.dimension, []).append(row)
    medians = {dimension: statistics.median(row.bandwidth_gbps for row in rows)
               for dimension, rows in by_dimension.items()}
    # On one host without GPUs every group shares the loopback: differences are scheduling noise.
    compare_links = uses_gpus or multi_host
    for dimension, rows in by_dimension.items():
        for row in rows:
            if compare_links and len(rows) > 1 and row.bandwidth_gbps < _SLOW_FRACTION * medians[dimension]:
                warnings.append(
                    f"{dimension} group {list(row.ranks)} reaches {row.bandwidth_gbps:.2f} GB/s, under half the"
                    f" median {medians[dimension]:.2f} GB/s of the {dimension} groups: check the links of hosts"
                    f" {sorted(set(row.hosts))} (NCCL_DEBUG=INFO shows the transport NCCL picked)."
                )
    if uses_gpus and "tp" in medians and "dp" in medians and medians["tp"] < _SLOW_FRACTION * medians["dp"]:
        warnings.append(
            f"tp all-reduce reaches {medians['tp']:.2f} GB/s, under half of dp's {medians['dp']:.2f} GB/s: tensor"
            " parallelism should run on the fastest links (NVLink inside a node); check the layout and the launch."
        )
    if report.backend == "nccl":
        if environment.get("NCCL_IB_DISABLE") == "1":
            warnings.append("NCCL_IB_DISABLE=1 turns InfiniBand off and falls back to sockets: unset it.")
        if environment.get("NCCL_P2P_DISABLE") == "1":
            warnings.append("NCCL_P2P_DISABLE=1 turns NVLink / PCIe peer-to-peer off inside a node: unset it.")
        if multi_host and not environment.get("NCCL_SOCKET_IFNAME"):
            warnings.append("NCCL_SOCKET_IFNAME is unset on a multi-host run: set it to the fast interface (e.g."
                            " ib0, or the 100G ethernet one) so bootstrap and socket traffic avoid a slow one.")
    elif uses_gpus:
        warnings.append(f"backend {report.backend} on GPUs: use nccl (TP3DStrategy(process_group_backend='nccl')).")
    elif multi_host and not environment.get("GLOO_SOCKET_IFNAME"):
        warnings.append("GLOO_SOCKET_IFNAME is unset on a multi-host gloo run: set it to the fast interface.")
    return warnings
