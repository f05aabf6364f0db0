"""Checkpoints through Lightning's `ModelCheckpoint` / `ckpt_path=` flow with TP3DStrategy.

* Exact resume at (tp, pp, dp) = (2, 2, 2) (FSDP2 over dp, 1F1B) with dropout and an LR warm-up: 8 steps
  straight (saving asynchronously) vs a new Trainer resuming from the checkpoints of steps 4 (mid-epoch),
  5 (last batch of an epoch) and 7 (mid second epoch): identical losses and final weights (exact equality).
* Resharded resume: saved at (2, 2, 1), resumed at (1, 2, 2) (FSDP2), (1, 1, 2) and (2, 1, 1): the continued
  losses equal the uninterrupted single-process run within 1e-5 and every step sees the same samples.
* Crash safety and clear errors: a process killed inside a save leaves the previous checkpoint whole;
  truncated shards, foreign models, unfinished or missing folders are named in the error.
* Opening a checkpoint never runs its code: a `.metadata` crafted to run a command (with meta.json's hash
  made to match, as an attacker can) is refused by the Trainer's and Fabric's resume, the offline reader,
  `tp3d export`, `tp3d check` and `tp3d verify`, naming the class, and the command never runs. One flipped
  byte in one shard is refused naming the shard and the rank that wrote it; `verify_checkpoints=False`
  (`--no-verify`) loads it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_tp3d import MODEL_PRESETS, ModelConfig, TP3DFabricStrategy, TP3DStrategy
from lightning_tp3d.cli import main as tp3d
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.io.checkpoint import load_checkpoint
from lightning_tp3d.io.checkpoint_format import (
    CheckpointError,
    load_model_tensors,
    read_lightning_checkpoint,
    read_meta,
)
from lightning_tp3d.io.folders import MARKER_FILE
from lightning_tp3d.models import CausalLMModule
from tests.distributed import run_distributed
from tests.helpers import (
    LEARNING_RATE,
    SEQ_LEN,
    MemoryLogger,
    _training_sample_order,
    assert_adam_weights_close,
    named_full,
    reference_network,
    reference_run,
    trainer_kwargs,
    world_size,
)

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

TOLERANCE = 1e-5
GLOBAL_BATCH = 8
STEPS = 8
SAVED_AT = 4  # the resharding checkpoint
GLOBAL_SAVED_AT = 3  # the global-batch run's: 6 batches at 2 per step, which 4 per step does not divide
EXACT_RESUME_STEPS = (4, 5, 7)
BATCHES_PER_EPOCH = 5  # limit_train_batches of the exact-resume runs: step 5 ends epoch 0


class RecordBatches(Callback):
    """The input ids each step trains on, with this rank's dp coordinate."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.batches.append(batch["input_ids"].clone())


def _fit(tp: int, pp: int, directory: Path, steps: int = STEPS, ckpt_path: Path | None = None,
         config: ModelConfig | None = None, callbacks: list[Callback] | None = None, mode: str = "replicate",
         async_checkpoint: bool = False, verify_checkpoints: bool = True, global_batch_size: int | None = None,
         per_rank_batch: int | None = None, **trainer_options: Any) -> dict:
    """Fit to `steps` (resuming from `ckpt_path`); return losses, recorded batches and whole final weights.

    With a `config` (dropout) the run is seeded and warms its learning rate up over 6 steps. The per-rank
    batch is GLOBAL_BATCH / dp unless `per_rank_batch` is given (with `global_batch_size`, the strategy
    then accumulates to that global batch)."""
    if config is not None:
        L.seed_everything(1234)
    dp = world_size() // (tp * pp)
    logger, recorder = MemoryLogger(), RecordBatches()
    strategy = TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, num_microbatches=2,
                            data_parallel_mode=mode, async_checkpoint=async_checkpoint,
                            verify_checkpoints=verify_checkpoints, global_batch_size=global_batch_size)
    trainer = L.Trainer(**trainer_kwargs(
        devices=world_size(), strategy=strategy, max_steps=steps, logger=logger, default_root_dir=directory,
        callbacks=[recorder, *(callbacks or [])], enable_checkpointing=bool(callbacks), **trainer_options))
    module = CausalLMModule(config or "tiny", learning_rate=LEARNING_RATE, warmup_steps=6 if config else 0)
    trainer.fit(module, TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=per_rank_batch or GLOBAL_BATCH // dp,
                                        val_fraction=0.2),
                ckpt_path=ckpt_path)
    return {"losses": logger.values("train_loss"), "batches": recorder.batches,
            "accumulate": trainer.accumulate_grad_batches,
            "dp_rank": strategy.layout.coordinates(trainer.global_rank).dp, "weights": named_full(module)}


