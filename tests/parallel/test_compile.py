"""Regional compilation (`TP3DStrategy(compile=True)`): the same training as eager, one graph, clean names.

* Each run below trains twice at the same layout, eager and compiled (inductor on the CPU), dropout off:
  the losses of 4 steps and every gradient of the first step on every rank agree (`RTOL`):
  the reference decoder at (tp, pp, dp) = (2, 2, 1) 1F1B and (1, 2, 2) FSDP2, a `transformers` Llama at
  (2, 1, 2) with the overlapped replicate all-reduce, PEFT LoRA at (2, 2, 1) and QLoRA (a 4-bit NF4 base) at
  (1, 2, 2) FSDP2, a Fabric loop at (1, 2, 2), bf16-mixed at (1, 2, 2) FSDP2 and (2, 2, 1) 1F1B
  (`BF16_RTOL`), and 16-mixed with the sharded loss scaler at (2, 1, 2) (`FP16_RTOL`).
* Dynamo sees no graph break in the blocks (the package's hooks, TP redistributions and recompute trace
  whole) and compiles one forward graph for all blocks of a layout (two where the first block's input
  needs no gradient: the embedding of a LoRA model is frozen).
* Checkpoints: the names in a checkpoint written compiled equal an eager one's (and its weights, to
  AdamW's rounding: `assert_adam_weights_close`); a compiled run resumes an eager checkpoint and an eager
  run a compiled one, continuing the eager run's losses.
* Refusals and warnings: unknown torch.compile keywords, schedules that split the backward, a
  `transformers` model that keeps its KV cache in training (a network the user compiled is refused naming
  the option: `tests/strategies/conformance.py`).

Tolerance (fp32). Inductor fuses each block's elementwise chains and norms into loops of its own, so sums
are taken in another order than eager's kernels: every fp32 result can move by a few units of 2^-24
relative, and a gradient, through the 2 x 4 blocks' forward and backward (~100 rounded operations in
sequence, each over rows of 64-176 terms), by at most ~100 x 4 x 6e-8 ~ 2.4e-5 in the worst case and ~1e-6
in norm typically. Losses after 3 AdamW steps at lr 3e-3 inherit the weights' differences (~lr x 1e-6
relative per step). RTOL = 1e-4 on losses and per-tensor gradient norms has margin over rounding, and a
real defect (a block skipped, a TP reduction lost or doubled, a LoRA factor not trained) moves both by 1e-2
or more.

Tolerance (bf16-mixed). Eager autocast rounds every matmul's output to bf16 (half a unit: 2^-9 ~ 2e-3
relative) and runs each elementwise op on bf16; inductor keeps a fused chain in fp32 and rounds once at
its end, so each of a block's ~12 rounded intermediates can differ by a unit, 3.9e-3. Over 4 blocks' forward
and backward these add with random signs, ~sqrt(100) x 2e-3 ~ 2e-2 at the worst tensor: BF16_RTOL = 6e-2 on
gradients (three times that), 1e-2 on losses (a mean over 8 x 16 tokens averages the roundings out). A
defect of the kinds above moves gradients by O(1).

Tolerance (16-mixed). The same count with fp16's half-unit, 2^-11 ~ 4.9e-4 (a unit 9.8e-4): ~sqrt(100) x
4.9e-4 ~ 5e-3 at the worst tensor; FP16_RTOL = 8e-3 on gradients (the scaler's power of two cancels
exactly), 1.5e-3 on losses. fp32 passes that, but bf16's roundings (3.9e-3 a unit) would not, nor a defect.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_tp3d import MODEL_PRESETS, TP3DFabricStrategy, TP3DPrecision, TP3DStrategy
from lightning_tp3d._compat.torch import dynamo_counters
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.io.checkpoint_format import load_model_tensors
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.parallel.compile import compile_settings, warn_of_training_cache
from tests.distributed import run_distributed
from tests.helpers import (
    LEARNING_RATE,
    SEQ_LEN,
    CaptureGradients,
    MemoryLogger,
    assert_adam_weights_close,
    named_full,
    reference_network,
    trainer_kwargs,
    world_size,
    worst_relative_difference,
)

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

RTOL = 1e-4
BF16_RTOL, BF16_LOSS_RTOL = 6e-2, 1e-2
FP16_RTOL, FP16_LOSS_RTOL = 8e-3, 1.5e-3
TOLERANCES = {"32-true": (RTOL, RTOL), "bf16-mixed": (BF16_LOSS_RTOL, BF16_RTOL),
              "16-mixed": (FP16_LOSS_RTOL, FP16_RTOL)}  # precision -> (losses, gradients)
GLOBAL_BATCH = 8
STEPS = 4
SAVED_AT = 2
# name -> (module, tp, pp, dp mode, precision)
RUNS = {"tp2-pp2": ("decoder", 2, 2, "replicate", "32-true"),
        "pp2-dp2-fsdp": ("decoder", 1, 2, "fsdp", "32-true"),
        "hf-tp2-dp2-overlap": ("transformers", 2, 1, "replicate", "32-true"),
        "lora-tp2-pp2": ("lora", 2, 2, "replicate", "32-true"),
        "qlora-pp2-dp2-fsdp": ("qlora", 1, 2, "fsdp", "32-true"),
        "pp2-dp2-fsdp-bf16": ("decoder", 1, 2, "fsdp", "bf16-mixed"),
        "tp2-pp2-bf16": ("decoder", 2, 2, "replicate", "bf16-mixed"),
        "tp2-dp2-fp16": ("decoder", 2, 1, "replicate", "16-mixed")}
FABRIC = "fabric-pp2-dp2"
SAVING = "tp2-pp2"


def _module(kind: str) -> L.LightningModule:
    if kind == "decoder":
        return CausalLMModule(MODEL_PRESETS["tiny"], learning_rate=LEARNING_RATE)
    if kind == "transformers":
        from tests.models.test_huggingface import HFModule

        module = HFModule("llama")
        module.model.config.use_cache = False  # as `warn_of_training_cache` asks
        return module
    if kind == "lora":
        from tests.models.test_lora import LoraModule

        return LoraModule()
    from tests.models.test_qlora import QLoraModule

    return QLoraModule()


def _fit(kind: str, tp: int, pp: int, mode: str, precision: str, compiled: bool, directory: Path,
         resume: Path | None = None) -> dict[str, Any]:
    L.seed_everything(7)
    dp = world_size() // (tp * pp)
    logger, capture = MemoryLogger(), CaptureGradients()
    saving = ModelCheckpoint(dirpath=directory, every_n_train_steps=SAVED_AT, save_top_k=-1, filename="{step}")
    strategy = TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, num_microbatches=2,
                            data_parallel_mode=mode, compile=compiled)
    # fp16 autocast with the loss scaler every rank agrees on (`strategies.precision`)
    amp = {"plugins": [TP3DPrecision("16-mixed")]} if precision == "16-mixed" else {"precision": precision}
    trainer = L.Trainer(**trainer_kwargs(devices=world_size(), strategy=strategy, max_steps=STEPS, logger=logger,
                                         callbacks=[capture, saving], enable_checkpointing=True, **amp))
    dynamo_counters().clear()
    trainer.fit(_module(kind), TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp),
                ckpt_path=str(resume) if resume is not None else None)
    return {"losses": logger.values("train_loss"), "first_grads": capture.first_grads, **_compiled_graphs()}


def _fabric(compiled: bool) -> dict[str, Any]:
    """A Fabric loop at (1, 2, 2), replicated over dp: `TP3DFabricStrategy(compile=...)` compiles the blocks
    in `setup`."""
    L.seed_everything(7)
    strategy = TP3DFabricStrategy(pipeline_parallel_size=2, num_microbatches=2, compile=compiled)
    fabric = L.Fabric(accelerator="cpu", devices=world_size(), strategy=strategy)
    fabric.launch()
    dynamo_counters().clear()
    model = fabric.setup(reference_network())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE))
    data = TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH)
    data.setup()
    loader = fabric.setup_dataloaders(DataLoader(data.train_dataset, batch_size=GLOBAL_BATCH // 2))
    losses, first_grads = [], None
    for _, batch in zip(range(STEPS), loader, strict=False):
        loss = model(batch["input_ids"], labels=batch["labels"])
        fabric.backward(loss)
        if first_grads is None:
            first_grads = named_full(model, "grad", prefix="_forward_module.")
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "first_grads": first_grads, **_compiled_graphs()}


def _compiled_graphs() -> dict[str, Any]:
    counters = dynamo_counters()
    return {"graph_breaks": dict(counters["graph_break"]), "graphs": counters["stats"]["unique_graphs"]}


def run_world(root: str) -> dict[str, Any]:
    root_path = Path(root)
    results: dict[str, Any] = {}
    for name, (kind, tp, pp, mode, precision) in RUNS.items():
        for compiled in (False, True):
            results[name, compiled] = _fit(kind, tp, pp, mode, precision, compiled, root_path / name / str(compiled))
    for compiled in (False, True):
        results[FABRIC, compiled] = _fabric(compiled)
    saved = f"step={SAVED_AT}.ckpt"
    for compiled in (False, True):  # resume the other kind's checkpoint
        results["resumed", compiled] = _fit(*RUNS[SAVING], compiled, root_path / "resumed" / str(compiled),
                                            root_path / SAVING / str(not compiled) / saved)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("compile")
    results = run_distributed(4, "tests.parallel.test_compile:run_world", str(root))
    return [dict(rank, root=root) for rank in results]


def _relative(values: list[float], reference: list[float]) -> float:
    return max(abs(value - expected) / abs(expected) for value, expected in zip(values, reference, strict=True))


@pytest.mark.parametrize("name", [*RUNS, FABRIC])
def test_compiled_training_equals_eager(runs, name):
    precision = RUNS[name][-1] if name in RUNS else "32-true"
    loss_rtol, gradient_rtol = TOLERANCES[precision]
    for rank in runs:
        eager, compiled = rank[name, False], rank[name, True]
        assert len(compiled["losses"]) == STEPS
        assert _relative(compiled["losses"], eager["losses"]) <= loss_rtol
        assert compiled["first_grads"] and compiled["first_grads"].keys() == eager["first_grads"].keys()
        assert worst_relative_difference(compiled["first_grads"], eager["first_grads"]) <= gradient_rtol


@pytest.mark.parametrize("name", [*RUNS, FABRIC])
def test_the_blocks_compile_whole_into_one_graph(runs, name):
    # a LoRA model's frozen embedding hands the first block an input without gradient: a second graph
    most = 2 if name in RUNS and RUNS[name][0] in ("lora", "qlora") else 1
    for rank in runs:
        assert rank[name, False]["graphs"] == 0
        assert rank[name, True]["graph_breaks"] == {}
        assert 1 <= rank[name, True]["graphs"] <= most, rank[name, True]["graphs"]


def test_compiled_checkpoints_have_the_eager_names(runs):
    root = runs[0]["root"] / SAVING
    eager, compiled = (load_model_tensors(root / str(kind) / f"step={SAVED_AT}.ckpt") for kind in (False, True))
    assert sorted(compiled) == sorted(eager)
    assert not [name for name in compiled if "_orig_mod" in name]
    for name, tensor in eager.items():
        assert_adam_weights_close(compiled[name], tensor, name)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_checkpoint_resumes_compiled_or_eager(runs, compiled):
    for rank in runs:
        resumed, eager = rank["resumed", compiled], rank[SAVING, False]
        assert len(resumed["losses"]) == STEPS - SAVED_AT
        assert _relative(resumed["losses"], eager["losses"][SAVED_AT:]) <= RTOL


def test_compile_options_are_checked():
    assert compile_settings(False) is None
    assert compile_settings(True) == {}
    assert compile_settings({"backend": "aot_eager", "fullgraph": True}) == {"backend": "aot_eager", "fullgraph": True}
    with pytest.raises(ValueError, match=r"\['backed'\] are not torch.compile keywords; the keywords are"):
        TP3DStrategy(compile={"backed": "inductor"})
    with pytest.raises(TypeError, match=r"compile='yes' must be True, False or a mapping"):
        TP3DStrategy(compile="yes")


@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"])
def test_schedules_that_split_the_backward_are_refused_with_compile(schedule):
    with pytest.raises(ValueError, match=rf"compile is not supported with pipeline_schedule='{schedule}': it splits"
                                         r" each backward.*Use one of \['1f1b', 'gpipe', 'interleaved_1f1b',"
                                         r" 'looped_bfs'\] with compile"):
        TP3DStrategy(pipeline_parallel_size=2, num_microbatches=4, pipeline_schedule=schedule, stages_per_rank=2,
                     compile=True)
    TP3DStrategy(pipeline_parallel_size=2, num_microbatches=4, pipeline_schedule=schedule, stages_per_rank=2)


def test_a_model_that_caches_in_training_is_warned_of():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig()
    with pytest.warns(UserWarning, match=r"compile=True with LlamaConfig.use_cache=True: .* Set"
                                         r" model.config.use_cache = False for training"):
        warn_of_training_cache(config)
    config.use_cache = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_of_training_cache(config)
    assert not caught
