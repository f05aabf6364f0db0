"""`tp3d fit --config` through LightningCLI at (tp, pp, dp) = (2, 2, 2) on 8 CPU processes, with the
registered name plus the `tp3d:` section and with the strategy's class_path / init_args: both runs log the
losses of the single-process reference within 1e-5 (and the same losses as each other).

The runs are `tp3d fit` on each rank of a live world, as `tp3d run --nproc-per-node N -m lightning_tp3d.cli
fit ...` starts them (`tests.commands`); the refusal of a bad layout runs `tp3d fit` in a new process, where
Lightning starts the ranks itself."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.commands import command_on_world
from tests.helpers import LEARNING_RATE, SEQ_LEN, reference_run

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

REPOSITORY = Path(__file__).resolve().parents[2]
EXAMPLES = REPOSITORY / "examples"
STEPS = 3
OVERRIDES = ["--trainer.max_steps", str(STEPS), "--trainer.log_every_n_steps", "1", "--trainer.limit_val_batches",
             "0", "--data.init_args.seq_len", str(SEQ_LEN), "--data.init_args.batch_size", "4",
             "--data.init_args.val_fraction", "0.2", "--data.init_args.source", "tiny",
             "--model.init_args.learning_rate", str(LEARNING_RATE),
             # Lightning's default logger is TensorBoard's when tensorboard(X) is installed; read the CSV one.
             "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", "."]


def _fit_command(world_size: int, arguments: list[str], directory: Path) -> str:
    """`tp3d fit arguments` on `world_size` live ranks in `directory`: rank 0's standard output."""
    return command_on_world(world_size, ["fit", *arguments], str(directory))[0]


def _fit(config: str, directory: Path) -> list[float]:
    output = _fit_command(8, ["--config", str(EXAMPLES / config), *OVERRIDES], directory)
    assert "step    1  loss " in output  # the example's PrintLosses callback
    (metrics,) = directory.glob("lightning_logs/version_*/metrics.csv")
    with open(metrics) as file:
        return [float(row["train_loss"]) for row in csv.DictReader(file) if row.get("train_loss")]


@pytest.mark.parametrize("config", ["tiny_2x2x2.yaml", "tiny_2x2x2_class_path.yaml"])
def test_yaml_run_at_2x2x2_matches_single_process(config, tmp_path):
    losses = _fit(config, tmp_path)
    reference = reference_run(STEPS, global_batch_size=8)["losses"]
    assert len(losses) == STEPS
    assert max(abs(a - b) for a, b in zip(losses, reference)) <= 1e-5


def test_a_bad_layout_in_fit_is_one_line_with_the_fix(tmp_path):
    """`tp3d fit` on 3 processes for a tp 2 x pp 2 YAML: the layout's refusal as one line on stderr (exit 2),
    as `tp3d plan` gives it, not a traceback; and no LightningCLI warning about its `args=` parameter."""
    process = subprocess.run([sys.executable, "-m", "lightning_tp3d.cli", "fit", "--config",
                              str(EXAMPLES / "tiny_2x2x2.yaml"), "--trainer.devices", "3"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert process.returncode == 2, process.stderr[-3000:]
    errors = [line for line in process.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert errors == ["tp3d fit: error: world size 3 is not divisible by tensor_parallel_size x"
                      " pipeline_parallel_size = 2 x 2 = 4; launch a multiple of 4 processes or change the tp/pp"
                      " sizes."], process.stderr[-3000:]
    assert "args parameter is intended" not in process.stderr


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fine_tune(recipe: str, directory: Path, *overrides: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """`recipe` as a user runs it, its PATH/TO/HF-FOLDER the tiny Llama's folder (4 CPU processes, fp32, 4
    steps): (the base, the merged model its ExportCallback wrote)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from tests.models.test_huggingface import hf_network

    base = hf_network("llama")
    base.save_pretrained(directory / "base")
    config = directory / recipe
    config.write_text((EXAMPLES / recipe).read_text().replace("PATH/TO/HF-FOLDER", str(directory / "base")))
    arguments = ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--trainer.max_steps", "4",
                 "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "2",
                 "--trainer.enable_progress_bar", "false", "--trainer.logger", "false", "--tp3d.num_microbatches",
                 "2", "--data.init_args.source", "tiny", "--data.init_args.seq_len", str(SEQ_LEN),
                 "--data.init_args.batch_size", "4", "--data.init_args.val_fraction", "0.2",
                 "--model.init_args.learning_rate", "0.01", *overrides]
    _fit_command(4, ["--config", str(config), *arguments], directory)
    (merged,) = directory.glob("export/*-merged")
    return base, transformers.AutoModelForCausalLM.from_pretrained(merged)


def _changed(merged: torch.nn.Module, expected: dict[str, torch.Tensor]) -> set[str]:
    """The merged (bf16) weights that differ from `expected` rounded to bf16 the same way."""
    return {name for name, value in merged.state_dict().items()
            if not torch.equal(value.float(), expected[name].to(torch.bfloat16).float())}


def test_the_lora_recipe_fine_tunes_a_folder_and_exports_the_merged_model(tmp_path):
    """`examples/finetune_lora.yaml` on a tiny Hugging Face folder at tp 2 x pp 2: the LoRA factors train, and
    the merged export at the end is a plain `LlamaForCausalLM` whose weights differ from the base's where
    LoRA adapted them and nowhere else."""
    base, merged = _fine_tune("finetune_lora.yaml", tmp_path)
    assert type(merged) is type(base)
    adapted = {name for name in base.state_dict() if any(f"{target}.weight" in name for target in PROJECTIONS[:4])}
    assert _changed(merged, base.state_dict()) == adapted


def test_the_qlora_recipe_fine_tunes_a_4_bit_base_and_exports_it_merged_from_the_folder(tmp_path):
    """`examples/finetune_qlora.yaml` at pp 2 x FSDP 2 (NF4 blocks small enough for the tiny model's 16 x 32
    projections sharded over 2; LoRA on q alone, so that six projections are 4-bit and not adapted): the
    merged export, built from the base folder, is a plain `LlamaForCausalLM` that equals dequant(quant(W))
    on every projection LoRA did not adapt (the base as training held it, not the folder's W: each one
    differs from W), the folder's weights where nothing is quantised, and moved where LoRA trained."""
    pytest.importorskip("torchao")
    from lightning_tp3d.parallel.nf4 import round_trip
    from lightning_tp3d.plan.qlora import NF4Format

    tiny = NF4Format(block_size=32, scaler_block_size=8)
    base, merged = _fine_tune("finetune_qlora.yaml", tmp_path, "--model.init_args.nf4_block_size", "32",
                              "--model.init_args.nf4_scaler_block_size", "8",
                              "--model.init_args.target_modules", "[q_proj]")
    assert type(merged) is type(base)
    projections = {name for name in base.state_dict() if any(f"{target}.weight" in name for target in PROJECTIONS)}
    held = {name: round_trip(value, tiny) if name in projections else value
            for name, value in base.state_dict().items()}
    assert _changed(merged, held) == {name for name in projections if "q_proj" in name}
    assert _changed(merged, base.state_dict()) == projections
