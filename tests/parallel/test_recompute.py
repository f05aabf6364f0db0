"""Activation recompute: identical gradients, less activation memory, and the planner's estimate.

* (tp, pp, dp) = (2, 2, 1) and (1, 2, 2) with FSDP2, dropout on: gradients of the first step and losses
  of 3 steps with `full` / `selective` recompute (every block, every 2nd, first block of each stage)
  equal the run without recompute within 1e-6.
* One process, tiny model: the peak of activations and backward temporaries measured with torch's
  MemTracker falls none > selective > full, and the ledger's estimate is within 10% of each.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning as L
import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from lightning_tp3d import MODEL_PRESETS, ParallelLayout, TP3DStrategy
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.models.llama import LlamaForCausalLM
from lightning_tp3d.parallel.recompute import apply_recompute
from lightning_tp3d.plan.ledger import TrainingOptions, training_ledger
from lightning_tp3d.plan.recompute import recomputed_layers
from tests.distributed import run_distributed
from tests.helpers import LEARNING_RATE, SEQ_LEN, CaptureGradients, MemoryLogger, trainer_kwargs, world_size

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

TOLERANCE = 1e-6
GLOBAL_BATCH = 8
DROPOUT = dataclasses.replace(MODEL_PRESETS["tiny"], hidden_dropout=0.1, attention_dropout=0.1)

# name -> (tp, pp, dp mode, recompute, method, N)
SCENARIOS = {
    "tp2-pp2-none": (2, 2, "replicate", "none", "uniform", 1),
    "tp2-pp2-full": (2, 2, "replicate", "full", "uniform", 1),
    "tp2-pp2-selective": (2, 2, "replicate", "selective", "uniform", 1),
    "tp2-pp2-full-every-2nd": (2, 2, "replicate", "full", "uniform", 2),
    "tp2-pp2-full-first-of-stage": (2, 2, "replicate", "full", "block", 1),
    "pp2-dp2-fsdp-none": (1, 2, "fsdp", "none", "uniform", 1),
    "pp2-dp2-fsdp-full": (1, 2, "fsdp", "full", "uniform", 1),
}


def _fit(tp: int, pp: int, mode: str, recompute: str, method: str, num_layers: int) -> dict[str, Any]:
    L.seed_everything(7)
    dp = world_size() // (tp * pp)
    logger, capture = MemoryLogger(), CaptureGradients()
    strategy = TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, num_microbatches=2,
                            data_parallel_mode=mode, recompute=recompute, recompute_method=method,
                            recompute_num_layers=num_layers)
    trainer = L.Trainer(**trainer_kwargs(devices=world_size(), strategy=strategy, max_steps=3, logger=logger,
                                         callbacks=[capture]))
    module = CausalLMModule(DROPOUT, learning_rate=LEARNING_RATE)
    trainer.fit(module, TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp,
                                        val_fraction=0.2))
    wrapped = {index: hasattr(block.forward if recompute == "full" else block.self_attn.core_attention, "__wrapped__")
               for index, block in module.model.model.layers.items()}
    return {"losses": logger.values("train_loss"), "first_grads": capture.first_grads,
            "recomputed": sorted(int(index) for index, is_wrapped in wrapped.items() if is_wrapped)}


def run_world() -> dict[str, Any]:
    return {name: _fit(*scenario) for name, scenario in SCENARIOS.items()}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, Any]]]:
    per_rank = run_distributed(4, "tests.parallel.test_recompute:run_world")
    return {name: [rank[name] for rank in per_rank] for name in SCENARIOS}


@pytest.mark.parametrize("name", [name for name, scenario in SCENARIOS.items() if scenario[3] != "none"])
def test_recompute_gives_the_same_gradients(runs, name):
    baseline = runs[name.split("-full")[0].split("-selective")[0] + "-none"]
    for rank, reference in zip(runs[name], baseline):
        assert len(rank["losses"]) == 3
        assert max(abs(a - b) for a, b in zip(rank["losses"], reference["losses"])) <= TOLERANCE
        assert rank["first_grads"].keys() == reference["first_grads"].keys()
        for key, expected in reference["first_grads"].items():
            assert (rank["first_grads"][key] - expected).abs().max().item() <= TOLERANCE, key


@pytest.mark.parametrize(("name", "layers"), [("tp2-pp2-full", [0, 1, 2, 3]), ("tp2-pp2-selective", [0, 1, 2, 3]),
                                             ("tp2-pp2-full-every-2nd", [0, 2]),
                                             ("tp2-pp2-full-first-of-stage", [0, 2])])
def test_recompute_is_applied_to_the_chosen_blocks(runs, name, layers):
    assert sorted({layer for rank in runs[name] for layer in rank["recomputed"]}) == layers


def test_which_layers_are_recomputed():
    stages = [range(0, 3), range(3, 6)]
    assert recomputed_layers(stages, "uniform", 1) == [0, 1, 2, 3, 4, 5]
    assert recomputed_layers(stages, "uniform", 2) == [0, 2, 4]
    assert recomputed_layers(stages, "block", 2) == [0, 1, 3, 4]


def _measured_activation_bytes(recompute: str, seq_len: int, batch: int) -> int:
    """Activations and backward temporaries at the step's memory peak (MemTracker's ACT + TEMP)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(MODEL_PRESETS["tiny"])
    if recompute != "none":
        apply_recompute(dict(enumerate(model.model.layers.values())), recompute)
    input_ids = torch.randint(0, 256, (batch, seq_len))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(input_ids, labels=torch.roll(input_ids, -1, dims=1)).backward()
    peak = {str(kind).rsplit(".", 1)[-1]: value
            for kind, value in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
    return peak["ACT"] + peak["TEMP"]


def test_activation_memory_falls_and_the_ledger_estimates_it():
    seq_len, batch = 64, 4
    measured, estimated = {}, {}
    for recompute in ("none", "selective", "full"):
        measured[recompute] = _measured_activation_bytes(recompute, seq_len, batch)
        ledger = training_ledger(MODEL_PRESETS["tiny"], ParallelLayout(micro_batch_size=batch),
                                 TrainingOptions(seq_len=seq_len, precision="32-true", recompute=recompute))
        estimated[recompute] = ledger.stages[0].activation_bytes
        assert abs(estimated[recompute] - measured[recompute]) <= 0.10 * measured[recompute], (recompute, measured,
                                                                                               estimated)
    assert measured["none"] > measured["selective"] > measured["full"]
    assert measured["full"] < 0.35 * measured["none"]


def test_bad_recompute_options_are_refused():
    with pytest.raises(ValueError, match=r"recompute='partial' is not one of \['none', 'full', 'selective'\]"):
        TP3DStrategy(recompute="partial")
    with pytest.raises(ValueError, match=r"recompute_method='interleaved' is not one of \['uniform', 'block'\]"):
        TP3DStrategy(recompute="full", recompute_method="interleaved")
    with pytest.raises(ValueError, match=r"recompute_num_layers must be a positive integer, got 0"):
        TP3DStrategy(recompute="full", recompute_num_layers=0)
    model = LlamaForCausalLM(MODEL_PRESETS["tiny"])
    with pytest.raises(AttributeError, match=r"block 0 \(DecoderLayer\) has no 'attn.core'; pass"
                                             r" TP3DStrategy\(recompute_target=...\)"):
        apply_recompute(dict(enumerate(model.model.layers.values())), "selective", "attn.core")
