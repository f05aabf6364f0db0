"""`io.dcp_files`: DCP's index read without running code, folders of torch's own `dcp.save`, and the
hashes computed while writing (one process, no process group)."""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from lightning_tp3d.io.dcp_files import (
    HashingFileSystemWriter,
    SafeFileSystemReader,
    UnsafeCheckpointError,
    file_sha256,
    read_dcp_index,
)


def _plain_dcp_folder(folder) -> dict:
    """What torch's own `dcp.save` writes for tensors of several dtypes, a non-tensor value and nesting."""
    state = {"weight": torch.randn(3, 4), "half": torch.randn(5, dtype=torch.bfloat16),
             "count": torch.tensor(7), "nested": {"bias": torch.zeros(2)}, "step": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    return state


def test_a_folder_written_by_torch_dcp_opens(tmp_path):
    state = _plain_dcp_folder(tmp_path)
    metadata = read_dcp_index(tmp_path)
    assert {"weight", "half", "count", "nested.bias", "step"} <= metadata.state_dict_metadata.keys()
    loaded = {"weight": torch.empty(3, 4), "half": torch.empty(5, dtype=torch.bfloat16), "count": torch.tensor(0),
              "nested": {"bias": torch.ones(2)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(loaded, storage_reader=SafeFileSystemReader(tmp_path), no_dist=True)
    assert torch.equal(loaded["weight"], state["weight"]) and torch.equal(loaded["half"], state["half"])
    assert int(loaded["count"]) == 7 and torch.equal(loaded["nested"]["bias"], torch.zeros(2))


def test_a_non_tensor_value_is_not_unpickled(tmp_path):
    """DCP reads non-tensor values by torch.load with weights_only=False: the safe reader refuses to (DCP
    hands the error on inside its CheckpointException)."""
    _plain_dcp_folder(tmp_path)
    with pytest.raises(CheckpointException, match=r"UnsafeCheckpointError: Loading 'step' from .* would unpickle"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load({"step": 0}, storage_reader=SafeFileSystemReader(tmp_path), no_dist=True)


class _RunsCode:
    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("payload", ["system", "eval", "inside"])
def test_a_crafted_index_is_refused_naming_the_class_and_runs_nothing(tmp_path, payload):
    marker = tmp_path / "ran"
    _plain_dcp_folder(tmp_path)
    metadata = pickle.loads((tmp_path / ".metadata").read_bytes())
    crafted = {"system": _RunsCode(marker), "eval": _Eval(marker), "inside": metadata}[payload]
    if payload == "inside":  # the code hides inside otherwise genuine metadata
        metadata.planner_data = {"x": _RunsCode(marker)}
    (tmp_path / ".metadata").write_bytes(pickle.dumps(crafted))
    expected = {"system": r"names (posix|nt)\.system", "eval": r"names builtins\.eval",
                "inside": r"names (posix|nt)\.system"}[payload]
    with pytest.raises(UnsafeCheckpointError, match=expected + r", which DCP metadata is not made of"):
        read_dcp_index(tmp_path)
    with pytest.raises((UnsafeCheckpointError, CheckpointException), match=expected):
        dcp.load({"weight": torch.empty(3, 4)}, storage_reader=SafeFileSystemReader(tmp_path), no_dist=True)
    assert not marker.exists()


class _Eval:
    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (eval, (f"open({str(self.marker)!r}, 'w')",))


def test_the_writer_hashes_what_it_writes(tmp_path):
    writer = HashingFileSystemWriter(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"weight": torch.randn(64, 64), "bias": torch.randn(64)}, storage_writer=writer, no_dist=True)
    files = {file.name for file in tmp_path.iterdir() if file.is_file()}
    assert writer.file_hashes.keys() == files and ".metadata" in files
    assert all(file_sha256(tmp_path / name) == digest for name, digest in writer.file_hashes.items())