# ---------------------------------------------------------------------- worlds
def run_exact_resume_world(directory: str) -> dict[str, Any]:
    """(2, 2, 2): a straight run saving every step asynchronously, then a new Trainer resuming from several
    steps (the checkpoints must hold each step's values although training went on while they were written)."""
    directory = Path(directory)
    dropout = dataclasses.replace(MODEL_PRESETS["tiny"], hidden_dropout=0.1, attention_dropout=0.1)
    every_step = ModelCheckpoint(dirpath=directory / "every", every_n_train_steps=1, save_top_k=-1)
    best_two = ModelCheckpoint(dirpath=directory / "best", every_n_train_steps=2, save_top_k=2,
                               monitor="train_loss", save_last=True)
    straight = _fit(2, 2, directory, config=dropout, callbacks=[every_step, best_two], mode="fsdp",
                    async_checkpoint=True, limit_train_batches=BATCHES_PER_EPOCH)
    results: dict[str, Any] = {"straight": straight["losses"], "best_kept": sorted(best_two.best_k_models)}
    for step in EXACT_RESUME_STEPS:
        path = directory / "every" / f"epoch={(step - 1) // BATCHES_PER_EPOCH}-step={step}.ckpt"
        resumed = _fit(2, 2, directory, ckpt_path=path, config=dropout, mode="fsdp",
                       limit_train_batches=BATCHES_PER_EPOCH)
        results[f"resumed-{step}"] = resumed["losses"]
        results[f"weights-{step}"] = all(torch.equal(straight["weights"][name], value)
                                         for name, value in resumed["weights"].items())
    return results


def run_reshard_save_world(directory: str) -> dict[str, Any]:
    """(2, 2, 1) saves at step 4; then, in the same world, (1, 2, 2) with FSDP2 over dp resumes from it."""
    directory = Path(directory)
    saver = ModelCheckpoint(dirpath=directory, filename="step4", every_n_train_steps=SAVED_AT)
    saved = _fit(2, 2, directory, steps=SAVED_AT, callbacks=[saver])
    resumed = _fit(1, 2, directory, ckpt_path=directory / "step4.ckpt", mode="fsdp")
    # (2, 1, 2) at a global batch of 8 from per-rank batches of 2: 2 batches accumulated per step
    every3 = ModelCheckpoint(dirpath=directory / "global", filename="{step}", every_n_train_steps=GLOBAL_SAVED_AT,
                             save_top_k=-1)
    global_batch = _fit(2, 1, directory, callbacks=[every3], global_batch_size=GLOBAL_BATCH, per_rank_batch=2)
    return {"saved": saved, "1-2-2": resumed, "global-dp2": global_batch}


