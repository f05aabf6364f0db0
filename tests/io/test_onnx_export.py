"""Train -> deploy through ONNX Runtime: the merged model as an ONNX graph, run by the engine that serves it.

Three models trained at three layouts check themselves at the end of fit with
`ConsistencyCheck(engine="onnxruntime")`: the live parallel model (every rank) against its ONNX export run
by ONNX Runtime on fixed prompts of lengths 7 and 32, batch 2 (the graph's dynamic axes):

* the reference decoder at (tp, pp, dp) = (2, 2, 2), 1F1B, replicated dp;
* `transformers`' `LlamaForCausalLM` at (1, 2, 2), FSDP2;
* a PEFT LoRA model (merged into the export) at (2, 1, 2), ZeRO-1, also exported by `ExportCallback(format="onnx")`.

Tolerance (fp32): both sides compute the same operations with other kernels and summation orders (MKL /
oneDNN against ONNX Runtime's MLAS, fused against unfused norms and softmax). A dot product of length K
rounds to a relative error of about sqrt(K) u (u = 2^-24, random-walk accumulation); the logits are at
the end of about 5 matmuls per layer over 4 layers and the head, K <= 128, so about
21 x 11 x 6e-8 = 1.4e-5 of the logits' scale. The bound is 1e-4 of the largest |logit| (7x margin); a bf16
rounding (u = 2^-8 = 4e-3) or a tp shard's rows in the wrong order (a change of order 1) are far above it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_tp3d import TP3DStrategy
from lightning_tp3d.callbacks import ConsistencyCheck, ExportCallback
from lightning_tp3d.cli import main as tp3d
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.diagnostics.consistency import fixed_prompts
from lightning_tp3d.diagnostics.engines import onnxruntime_outputs
from lightning_tp3d.io import onnx_export
from lightning_tp3d.io.checkpoint_format import CheckpointError
from lightning_tp3d.io.export import export_checkpoint
from lightning_tp3d.io.onnx_export import (
    EXTERNAL_DATA_BYTES,
    ONNX_FILE,
    OnnxManifest,
    export_onnx,
    onnx_from_hf_folder,
    uses_external_data,
)
from lightning_tp3d.models import CausalLMModule
from tests.distributed import run_distributed
from tests.helpers import LEARNING_RATE, SEQ_LEN, trainer_kwargs, world_size

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

RELATIVE_TOLERANCE = 1e-4  # of the largest |logit|: see the module docstring
PROMPT_LENGTHS = (7, 32)
GLOBAL_BATCH = 8
# name -> (world size, model, TP3DStrategy arguments)
RUNS: dict[str, tuple[int, str, dict[str, Any]]] = {
    "reference-tp2-pp2-dp2-1f1b-replicate": (8, "reference", dict(tensor_parallel_size=2, pipeline_parallel_size=2)),
    "llama-tp1-pp2-dp2-fsdp": (4, "llama", dict(pipeline_parallel_size=2, data_parallel_mode="fsdp")),
    "lora-tp2-pp1-dp2-zero1": (4, "lora", dict(tensor_parallel_size=2, data_parallel_mode="zero1")),
}


def _module(model: str) -> L.LightningModule:
    if model == "reference":
        return CausalLMModule("tiny", learning_rate=LEARNING_RATE)
    if model == "llama":
        from tests.models.test_huggingface import HFModule

        return HFModule("llama")
    from tests.models.test_lora import LoraModule

    return LoraModule()


# ---------------------------------------------------------------------- worlds
def run_onnx_world(directory: str) -> dict[str, Any]:
    """Each run of this world's size: 2 steps, then the ONNX Runtime check (and the LoRA run's ONNX export)."""
    directory, results = Path(directory), {}
    for name, (world, model, options) in RUNS.items():
        if world != world_size():
            continue
        check = ConsistencyCheck(directory / name, engine="onnxruntime", prompt_lengths=PROMPT_LENGTHS)
        callbacks: list[Any] = [check]
        if model == "lora":
            callbacks.append(ExportCallback(directory / f"{name}-exported", format="onnx"))
        strategy = TP3DStrategy(num_microbatches=2, **options)
        trainer = L.Trainer(**trainer_kwargs(devices=world, strategy=strategy, max_steps=2, callbacks=callbacks))
        dp = world // (options.get("tensor_parallel_size", 1) * options.get("pipeline_parallel_size", 1))
        module = _module(model)
        trainer.fit(module, TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp))
        trainer.save_checkpoint(directory / f"{name}.ckpt")
        module.eval()
        vocab = trainer.strategy.network.config.vocab_size
        with torch.no_grad():
            logits = [trainer.strategy.network(prompt) for prompt in fixed_prompts(vocab, PROMPT_LENGTHS, batch_size=2)]
        largest = max(float((output.logits if hasattr(output, "logits") else output).abs().max()) for output in logits)
        results[name] = {"report": check.report.to_dict() if check.report is not None else None, "largest": largest}
    return results


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[dict[str, Any], Path]:
    directory = tmp_path_factory.mktemp("onnx")
    results: dict[str, Any] = {}
    for world in sorted({world for world, _, _ in RUNS.values()}, reverse=True):
        results |= run_distributed(world, "tests.io.test_onnx_export:run_onnx_world", str(directory))[0]
    return results, directory


# ---------------------------------------------------------------------- the live model against ONNX Runtime
@pytest.mark.parametrize("name", list(RUNS))
def test_the_onnx_export_in_onnx_runtime_equals_the_live_parallel_model(trained, name):
    results, directory = trained
    report = results[name]["report"]
    assert report["verdict"] == "PASS", report
    assert report["max_abs_diff"] <= RELATIVE_TOLERANCE * results[name]["largest"], report
    assert set(report["layer_max_abs_diff"]) == {f"model.layers.{index}" for index in range(4)}
    manifest = OnnxManifest.read(directory / name)
    assert manifest.dtype == "fp32" and manifest.num_layers == 4 and not manifest.external_data


def test_the_export_callback_writes_the_same_graph_the_check_ran(trained):
    _, directory = trained
    prompts = fixed_prompts(256, PROMPT_LENGTHS, batch_size=2)
    checked, exported = (onnxruntime_outputs(directory / folder, prompts)
                         for folder in ("lora-tp2-pp1-dp2-zero1", "lora-tp2-pp1-dp2-zero1-exported"))
    for checked_logits, exported_logits in zip(checked[0], exported[0]):
        assert torch.equal(checked_logits, exported_logits)


def test_the_graph_has_dynamic_batch_and_sequence_axes(trained):
    import onnxruntime

    _, directory = trained
    session = onnxruntime.InferenceSession(str(directory / "llama-tp1-pp2-dp2-fsdp" / ONNX_FILE),
                                           providers=["CPUExecutionProvider"])
    assert [(item.name, item.shape) for item in session.get_inputs()] == [("input_ids", ["batch", "sequence"])]
    assert [item.name for item in session.get_outputs()] == ["logits"] + [f"hidden_states.{i}" for i in range(4)]
    for shape in ((1, 1), (3, 5)):
        logits = session.run(["logits"], {"input_ids": torch.zeros(shape, dtype=torch.long).numpy()})[0]
        assert logits.shape == (*shape, 256)


# ---------------------------------------------------------------------- tp3d export --format onnx / check --engine
def test_cli_export_and_check_pass_and_fp16_is_told_apart(trained, tmp_path, capsys):
    results, directory = trained
    checkpoint = str(directory / "reference-tp2-pp2-dp2-1f1b-replicate.ckpt")
    assert tp3d(["export", checkpoint, str(tmp_path / "fp32"), "--format", "onnx"]) == 0
    assert "model.onnx" in capsys.readouterr().out
    assert tp3d(["check", str(tmp_path / "fp32"), "--checkpoint", checkpoint, "--engine", "onnxruntime",
                 "--prompt-lengths", *map(str, PROMPT_LENGTHS), "--json"]) == 0
    fp32 = json.loads(capsys.readouterr().out)
    assert fp32["max_abs_diff"] <= RELATIVE_TOLERANCE * results["reference-tp2-pp2-dp2-1f1b-replicate"]["largest"]
    # fp16 weights and arithmetic: within the PASS band against the weights rounded to fp16, far from fp32's
    assert tp3d(["export", checkpoint, str(tmp_path / "fp16"), "--format", "onnx", "--dtype", "fp16"]) == 0
    capsys.readouterr()
    assert tp3d(["check", str(tmp_path / "fp16"), "--checkpoint", checkpoint, "--engine", "onnxruntime", "--json"]) == 0
    fp16 = json.loads(capsys.readouterr().out)
    assert fp16["verdict"] == "PASS" and fp16["max_abs_diff"] > 10 * fp32["max_abs_diff"], (fp16, fp32)
    # bf16: ONNX Runtime's CPU provider has no bf16 kernels, said in one line
    assert tp3d(["export", checkpoint, str(tmp_path / "bf16"), "--format", "onnx", "--dtype", "bf16"]) == 0
    capsys.readouterr()
    assert tp3d(["check", str(tmp_path / "bf16"), "--checkpoint", checkpoint, "--engine", "onnxruntime"]) == 2
    error = capsys.readouterr().err.strip()
    assert "no bf16 kernels" in error and "--dtype fp16 or fp32" in error and "\n" not in error


def test_a_garbled_export_fails_and_names_the_first_bad_layer(trained, tmp_path, capsys):
    """The documents' "garbled output": layer 1's value projection with its two tp shards' rows (one kv head
    each) in the wrong order, as a merge that concatenated the shards the wrong way round writes it."""
    _, directory = trained
    checkpoint = directory / "reference-tp2-pp2-dp2-1f1b-replicate.ckpt"
    merged = tmp_path / "hf"
    export_checkpoint(checkpoint, merged)
    tensors = load_file(merged / "model.safetensors")
    name = "model.layers.1.self_attn.v_proj.weight"
    first, second = tensors[name].chunk(2)
    tensors[name] = torch.cat([second, first])
    save_file(tensors, merged / "model.safetensors", metadata={"format": "pt"})
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    onnx_from_hf_folder(merged, garbled)
    assert tp3d(["check", str(garbled), "--checkpoint", str(checkpoint), "--engine", "onnxruntime"]) == 1
    out = capsys.readouterr().out
    assert "consistency FAIL" in out and "first layer over the PASS band: model.layers.1" in out
    bands = {line.split()[0]: line.split()[-1] for line in out.splitlines() if line.startswith("model.layers.")}
    assert bands["model.layers.0"] == "PASS" and bands["model.layers.1"] == "FAIL", bands


# ---------------------------------------------------------------------- refusals
def test_without_the_extra_onnx_export_says_which_extra_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(onnx_export, "_importable", lambda name: name != "onnxscript")
    assert tp3d(["export", str(tmp_path / "missing.ckpt"), str(tmp_path / "out"), "--format", "onnx"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == ("tp3d export: error: ONNX export and checks need onnxscript: pip install 'lightning-tp3d[onnx]'.")
    with pytest.raises(ImportError, match=r"lightning-tp3d\[onnx\]"):
        ExportCallback(tmp_path / "out", format="onnx")
    with pytest.raises(ImportError, match=r"lightning-tp3d\[onnx\]"):
        ConsistencyCheck(tmp_path / "out", engine="onnxruntime")


def test_a_mixture_of_experts_is_refused_with_the_reason(tmp_path, monkeypatch):
    class Meta:
        model_config = {"model_type": "deepseek_v3"}

    monkeypatch.setattr(onnx_export, "read_meta", lambda checkpoint: Meta())
    with pytest.raises(CheckpointError, match="mixture of experts.*data dependent.*serve it with vLLM"):
        export_onnx(tmp_path / "moe.ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_options_onnx_cannot_take_are_refused(tmp_path, capsys):
    assert tp3d(["export", str(tmp_path / "c.ckpt"), str(tmp_path / "o"), "--format", "onnx", "--deploy-tp", "2"]) == 2
    assert "--format onnx writes one merged graph" in capsys.readouterr().err
    with pytest.raises(ValueError, match="deploy_tp goes with format='hf'"):
        ExportCallback(tmp_path / "o", format="onnx", deploy_tp=2)
    with pytest.raises(ValueError, match="format='safetensors' is not one of"):
        ExportCallback(tmp_path / "o", format="safetensors")
    with pytest.raises(ValueError, match="tp3d check EXPORT --checkpoint CKPT --engine vllm"):
        ConsistencyCheck(tmp_path / "o", engine="vllm")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "config.json").write_text(json.dumps({"vocab_size": 256}))
    assert tp3d(["check", str(tmp_path / "o"), "--engine", "onnxruntime"]) == 2
    assert "pass --checkpoint CHECKPOINT" in capsys.readouterr().err


def test_weights_of_2_gib_and_more_go_to_an_external_data_file():
    assert EXTERNAL_DATA_BYTES == 2 * 1024**3
    assert not uses_external_data(EXTERNAL_DATA_BYTES - 1) and uses_external_data(EXTERNAL_DATA_BYTES)
