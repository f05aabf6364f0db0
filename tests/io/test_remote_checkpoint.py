"""Checkpoints on remote storage: an S3-compatible server (moto's, on this machine's loopback) stands in
for the store, reached through fsspec (s3fs) as a cluster reaches S3.

* A fit at (tp, pp, dp) = (2, 2, 1) saves asynchronously to `s3://...` through Lightning's
  `ModelCheckpoint` (every 2 steps, keep the last 2 by step, and `last.ckpt`); a new Trainer resumes from
  the step-4 URL and trains the same losses (bitwise) and weights as the run that went on, and one given
  `ckpt_path="last"` finds the step-6 `last.ckpt` there by itself.
* A save killed (SIGKILL) while uploading its shards leaves the previous checkpoint of that name whole; one
  killed while committing a replacement (the store has no rename: a copy, `meta.json` last) is read from
  the complete staged folder, and the next save finishes the replacement.
* `ckpt_path="last"` finds the newest complete `last` checkpoint in a remote folder.
* Reading from the URL: `tp3d verify`, `tp3d export` (the same files as exporting a downloaded copy),
  `load_from_checkpoint`, and a flipped byte in a remote shard refused naming the shard.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_tp3d.cli import main as tp3d
from lightning_tp3d.io.checkpoint import save_checkpoint
from lightning_tp3d.io.checkpoint_format import CheckpointError, CheckpointMeta, load_model_tensors, read_meta
from lightning_tp3d.io.last_checkpoint import newest_last_checkpoint
from lightning_tp3d.io.storage import is_remote, location
from lightning_tp3d.models import CausalLMModule
from tests.distributed import run_distributed
from tests.io.test_checkpoint import _fit

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

BUCKET = "tp3d"
RUN = f"s3://{BUCKET}/run"
STEPS = 6
SIZES = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1}


@pytest.fixture(scope="module")
def s3_store() -> Any:
    """An S3-compatible server on the loopback, and the environment s3fs (and spawned ranks) reach it with."""
    moto_server = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    variables = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    store = s3fs.S3FileSystem()
    store.mkdir(BUCKET)
    yield store
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    server.stop()


# ---------------------------------------------------------------------- worlds and child processes
def run_remote_fit_world(directory: str) -> dict[str, Any]:
    """(2, 2, 1): 6 steps saving to S3 asynchronously, then a new Trainer resuming from the step-4 URL."""
    keep = ModelCheckpoint(dirpath=RUN, every_n_train_steps=2, save_top_k=2, monitor="step", mode="max",
                           save_last=True)
    straight = _fit(2, 2, Path(directory), steps=STEPS, callbacks=[keep], async_checkpoint=True)
    kept = sorted(keep.best_k_models)
    step4 = next(path for path in kept if path.endswith("step=4.ckpt"))
    resumed = _fit(2, 2, Path(directory), steps=STEPS, ckpt_path=step4)
    from_last = _fit(2, 2, Path(directory), steps=STEPS, ckpt_path="last",
                     callbacks=[ModelCheckpoint(dirpath=RUN, save_last=True)])
    return {"straight": straight["losses"], "resumed": resumed["losses"], "kept": kept,
            "from_last": from_last["losses"], "weights": _same(straight["weights"], resumed["weights"]),
            "weights_from_last": _same(straight["weights"], from_last["weights"])}


def _same(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> bool:
    return first.keys() == second.keys() and all(torch.equal(first[name], value) for name, value in second.items())


def _weights(value: float) -> dict[str, dict[str, torch.Tensor]]:
    return {"module": {"w": torch.full((256, 256), value), "b": torch.arange(8.0) + value}}


def _meta(step: int) -> CheckpointMeta:
    return CheckpointMeta(layout=SIZES, world_size=1, global_step=step)


def save_twice_and_die(url: str, moment: str) -> None:
    """One process: save step 1 to `url`, then die (SIGKILL) in the step-2 save to the same name, while
    uploading its shards (`moment="upload"`) or after copying two files of the commit (`"commit"`)."""
    import lightning_tp3d.io.dcp_files as dcp_files

    save_checkpoint(url, _weights(1.0), {}, _meta(1))
    if moment == "upload":
        def die(self: Any, data: Any) -> int:
            os.kill(os.getpid(), signal.SIGKILL)

        dcp_files._HashingStream.write = die
    else:
        files = location(url).fs  # fsspec's cached instance, which the next save uses too
        copy, copies = files.copy, []

        def copy_then_die(*args: Any, **kwargs: Any) -> Any:
            copies.append(args)
            if len(copies) == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            return copy(*args, **kwargs)

        files.copy = copy_then_die
    save_checkpoint(url, _weights(2.0), {}, _meta(2))


def _killed(url: str, moment: str) -> None:
    command = [sys.executable, "-c", "import sys; from tests.io.test_remote_checkpoint import save_twice_and_die as f;"
               " f(*sys.argv[1:])", url, moment]
    process = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, timeout=300)
    assert process.returncode == -signal.SIGKILL, process.stderr.decode()[-3000:]


def _equal(found: dict[str, torch.Tensor], expected: dict[str, dict[str, torch.Tensor]]) -> bool:
    return found.keys() == expected["module"].keys() and all(
        torch.equal(found[name], value) for name, value in expected["module"].items())


@pytest.fixture(scope="module")
def remote_fit(s3_store, tmp_path_factory) -> list[dict[str, Any]]:
    return run_distributed(4, "tests.io.test_remote_checkpoint:run_remote_fit_world",
                           str(tmp_path_factory.mktemp("remote")))


# ---------------------------------------------------------------------- tests
def test_location_of_local_paths_and_urls(s3_store):
    assert location("file:///tmp/run/last.ckpt") == Path("/tmp/run/last.ckpt")
    assert location("checkpoints/last.ckpt") == Path("checkpoints/last.ckpt")
    remote = location(f"{RUN}/last.ckpt")
    assert is_remote(remote) and str(remote) == f"{RUN}/last.ckpt" and remote.name == "last.ckpt"
    assert location(remote) is remote and not is_remote(Path("/tmp"))


def test_remote_storage_without_universal_pathlib_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "upath", None)
    with pytest.raises(ImportError, match=r"s3://bucket/x is on remote storage .*pip install universal_pathlib"):
        location("s3://bucket/x")


def test_fit_saves_to_s3_and_resumes_exactly(remote_fit, s3_store):
    for rank in remote_fit:
        assert len(rank["straight"]) == STEPS
        assert rank["resumed"] == rank["straight"][4:]  # bitwise: same layout, random states restored
        assert rank["weights"]
        assert rank["from_last"] == [] and rank["weights_from_last"]  # "last" found step 6, the run's end
    kept = remote_fit[0]["kept"]
    assert [path.rsplit("step=", 1)[1] for path in kept] == ["4.ckpt", "6.ckpt"]
    listed = sorted(name.rsplit("/", 1)[1] for name in s3_store.ls(f"{BUCKET}/run", refresh=True))
    assert listed == sorted([path.rsplit("/", 1)[1] for path in kept] + ["last.ckpt"])  # step 2 removed
    meta = read_meta(f"{RUN}/last.ckpt")
    assert meta.global_step == STEPS and meta.parallel_sizes == (2, 2, 1) and meta.world_size == 4
    assert len([name for name in meta.file_hashes if name.startswith("rng/")]) == 4


def test_a_save_killed_while_uploading_leaves_the_previous_checkpoint_whole(s3_store):
    url = f"s3://{BUCKET}/killed-upload/last.ckpt"
    _killed(url, "upload")
    assert read_meta(url).global_step == 1
    assert _equal(load_model_tensors(url), _weights(1.0))
    assert s3_store.exists(f"{BUCKET}/killed-upload/last.ckpt.partial/trainer_state.pt")
    assert not s3_store.exists(f"{BUCKET}/killed-upload/last.ckpt.partial/meta.json")
    save_checkpoint(url, _weights(3.0), {}, _meta(3))  # the stale staging folder is replaced
    assert read_meta(url).global_step == 3 and _equal(load_model_tensors(url), _weights(3.0))
    assert not s3_store.exists(f"{BUCKET}/killed-upload/last.ckpt.partial")


def test_a_save_killed_while_committing_is_read_from_the_staged_folder(s3_store):
    url = f"s3://{BUCKET}/killed-commit/last.ckpt"
    _killed(url, "commit")
    folder = f"{BUCKET}/killed-commit/last.ckpt"
    copied, staged = s3_store.find(folder, refresh=True), s3_store.find(f"{folder}.partial")
    assert 0 < len(copied) < len(staged) and not s3_store.exists(f"{folder}/meta.json")  # killed mid-copy
    with pytest.warns(UserWarning, match=r"last.ckpt is incomplete: a save replacing it was interrupted; reading"
                                         r" the complete folder last.ckpt.partial"):
        assert read_meta(url).global_step == 2
    with pytest.warns(UserWarning, match=r"reading the complete folder last.ckpt.partial"):
        assert _equal(load_model_tensors(url), _weights(2.0))
    with pytest.warns(UserWarning, match=r"reading the complete folder last.ckpt.partial"):  # ckpt_path="last"
        assert newest_last_checkpoint([(f"s3://{BUCKET}/killed-commit", "last", ".ckpt")]) == url
    save_checkpoint(url, _weights(3.0), {}, _meta(3))
    assert read_meta(url).global_step == 3 and _equal(load_model_tensors(url), _weights(3.0))
    assert not s3_store.exists(f"{folder}.partial")


def test_the_newest_complete_last_checkpoint_is_found(s3_store):
    """`ckpt_path="last"`: `last.ckpt` and `last-v1.ckpt` dated by their meta.json (S3 dates to the second),
    an unfinished save (no meta.json) and other names passed over, the protocol kept."""
    folder = f"s3://{BUCKET}/search"
    for name, step in (("last-v1.ckpt", 1), ("last.ckpt", 2), ("epoch=0-step=3.ckpt", 3), ("last-v2.ckpt", 4)):
        save_checkpoint(f"{folder}/{name}", _weights(float(step)), {}, _meta(step))
        time.sleep(1.1)
    s3_store.rm(f"{BUCKET}/search/last-v2.ckpt/meta.json")
    assert newest_last_checkpoint([(folder, "last", ".ckpt")]) == f"{folder}/last.ckpt"
    assert newest_last_checkpoint([(folder, "final", ".ckpt"), (f"s3://{BUCKET}/none", "last", ".ckpt")]) is None


def test_commands_and_lightning_read_from_the_url(remote_fit, s3_store, tmp_path, capsys):
    url = f"{RUN}/last.ckpt"
    assert tp3d(["verify", url]) == 0 and "files match their recorded SHA-256" in capsys.readouterr().out
    assert tp3d(["export", url, str(tmp_path / "from-s3")]) == 0
    s3_store.get(f"{BUCKET}/run/last.ckpt", str(tmp_path / "last.ckpt"), recursive=True)
    assert tp3d(["export", str(tmp_path / "last.ckpt"), str(tmp_path / "from-disk")]) == 0
    exported = sorted(path.name for path in (tmp_path / "from-s3").iterdir())
    assert "config.json" in exported and any(name.endswith(".safetensors") for name in exported)
    for name in exported:
        assert (tmp_path / "from-s3" / name).read_bytes() == (tmp_path / "from-disk" / name).read_bytes(), name
    module = CausalLMModule.load_from_checkpoint(url)
    stored = load_model_tensors(url)
    assert all(torch.equal(value, stored[name]) for name, value in module.state_dict().items())


def test_a_flipped_byte_in_a_remote_shard_is_named(remote_fit, s3_store):
    source, copy = f"{BUCKET}/run/last.ckpt", f"{BUCKET}/damaged/last.ckpt"
    s3_store.copy(source, copy, recursive=True)
    shard = sorted(name for name in s3_store.find(copy) if name.endswith(".distcp"))[0]
    data = bytearray(s3_store.cat_file(shard))
    data[len(data) // 2] ^= 0xFF
    s3_store.pipe_file(shard, bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.rsplit('/', 1)[1]} \(written by rank \d\) does not match the"
                                              r" SHA-256 recorded"):
        load_model_tensors(f"s3://{copy}")


def test_a_remote_folder_without_its_commit_marker_is_refused(s3_store):
    """The commit marker is what makes a remote folder a checkpoint: without meta.json it is refused."""
    url = f"s3://{BUCKET}/no-commit/step.ckpt"
    save_checkpoint(url, _weights(1.0), {}, _meta(1))
    s3_store.rm(f"{BUCKET}/no-commit/step.ckpt/meta.json")
    with pytest.raises(CheckpointError, match=r"has no meta.json: it is not a lightning_tp3d checkpoint, or the save"
                                              r" that wrote it did not complete"):
        read_meta(url)
    save_checkpoint(url, _weights(2.0), {}, _meta(2))  # ours: written again in place
    assert read_meta(url).global_step == 2 and not s3_store.exists(f"{BUCKET}/no-commit/step.ckpt.partial")


def test_a_remote_folder_this_package_did_not_write_is_never_replaced(s3_store):
    foreign = f"{BUCKET}/foreign/x.ckpt"
    s3_store.pipe_file(f"{foreign}/meta.json", b"{}")
    s3_store.pipe_file(f"{foreign}/weights.bin", b"the user's")
    with pytest.raises(FileExistsError, match=r"x.ckpt exists and was not written by lightning_tp3d; nothing was"
                                              r" replaced"):
        save_checkpoint(f"s3://{foreign}", _weights(1.0), {}, _meta(1))
    assert s3_store.cat_file(f"{foreign}/weights.bin") == b"the user's"
    assert s3_store.exists(f"{foreign}/meta.json")