def run_reshard_resume_world(directory: str) -> dict[str, Any]:
    directory = Path(directory)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = {"1-1-2": _fit(1, 1, directory, ckpt_path=directory / "step4.ckpt"),
                   "2-1-1": _fit(2, 1, directory, ckpt_path=directory / "step4.ckpt")}
    # the global-batch run resumed at dp 1 (a lost replica): 4 batches accumulated per step
    results["global-dp1"] = _fit(2, 1, directory, ckpt_path=directory / "global" / f"step={GLOBAL_SAVED_AT}.ckpt",
                                 global_batch_size=GLOBAL_BATCH, per_rank_batch=2)
    results["warnings"] = [str(warning.message) for warning in caught if "Resharding" in str(warning.message)]
    results["crafted-trainer"] = _error_of(lambda: _fit(1, 1, directory, ckpt_path=directory / "crafted.ckpt"))
    results["crafted-fabric"] = _error_of(lambda: _fabric_load(directory / "crafted.ckpt"))
    results["flipped-trainer"] = _error_of(lambda: _fit(1, 1, directory, ckpt_path=directory / "flipped.ckpt"))
    results["flipped-unchecked"] = _fit(1, 1, directory, ckpt_path=directory / "flipped.ckpt",
                                        verify_checkpoints=False)["losses"]
    return results


def _error_of(action: Any) -> str | None:
    try:
        action()
    except CheckpointError as error:
        return str(error)
    return None


def _fabric_load(path: Path) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=TP3DFabricStrategy(pipeline_parallel_size=2))
    fabric.launch()
    model = fabric.setup(reference_network())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE))
    fabric.load(path, {"model": model, "optimizer": optimizer})


