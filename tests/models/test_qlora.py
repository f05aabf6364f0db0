"""QLoRA (`models/qlora.py`): the PEFT LoRA model of the LoRA tests with its base's block projections held in
4-bit NF4 (torchao), trained at (1, 1, 2) FSDP (the 4-bit weights sharded), (1, 1, 2) ZeRO-1 and (1, 2, 1)
with 1F1B, interleaved 1F1B and DualPipeV (FSDP), against the same quantised model trained by one process:
5 steps of losses and every LoRA gradient before the first update (fp32, rtol 1e-5: the quantised weights
are the same bytes in both, dequantised by the same kernel, so the bound is the LoRA parity suite's
summation-order one), and at (1, 1, 2) FSDP in bf16-mixed against the one-process bf16 run. Each rank's
weight, gradient and optimizer bytes and its dp traffic are the ledgers' to the byte. Checkpoints of a
quantised base hold what trains and resume at another layout; the merged export from the base folder is
the trained model.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from lightning_tp3d import TP3DStrategy
from lightning_tp3d.callbacks.monitor import local_storage_bytes
from lightning_tp3d.callbacks.traffic import RecordTraffic
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.io.checkpoint_format import ModelTensorReader
from lightning_tp3d.models.qlora import quantize_base
from lightning_tp3d.parallel.nf4 import dequantized, quantized_parameters
from lightning_tp3d.plan.communication import communication_ledger
from lightning_tp3d.plan.config import ModelConfig
from lightning_tp3d.plan.layout import LayoutError, ParallelLayout
from lightning_tp3d.plan.ledger import TrainingOptions, training_ledger
from lightning_tp3d.plan.qlora import NF4Format, nf4_bytes
from tests.distributed import results_by_name
from tests.helpers import (
    BF16_MIXED_LORA_GRADIENT_TOLERANCE,
    SEQ_LEN,
    CaptureGradients,
    MemoryLogger,
    assert_ranks_match,
    full_tensor,
    reference_run,
    trainer_kwargs,
    worst_relative_difference,
)
from tests.models.test_huggingface import SHAPE, hf_loss, hf_network
from tests.models.test_lora import TARGETS, LoraModule, lora_network

pytest.importorskip("peft")
pytest.importorskip("torchao")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

RTOL, ATOL = 1e-5, 1e-7
STEPS, RESUMED_STEPS = 5, 3
GLOBAL_BATCH = 8
# small blocks for the tiny model: a k_proj (16 x 32) sharded over dp 2 holds 256 weights, one scaler block
TINY_NF4 = NF4Format(block_size=32, scaler_block_size=8)
QUANTIZED_PER_LAYER = 7  # q, k, v, o, gate, up, down


def qlora_network() -> nn.Module:
    network = lora_network()
    quantize_base(network, TINY_NF4)
    return network


class QLoraModule(LoraModule):
    def __init__(self) -> None:
        super().__init__()
        quantize_base(self.model, TINY_NF4)


class QuantizedWeights(Callback):
    """This rank's NF4 weights, dequantised, at the start and the end of fit."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = {name: full_tensor(dequantized(parameter))
                      for name, parameter in quantized_parameters(pl_module).items()}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        quantized = quantized_parameters(pl_module)
        self.count = len(quantized)
        self.changed = [name for name, parameter in quantized.items()
                        if not torch.equal(full_tensor(dequantized(parameter)), self.start[name])]
        self.local_bytes = sum(_nf4_storage(parameter) for parameter in quantized.values())
        self.local_numel = sum(_local(parameter).numel() for parameter in quantized.values())
        self.moment_bytes = local_storage_bytes(  # Adam's two moments (the step counts are scalars)
            state[key] for optimizer in trainer.optimizers for state in optimizer.state.values()
            for key in ("exp_avg", "exp_avg_sq"))

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.gradient_bytes = local_storage_bytes(parameter.grad for parameter in pl_module.parameters())


def _local(parameter: torch.Tensor) -> torch.Tensor:
    return parameter.to_local() if hasattr(parameter, "to_local") else parameter


