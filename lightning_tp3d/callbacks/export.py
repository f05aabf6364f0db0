"""Callbacks that carry a run to deployment: merged Hugging Face (or ONNX) export and the train-vs-deploy check.

Both work at any layout with `TP3DStrategy`: the live model is saved as a sharded checkpoint (every
rank writes its own shards), then rank 0 merges it into a Hugging Face folder in one process.

Example usage::

    trainer = Trainer(strategy=TP3DStrategy(tensor_parallel_size=2, pipeline_parallel_size=2),
                      callbacks=[ExportCallback("export/hf", dtype="bf16", deploy_tp=2),
                                 ConsistencyCheck("export/check")])
    ConsistencyCheck("export/onnx-check", engine="onnxruntime")   # the live model against ONNX Runtime
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_tp3d._compat.lightning import last_checkpoint_saved
from lightning_tp3d.diagnostics.consistency import (
    DEFAULT_PROMPT_LENGTHS,
    FAIL_ABOVE,
    WARN_ABOVE,
    ConsistencyReport,
    compare_outputs,
    exact_fp32_matmuls,
    fixed_prompts,
    model_from_hf_folder,
    rounded_to,
    run_with_layer_outputs,
)
from lightning_tp3d.diagnostics.engines import onnxruntime_outputs
from lightning_tp3d.io.checkpoint_format import read_meta
from lightning_tp3d.io.deploy import DEPLOY_SHARDS, deploy_folder
from lightning_tp3d.io.export import HF_EXPORT, ExportResult, export_checkpoint
from lightning_tp3d.io.folders import check_output_folder
from lightning_tp3d.io.hf import EXPORT_DTYPES
from lightning_tp3d.io.onnx_export import ONNX_EXPORT, export_onnx, require_onnx
from lightning_tp3d.parallel.attributes import indexed_blocks, resolve_attribute
from lightning_tp3d.parallel.nf4 import quantized_parameters

__all__ = ["ConsistencyCheck", "ExportCallback"]


_EXPORTS = {"hf": (HF_EXPORT, export_checkpoint), "onnx": (ONNX_EXPORT, export_onnx)}  # format -> kind, writer


def _check_format(format: str) -> None:
    if format not in _EXPORTS:
        raise ValueError(f"format={format!r} is not one of {sorted(_EXPORTS)}.")
    if format == "onnx":
        require_onnx()


def _check_outputs(trainer: L.Trainer, output: Path, deploy_tp: int | None, overwrite: bool,
                   format: str = "hf") -> None:
    """Refuse, before training, an export folder holding what this package did not write (rank 0 looks,
    every rank raises)."""
    problem = None
    if trainer.is_global_zero:
        try:
            check_output_folder(output, _EXPORTS[format][0], overwrite)
            if deploy_tp is not None:
                check_output_folder(deploy_folder(output, deploy_tp), DEPLOY_SHARDS, overwrite)
        except FileExistsError as error:
            problem = str(error)
    problem = trainer.strategy.broadcast(problem)
    if problem is not None:
        raise FileExistsError(problem)


def _export_live_model(trainer: L.Trainer, output: Path, format: str = "hf", **options: Any) -> ExportResult | None:
    """Save the live model as a sharded checkpoint next to `output`, merge it on rank 0 (into a Hugging Face
    folder, or an ONNX one), remove it."""
    checkpoint = output.with_name(output.name + ".source.ckpt")
    trainer.save_checkpoint(checkpoint)
    finish = getattr(trainer.strategy, "finish_pending_save", None)
    if finish is not None:
        finish()
    result = _EXPORTS[format][1](checkpoint, output, **options) if trainer.is_global_zero else None
    trainer.strategy.barrier("export")
    if trainer.is_global_zero:
        shutil.rmtree(checkpoint)
    return result


class ExportCallback(Callback):
    """Write a Hugging Face folder (and optionally deploy-TP shards), or with `format="onnx"` an ONNX folder
    (`io.onnx_export`), at the end of fit, and with every `every_n_checkpoints`-th checkpoint
    `ModelCheckpoint` saves (into `<output>-step-<its global step>`).

    Args:
        output: the folder of the final export.
        dtype / max_shard_size / deploy_tp: as `tp3d export` (the last two: Hugging Face folders only).
        format: "hf" (default) or "onnx" (needs the [onnx] extra; checked when the callback is made).
        every_n_checkpoints: also export every n-th saved checkpoint (None: only at the end).
        overwrite: replace `output` even if it holds files that are not an earlier export (checked when
            fit starts; by default such a folder is refused before training).
        base: the Hugging Face folder of the frozen base, for a strategy that saves without it
            (`save_frozen_weights=False`, a QLoRA base): as `tp3d export --base`.
    """

    def __init__(self, output: str | Path, dtype: str = "fp32", max_shard_size: str | int = "5GB",
                 deploy_tp: int | None = None, every_n_checkpoints: int | None = None, overwrite: bool = False,
                 base: str | Path | None = None, format: str = "hf") -> None:
        _check_format(format)
        if format == "onnx" and deploy_tp is not None:
            raise ValueError("ExportCallback(format='onnx') writes one merged graph: deploy_tp goes with format='hf'.")
        self.output = Path(output)
        self.format = format
        self.options: dict[str, Any] = {"dtype": dtype, "overwrite": overwrite, "base": base}
        if format == "hf":
            self.options |= {"max_shard_size": max_shard_size, "deploy_tp": deploy_tp}
        self.every_n_checkpoints = every_n_checkpoints
        self.result: ExportResult | None = None
        self._saves = 0
        self._exported_saves = 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        options = getattr(getattr(trainer.strategy, "core", None), "options", None)
        without_base = options is not None and (not options.save_frozen_weights or quantized_parameters(pl_module))
        if without_base and self.options["base"] is None:  # refused now, not after the run
            raise ValueError(
                "ExportCallback merges the model from a checkpoint of the live model, which needs its frozen"
                " weights, but the strategy saves without them (save_frozen_weights=False, or a 4-bit QLoRA base):"
                " pass ExportCallback(base=FOLDER), the Hugging Face folder the base was loaded from, or export the"
                " adapter after fit with `tp3d export CKPT OUT --adapter`."
            )
        _check_outputs(trainer, self.output, self.options.get("deploy_tp"), self.options["overwrite"], self.format)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._saves += 1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        # ModelCheckpoint runs after the other callbacks: a save of the previous step is complete now.
        due = self.every_n_checkpoints and self._saves // self.every_n_checkpoints > self._exported_saves
        saved = last_checkpoint_saved(trainer.checkpoint_callback)
        if not due or not saved:
            return
        self._exported_saves = self._saves // self.every_n_checkpoints
        finish = getattr(trainer.strategy, "finish_pending_save", None)
        if finish is not None:
            finish()
        if trainer.is_global_zero:
            step = read_meta(saved).global_step
            _EXPORTS[self.format][1](saved, self.output.with_name(f"{self.output.name}-step-{step}"), **self.options)
        trainer.strategy.barrier("export")

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.result = _export_live_model(trainer, self.output, self.format, **self.options)
        if self.result is not None:
            rank_zero_info(f"Exported {self.result.folder} ({len(self.result.files)} file(s)).")


class ConsistencyCheck(Callback):
    """At the end of fit, compare the live parallel model with its merged export loaded in one process.

    Fixed prompts go through the live model (every rank takes part: tensor and pipeline parallel forward)
    and through the export loaded by transformers (or this package's decoder without transformers), or with
    `engine="onnxruntime"` through its ONNX export run by ONNX Runtime (`diagnostics.engines`). The
    report (max |logit diff|, KL, each decoder layer's max |diff|, the first layer over tolerance) is
    logged as `consistency/*` and kept in `self.report`; over the tolerance it raises (or warns).

    The live model runs with its weights rounded to the export's dtype (`consistency.rounded_to`), so the
    bands judge the export itself; with a lower-precision export the difference against the unrounded
    weights is reported too (`precision_max_abs_diff`).

    Args:
        output: folder of the export that is checked (kept afterwards).
        dtype: export dtype.
        tolerance: FAIL above this max |logit diff| (default `consistency.FAIL_ABOVE`, 1e-2).
        warn_above: WARN above this, PASS at or below (default `consistency.WARN_ABOVE`, 1e-3).
        prompt_lengths: lengths of the fixed prompts.
        use_transformers: load the export with transformers when it is installed.
        raise_on_failure: raise `RuntimeError` when the check fails (else a warning).
        overwrite: as `ExportCallback`'s.
        engine: "transformers" (default: the Hugging Face export) or "onnxruntime" (the ONNX export; needs
            the [onnx] extra). vLLM serves on its own GPUs: check there with `tp3d check --engine vllm`.
        batch_size: prompts per length (default 2 with "onnxruntime", whose batch axis is dynamic, else 1).
    """

    def __init__(self, output: str | Path, dtype: str = "fp32", tolerance: float | None = None,
                 prompt_lengths: Sequence[int] = DEFAULT_PROMPT_LENGTHS, use_transformers: bool = True,
                 raise_on_failure: bool = True, overwrite: bool = False, warn_above: float = WARN_ABOVE,
                 engine: str = "transformers", batch_size: int | None = None) -> None:
        if engine not in ("transformers", "onnxruntime"):
            hint = " vLLM serves on its own GPUs: run `tp3d check EXPORT --checkpoint CKPT --engine vllm` there." \
                if engine == "vllm" else ""
            raise ValueError(f"engine={engine!r} is not 'transformers' or 'onnxruntime'.{hint}")
        if engine == "onnxruntime":
            require_onnx()
        self.engine = engine
        self.format = "onnx" if engine == "onnxruntime" else "hf"
        self.batch_size = batch_size or (2 if engine == "onnxruntime" else 1)
        self.output = Path(output)
        self.overwrite = overwrite
        self.dtype = dtype
        if dtype not in EXPORT_DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {sorted(EXPORT_DTYPES)}.")
        self.tolerance = FAIL_ABOVE if tolerance is None else tolerance
        self.warn_above = warn_above
        self.prompt_lengths = tuple(prompt_lengths)
        self.use_transformers = use_transformers
        self.raise_on_failure = raise_on_failure
        self.report: ConsistencyReport | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _check_outputs(trainer, self.output, None, self.overwrite, self.format)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        network = trainer.strategy.network
        prompts = [prompt.to(pl_module.device) for prompt in fixed_prompts(network.config.vocab_size,
                                                                           self.prompt_lengths,
                                                                           batch_size=self.batch_size)]
        # the blocks where the model's family keeps them (a PEFT model's are under its prefix)
        layers = indexed_blocks(resolve_attribute(network, trainer.strategy.core.model_adapter_of(network)
                                                  .layers_attribute, "layers_attribute"))
        was_training = network.training
        network.eval()
        with exact_fp32_matmuls():
            with rounded_to(network, EXPORT_DTYPES[self.dtype]):
                live = _gather_to_rank_zero(run_with_layer_outputs(network, prompts, layers), trainer)
            unrounded = None if self.dtype == "fp32" else run_with_layer_outputs(network, prompts, layers)[0]
        network.train(was_training)
        _export_live_model(trainer, self.output, self.format, dtype=self.dtype, overwrite=self.overwrite)
        if trainer.is_global_zero:
            on_cpu = [prompt.cpu() for prompt in prompts]
            if self.engine == "onnxruntime":
                outputs = onnxruntime_outputs(self.output, on_cpu)
            else:
                outputs = run_with_layer_outputs(model_from_hf_folder(self.output, self.use_transformers), on_cpu)
            self.report = compare_outputs(live, outputs, self.tolerance, self.warn_above)
            if unrounded is not None:
                self.report.precision_max_abs_diff = compare_outputs((unrounded, []), outputs).max_abs_diff
            if trainer.logger is not None:
                trainer.logger.log_metrics({"consistency/max_abs_diff": self.report.max_abs_diff,
                                            "consistency/kl": self.report.kl}, step=trainer.global_step)
            rank_zero_info(self.report.summary())
        verdict, summary = trainer.strategy.broadcast(
            (self.report.verdict, self.report.summary()) if self.report is not None else (None, None))
        if verdict == "WARN":
            rank_zero_warn(f"Train-vs-deploy check of {self.output}: {summary}")
        failure = summary if verdict == "FAIL" else None
        if failure is not None:
            if self.raise_on_failure:
                raise RuntimeError(f"Train-vs-deploy check of {self.output}: {failure}")
            rank_zero_warn(failure)


def _gather_to_rank_zero(outputs: tuple[list[torch.Tensor], list[dict[int, torch.Tensor]]],
                         trainer: L.Trainer) -> tuple[list[torch.Tensor], list[dict[int, torch.Tensor]]]:
    """Each pipeline stage saw its own layers: rank 0 gets the union (logits are on every rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return outputs
    gathered: list[Any] | None = [None] * dist.get_world_size() if trainer.is_global_zero else None
    dist.gather_object(outputs[1], gathered, dst=0)
    if not trainer.is_global_zero:
        return outputs
    layers = [dict() for _ in outputs[1]]
    for rank_layers in gathered:
        for merged, prompt_layers in zip(layers, rank_layers):
            merged.update(prompt_layers)
    return outputs[0], layers