class _RunsCode:
    """What an attacker's pickle holds: unpickling it runs `touch marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def tampered_copies(checkpoint: Path) -> None:
    """Beside `checkpoint`: `crafted.ckpt`, whose DCP index runs a command when unpickled (meta.json's hash of
    it updated, as an attacker who rewrites the folder can), and `flipped.ckpt`, with one byte of its
    largest shard flipped."""
    crafted = Path(shutil.copytree(checkpoint, checkpoint.with_name("crafted.ckpt")))
    payload = pickle.dumps(_RunsCode(checkpoint.with_name("ran")))
    (crafted / ".metadata").write_bytes(payload)
    meta = json.loads((crafted / "meta.json").read_text())
    meta["file_hashes"][".metadata"]["sha256"] = hashlib.sha256(payload).hexdigest()
    (crafted / "meta.json").write_text(json.dumps(meta))
    flipped = Path(shutil.copytree(checkpoint, checkpoint.with_name("flipped.ckpt")))
    shard = max(flipped.glob("*.distcp"), key=lambda file: file.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def crash_during_second_save(directory: str) -> None:
    """One process: save `last.ckpt` after step 1, then die (SIGKILL) in the middle of the step-2 save."""
    import lightning_tp3d.io.checkpoint as checkpoint

    directory = Path(directory)
    rename = checkpoint.replace_folder
    renames = []

    def rename_or_die(partial: Path, path: Path, *args: Any) -> None:
        renames.append(path)
        if len(renames) == 2:  # every file of the step-2 save is written, only the rename is left
            os.kill(os.getpid(), signal.SIGKILL)
        rename(partial, path, *args)

    class KeepWeights(Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            if trainer.global_step == 1:
                torch.save({name: value for name, value in pl_module.state_dict().items()}, directory / "step1.pt")

    checkpoint.replace_folder = rename_or_die
    last = ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=0, save_last=True)
    L.Trainer(**trainer_kwargs(devices=1, strategy=TP3DStrategy(), max_steps=3, enable_checkpointing=True,
                               callbacks=[KeepWeights(), last], logger=False)).fit(
        CausalLMModule("tiny"), TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=4))


def crash_between_renames(directory: str) -> None:
    """Two ranks at tp = 2 save `last.ckpt` asynchronously after every step; the whole job is killed
    (SIGKILL to every process, as when a node fails) while the step-2 checkpoint replaces the step-1 one,
    between moving the old folder aside and moving the new one in: the replacement a system without an
    atomic folder swap makes. The step-2 weights are kept in `step2.pt` to compare with."""
    run_distributed(2, "tests.io.test_checkpoint:_save_every_step", directory, None, True)


def _die_between_renames() -> None:
    import lightning_tp3d.io.folders as folders

    folders._exchange = lambda first, second: False  # as where renameat2 is unavailable
    rename = Path.rename

    def rename_or_die(self: Path, target: Path) -> Path:
        moved = rename(self, target)
        if str(target).endswith(folders.REPLACED_SUFFIX):
            os.killpg(os.getpgrp(), signal.SIGKILL)
        return moved

    Path.rename = rename_or_die


class _KeepWeights(Callback):
    def __init__(self, directory: Path, step: int) -> None:
        self.directory, self.step = directory, step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            weights = named_full(pl_module)
            if trainer.is_global_zero:
                torch.save(weights, self.directory / f"step{self.step}.pt")


def _save_every_step(directory: str, ckpt_path: str | None = None, crash: bool = False) -> dict[str, Any]:
    if crash:
        _die_between_renames()
    directory = Path(directory)
    last = ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=0, save_last=True)
    loaded: dict[str, Any] = {}

    class RecordStart(Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            loaded.update(step=trainer.global_step, weights=named_full(pl_module))

    result = _fit(2, 1, directory, steps=3, ckpt_path=ckpt_path, async_checkpoint=True,
                  callbacks=[_KeepWeights(directory, 2), last, RecordStart()])
    return {"loaded": loaded, "losses": result["losses"]}


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def exact(tmp_path_factory) -> tuple[dict[str, Any], Path]:
    directory = tmp_path_factory.mktemp("exact")
    return run_distributed(8, "tests.io.test_checkpoint:run_exact_resume_world", str(directory)), directory


@pytest.fixture(scope="module")
def resharded(tmp_path_factory) -> tuple[dict[str, dict], Path]:
    directory = tmp_path_factory.mktemp("reshard")
    four = run_distributed(4, "tests.io.test_checkpoint:run_reshard_save_world", str(directory))
    tampered_copies(directory / "step4.ckpt")
    two = run_distributed(2, "tests.io.test_checkpoint:run_reshard_resume_world", str(directory))
    runs = {name: [rank[name] for rank in four] for name in four[0]}
    runs.update({name: [rank[name] for rank in two] for name in two[0]})
    return runs, directory / "step4.ckpt"


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return reference_run(STEPS, GLOBAL_BATCH)


# ---------------------------------------------------------------------- exact resume
@pytest.mark.parametrize("step", EXACT_RESUME_STEPS)
def test_resume_at_same_layout_is_exact(exact, step):
    for rank in exact[0]:
        assert len(rank["straight"]) == STEPS
        assert rank[f"resumed-{step}"] == rank["straight"][step:]  # bitwise, dropout and LR warm-up included
        assert rank[f"weights-{step}"]


def test_model_checkpoint_top_k_and_last(exact):
    results, directory = exact
    kept = sorted(path.name for path in (directory / "best").iterdir())
    assert kept == sorted([Path(path).name for path in results[0]["best_kept"]] + ["last.ckpt"])
    assert len(kept) == 3 and not any(name.endswith(".partial") for name in kept)
    assert read_meta(directory / "best" / "last.ckpt").global_step == STEPS
    meta = read_meta(directory / "every" / "epoch=1-step=7.ckpt")
    position = (meta.epoch, meta.consumed_samples_in_epoch, meta.consumed_samples)
    assert position == (1, 2 * GLOBAL_BATCH, 7 * GLOBAL_BATCH)
    assert meta.parallel_sizes == (2, 2, 2) and meta.world_size == 8
    assert sorted(path.name for path in (directory / "every" / "epoch=1-step=7.ckpt" / "rng").iterdir()) == [
        f"rank_{rank:05d}.pt" for rank in range(8)]


# ---------------------------------------------------------------------- resharded resume
def _steps_samples(run: list[dict], steps: range) -> list[list[list[int]]]:
    """Per step, the global batch's rows (sorted) assembled from one rank of every dp coordinate."""
    by_dp = {rank["dp_rank"]: rank["batches"] for rank in run}
    return [sorted(row for dp in sorted(by_dp) for row in by_dp[dp][index].tolist()) for index in range(len(steps))]