def _nf4_storage(parameter: torch.Tensor) -> int:
    local = _local(parameter)
    names, _ = local.__tensor_flatten__()
    return sum(getattr(local, name).nbytes for name in names)


RUNS: dict[int, dict[str, dict[str, Any]]] = {2: {
    "qlora-tp1-pp1-dp2-fsdp": dict(tp=1, pp=1, mode="fsdp", save=True),
    "qlora-tp1-pp2-dp1-1f1b": dict(tp=1, pp=2, mode="replicate"),
    "qlora-tp1-pp1-dp2-zero1": dict(tp=1, pp=1, mode="zero1"),
    "qlora-tp1-pp2-dp1-interleaved-1f1b": dict(tp=1, pp=2, mode="replicate", schedule="interleaved_1f1b"),
    "qlora-tp1-pp2-dp1-dualpipev-fsdp": dict(tp=1, pp=2, mode="fsdp", schedule="dualpipev", num_microbatches=4),
    "qlora-tp1-pp1-dp2-fsdp-bf16-mixed": dict(tp=1, pp=1, mode="fsdp", precision="bf16-mixed"),
    "qlora-resumed-tp1-pp2-dp1": dict(tp=1, pp=2, mode="fsdp", resume="qlora-tp1-pp1-dp2-fsdp"),
    "qlora-tp2-refused": dict(tp=2, pp=1, mode="replicate"),
}}
CONFIGURATIONS = ["qlora-tp1-pp1-dp2-fsdp", "qlora-tp1-pp2-dp1-1f1b", "qlora-tp1-pp1-dp2-zero1",
                  "qlora-tp1-pp2-dp1-interleaved-1f1b", "qlora-tp1-pp2-dp1-dualpipev-fsdp"]


def _fit(directory: Path, name: str, tp: int, pp: int, mode: str, save: bool = False,
         resume: str | None = None, schedule: str = "1f1b", num_microbatches: int = 2,
         precision: str = "32-true") -> dict[str, Any]:
    dp = 2 // (tp * pp)
    logger, capture, quantized, traffic = MemoryLogger(), CaptureGradients(), QuantizedWeights(), RecordTraffic()
    strategy = TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, num_microbatches=num_microbatches,
                            data_parallel_mode=mode, pipeline_schedule=schedule)
    callbacks: list[Callback] = [capture, quantized, traffic]
    if save:
        callbacks.append(ModelCheckpoint(dirpath=directory, filename=name, every_n_train_steps=STEPS))
    trainer = L.Trainer(**trainer_kwargs(devices=2, strategy=strategy, logger=logger, callbacks=callbacks,
                                         enable_checkpointing=save, precision=precision,
                                         max_steps=STEPS + RESUMED_STEPS if resume else STEPS))
    data = TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp, val_fraction=0.2)
    try:
        trainer.fit(QLoraModule(), data, ckpt_path=str(directory / f"{resume}.ckpt") if resume else None)
    except LayoutError as error:
        return {"error": str(error)}
    return {"losses": logger.values("train_loss"), "first_grads": capture.first_grads,
            "final_params": {key: value for key, value in capture.final_params.items() if ".lora_" in key},
            "changed": quantized.changed, "count": quantized.count, "local_bytes": quantized.local_bytes,
            "local_numel": quantized.local_numel, "weight_bytes": capture.parameter_bytes,
            "gradient_bytes": quantized.gradient_bytes, "optimizer_bytes": quantized.moment_bytes,
            "dp_bytes": traffic.recorder.per_group().get("dp", {}).get("payload_bytes", 0) if traffic.recorder else 0}


def run_world(world: int, directory: str) -> dict[str, Any]:
    return {name: _fit(Path(directory), name, **configuration) for name, configuration in RUNS[world].items()}


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qlora")


@pytest.fixture(scope="module")
def world_results(directory) -> dict[str, list[dict[str, Any]]]:
    return results_by_name(RUNS, "tests.models.test_qlora:run_world", str(directory))


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return reference_run(STEPS + RESUMED_STEPS, GLOBAL_BATCH, build_network=qlora_network, loss_of=hf_loss)


