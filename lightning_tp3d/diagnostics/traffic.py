"""Measure what this rank sends over each mesh group: the counterpart of `plan.communication`.

Collectives come from torch's flight recorder (on for every group this package creates, see
`parallel.collectives.enable_collective_recording`): it records each collective a process group runs,
including DTensor's and FSDP2's, with its input sizes and dtypes. Point-to-point sends are not in
gloo's recorder, so `isend` and `send` are wrapped while recording, in `torch.distributed` and in
`distributed_c10d` (whose `P2POp` accepts only the function it holds as `isend`), which covers
pipelining's batched and unbatched sends. Both are keyed by group name ("tp", "pp", "dp" from the
mesh, "world" for the default group). Scalars (the non-finite-step flag, the loss broadcast, logged
metrics) and barriers are kept apart as control traffic.

    with TrafficRecorder(mesh) as traffic:
        train_one_step()
    traffic.transfers   # {(group, operation, elements, element_bytes): calls}
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp3d._compat.torch import recorded_collectives

__all__ = ["TrafficRecorder"]

_DTYPE_BYTES = {"Float": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Long": 8, "Int": 4, "Byte": 1, "Bool": 1,
                "Char": 1, "Short": 2}
_P2P_CALLS = ("isend", "send")
Key = tuple[str, str, int, int]


class TrafficRecorder:
    """Counts this rank's collectives and sends per mesh group between `__enter__` and `__exit__`, the groups
    of `mesh` and of any `more_meshes` (e.g. the experts' ("edp", "ep") mesh) by their dimension names."""

    def __init__(self, mesh: DeviceMesh, *more_meshes: DeviceMesh) -> None:
        named = [(each, name) for each in (mesh, *more_meshes) for name in each.mesh_dim_names or ()]
        self._descriptions = {f"mesh_{name}": name for _, name in named} | {"default_pg": "world"}
        self._groups = {id(each.get_group(name)): name for each, name in named}
        self.transfers: collections.Counter[Key] = collections.Counter()
        self.control: collections.Counter[Key] = collections.Counter()
        self._last_record = -1
        self._originals: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> TrafficRecorder:
        self._last_record = max((entry.get("record_id", -1) for entry in recorded_collectives()), default=-1)
        for name in _P2P_CALLS:
            original = getattr(c10d, name)
            self._originals[name] = original
            wrapped = self._wrapped(original)
            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for name, original in self._originals.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)
        self._originals.clear()
        for entry in recorded_collectives():
            if entry.get("record_id", -1) <= self._last_record or entry.get("is_p2p"):
                continue
            operation = entry.get("profiling_name", "").split(":")[-1]
            group = self._descriptions.get((entry.get("process_group") or ["", ""])[-1], "other")
            sizes, dtypes = entry.get("input_sizes") or [[]], entry.get("input_dtypes") or ["Byte"]
            for size, dtype in zip(sizes, dtypes):
                self._add(group, operation, int(torch.Size(size).numel()) if operation != "barrier" else 0,
                          _DTYPE_BYTES.get(dtype, 1))

    def _add(self, group: str, operation: str, elements: int, element_bytes: int) -> None:
        counter = self.control if elements <= 1 else self.transfers
        counter[(group, operation, elements, element_bytes)] += 1

    def _record_send(self, tensor: torch.Tensor, group: Any) -> None:
        name = self._groups.get(id(group), "world" if group is None else "other")
        self._add(name, "send", tensor.numel(), tensor.element_size())

    def _wrapped(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def recording(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._record_send(tensor, kwargs.get("group", args[1] if len(args) > 1 else None))
            return original(tensor, *args, **kwargs)

        return recording

    def per_group(self) -> dict[str, dict[str, int]]:
        """Per group: calls and payload bytes (control traffic left out)."""
        result: dict[str, dict[str, int]] = {}
        for (group, _, elements, element_bytes), calls in self.transfers.items():
            total = result.setdefault(group, {"calls": 0, "payload_bytes": 0})
            total["calls"] += calls
            total["payload_bytes"] += calls * elements * element_bytes
        return result
