"""The configuration matrix: every pipeline schedule x data-parallel mode x tensor-parallel size trains
exactly like one process.

Grid: the seven schedules x {replicate, fsdp} x tp in {1, 2} at pp = 2 and dp = 2 (worlds of 4 and 8
processes, each spawned once), plus corners: gradient accumulation, full recompute, explicit
`layers_per_stage`, `stages_per_rank = 3`, tied embeddings under tp, FSDP resharding after forward
under 1F1B and FSDP keeping parameters gathered without pipelining, and ZeRO-1 (`zero1`) under every
schedule but 1F1B (which `tests/parallel/data_parallel/test_zero.py` covers), with full recompute and tied
embeddings. For every configuration, on every rank (each dp replica, each stage): the losses of 5
steps and every gradient the rank holds after step 1 against the single-process reference, per tensor
with `torch.testing.assert_close` (rtol 1e-5, atol 1e-7, fp32).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_tp3d import ModelConfig, TP3DStrategy
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.plan.schedules import PIPELINE_SCHEDULES
from tests.distributed import released_process_groups, results_by_name
from tests.helpers import (
    LEARNING_RATE,
    SEQ_LEN,
    CaptureGradients,
    MemoryLogger,
    reference_run,
    reference_validation_loss,
    trainer_kwargs,
    world_size,
)

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

RTOL, ATOL = 1e-5, 1e-7
STEPS = 5
GLOBAL_BATCH = 8
SIX_LAYERS = ModelConfig(num_hidden_layers=6)
TIED = ModelConfig(tie_word_embeddings=True)


def _configuration(tp: int, schedule: str, mode: str, **extra: Any) -> dict[str, Any]:
    return dict(tp=tp, pp=2, schedule=schedule, mode=mode, microbatches=4 if schedule == "dualpipev" else 2, **extra)


GRID: dict[int, dict[str, dict[str, Any]]] = {
    world: {f"tp{tp}-{schedule}-{mode}": _configuration(tp, schedule, mode)
            for schedule in PIPELINE_SCHEDULES for mode in ("replicate", "fsdp")}
    for world, tp in ((4, 1), (8, 2))
}
CORNERS: dict[int, dict[str, dict[str, Any]]] = {
    4: {"tp1-1f1b-fsdp-layers-1-3": _configuration(1, "1f1b", "fsdp", layers_per_stage=(1, 3)),
        "tp1-1f1b-fsdp-reshard-after-forward": _configuration(1, "1f1b", "fsdp", fsdp_reshard_after_forward=True),
        "tp1-interleaved_1f1b-replicate-3-stages-per-rank": _configuration(
            1, "interleaved_1f1b", "replicate", stages_per_rank=3, model=SIX_LAYERS),
        "tp1-looped_bfs-fsdp-3-stages-per-rank": _configuration(
            1, "looped_bfs", "fsdp", stages_per_rank=3, model=SIX_LAYERS),
        "tp2-pp1-replicate-tied": dict(tp=2, pp=1, mode="replicate", model=TIED),
        "tp2-pp1-fsdp-tied": dict(tp=2, pp=1, mode="fsdp", model=TIED),
        "tp2-pp1-fsdp-kept-gathered": dict(tp=2, pp=1, mode="fsdp", fsdp_reshard_after_forward=False),
        "tp1-interleaved_1f1b-zero1": _configuration(1, "interleaved_1f1b", "zero1"),
        "tp1-dualpipev-zero1": _configuration(1, "dualpipev", "zero1"),
        "tp1-gpipe-zero1": _configuration(1, "gpipe", "zero1"),
        "tp1-looped_bfs-zero1": _configuration(1, "looped_bfs", "zero1")},
    8: {"tp2-1f1b-fsdp-accumulate-2": _configuration(2, "1f1b", "fsdp", accumulate=2),
        "tp2-zbv_zero_bubble-replicate-accumulate-2": _configuration(2, "zbv_zero_bubble", "replicate", accumulate=2),
        "tp2-interleaved_zero_bubble-fsdp-recompute": _configuration(2, "interleaved_zero_bubble", "fsdp",
                                                                     recompute="full"),
        "tp2-interleaved_1f1b-replicate-recompute": _configuration(2, "interleaved_1f1b", "replicate",
                                                                   recompute="full"),
        "tp2-zbv_zero_bubble-zero1-accumulate-2": _configuration(2, "zbv_zero_bubble", "zero1", accumulate=2),
        "tp2-pp1-zero1-tied": dict(tp=2, pp=1, mode="zero1", model=TIED),
        "tp2-interleaved_zero_bubble-zero1-recompute": _configuration(2, "interleaved_zero_bubble", "zero1",
                                                                      recompute="full")},
}
CONFIGURATIONS = {name: configuration for table in (GRID, CORNERS) for world in table
                  for name, configuration in table[world].items()}


@released_process_groups()
def _fit(tp: int, mode: str, pp: int = 2, schedule: str = "1f1b", microbatches: int = 2, accumulate: int = 1,
         model: ModelConfig | str = "tiny", **options: Any) -> dict[str, Any]:
    """`STEPS` steps of training, then one validation pass (the pipeline's forward-only path)."""
    world = world_size()
    dp = world // (tp * pp)
    logger, capture = MemoryLogger(), CaptureGradients()
    strategy = TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_schedule=schedule,
                            num_microbatches=microbatches, data_parallel_mode=mode, **options)
    trainer = L.Trainer(**trainer_kwargs(devices=world, strategy=strategy, logger=logger, callbacks=[capture],
                                         max_steps=STEPS, accumulate_grad_batches=accumulate,
                                         limit_val_batches=None, val_check_interval=STEPS * accumulate,
                                         check_val_every_n_epoch=None))
    module = CausalLMModule(model, learning_rate=LEARNING_RATE)
    trainer.fit(module, TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp // accumulate,
                                        val_fraction=0.2))
    return {"losses": logger.values("train_loss"), "val_loss": logger.values("val_loss"),
            "first_grads": capture.first_grads}


