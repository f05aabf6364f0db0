"""`TP3DThroughputMonitor` at (tp, pp, dp) = (2, 1, 2) and (1, 2, 2) on 4 processes (world size 4 != dp 2):
the logged samples, tokens, FLOPs and MFU agree with the tokens actually processed, and the logged
gradient norm is the single-process reference's. `HardwareMonitor` in the same runs: every rank's
reading reaches the log summarised over the world (mean, min, max, worst rank) at each logging step; NVML
read through nvidia-ml-py's calls (a stand-in module on this GPU-less machine)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_tp3d import MODEL_PRESETS, ModelConfig, TP3DStrategy
from lightning_tp3d.callbacks.hardware import HARDWARE_METRICS, HardwareMonitor, NvmlReader, summarize_ranks
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
        hardware, no_gpu = HardwareMonitor(read=_rank_reading), HardwareMonitor()
        trainer = L.Trainer(**trainer_kwargs(devices=world_size(), strategy=strategy, max_steps=STEPS, logger=logger,
                                             callbacks=[monitor, hardware, no_gpu], **clip))
        trainer.fit(CausalLMModule("tiny", learning_rate=LEARNING_RATE),
                    TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=PER_RANK_BATCH, val_fraction=0.2))
        results[f"tp{tp}-pp{pp}"] = logger.records
        results[f"tp{tp}-pp{pp}-mfu-warning"] = monitor.mfu_warning
        results[f"tp{tp}-pp{pp}-no-gpu"] = no_gpu.last_logged
    results["lora-tp2-pp1"] = _lora_records()
    return results


def _rank_reading(rank: int | None = None) -> dict[str, float]:
    """What rank r's GPU reads in the hardware test: distinct per rank, rank 1 the least utilised."""
    rank = torch.distributed.get_rank() if rank is None else rank
    return {"gpu_utilization_percent": [90.0, 30.0, 80.0, 70.0][rank], "memory_used_gib": 10.0 + rank,
            "temperature_c": [60.0, 61.0, 75.0, 62.0][rank], "power_w": 300.0 + 100 * rank}


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


# ---------------------------------------------------------------------- hardware metrics
def test_every_rank_reading_is_logged_summarised_at_each_logging_step(records):
    expected = summarize_ranks([_rank_reading(rank) for rank in range(4)])
    assert expected["hardware/gpu_utilization_percent_mean"] == 67.5
    assert expected["hardware/gpu_utilization_percent_min"] == 30.0
    assert expected["hardware/gpu_utilization_percent_worst_rank"] == 1.0  # the least utilised GPU
    assert expected["hardware/temperature_c_worst_rank"] == 2.0 and expected["hardware/power_w_max"] == 600.0
    for layout in ("tp2-pp1", "tp1-pp2"):
        logged = {}
        for step, name, value in records[0][layout]:
            if name.startswith("hardware/"):
                logged.setdefault(step, {})[name] = value
        losses = sorted(step for step, name, _ in records[0][layout] if name == "train_loss")
        assert sorted(logged) == losses and len(losses) == STEPS  # at every logging step, as the loss
        assert all(values == pytest.approx(expected, rel=0, abs=0) for values in logged.values())
        assert all(rank[f"{layout}-no-gpu"] is None for rank in records)  # no CUDA: nothing to read


def test_nvml_reader_reads_the_device_of_this_uuid_in_loggable_units():
    class Nvml:
        NVML_TEMPERATURE_GPU = 0
        calls: list = []

        def nvmlInit(self) -> None:
            self.calls.append("init")

        def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
            self.calls.append(uuid)
            return "handle"

        def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:
            return type("Rates", (), {"gpu": 87, "memory": 40})()

        def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
            return type("Memory", (), {"used": 3 * 1024**3, "total": 141 * 1024**3})()

        def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
            return 64 if sensor == self.NVML_TEMPERATURE_GPU else -1

        def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
            return 412_500  # milliwatts

    nvml = Nvml()
    reading = NvmlReader(nvml, "GPU-1234").read()
    assert nvml.calls == ["init", "GPU-1234"]
    assert reading == {"gpu_utilization_percent": 87.0, "memory_used_gib": 3.0, "temperature_c": 64.0,
                       "power_w": 412.5}
    assert set(reading) == set(HARDWARE_METRICS)