def test_quantize_base_holds_every_block_projection_in_nf4_and_refuses_what_it_cannot_hold():
    network = qlora_network()
    quantized = quantized_parameters(network)
    assert len(quantized) == QUANTIZED_PER_LAYER * SHAPE["num_hidden_layers"]
    assert all(".layers." in name and not parameter.requires_grad for name, parameter in quantized.items())
    # what a weight costs: 4 bits, an int8 scale per block, a factor per scaler block (plan.qlora)
    for parameter in quantized.values():
        assert _nf4_storage(parameter) == nf4_bytes(parameter.numel(), 4, TINY_NF4), parameter.shape
    # a quantised weight stands for values close to the original: NF4's widest gap between levels is
    # 0.304 of the block's absmax (-1 to -0.696), so a weight is off by at most 0.152 of it, plus the int8
    # rounding of the scale (well under 0.05 of it here); a wrong scale or level is off by ~ the absmax
    plain = lora_network()
    name = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    original = dict(plain.named_parameters())[name]
    error = (dequantized(quantized[name]) - original).abs().max()
    assert 0 < error <= 0.2 * original.abs().max()
    with pytest.raises(ValueError, match="multiple of 16384 elements; pick smaller blocks"):
        quantize_base(lora_network())  # the paper's blocks (64 x 256) do not fit a 32 x 32 weight
    with pytest.raises(ValueError, match="no frozen nn.Linear"):
        quantize_base(hf_network("llama"))  # nothing frozen: no PEFT model around it


@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_qlora_matches_the_single_process_qlora_run(world_results, reference, name):
    steps = {key: value[:STEPS] if key == "losses" else value for key, value in reference.items()}
    covered = assert_ranks_match(name, world_results[name], steps, RTOL, ATOL)
    assert covered == reference["first_grads"].keys() and all(".lora_" in key for key in covered), name
    for rank, rank_result in enumerate(world_results[name]):
        assert rank_result["changed"] == [], (name, rank)  # the 4-bit base never moves


@pytest.mark.parametrize("name", CONFIGURATIONS[:3])  # the ledgers' schedules: 1F1B and GPipe
def test_the_ledgers_count_what_each_rank_holds_and_sends(world_results, name):
    """measured = ledger, to the byte, on every rank: the weights (the 4-bit projections' packed parts, FSDP's
    shards of them, the dense embedding, norms, head and factors), gradients and Adam's moments of the
    factors alone (`plan.ledger` with `qlora`), and the dp payload (FSDP2 gathers the NF4 parts as bytes;
    `plan.communication`)."""
    configuration = RUNS[2][name]
    tp, pp = configuration["tp"], configuration["pp"]
    layout = ParallelLayout(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=2 // (tp * pp),
                            num_microbatches=2)
    options = TrainingOptions(seq_len=SEQ_LEN, precision="32-true", data_parallel_mode=configuration["mode"],
                              lora_rank=4, lora_targets=tuple(TARGETS), qlora=TINY_NF4)
    memory = training_ledger(ModelConfig(**SHAPE), layout, options)
    traffic = communication_ledger(ModelConfig(**SHAPE), layout, options, backend="gloo")
    for rank, rank_result in enumerate(world_results[name]):
        stage = layout.coordinates(rank).pp
        predicted = {kind: getattr(memory.stages[stage], kind)
                     for kind in ("weight_bytes", "gradient_bytes", "optimizer_bytes")}
        predicted["dp_bytes"] = traffic.totals(stage)["dp"]["payload_bytes"]
        assert {kind: rank_result[kind] for kind in predicted} == predicted, (name, rank)


