"""Train -> deploy: merged Hugging Face weights from a checkpoint of any layout.

`export_checkpoint` writes a folder that `transformers.AutoModelForCausalLM.from_pretrained` and vLLM
load as is: `config.json` (the trained model's own Hugging Face config when it was a `transformers`
model, e.g. `Qwen2ForCausalLM` with its fields; `LlamaForCausalLM` for the reference decoder) and
`model.safetensors`, or numbered shards
`model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`; a PEFT LoRA model is exported
merged, its factors added to the weights they adapt (`io.lora`). It streams: the files and their
headers are planned from the checkpoint's shapes, then each tensor is merged from the checkpoint's
shards alone (`ModelTensorReader`), converted and written straight to its file (`io.hf.write_safetensors`),
so memory stays near twice the largest tensor whatever the model size (no shard is buffered). The folder
is written as `<out>.partial` and moved under its name when complete, replacing an earlier export in one
step; a folder that is not an earlier export of this package is refused unless `overwrite=True`
(`lightning_tp3d.io.folders`). With `deploy_tp` it also writes the deploy shards (`io.deploy`).

Example usage::

    export_checkpoint("checkpoints/last.ckpt", "export/hf", dtype="bf16", max_shard_size="5GB")
    write_deploy_shards("export/hf", tensor_parallel_size=2)   # export/hf-deploy-tp2/rank-00/...

"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_tp3d.io.checkpoint_format import CheckpointError, CheckpointMeta, ModelTensorReader
from lightning_tp3d.io.deploy import DEPLOY_SHARDS, check_deploy_tp, deploy_folder, write_deploy_shards
from lightning_tp3d.io.folders import check_output_folder, replace_folder, staging_folder
from lightning_tp3d.io.frozen_base import open_frozen_base
from lightning_tp3d.io.hf import (
    EXPORT_DTYPES,
    exported_as_held,
    hf_config_for,
    write_safetensors,
)
from lightning_tp3d.io.hub_names import HubNames
from lightning_tp3d.io.lora import LoraMerge, adapter_config, adapter_entries
from lightning_tp3d.io.storage import location
from lightning_tp3d.plan.config import ModelConfig
from lightning_tp3d.plan.sharding import hf_tensor_names
from lightning_tp3d.plan.units import parse_size

__all__ = ["ADAPTER_EXPORT", "ExportResult", "HF_EXPORT", "export_checkpoint", "export_lora_adapter"]

HF_EXPORT = "hf-export"  # the kinds of folder this module writes (see `io.folders`)
ADAPTER_EXPORT = "lora-adapter-export"


@dataclass(frozen=True)
class ExportResult:
    folder: Path
    files: tuple[str, ...]
    total_bytes: int
    deploy_folders: tuple[Path, ...] = ()  # one per deploy tp size, in the order asked


def export_checkpoint(
    checkpoint: str | Path,
    output: str | Path,
    dtype: str = "fp32",
    max_shard_size: str | int = "5GB",
    deploy_tp: int | Sequence[int] | None = None,
    overwrite: bool = False,
    verify: bool = True,
    base: str | Path | None = None,
) -> ExportResult:
    """Merge a checkpoint of any (tp, pp, dp) into a Hugging Face folder, in this process alone.

    `output` may be new, empty or an earlier export (replaced whole once the new one is complete);
    a folder holding anything else is refused unless `overwrite=True`, which replaces it. The files read
    are checked against their recorded hashes first (`verify=False` skips that). A checkpoint saved
    without its frozen weights (`save_frozen_weights=False`, a QLoRA base) takes them from `base`, the
    Hugging Face folder they were loaded from, checked against its recorded fingerprint (`io.frozen_base`)."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(EXPORT_DTYPES)}.")
    checkpoint, output = location(checkpoint), Path(output)
    deploy_sizes = (deploy_tp,) if isinstance(deploy_tp, int) else tuple(deploy_tp or ())
    check_output_folder(output, HF_EXPORT, overwrite)
    for size in deploy_sizes:
        check_output_folder(deploy_folder(output, size), DEPLOY_SHARDS, overwrite)
    reader = ModelTensorReader(checkpoint, verify)  # checked once, then read one tensor at a time
    meta = reader.meta
    if meta.frozen_weights is not None and base is None:
        raise CheckpointError(
            f"{checkpoint} holds only what trained (saved with save_frozen_weights=False, or a QLoRA base), not"
            " the frozen base a merged export needs: pass the Hugging Face folder the base was loaded from"
            " (--base FOLDER, checked against the checkpoint's fingerprint), or export the adapter with --adapter."
        )
    if meta.model_config is None:
        raise CheckpointError(
            f"{checkpoint} records no model config (its network has no `config` with Hugging Face names), so the"
            " Hugging Face config.json cannot be written."
        )
    config = ModelConfig.from_dict(meta.model_config)
    if deploy_sizes and exported_as_held(meta.model_config):
        raise ValueError(
            f"deploy shards follow Llama's split table, not {meta.model_config['model_type']}'s: export without"
            " --deploy-tp and let the serving engine split the merged folder (vLLM: --tensor-parallel-size N"
            " --enable-expert-parallel; `tp3d plan MODEL --serve` sizes it).")
    for size in deploy_sizes:
        check_deploy_tp(config, size)
    prefix = meta.network_prefix
    shapes = {name.removeprefix(prefix): tuple(shape) for name, (shape, _) in reader.shapes.items()
              if name.startswith(prefix)}
    with ExitStack() as stack:
        frozen = (stack.enter_context(open_frozen_base(base, meta, set(shapes)))
                  if meta.frozen_weights is not None else None)

        def read(names: list[str]) -> dict[str, torch.Tensor]:
            tensors = {name: frozen.load(name) for name in names if frozen is not None and name in frozen.sources}
            held = [prefix + name for name in names if name not in tensors]
            return tensors | {name.removeprefix(prefix): tensor for name, tensor in reader.load(held).items()}

        result = _write_merged(output, meta, shapes | (frozen.shapes if frozen is not None else {}), read, checkpoint,
                               config, dtype, max_shard_size)
    deploys = tuple(write_deploy_shards(output, size, max_shard_size=max_shard_size, overwrite=overwrite)
                    for size in deploy_sizes)
    return ExportResult(result.folder, result.files, result.total_bytes, deploys)