class PredictWithInputs(CausalLMModule):
    """The shipped `predict_step`, returned with the batch it saw (to compute the reference on it)."""

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        return {"input_ids": batch["input_ids"], "logits": super().predict_step(batch, batch_idx)}


# `trainer.test` and `trainer.predict` through the pipeline (forward only, no schedule), per world.
EVALUATIONS = {4: dict(tp=1, schedule="looped_bfs", mode="replicate"),
               8: dict(tp=2, schedule="zbv_zero_bubble", mode="fsdp")}
EVALUATION_BATCH = 4


@released_process_groups()
def _test_and_predict(tp: int, schedule: str, mode: str) -> dict[str, Any]:
    def trainer() -> L.Trainer:
        strategy = TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=2, pipeline_schedule=schedule,
                                num_microbatches=2, data_parallel_mode=mode)
        return L.Trainer(**trainer_kwargs(devices=world_size(), strategy=strategy, logger=False))

    data = TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=EVALUATION_BATCH, val_fraction=0.2)
    (tested,) = trainer().test(CausalLMModule("tiny", learning_rate=LEARNING_RATE), data, verbose=False)
    predictions = trainer().predict(PredictWithInputs("tiny", learning_rate=LEARNING_RATE), data)
    return {"test_loss": tested["test_loss"], "predictions": predictions}


def run_world(world: int) -> dict[str, Any]:
    results = {name: _fit(**configuration) for table in (GRID, CORNERS) for name, configuration in table[world].items()}
    results[f"test-predict-{world}"] = _test_and_predict(**EVALUATIONS[world])
    return results


@pytest.fixture(scope="module")
def world_results() -> dict[str, list[dict[str, Any]]]:
    return results_by_name(GRID, "tests.parallel.test_matrix:run_world")


_REFERENCES: dict[str, dict[str, Any]] = {}


def _reference(model: ModelConfig | str, accumulate: int) -> dict[str, Any]:
    key = f"{model!r}-{accumulate}"
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_run(
            STEPS, GLOBAL_BATCH, accumulate=accumulate, validate_batch_size=GLOBAL_BATCH // 2 // accumulate,
            build_network=lambda: _built(CausalLMModule(model, learning_rate=LEARNING_RATE)))
    return _REFERENCES[key]


def _built(module: CausalLMModule) -> torch.nn.Module:
    module.configure_model()
    return module.model


def test_grid_covers_every_schedule_mode_and_tp_size():
    covered = {(c["tp"], c["schedule"], c["mode"]) for c in CONFIGURATIONS.values() if c["pp"] == 2}
    assert covered >= {(tp, schedule, mode) for tp in (1, 2) for schedule in PIPELINE_SCHEDULES
                       for mode in ("replicate", "fsdp")}


@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_losses_and_every_rank_gradients_match_single_process(world_results, name):
    configuration = CONFIGURATIONS[name]
    reference = _reference(configuration.get("model", "tiny"), configuration.get("accumulate", 1))
    covered: set[str] = set()
    # Accumulating k batches a step logs the loss of the step's last batch (the last k-th of its samples).
    accumulate = configuration.get("accumulate", 1)
    expected_losses = torch.tensor(reference["losses" if accumulate == 1 else "last_batch_losses"])
    for rank, rank_result in enumerate(world_results[name]):
        torch.testing.assert_close(torch.tensor(rank_result["losses"]), expected_losses, rtol=RTOL, atol=0.0,
                                   msg=lambda message, rank=rank: f"{name} rank {rank} losses: {message}")
        for key, gradient in rank_result["first_grads"].items():
            torch.testing.assert_close(gradient, reference["first_grads"][key], rtol=RTOL, atol=ATOL,
                                       msg=lambda message, rank=rank, key=key: f"{name} rank {rank} gradient {key}:"
                                                                               f" {message}")
        covered.update(rank_result["first_grads"])
        (val_loss,) = rank_result["val_loss"]
        assert val_loss == pytest.approx(reference["val_loss"], rel=RTOL, abs=0.0), f"{name} rank {rank} val_loss"
    assert covered == reference["first_grads"].keys(), f"{name}: the ranks' stages do not cover the model"
    assert reference["losses"][-1] < reference["losses"][0], "the reference itself must learn"


@pytest.mark.parametrize("world", list(EVALUATIONS))
def test_test_and_predict_through_the_pipeline_match_single_process(world_results, world):
    network = _built(CausalLMModule("tiny", learning_rate=LEARNING_RATE))
    data = TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=EVALUATION_BATCH, val_fraction=0.2)
    data.setup()
    expected_loss = reference_validation_loss(network, data, batch_size=EVALUATION_BATCH, dp=2)
    network.eval()
    for rank, rank_result in enumerate(world_results[f"test-predict-{world}"]):
        assert rank_result["test_loss"] == pytest.approx(expected_loss, rel=RTOL, abs=0.0), f"rank {rank}"
        assert len(rank_result["predictions"]) > 0
        for prediction in rank_result["predictions"]:
            with torch.no_grad():
                expected = network(prediction["input_ids"])
            torch.testing.assert_close(prediction["logits"], expected, rtol=RTOL, atol=1e-6)
