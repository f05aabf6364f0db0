"""NCCL's settings and the transports it picked: what the doctor reads, reports and warns about.

Settings (environment variables) the design documents name for a cluster, with the values that are known
to cost bandwidth: `NCCL_IB_DISABLE=1` (no InfiniBand: sockets), `NCCL_P2P_DISABLE=1` or
`NCCL_P2P_LEVEL=LOC` (no NVLink / PCIe peer-to-peer), `NCCL_NET_GDR_LEVEL=LOC` (no GPUDirect RDMA),
`NCCL_BUFFSIZE` under 1 MiB (small chunks), a forced `NCCL_ALGO` (NCCL's tuner knows better, except for a
measured reason), `NCCL_DEBUG=TRACE` (slow logging). `NCCL_IB_HCA`, `NCCL_SOCKET_IFNAME` and `NCCL_DEBUG`
are reported as they are.

Transports: with `NCCL_DEBUG=INFO` NCCL logs each channel's connection (`... via P2P/IPC`, `via NET/IB/0`,
`via NET/Socket/1`, `via SHM`); `transports_in_log` collects them, and `NET/Socket` on a multi-host run is
the fallback to TCP that the design documents warn about.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["NCCL_SETTINGS", "nccl_settings", "nccl_setting_warnings", "transport_warnings", "transports_in_log"]

NCCL_SETTINGS = ("NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_NET_GDR_LEVEL", "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL",
                 "NCCL_BUFFSIZE", "NCCL_ALGO", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG")
_MIN_BUFFSIZE = 1 << 20
_TRANSPORT = re.compile(r"\bvia (P2P/[\w-]+|NET/[\w-]+|SHM|CollNet/?[\w-]*)")


def nccl_settings(environment: Mapping[str, str]) -> dict[str, str | None]:
    """Every NCCL setting the doctor knows, as set (None: NCCL's default)."""
    return {name: environment.get(name) for name in NCCL_SETTINGS}


def nccl_setting_warnings(environment: Mapping[str, str], multi_host: bool) -> list[str]:
    """Settings known to cost bandwidth, each with its fix (see the module docstring)."""
    warnings = []
    if environment.get("NCCL_IB_DISABLE") == "1":
        warnings.append("NCCL_IB_DISABLE=1 turns InfiniBand off and falls back to sockets: unset it.")
    if environment.get("NCCL_P2P_DISABLE") == "1":
        warnings.append("NCCL_P2P_DISABLE=1 turns NVLink / PCIe peer-to-peer off inside a node: unset it.")
    if environment.get("NCCL_P2P_LEVEL", "").upper() == "LOC":
        warnings.append("NCCL_P2P_LEVEL=LOC never uses peer-to-peer between GPUs: unset it (or use NVL / SYS).")
    if environment.get("NCCL_NET_GDR_LEVEL", "").upper() == "LOC":
        warnings.append("NCCL_NET_GDR_LEVEL=LOC turns GPUDirect RDMA off (network traffic staged through host"
                        " memory): unset it or use PHB / SYS where the NIC and GPU share a switch.")
    buffsize = environment.get("NCCL_BUFFSIZE")
    if buffsize is not None and buffsize.isdigit() and int(buffsize) < _MIN_BUFFSIZE:
        warnings.append(f"NCCL_BUFFSIZE={buffsize} is under 1 MiB: small chunks cut bandwidth; unset it (default"
                        " 4 MiB).")
    if environment.get("NCCL_ALGO"):
        warnings.append(f"NCCL_ALGO={environment['NCCL_ALGO']} forces an algorithm for every message size: unset it"
                        " unless a measurement showed it faster.")
    if environment.get("NCCL_DEBUG", "").upper() == "TRACE":
        warnings.append("NCCL_DEBUG=TRACE logs every call and slows training: use INFO (or WARN) for runs.")
    if multi_host and not environment.get("NCCL_SOCKET_IFNAME"):
        warnings.append("NCCL_SOCKET_IFNAME is unset on a multi-host run: set it to the fast interface (e.g."
                        " ib0, or the 100G ethernet one) so bootstrap and socket traffic avoid a slow one.")
    return warnings


def transports_in_log(log: str) -> dict[str, int]:
    """Channel connections per transport in an `NCCL_DEBUG=INFO` log (e.g. {"P2P/IPC": 24, "NET/IB": 8})."""
    counts: dict[str, int] = {}
    for match in _TRANSPORT.finditer(log):
        transport = match.group(1)
        kind = transport if transport.startswith("P2P") or transport == "SHM" else "/".join(transport.split("/")[:2])
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def transport_warnings(transports: Mapping[str, int], multi_host: bool) -> list[str]:
    """The fallback to sockets, from `transports_in_log`'s counts."""
    if multi_host and transports.get("NET/Socket"):
        return [f"NCCL connected {transports['NET/Socket']} channel(s) over NET/Socket (TCP) instead of InfiniBand:"
                " check NCCL_IB_HCA, the IB drivers (ibv_devinfo) and NCCL_IB_DISABLE."]
    return []