def test_qlora_in_bf16_mixed_matches_the_single_process_bf16_run(world_results):
    """At (1, 1, 2) FSDP in bf16-mixed every LoRA gradient of the first step is within
    `BF16_MIXED_LORA_GRADIENT_TOLERANCE` of the one-process bf16 autocast QLoRA run's, which the fp32 run exceeds."""
    bf16 = reference_run(1, GLOBAL_BATCH, build_network=qlora_network, loss_of=hf_loss, autocast_dtype=torch.bfloat16)
    fp32 = reference_run(1, GLOBAL_BATCH, build_network=qlora_network, loss_of=hf_loss)
    assert worst_relative_difference(fp32["first_grads"], bf16["first_grads"]) > BF16_MIXED_LORA_GRADIENT_TOLERANCE
    results = world_results["qlora-tp1-pp1-dp2-fsdp-bf16-mixed"]
    for rank, rank_result in enumerate(results):
        assert rank_result["first_grads"].keys() == bf16["first_grads"].keys(), rank
        assert worst_relative_difference(rank_result["first_grads"], bf16["first_grads"]) <= \
            BF16_MIXED_LORA_GRADIENT_TOLERANCE, rank
        assert rank_result["changed"] == [], rank


def test_fsdp_shards_the_4_bit_weights_over_dp(world_results):
    """At (1, 1, 2) FSDP each rank holds half of each NF4 weight's packed blocks; at (1, 2, 1) a stage holds
    its own layers' weights whole."""
    whole = sum(parameter.numel() for parameter in quantized_parameters(qlora_network()).values())
    for rank_result in world_results["qlora-tp1-pp1-dp2-fsdp"]:
        assert rank_result["local_numel"] == whole // 2
    assert sum(rank_result["local_numel"] for rank_result in world_results["qlora-tp1-pp2-dp1-1f1b"]) == whole


def test_a_qlora_checkpoint_holds_what_trains_and_resumes_at_another_layout(world_results, reference, directory):
    reader = ModelTensorReader(directory / "qlora-tp1-pp1-dp2-fsdp.ckpt")
    assert reader.shapes and all(".lora_" in name for name in reader.shapes)
    record = reader.meta.lora["quantized_base"]
    assert record["format"] == "nf4" and record["block_size"] == 32 and record["scaler_block_size"] == 8
    assert len(record["names"]) == QUANTIZED_PER_LAYER * SHAPE["num_hidden_layers"]
    assert reader.meta.frozen_weights["tensors"] == sum(not p.requires_grad for p in qlora_network().parameters())
    for rank, rank_result in enumerate(world_results["qlora-resumed-tp1-pp2-dp1"]):
        torch.testing.assert_close(torch.tensor(rank_result["losses"]), torch.tensor(reference["losses"][STEPS:]),
                                   rtol=RTOL, atol=0.0, msg=lambda message, rank=rank: f"rank {rank}: {message}")


def test_tensor_parallelism_refuses_a_4_bit_base_with_the_reason(world_results):
    for rank_result in world_results["qlora-tp2-refused"]:
        assert "4-bit NF4 (QLoRA" in rank_result["error"] and "tensor_parallel_size=1" in rank_result["error"]


def test_the_merged_export_from_the_base_folder_is_the_trained_qlora_model(world_results, directory):
    """`tp3d export CKPT OUT --base FOLDER`: the base read from its folder, quantised and dequantised as
    training held it, the factors merged in; transformers' logits equal the live QLoRA model's (fp32: the
    merge reorders one sum per weight, ~1e-7 on logits of order 1)."""
    base = directory / "base"
    hf_network("llama").save_pretrained(base)
    live = qlora_network()
    assert live.load_state_dict(world_results["qlora-tp1-pp1-dp2-fsdp"][0]["final_params"], strict=False
                                ).unexpected_keys == []
    command = [sys.executable, "-m", "lightning_tp3d.cli", "export", str(directory / "qlora-tp1-pp1-dp2-fsdp.ckpt"),
               str(directory / "merged"), "--base", str(base)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    merged = transformers.AutoModelForCausalLM.from_pretrained(directory / "merged")
    prompt = torch.randint(0, SHAPE["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=prompt).logits, live(input_ids=prompt).logits, rtol=0.0, atol=1e-5)
    other = directory / "other-base"
    changed = hf_network("llama")
    with torch.no_grad():
        changed.model.norm.weight.add_(0.01)
    changed.save_pretrained(other)
    refused = subprocess.run([*command[:-1], str(other)], capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "differ from the ones the checkpoint was trained on" in refused.stderr
