"""The communication table `tp3d plan` prints (per stage and group of a `plan.communication`
ledger, with times on the given links) and the links' bandwidths it reads from the command line."""

from __future__ import annotations

import argparse
import json

from lightning_tp3d.plan.communication import EXPERT_DATA_GROUP, EXPERT_GROUP, GROUPS, CommunicationLedger

__all__ = ["GPUS_PER_NODE", "communication_lines", "given_bandwidths"]

GPUS_PER_NODE = 8  # when --gpus-per-node is not given: which groups cross nodes


def given_bandwidths(args: argparse.Namespace) -> dict[str, float]:
    """GB/s per group from --doctor-report (largest message measured), then --bandwidth on top."""
    given: dict[str, float] = {}
    if args.doctor_report is not None:
        with open(args.doctor_report) as handle:
            measurements = json.load(handle)["measurements"]
        for row in sorted(measurements, key=lambda row: row["bytes"]):
            given[row["dimension"]] = row["bandwidth_gbps"]
    for item in args.bandwidth:
        group, _, value = item.partition("=")
        if group not in (*GROUPS, EXPERT_GROUP, EXPERT_DATA_GROUP) or not value:
            raise ValueError(f"--bandwidth {item!r}: write GROUP=GB/s with GROUP one of"
                             f" {[*GROUPS, EXPERT_GROUP, EXPERT_DATA_GROUP]}, e.g. tp=150.")
        given[group] = float(value.removesuffix("GB/s").removesuffix("GB"))
    return given



def communication_lines(ledger: CommunicationLedger, bandwidth: dict[str, float]) -> list[str]:
    lines = ["communication per step and rank (lightning_tp3d.plan.communication)",
             "(payload: the tensors handed to collectives; sent: the ring algorithm's bytes on the wire)",
             f"{'stage':>5} {'group':>5} {'calls':>7} {'payload MB':>11} {'sent MB':>10} {'GB/s':>7} {'ms':>9}"
             f" {'hideable ms':>11}"]
    for stage in range(len(ledger.stages)):
        totals, seconds = ledger.totals(stage), ledger.seconds(stage, bandwidth)
        for group in ledger.group_sizes:
            total, time = totals[group], seconds[group]
            if total["calls"]:
                lines.append(f"{stage:>5} {group:>5} {total['calls']:>7,} {total['payload_bytes'] / 1e6:>11,.1f}"
                             f" {total['sent_bytes'] / 1e6:>10,.1f} {bandwidth[group] / 1e9:>7.1f}"
                             f" {time['seconds'] * 1e3:>9.1f} {time['hideable_seconds'] * 1e3:>11.1f}")
    return lines
