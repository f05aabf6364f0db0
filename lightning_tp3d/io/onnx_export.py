"""Train -> deploy as an ONNX graph: the merged model of a checkpoint of any layout, for ONNX Runtime.

`export_onnx(checkpoint, output)` merges the checkpoint into a Hugging Face folder first
(`io.export.export_checkpoint`: any (tp, pp, dp), LoRA factors merged), loads that folder as a server
would (`transformers.AutoModelForCausalLM`: the reference decoder's export is a `LlamaForCausalLM`) and
exports the loaded network's forward with torch's own exporter (`torch.onnx.export(dynamo=True)`: `torch.export`, then
onnxscript's translation and graph optimisation). The folder holds:

* `model.onnx`: input `input_ids` (int64, [batch, sequence], both axes dynamic); outputs `logits`
  ([batch, sequence, vocab], the export's dtype) and `hidden_states.{i}`, decoder layer i's output, which
  the train-vs-deploy check compares layer by layer to name the first that departs
  (`diagnostics.engines`); a server reads `logits` and ignores the rest. Weights of 2 GiB or more go to
  the external-data file `model.onnx.data` beside it (protobuf caps a file at 2 GiB).
* `config.json`, the merged model's Hugging Face config, and `onnx_export.json` (`OnnxManifest`).

The merged Hugging Face folder is written inside the staging folder and removed once the graph is there;
the folder is moved under its name when complete, as every export of this package (`io.folders`).
A mixture of experts is refused: its experts' token routing is data dependent (top-k selection, then a
gather per expert), which `torch.export` cannot trace into one static graph.

Example usage::

    export_onnx("checkpoints/last.ckpt", "export/onnx")          # tp3d export ... --format onnx
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_tp3d.io.checkpoint_format import CheckpointError, read_meta
from lightning_tp3d.io.export import ExportResult, export_checkpoint
from lightning_tp3d.io.folders import check_output_folder, replace_folder, staging_folder
from lightning_tp3d.io.hf import EXPORT_DTYPES, EXPORTED_AS_HELD, exported_as_held
from lightning_tp3d.io.storage import location

__all__ = ["EXTERNAL_DATA_BYTES", "MissingExtraError", "ONNX_EXPORT", "ONNX_FILE", "ONNX_MANIFEST",
           "OnnxManifest", "export_onnx",
           "layer_output_name", "onnx_from_hf_folder", "require_onnx", "uses_external_data"]

ONNX_EXPORT = "onnx-export"  # the kind of folder this module writes (see `io.folders`)
ONNX_FILE = "model.onnx"
ONNX_MANIFEST = "onnx_export.json"
EXTERNAL_DATA_BYTES = 2 * 1024**3  # protobuf's limit on one file
_EXAMPLE_SHAPE = (2, 8)  # traced with sizes above 1, so that neither axis is specialised to a constant


def layer_output_name(index: int) -> str:
    return f"hidden_states.{index}"


@dataclass(frozen=True)
class OnnxManifest:
    """What `onnx_export.json` records of an ONNX export."""

    dtype: str
    num_layers: int
    weight_bytes: int
    external_data: bool
    opset: int
    source: str  # the checkpoint (or Hugging Face folder) it was exported from

    @classmethod
    def read(cls, folder: Path) -> OnnxManifest:
        path = Path(folder) / ONNX_MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"{folder} is not an ONNX export of lightning_tp3d (no {ONNX_MANIFEST});"
                                    " write one with `tp3d export CHECKPOINT OUTPUT --format onnx`.")
        return cls(**json.loads(path.read_text()))


class MissingExtraError(ImportError):
    """An optional dependency of the feature asked for is not installed (the message names the extra)."""


def require_onnx() -> None:
    """Refuse, in one line, when the `[onnx]` extra is not installed."""
    missing = [name for name in ("onnx", "onnxscript", "onnxruntime", "transformers") if not _importable(name)]
    if missing:
        raise MissingExtraError(f"ONNX export and checks need {', '.join(missing)}:"
                                " pip install 'lightning-tp3d[onnx]'.")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def uses_external_data(weight_bytes: int) -> bool:
    """Whether the weights go to `model.onnx.data` rather than into `model.onnx` (at 2 GiB and above)."""
    return weight_bytes >= EXTERNAL_DATA_BYTES


def export_onnx(checkpoint: str | Path, output: str | Path, dtype: str = "fp32", overwrite: bool = False,
                verify: bool = True, base: str | Path | None = None, opset: int | None = None) -> ExportResult:
    """Merge a checkpoint of any layout and write it as an ONNX folder (see the module docstring).

    `output`, `overwrite`, `verify` and `base` as `export_checkpoint`'s; `dtype` the graph's weights and
    computation ("fp32", "bf16", "fp16"); `opset` the ONNX opset (torch's default when None)."""
    require_onnx()
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(EXPORT_DTYPES)}.")
    checkpoint, output = location(checkpoint), Path(output)
    saved = read_meta(checkpoint).model_config or {}
    if exported_as_held(saved):
        raise CheckpointError(
            f"{checkpoint} is a mixture of experts ({saved['model_type']}; one of {list(EXPORTED_AS_HELD)}), which"
            " the ONNX export refuses: its token routing is data dependent and torch.export cannot trace it into"
            " one graph. Export the Hugging Face folder (`tp3d export` without --format onnx) and serve it with vLLM.")
    check_output_folder(output, ONNX_EXPORT, overwrite)
    staged = staging_folder(output, ONNX_EXPORT)
    merged = staged / "merged-hf"
    export_checkpoint(checkpoint, merged, dtype=dtype, verify=verify, base=base)
    onnx_from_hf_folder(merged, staged, dtype, opset, source=str(checkpoint))
    shutil.rmtree(merged)
    replace_folder(staged, output)
    return _result(output)