def _reference_samples(steps: range) -> list[list[list[int]]]:
    data = TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH, val_fraction=0.2)
    data.setup()
    order = _training_sample_order(len(data.train_dataset))
    return [sorted(data.train_dataset[int(i)]["input_ids"].tolist()
                   for i in order[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]) for step in steps]


@pytest.mark.parametrize("layout", ["1-2-2", "1-1-2", "2-1-1"])
def test_resume_at_another_layout_continues_the_reference(resharded, reference, layout):
    runs, _ = resharded
    saved, resumed = runs["saved"], runs[layout]
    for rank in saved:
        assert max(abs(a - b) for a, b in zip(rank["losses"], reference["losses"][:SAVED_AT])) <= TOLERANCE
    for rank in resumed:
        assert len(rank["losses"]) == STEPS - SAVED_AT
        assert max(abs(a - b) for a, b in zip(rank["losses"], reference["losses"][SAVED_AT:])) <= TOLERANCE
    assert _steps_samples(resumed, range(SAVED_AT, STEPS)) == _reference_samples(range(SAVED_AT, STEPS))
    assert _steps_samples(saved, range(SAVED_AT)) == _reference_samples(range(SAVED_AT))
    weights = resumed[0]["weights"]
    for name, expected in reference["final_params"].items():
        if name in weights:
            assert_adam_weights_close(weights[name], expected, name)


def _accumulated_samples(run: list[dict], steps: range, accumulate: int) -> list[list[list[int]]]:
    """Per step, the global batch's rows (sorted): `accumulate` batches of one rank of every dp coordinate."""
    by_dp = {rank["dp_rank"]: rank["batches"] for rank in run}
    return [sorted(row for dp in sorted(by_dp) for batch in by_dp[dp][index * accumulate:(index + 1) * accumulate]
                   for row in batch.tolist()) for index in range(len(steps))]


def test_global_batch_is_kept_through_accumulation_when_dp_shrinks(resharded):
    """`global_batch_size=8` at per-rank batches of 2: 2 batches per step at dp 2, 4 after resuming at dp 1,
    the same samples in the same steps and the single-process run's losses and weights."""
    runs, _ = resharded
    straight, resumed = runs["global-dp2"], runs["global-dp1"]
    assert {rank["accumulate"] for rank in straight} == {2} and {rank["accumulate"] for rank in resumed} == {4}
    by_two, by_four = (reference_run(STEPS, GLOBAL_BATCH, accumulate=k) for k in (2, 4))
    for rank in straight:  # the logged loss is the last accumulated batch's (mean over dp)
        assert max(abs(a - b) for a, b in zip(rank["losses"], by_two["last_batch_losses"], strict=True)) <= TOLERANCE
    for rank in resumed:
        assert max(abs(a - b) for a, b in zip(rank["losses"], by_four["last_batch_losses"][GLOBAL_SAVED_AT:],
                                              strict=True)) <= TOLERANCE
    assert _accumulated_samples(straight, range(STEPS), 2) == _reference_samples(range(STEPS))
    assert _accumulated_samples(resumed, range(GLOBAL_SAVED_AT, STEPS), 4) == _reference_samples(
        range(GLOBAL_SAVED_AT, STEPS))
    for name, expected in by_four["final_params"].items():
        assert_adam_weights_close(resumed[0]["weights"][name], expected, name)


