"""`tp3d doctor`: per-group figures at (tp, pp, dp) = (2, 2, 2) on 8 CPU processes, JSON and table output,
the same at strategy setup (`TP3DStrategy(preflight=True)`), and the warnings `diagnose` derives from
hosts, bandwidths and NCCL settings."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import lightning as L
import pytest

from lightning_tp3d import TP3DStrategy
from lightning_tp3d.cli import main as tp3d
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.diagnostics.doctor import DoctorReport, Measurement, diagnose
from lightning_tp3d.models import CausalLMModule
from tests.distributed import run_distributed
from tests.helpers import SEQ_LEN, trainer_kwargs, world_size

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'


def run_doctor_world() -> dict[str, Any]:
    outputs = {}
    for flag in ([], ["--json"]):
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            code = tp3d(["doctor", "--tp", "2", "--pp", "2", "--sizes", "4KiB", "256KiB", "--iterations", "3",
                         "--timeout", "60", *flag])
        outputs["json" if flag else "table"] = (code, stdout.getvalue())
    strategy = TP3DStrategy(tensor_parallel_size=2, pipeline_parallel_size=2, preflight=True)
    trainer = L.Trainer(**trainer_kwargs(devices=world_size(), strategy=strategy, max_steps=1))
    trainer.fit(CausalLMModule("tiny"), TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=4))
    outputs["preflight"] = [(row.dimension, row.bytes) for row in strategy.preflight_report.measurements]
    return outputs


@pytest.fixture(scope="module")
def doctor() -> list[dict[str, Any]]:
    return run_distributed(8, "tests.diagnostics.test_doctor:run_doctor_world")


def test_doctor_reports_every_group_of_every_dimension(doctor):
    code, text = doctor[0]["json"]
    assert code == 0
    report = json.loads(text)
    assert report["backend"] == "gloo" and report["world_size"] == 8
    assert (report["layout"]["tensor_parallel_size"], report["layout"]["pipeline_parallel_size"],
            report["layout"]["data_parallel_size"]) == (2, 2, 2)
    groups: dict[str, set] = {}
    for row in report["measurements"]:
        groups.setdefault(row["dimension"], set()).add(tuple(row["ranks"]))
        assert row["latency_seconds"] > 0 and row["bandwidth_gbps"] > 0
        assert row["operation"] == ("send_recv" if row["dimension"] == "pp" else "all_reduce")
        assert row["bytes"] in (4096, 262144)
    # rank = (pp x 2 + dp) x 2 + tp: tp pairs are consecutive ranks, dp pairs 2 apart, pp neighbours 4 apart
    assert groups["tp"] == {(0, 1), (2, 3), (4, 5), (6, 7)}
    assert groups["dp"] == {(0, 2), (1, 3), (4, 6), (5, 7)}
    assert groups["pp"] == {(rank, (rank + 4) % 8) for rank in range(8)}
    assert len(report["measurements"]) == 2 * (4 + 4 + 8)
    assert report["warnings"] == []  # one host, gloo on CPU
    for rank in doctor[1:]:  # only rank 0 prints
        assert rank["json"] == (0, "") and rank["table"] == (0, "")


def test_doctor_table(doctor):
    code, text = doctor[0]["table"]
    assert code == 0
    lines = text.splitlines()
    assert lines[0].startswith("backend gloo, 8 ranks on 1 host(s); tp=2 pp=2 dp=2")
    assert sum(line.lstrip().startswith(("tp ", "dp ", "pp ")) for line in lines) == 32
    assert lines[-1] == "no warnings"


def test_preflight_at_strategy_setup(doctor):
    for rank in doctor:
        assert sorted(rank["preflight"]) == sorted([("tp", 2**20)] * 4 + [("dp", 2**20)] * 4 + [("pp", 2**20)] * 8)


def _row(dimension: str, ranks: tuple, hosts: tuple, gbps: float) -> Measurement:
    return Measurement(dimension, ranks, hosts, "all_reduce", 1 << 24, 1e-3, gbps)


def test_diagnose_names_the_problem_and_the_fix():
    report = DoctorReport("nccl", 16, {}, ["a"] * 8 + ["b"] * 8, [
        _row("tp", (6, 7, 8, 9), ("a", "a", "b", "b"), 20.0), _row("tp", (0, 1, 2, 3), ("a",) * 4, 200.0),
        _row("tp", (10, 11, 12, 13), ("b",) * 4, 210.0),
        _row("dp", (0, 8), ("a", "b"), 40.0), _row("dp", (1, 9), ("a", "b"), 42.0),
        _row("dp", (2, 10), ("a", "b"), 3.0),
    ])
    warnings = diagnose(report, {"NCCL_IB_DISABLE": "1"}, uses_gpus=True)
    assert any(w.startswith("tp group [6, 7, 8, 9] spans hosts ['a', 'b']: tensor parallelism") for w in warnings)
    assert any(w.startswith("tp group [6, 7, 8, 9] reaches 20.00 GB/s, under half the median 200.00 GB/s")
               for w in warnings)
    assert any(w.startswith("dp group [2, 10] reaches 3.00 GB/s") for w in warnings)
    assert "NCCL_IB_DISABLE=1 turns InfiniBand off and falls back to sockets: unset it." in warnings
    assert any(w.startswith("NCCL_SOCKET_IFNAME is unset on a multi-host run") for w in warnings)
    slow_tp = DoctorReport("nccl", 4, {}, ["a"] * 4, [_row("tp", (0, 1), ("a", "a"), 5.0),
                                                       _row("dp", (0, 2), ("a", "a"), 50.0)])
    assert any(w.startswith("tp all-reduce reaches 5.00 GB/s, under half of dp's 50.00 GB/s")
               for w in diagnose(slow_tp, {}, uses_gpus=True))
    assert diagnose(DoctorReport("gloo", 4, {}, ["a"] * 4, []), {}, uses_gpus=True) == [
        "backend gloo on GPUs: use nccl (TP3DStrategy(process_group_backend='nccl'))."]


def test_nccl_settings_floors_and_the_socket_fallback():
    """The design documents' NCCL settings are reported and known-bad values named with the fix; on GPUs a
    group below its absolute floor warns (NVLink inside a node, InfiniBand across nodes, overridable); an
    NCCL_DEBUG=INFO log's transports are counted and NET/Socket across hosts is the fallback to TCP."""
    from lightning_tp3d.diagnostics.nccl import nccl_settings, transports_in_log

    environment = {"NCCL_P2P_LEVEL": "LOC", "NCCL_NET_GDR_LEVEL": "loc", "NCCL_BUFFSIZE": "65536",
                   "NCCL_ALGO": "Ring", "NCCL_DEBUG": "TRACE", "NCCL_IB_HCA": "mlx5_0", "NCCL_SOCKET_IFNAME": "ib0"}
    assert nccl_settings(environment)["NCCL_IB_HCA"] == "mlx5_0" and nccl_settings({})["NCCL_ALGO"] is None
    log = ("node0:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC\n"
           "node0:1:2 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/IPC/read\n"
           "node0:1:2 [1] NCCL INFO Channel 00/0 : 1[1] -> 8[0] [send] via NET/Socket/0\n")
    assert transports_in_log(log) == {"P2P/IPC": 2, "NET/Socket": 1}
    report = DoctorReport("nccl", 16, {}, ["a"] * 8 + ["b"] * 8, [
        _row("tp", (0, 1), ("a", "a"), 40.0), _row("tp", (8, 9), ("b", "b"), 160.0),
        _row("dp", (0, 8), ("a", "b"), 4.0)], transports=transports_in_log(log))
    warnings = diagnose(report, environment, uses_gpus=True)
    expected = [
        "NCCL_P2P_LEVEL=LOC never uses peer-to-peer between GPUs", "NCCL_NET_GDR_LEVEL=LOC turns GPUDirect RDMA off",
        "NCCL_BUFFSIZE=65536 is under 1 MiB", "NCCL_ALGO=Ring forces an algorithm", "NCCL_DEBUG=TRACE logs every call",
        "NCCL connected 1 channel(s) over NET/Socket (TCP) instead of InfiniBand",
        "tp group [0, 1] reaches 40.00 GB/s, below the 100 GB/s floor for NVLink inside a node",
        "dp group [0, 8] reaches 4.00 GB/s, below the 10 GB/s floor for InfiniBand across nodes"]
    for start in expected:
        assert any(warning.startswith(start) for warning in warnings), start
    assert not any(warning.startswith("tp group [8, 9]") for warning in warnings)
    relaxed = diagnose(report, {}, uses_gpus=True, floors_gbps={"intra_node": 30.0, "inter_node": 3.0})
    assert not any("floor" in warning for warning in relaxed)
    assert "NCCL settings: NCCL_IB_HCA=mlx5_0" in DoctorReport(
        "nccl", 2, {"tensor_parallel_size": 2, "pipeline_parallel_size": 1, "data_parallel_size": 1}, ["a", "a"],
        nccl_settings=nccl_settings({"NCCL_IB_HCA": "mlx5_0"})).table()