def _result(folder: Path) -> ExportResult:
    files = tuple(sorted(path.name for path in folder.iterdir() if path.is_file() and not path.name.startswith(".")))
    return ExportResult(folder, files, sum((folder / name).stat().st_size for name in files))


def onnx_from_hf_folder(folder: str | Path, output: str | Path, dtype: str = "fp32", opset: int | None = None,
                        source: str | None = None) -> OnnxManifest:
    """Write `model.onnx` (with `model.onnx.data` where needed), `config.json` and `onnx_export.json` of the
    Hugging Face folder `folder` into the existing folder `output`."""
    from transformers import AutoModelForCausalLM

    folder, output = Path(folder), Path(output)
    model = AutoModelForCausalLM.from_pretrained(folder).to(EXPORT_DTYPES[dtype]).eval()
    layers = dict(enumerate(model.get_decoder().layers))
    graph = _LogitsAndLayerOutputs(model, list(layers.values())).eval()
    weight_bytes = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    external = uses_external_data(weight_bytes)
    example = torch.zeros(_EXAMPLE_SHAPE, dtype=torch.long)
    axes = {"input_ids": {0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")}}
    names = ["logits"] + [layer_output_name(index) for index in layers]
    with torch.no_grad():
        program = torch.onnx.export(graph, (example,), output / ONNX_FILE, dynamo=True, input_names=["input_ids"],
                                    output_names=names, dynamic_shapes=axes, external_data=external,
                                    opset_version=opset, verbose=False)
    shutil.copyfile(folder / "config.json", output / "config.json")
    manifest = OnnxManifest(dtype, len(layers), weight_bytes, external, _opset_of(program),
                            source if source is not None else str(folder))
    (output / ONNX_MANIFEST).write_text(json.dumps(asdict(manifest), indent=2))
    return manifest


def _opset_of(program: Any) -> int:
    return next(entry.version for entry in program.model_proto.opset_import if entry.domain in ("", "ai.onnx"))


class _LogitsAndLayerOutputs(nn.Module):
    """`model`'s logits for `input_ids`, then each of `layers`' outputs (taken by forward hooks while the
    exporter traces the call)."""

    def __init__(self, model: nn.Module, layers: list[nn.Module]) -> None:
        super().__init__()
        self.model = model
        self.layers = layers  # a plain list: the layers are the model's, not registered twice

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs: list[torch.Tensor] = []
        handles = [layer.register_forward_hook(_append_to(outputs)) for layer in self.layers]
        try:
            logits = self.model(input_ids=input_ids, use_cache=False).logits
        finally:
            for handle in handles:
                handle.remove()
        return (logits, *outputs)


def _append_to(outputs: list[torch.Tensor]) -> Callable[..., None]:
    def hook(_: nn.Module, __: Any, output: Any) -> None:
        outputs.append(output[0] if isinstance(output, tuple) else output)
    return hook
