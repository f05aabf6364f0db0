"""`TP3DThroughputMonitor` at (tp, pp, dp) = (2, 1, 2) and (1, 2, 2) on 4 processes (world size 4 != dp 2):
the logged samples, tokens, FLOPs and MFU agree with the tokens actually processed, and the logged
gradient norm is the single-process reference's."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_tp3d import MODEL_PRESETS, ModelConfig, TP3DStrategy
from lightning_tp3d.callbacks.monitor import TP3DThroughputMonitor
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.plan.ledger import training_flops_per_token
from tests.distributed import run_distributed
from tests.helpers import LEARNING_RATE, SEQ_LEN, MemoryLogger, reference_run, trainer_kwargs, world_size

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

PER_RANK_BATCH = 4
PEAK_FLOPS = 1e12
STEPS = 6


def run_world() -> dict[str, Any]:
    results = {}
    for tp, pp in ((2, 1), (1, 2)):
        logger = MemoryLogger()
        strategy = TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, num_microbatches=2)
        # pp 2 clips by a norm no gradient reaches: the logged norm is then the clipping's own
        clip = {"gradient_clip_val": 1e6} if pp > 1 else {}
        # a peak no CPU reaches: MFU far below the 40% target, which must warn once with the causes
        monitor = TP3DThroughputMonitor(window_size=2, available_flops=PEAK_FLOPS, mfu_target=0.40)
        trainer = L.Trainer(**trainer_kwargs(devices=world_size(), strategy=strategy, max_steps=STEPS, logger=logger,
                                             callbacks=[monitor], **clip))
        trainer.fit(CausalLMModule("tiny", learning_rate=LEARNING_RATE),
                    TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=PER_RANK_BATCH, val_fraction=0.2))
        results[f"tp{tp}-pp{pp}"] = logger.records
        results[f"tp{tp}-pp{pp}-mfu-warning"] = monitor.mfu_warning
    results["lora-tp2-pp1"] = _lora_records()
    return results


def _lora_records() -> list:
    """The PEFT LoRA model of the LoRA tests at (2, 1, 2): what its monitor logs."""
    from tests.models.test_lora import LoraModule

    logger = MemoryLogger()
    trainer = L.Trainer(**trainer_kwargs(devices=world_size(), strategy=TP3DStrategy(tensor_parallel_size=2),
                                         max_steps=STEPS, logger=logger,
                                         callbacks=[TP3DThroughputMonitor(window_size=2, available_flops=PEAK_FLOPS)]))
    trainer.fit(LoraModule(), TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=PER_RANK_BATCH,
                                              val_fraction=0.2))
    return logger.records


@pytest.fixture(scope="module")
def records() -> list[dict[str, Any]]:
    return run_distributed(4, "tests.callbacks.test_monitor:run_world")


def _last(records: list, key: str) -> float:
    return [value for _, name, value in records if name == key][-1]


@pytest.mark.parametrize(("name", "model_parallel"), [("tp2-pp1", 2), ("tp1-pp2", 2)])
def test_rates_count_each_sample_once_and_flops_per_rank(records, name, model_parallel):
    logged = records[0][name]  # rank 0 logs
    dp, world = 2, 4
    assert _last(logged, "train/samples") == STEPS * PER_RANK_BATCH
    assert _last(logged, "train/lengths") == STEPS * PER_RANK_BATCH * SEQ_LEN
    device_samples = _last(logged, "train/device/samples_per_sec")
    assert _last(logged, "train/samples_per_sec") == pytest.approx(dp * device_samples)  # not x world size
    device_tokens = _last(logged, "train/device/items_per_sec")
    assert device_tokens == pytest.approx(SEQ_LEN * device_samples)
    assert _last(logged, "train/items_per_sec") == pytest.approx(dp * device_tokens)
    flops_per_token = training_flops_per_token(MODEL_PRESETS["tiny"], SEQ_LEN)
    device_flops = _last(logged, "train/device/flops_per_sec")
    assert device_flops == pytest.approx(device_tokens * flops_per_token / model_parallel)
    assert _last(logged, "train/flops_per_sec") == pytest.approx(world * device_flops)
    assert _last(logged, "train/device/mfu") == pytest.approx(device_flops / PEAK_FLOPS)
    assert _last(logged, "train/device/peak_memory_bytes") > 0


def test_a_lora_model_counts_no_weight_gradient_for_its_frozen_base(records):
    """4 x each frozen weight (forward and input gradient) + 6 x the factors (r 4 on every projection):
    `training_flops_per_token` with the LoRA options, below the full fine-tune's 6 x every weight."""
    pytest.importorskip("peft")
    from tests.models.test_huggingface import SHAPE
    from tests.models.test_lora import TARGETS

    config = ModelConfig(**SHAPE)
    logged = records[0]["lora-tp2-pp1"]
    lora = training_flops_per_token(config, SEQ_LEN, lora_rank=4, lora_targets=tuple(TARGETS))
    assert lora < training_flops_per_token(config, SEQ_LEN)
    device_flops = _last(logged, "train/device/flops_per_sec")
    assert device_flops == pytest.approx(_last(logged, "train/device/items_per_sec") * lora / 2)


def test_flops_per_token_by_hand():
    h, kv, f, layers, vocab, s = 64, 2 * 16, 128, 4, 256, SEQ_LEN
    matmul = layers * (2 * h * h + 2 * h * kv + 3 * h * f) + vocab * h
    assert training_flops_per_token(MODEL_PRESETS["tiny"], s) == 6 * matmul + 12 * layers * h * s


@pytest.mark.parametrize("name", ["tp2-pp1", "tp1-pp2"])
def test_logged_gradient_norm_is_the_reference(records, name):
    reference = reference_run(1, 2 * PER_RANK_BATCH)["first_grads"]
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in reference.values()])).item()
    for rank in records:
        norms = [value for _, key, value in rank[name] if key == "train/grad_norm"]
        assert len(norms) == STEPS
        assert norms[0] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("name", ["tp2-pp1", "tp1-pp2"])
def test_mfu_below_the_target_warns_once_with_the_causes(records, name):
    warning = records[0][f"{name}-mfu-warning"]
    assert warning.startswith("MFU ") and "is below the target 40% after warm-up" in warning
    assert "exposed communication" in warning
    assert ("the pipeline bubble (33% of each step at pp=2, num_microbatches=2" in warning) == (name == "tp1-pp2")
