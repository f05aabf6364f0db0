"""Preflight doctor: measure what each mesh dimension's links deliver before a run is launched.

For the launched world and a layout it reports the backend, the hosts each tp / dp / pp group spans,
and per group the latency and bandwidth at a few message sizes: all-reduce for tp and dp (bus bandwidth
as nccl-tests defines it, 2 (n - 1) / n x bytes / time), send/recv to the next pipeline stage for pp
(bytes / time). Every group of a dimension is measured at once, as training loads them. `diagnose`
turns the figures into warnings with the fix: a tp group across hosts, a group far slower than the
others of its dimension or (on GPUs) below an absolute floor (NVLink inside a node, InfiniBand across
nodes), tensor parallelism on slower links than data parallelism, NCCL settings known to cost bandwidth
and a fallback to sockets seen in an `NCCL_DEBUG=INFO` log (`diagnostics.nccl`).

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

from lightning_tp3d.diagnostics.nccl import (
    nccl_setting_warnings,
    nccl_settings,
    transport_warnings,
    transports_in_log,
)
from lightning_tp3d.parallel.mesh import mesh_device
from lightning_tp3d.parallel.timing import DeviceInterval
from lightning_tp3d.plan.layout import ParallelLayout

__all__ = ["DEFAULT_FLOORS_GBPS", "DEFAULT_SIZES", "DoctorReport", "Measurement", "diagnose", "run_doctor"]

DEFAULT_SIZES = (4 * 1024, 1024**2, 16 * 1024**2)
# Absolute floors (GB/s) for the largest message, on GPUs: a group inside one node should run on NVLink
# (bus bandwidth in the hundreds of GB/s on H100 / H200), a group across nodes on InfiniBand (400 Gb/s
# NDR: ~50 GB/s a port). Far below the floor means PCIe, sockets or a misconfigured fabric.
DEFAULT_FLOORS_GBPS = {"intra_node": 100.0, "inter_node": 10.0}
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
    nccl_settings: dict[str, str | None] = field(default_factory=dict)
    transports: dict[str, int] = field(default_factory=dict)  # from an NCCL_DEBUG=INFO log, when given

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
        if self.backend == "nccl":
            settings = ", ".join(f"{name}={value}" for name, value in self.nccl_settings.items() if value is not None)
            lines.append(f"NCCL settings: {settings or 'all defaults'}")
        if self.transports:
            lines.append("NCCL transports: " + ", ".join(f"{name} x{count}" for name, count in self.transports.items()))
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
               warmup: int = 2, environment: Mapping[str, str] | None = None,
               floors_gbps: Mapping[str, float] | None = None, nccl_log: str | None = None) -> DoctorReport:
    """Measure every mesh dimension; a collective over all ranks, which all receive the whole report.
    `nccl_log` is the text of an `NCCL_DEBUG=INFO` log of this run, for the transports."""
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
    environment = dict(os.environ) if environment is None else environment
    report = DoctorReport(dist.get_backend(), world, layout.to_dict(), hosts, measurements,
                          nccl_settings=nccl_settings(environment),
                          transports=transports_in_log(nccl_log) if nccl_log else {})
    report.warnings = diagnose(report, environment, uses_gpus=mesh.device_type == "cuda", floors_gbps=floors_gbps)
    return report


def diagnose(report: DoctorReport, environment: Mapping[str, str], uses_gpus: bool,
             floors_gbps: Mapping[str, float] | None = None) -> list[str]:
    """Warnings, each with its fix, from a report's figures (relative to the other groups and, on GPUs,
    against absolute floors: `DEFAULT_FLOORS_GBPS` unless `floors_gbps` says otherwise), its hosts, the NCCL /
    gloo settings and the transports NCCL picked."""
    warnings = []
    multi_host = len(set(report.hosts)) > 1
    floors = {**DEFAULT_FLOORS_GBPS, **(floors_gbps or {})}
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
    for dimension, rows in by_dimension.items():
        for row in rows:
            where = "intra_node" if len(set(row.hosts)) == 1 else "inter_node"
            if uses_gpus and row.bandwidth_gbps < floors[where]:
                link = "NVLink inside a node" if where == "intra_node" else "InfiniBand across nodes"
                warnings.append(
                    f"{dimension} group {list(row.ranks)} reaches {row.bandwidth_gbps:.2f} GB/s, below the"
                    f" {floors[where]:g} GB/s floor for {link}: check the topology (nvidia-smi topo -m) and the"
                    f" NCCL settings (floors: --floor-intra-node / --floor-inter-node)."
                )
    if uses_gpus and "tp" in medians and "dp" in medians and medians["tp"] < _SLOW_FRACTION * medians["dp"]:
        warnings.append(
            f"tp all-reduce reaches {medians['tp']:.2f} GB/s, under half of dp's {medians['dp']:.2f} GB/s: tensor"
            " parallelism should run on the fastest links (NVLink inside a node); check the layout and the launch."
        )
    if report.backend == "nccl":
        warnings += nccl_setting_warnings(environment, multi_host)
        warnings += transport_warnings(report.transports, multi_host)
    elif uses_gpus:
        warnings.append(f"backend {report.backend} on GPUs: use nccl (TP3DStrategy(process_group_backend='nccl')).")
    elif multi_host and not environment.get("GLOO_SOCKET_IFNAME"):
        warnings.append("GLOO_SOCKET_IFNAME is unset on a multi-host gloo run: set it to the fast interface.")
    return warnings