def test_global_batch_that_does_not_divide_is_refused():
    from lightning_tp3d.strategies.accumulation import accumulation_for

    assert accumulation_for(8, 2, 2, requested=1) == 2
    with pytest.raises(ValueError, match=r"global_batch_size=8 is not a multiple of the per-rank batch 3 x dp 2 = 6"):
        accumulation_for(8, 3, 2, requested=1)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=3\) disagrees with global_batch_size=8"):
        accumulation_for(8, 2, 2, requested=3)
    with pytest.raises(ValueError, match=r"positive number of samples"):
        TP3DStrategy(global_batch_size=0)


def test_layout_change_is_reported(resharded):
    runs, path = resharded
    assert runs["warnings"][0] == [
        f"Resharding checkpoint {path}: saved at (tp, pp, dp) = (2, 2, 1), loading at (1, 1, 2). Model and optimizer"
        " state are resharded; random states belong to the old ranks and are not restored.",
        f"Resharding checkpoint {path}: saved at (tp, pp, dp) = (2, 2, 1), loading at (2, 1, 1). Model and optimizer"
        " state are resharded; random states belong to the old ranks and are not restored."]
    assert runs["warnings"][1] == []  # reported once, by rank 0


def test_sharded_checkpoint_consolidates_in_one_process(resharded):
    _, path = resharded
    expected = reference_run(SAVED_AT, GLOBAL_BATCH)["final_params"]
    merged = load_model_tensors(path)
    assert merged.keys() == {f"model.{name}" for name in expected}
    for name, value in expected.items():
        assert_adam_weights_close(merged[f"model.{name}"], value, name)
    one = load_model_tensors(path, ["model.lm_head.weight"])
    assert one.keys() == {"model.lm_head.weight"} and torch.equal(one["model.lm_head.weight"],
                                                                   merged["model.lm_head.weight"])


# ---------------------------------------------------------------------- crash safety and errors
def _model_state(network: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    return {"module": {f"model.{name}": value for name, value in network.state_dict().items()}}


def test_killed_save_leaves_the_previous_checkpoint_whole(tmp_path):
    command = [sys.executable, "-c", "import sys; from tests.io.test_checkpoint import crash_during_second_save as f;"
               " f(sys.argv[1])", str(tmp_path)]
    process = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, timeout=300)
    assert process.returncode == -signal.SIGKILL, process.stderr.decode()[-3000:]
    assert (tmp_path / "last.ckpt.partial").is_dir()
    assert read_meta(tmp_path / "last.ckpt").global_step == 1
    expected = torch.load(tmp_path / "step1.pt", weights_only=True)
    restored = load_model_tensors(tmp_path / "last.ckpt")
    assert restored.keys() == expected.keys()
    assert all(torch.equal(restored[name], expected[name]) for name in expected)
    with pytest.raises(CheckpointError, match=r"last.ckpt.partial is an unfinished save \(interrupted"):
        read_meta(tmp_path / "last.ckpt.partial")
    # With the name gone, the step-2 folder is found: every rank had finished and meta.json was written.
    shutil.rmtree(tmp_path / "last.ckpt")
    with pytest.warns(UserWarning, match=r"reading the complete folder last.ckpt.partial instead"):
        assert read_meta(tmp_path / "last.ckpt").global_step == 2
    (tmp_path / "last.ckpt.partial" / "meta.json").unlink()  # as if killed before every rank had finished
    with pytest.raises(CheckpointError, match=r"last.ckpt does not exist. .*last.ckpt.partial exists: a save to this"
                                              r" name was interrupted"):
        read_meta(tmp_path / "last.ckpt")