def _write_merged(output: Path, meta: CheckpointMeta, shapes: dict[str, tuple[int, ...]],
                  read: Callable[[list[str]], dict[str, torch.Tensor]], checkpoint: Path, config: ModelConfig,
                  dtype: str, max_shard_size: str | int) -> ExportResult:
    """The Hugging Face folder of the model whose tensors `read` gives (`shapes`: the checkpoint's names)."""
    # a PEFT LoRA model: its factors merged into the weights they adapt
    merge = LoraMerge(meta.lora, shapes) if meta.lora is not None else None
    if merge is not None:
        shapes = merge.shapes

    def load(name: str) -> torch.Tensor:
        return merge.load(name, read) if merge is not None else read([name])[name]

    required = [] if exported_as_held(meta.model_config) else hf_tensor_names(config)
    missing = [name for name in required if name not in shapes]
    if missing:
        raise CheckpointError(
            f"{checkpoint} lacks {len(missing)} tensor(s) of a Llama model with its config, e.g. {missing[0]!r};"
            " it was not saved from a network with Hugging Face Llama names."
        )
    extra = shapes.keys() - set(required)  # e.g. Qwen2's q/k/v biases
    entries = [(name, shapes[name]) for name in required + [name for name in shapes if name in extra]]
    if exported_as_held(meta.model_config):  # a mixture of experts: the Hub's per-expert names, as vLLM reads
        hub = HubNames.for_config(meta.model_config, entries)
        entries, load = hub.entries, functools.partial(hub.load, load_held=load)
    return _write_hf_folder(output, hf_config_for(meta.model_config, EXPORT_DTYPES[dtype]), entries, load,
                            EXPORT_DTYPES[dtype], parse_size(max_shard_size))


def _write_hf_folder(output: Path, config: dict[str, Any], entries: list[tuple[str, tuple[int, ...]]],
                     load: Callable[[str], torch.Tensor], dtype: torch.dtype, max_shard_bytes: int) -> ExportResult:
    partial = staging_folder(output, HF_EXPORT)
    files, total = write_safetensors(partial, entries, dtype, load, max_shard_bytes)
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    replace_folder(partial, output)
    return ExportResult(output, files, total)


def export_lora_adapter(checkpoint: str | Path, output: str | Path, dtype: str = "fp32", overwrite: bool = False,
                        verify: bool = True) -> ExportResult:
    """Write the LoRA adapter of a PEFT checkpoint (any layout) as the folder `PeftModel.from_pretrained(base,
    output)` and vLLM's LoRA loading read: `adapter_config.json` and `adapter_model.safetensors`
    (`io.lora`). `output` is handled as by `export_checkpoint`."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(EXPORT_DTYPES)}.")
    checkpoint, output = location(checkpoint), Path(output)
    check_output_folder(output, ADAPTER_EXPORT, overwrite)
    reader = ModelTensorReader(checkpoint, verify)
    if reader.meta.lora is None:
        raise CheckpointError(f"{checkpoint} holds no LoRA adapter (it was not saved from a PEFT LoRA model);"
                              " export the whole model without --adapter.")
    prefix = reader.meta.network_prefix
    shapes = {name.removeprefix(prefix): tuple(shape) for name, (shape, _) in reader.shapes.items()
              if name.startswith(prefix)}
    entries = adapter_entries(reader.meta.lora, shapes)

    def load(name: str) -> torch.Tensor:
        return reader.load([prefix + entries[name]])[prefix + entries[name]]

    partial = staging_folder(output, ADAPTER_EXPORT)
    files, total = write_safetensors(partial, [(name, shapes[source]) for name, source in entries.items()],
                                     EXPORT_DTYPES[dtype], load, max_bytes=2**62, stem="adapter_model")
    (partial / "adapter_config.json").write_text(json.dumps(adapter_config(reader.meta.lora), indent=2))
    replace_folder(partial, output)
    return ExportResult(output, files, total)
