"""Pipeline parallelism inside TP3DStrategy at dp = 1 and pp = 4, compared with the single-process
reference (losses of 10 steps, every gradient after step 1) within 1e-5 in fp32, plus the stage split,
stage timing and the pipeline's errors. Every schedule x dp mode x tp size at pp = 2, dp = 2 is in
`test_matrix.py`. The same `CausalLMModule` as the TP x DP tests runs unchanged."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_tp3d import LayoutError, ModelConfig, TP3DStrategy
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from tests.distributed import results_by_name
from tests.helpers import (
    LEARNING_RATE,
    SEQ_LEN,
    CaptureGradients,
    MemoryLogger,
    reference_run,
    trainer_kwargs,
    world_size,
)

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

TOLERANCE = 1e-5
STEPS = 10
GLOBAL_BATCH = 8

# name -> (tp, pp, schedule, dp mode, micro-batches); dp follows from the world size.
SCENARIOS: dict[int, dict[str, tuple]] = {
    2: {"pp2-1f1b": (1, 2, "1f1b", "replicate", 2)},
    4: {"pp4-1f1b": (1, 4, "1f1b", "replicate", 4),
        "tp2-pp2-gpipe": (2, 2, "gpipe", "replicate", 2)},
}


def _fit(tp: int, pp: int, schedule: str, mode: str, microbatches: int, module: L.LightningModule | None = None,
         batch: int | None = None) -> dict[str, Any]:
    world = world_size()
    dp = world // (tp * pp)
    module = module or CausalLMModule("tiny", learning_rate=LEARNING_RATE)
    logger, capture = MemoryLogger(), CaptureGradients()
    strategy = TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_schedule=schedule,
                            num_microbatches=microbatches, data_parallel_mode=mode)
    trainer = L.Trainer(**trainer_kwargs(devices=world, strategy=strategy, logger=logger, callbacks=[capture],
                                         limit_val_batches=None, val_check_interval=STEPS,
                                         check_val_every_n_epoch=None))
    trainer.fit(module, TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=batch or GLOBAL_BATCH // dp,
                                        val_fraction=0.2))
    timing = trainer.strategy.pipeline_timing
    return {"losses": logger.values("train_loss"), "val_loss": logger.values("val_loss"),
            "first_grads": capture.first_grads, "batch": batch or GLOBAL_BATCH // dp,
            "timing": (timing.step_seconds, timing.busy_seconds, timing.idle_fraction)}


def _error_of(function, *args) -> str:
    try:
        function(*args)
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}"
    return "no error"


def run_world() -> dict[str, Any]:
    results = {name: _fit(*scenario) for name, scenario in SCENARIOS[world_size()].items()}
    if world_size() == 2:
        results["error-batch"] = _error_of(_fit, 1, 2, "1f1b", "replicate", 2, None, 3)
        tied = CausalLMModule(ModelConfig(tie_word_embeddings=True))
        results["error-tied"] = _error_of(_fit, 1, 2, "1f1b", "replicate", 2, tied)
    return results


@pytest.fixture(scope="module")
def world_results() -> dict[str, list[Any]]:
    return results_by_name(SCENARIOS, "tests.parallel.test_pipeline:run_world", with_world=False)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return reference_run(STEPS, GLOBAL_BATCH, validate_batch_size=4)


@pytest.mark.parametrize("name", [name for scenarios in SCENARIOS.values() for name in scenarios])
def test_pipeline_losses_and_gradients_match_single_process(world_results, reference, name):
    per_rank = world_results[name]
    for rank_result in per_rank:  # the loss is broadcast from the last stage: every rank logs the same
        assert len(rank_result["losses"]) == STEPS
        assert max(abs(a - b) for a, b in zip(rank_result["losses"], reference["losses"])) <= TOLERANCE
    gradients: dict[str, torch.Tensor] = {}
    for rank_result in per_rank:  # each stage holds its own layers: the union is the whole model
        gradients.update(rank_result["first_grads"])
    assert gradients.keys() == reference["first_grads"].keys()
    for key, expected in reference["first_grads"].items():
        assert (gradients[key] - expected).abs().max().item() <= TOLERANCE, key


def test_stage_split_keeps_global_names(world_results):
    first, last = world_results["pp2-1f1b"][0]["first_grads"], world_results["pp2-1f1b"][1]["first_grads"]
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert "lm_head.weight" in last and "model.norm.weight" in last and "model.layers.3.mlp.up_proj.weight" in last


def test_stage_busy_and_idle_time_are_recorded(world_results):
    """Only consistency is checked here; measured vs theoretical bubble belongs to the benchmarks."""
    for name in ("pp2-1f1b", "pp4-1f1b", "tp2-pp2-gpipe"):
        for step_seconds, busy_seconds, idle_fraction in (rank["timing"] for rank in world_results[name]):
            assert 0.0 < busy_seconds < step_seconds
            assert idle_fraction == pytest.approx(1.0 - busy_seconds / step_seconds)


def test_runtime_pipeline_errors_are_clear(world_results):
    for message in world_results["error-batch"]:
        assert "the batch of 3 samples cannot be split into num_microbatches=2" in message
    for message in world_results["error-tied"]:
        assert "tie_word_embeddings=True with pipeline_parallel_size > 1 is not supported" in message


def test_bad_pipeline_configurations_raise_before_launch():
    with pytest.raises(ValueError, match=r"pipeline_schedule='zigzag' is not one of"):
        TP3DStrategy(pipeline_parallel_size=2, pipeline_schedule="zigzag")
    with pytest.raises(ValueError, match=r"needs num_microbatches >= pipeline_parallel_size, got num_microbatches=1"):
        TP3DStrategy(pipeline_parallel_size=2, num_microbatches=1, pipeline_schedule="1f1b")
    with pytest.raises(ValueError, match=r"'dualpipev' .* needs num_microbatches >= 2 x pipeline_parallel_size = 4"):
        TP3DStrategy(pipeline_parallel_size=2, num_microbatches=2, pipeline_schedule="dualpipev")
    with pytest.raises(ValueError, match=r"set stages_per_rank >= 2 \(got 1\)"):
        TP3DStrategy(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b", stages_per_rank=1)
    with pytest.warns(UserWarning, match=r"num_microbatches=1 < pipeline_parallel_size=4: the pipeline bubble"):
        TP3DStrategy(pipeline_parallel_size=4, num_microbatches=1, pipeline_schedule="gpipe")
    trainer = L.Trainer(accelerator="cpu", devices=8, strategy=TP3DStrategy(pipeline_parallel_size=8,
                                                                            num_microbatches=8))
    with pytest.raises(LayoutError, match=r"the pipeline has 8 stages .* but the model has only 4 layers"):
        trainer.strategy.connect(CausalLMModule("tiny"))