def test_kill_between_the_renames_of_a_replacement_then_resume(tmp_path):
    command = [sys.executable, "-c", "import sys; from tests.io.test_checkpoint import crash_between_renames as f;"
               " f(sys.argv[1])", str(tmp_path)]
    process = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, timeout=300,
                             start_new_session=True)
    assert process.returncode == -signal.SIGKILL, process.stderr.decode()[-3000:]
    # The moment the issue is about: the name is missing, the old folder is aside, the new one complete.
    assert not (tmp_path / "last.ckpt").exists()
    assert (tmp_path / "last.ckpt.replaced").is_dir() and (tmp_path / "last.ckpt.partial" / "meta.json").is_file()
    with pytest.warns(UserWarning, match=r"last.ckpt is missing: a save replacing it was interrupted"):
        assert read_meta(tmp_path / "last.ckpt").global_step == 2
    expected = torch.load(tmp_path / "step2.pt", weights_only=True)
    with pytest.warns(UserWarning, match=r"reading the complete folder last.ckpt.partial"):
        restored = load_model_tensors(tmp_path / "last.ckpt")
    assert all(torch.equal(restored[f"model.{name}"], value) for name, value in expected.items())
    # Resuming from `last.ckpt` at two ranks starts from step 2's weights, and the next save tidies up.
    (resumed, _) = run_distributed(2, "tests.io.test_checkpoint:_save_every_step", str(tmp_path),
                                   str(tmp_path / "last.ckpt"))
    assert resumed["loaded"]["step"] == 2 and len(resumed["losses"]) == 1
    assert all(torch.equal(resumed["loaded"]["weights"][name], value) for name, value in expected.items())
    assert read_meta(tmp_path / "last.ckpt").global_step == 3
    assert not (tmp_path / "last.ckpt.replaced").exists() and not (tmp_path / "last.ckpt.partial").exists()


def test_replacement_swaps_folders_atomically_where_the_system_can(tmp_path):
    from lightning_tp3d.io.folders import replace_folder

    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "meta.json").write_text("old")
    (tmp_path / "new.partial").mkdir()
    (tmp_path / "new.partial" / "meta.json").write_text("new")
    (tmp_path / "old").rename(tmp_path / "name")
    replace_folder(tmp_path / "new.partial", tmp_path / "name")
    assert (tmp_path / "name" / "meta.json").read_text() == "new"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["name"]
    if sys.platform.startswith("linux"):  # renameat2(RENAME_EXCHANGE) swaps in one step on Linux
        import lightning_tp3d.io.folders as folders

        (tmp_path / "other").mkdir()
        assert folders._exchange(tmp_path / "other", tmp_path / "name")
        assert (tmp_path / "other" / "meta.json").read_text() == "new"


def test_truncated_shard_is_named(resharded, tmp_path):
    _, path = resharded
    copy = shutil.copytree(path, tmp_path / "copy.ckpt")
    shard = sorted(copy.glob("*.distcp"))[-1]
    size = shard.stat().st_size
    with open(shard, "r+b") as file:
        file.truncate(size // 2)
    with pytest.raises(CheckpointError, match=rf"Shard .*{shard.name} is truncated: {size // 2} bytes on disk, the DCP"
                                              r" index needs at least \d+"):
        load_checkpoint(copy, _model_state(reference_network()))
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"Shard .*{shard.name} is missing"):
        load_model_tensors(copy)


def test_checkpoint_of_another_model_is_refused(resharded):
    _, path = resharded
    other = CausalLMModule(dataclasses.replace(MODEL_PRESETS["tiny"], hidden_size=32, num_attention_heads=2,
                                               num_key_value_heads=1))
    other.configure_model()
    with pytest.raises(CheckpointError, match=r"does not fit this model and optimizer: module.model.model.embed_tokens"
                                              r".weight has shape \[256, 64\] in the checkpoint, \[256, 32\] here"):
        load_checkpoint(path, _model_state(other.model))


def test_not_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "model.ckpt").write_bytes(b"\x80\x04not a folder")
    with pytest.raises(CheckpointError, match=r"model.ckpt is a file, but a lightning_tp3d checkpoint is a folder"):
        read_meta(tmp_path / "model.ckpt")
    (tmp_path / "folder.ckpt").mkdir()
    with pytest.raises(CheckpointError, match=r"folder.ckpt has no meta.json: it is not a lightning_tp3d checkpoint"):
        read_meta(tmp_path / "folder.ckpt")
    (tmp_path / "folder.ckpt" / "meta.json").write_text('{"format": "lightning_tp3d", "layout": ')
    with pytest.raises(CheckpointError, match=r"meta.json is not valid JSON"):
        read_meta(tmp_path / "folder.ckpt")


# ---------------------------------------------------------------------- code in a checkpoint, damaged files
CRAFTED = r"\.metadata names (posix|nt)\.system, which DCP metadata is not made of: the folder is not a checkpoint"


def test_resume_never_runs_a_crafted_index_and_refuses_a_flipped_byte(resharded):
    runs, path = resharded
    for rank in runs["crafted-trainer"] + runs["crafted-fabric"]:
        assert rank is not None and re.search(CRAFTED, rank), rank
    for rank in runs["flipped-trainer"]:
        assert rank is not None and re.search(r"flipped.ckpt is damaged: .*__\d_0.distcp \(written by rank \d\) does"
                                              r" not match the SHA-256 recorded when it was saved", rank), rank
    assert all(len(rank) == STEPS - SAVED_AT for rank in runs["flipped-unchecked"])
    assert not path.with_name("ran").exists()


def test_offline_readers_and_commands_never_run_a_crafted_index(resharded, tmp_path, capsys):
    _, path = resharded
    crafted, marker = path.with_name("crafted.ckpt"), path.with_name("ran")
    for read in (load_model_tensors, read_lightning_checkpoint):
        with pytest.raises(CheckpointError, match=CRAFTED):
            read(crafted)
    assert tp3d(["export", str(path), str(tmp_path / "hf")]) == 0
    for command in (["export", str(crafted), str(tmp_path / "other")], ["verify", str(crafted)],
                    ["check", str(tmp_path / "hf"), "--checkpoint", str(crafted)]):
        assert tp3d(command) == 2, command
        assert re.search(CRAFTED, capsys.readouterr().err), command
    assert not marker.exists() and not (tmp_path / "other").exists()
    # Replaced without its recorded hash: refused before the index is read at all.
    swapped = Path(shutil.copytree(path, tmp_path / "swapped.ckpt"))
    (swapped / ".metadata").write_bytes((crafted / ".metadata").read_bytes())
    with pytest.raises(CheckpointError, match=r"swapped.ckpt is damaged: .*\.metadata \(written by rank 0\) does not"):
        load_model_tensors(swapped)
    assert not marker.exists()


def test_a_flipped_byte_is_named_and_the_check_can_be_skipped(resharded, tmp_path, capsys):
    _, path = resharded
    flipped = path.with_name("flipped.ckpt")
    with pytest.raises(CheckpointError, match=r"flipped.ckpt is damaged: .*distcp \(written by rank \d\) does not"):
        load_model_tensors(flipped)
    assert tp3d(["verify", str(flipped)]) == 2 and "does not match the SHA-256" in capsys.readouterr().err
    assert tp3d(["verify", str(path)]) == 0
    assert f"{len(read_meta(path).file_hashes)} files match their recorded SHA-256" in capsys.readouterr().out
    assert tp3d(["export", str(flipped), str(tmp_path / "hf"), "--no-verify"]) == 0
    # Every file of a checkpoint is recorded, with the rank that wrote it (2 x 2 x 1 = 4 ranks).
    recorded = read_meta(path).file_hashes
    assert {entry["rank"] for entry in recorded.values()} == {0, 1, 2, 3}
    assert {".metadata", "trainer_state.pt", "rng/rank_00003.pt"} <= recorded.keys()
    unrecorded = {file.relative_to(path).as_posix() for file in path.rglob("*") if file.is_file()} - recorded.keys()
    assert unrecorded == {"meta.json", MARKER_FILE}  # meta.json holds the hashes; the marker only a folder kind
