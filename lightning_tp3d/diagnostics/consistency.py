"""Train-vs-deploy consistency: the same fixed prompts through two models, logits and layers compared.

The usual export bugs (a split along the wrong dim, an embedding or head duplicated or lost when pipeline
stages are merged, norms split that should be copied) change the logits by far more than rounding; the
check reports the largest absolute logit difference and the KL divergence of the next-token
distributions, and when the difference is over the tolerance it compares the output of every decoder
layer and names the first one over it (or the final norm / head when every layer agrees).

Default tolerances on the max absolute logit difference: fp32 1e-5, bf16 1e-2, fp16 1e-3 when both models
run on the CPU. A model on a GPU against the CPU reference differs by more than rounding order on one
device (cuBLAS's blocking, NCCL's reduction order), so `default_tolerance` raises the fp32 bound to 1e-4
there, and `exact_fp32_matmuls` turns TF32 off while the GPU side runs (TF32 alone moves logits by ~1e-3).
The GPU figure is a bound from fp32 arithmetic, not yet a measured one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_tp3d.io.checkpoint_format import ModelTensorReader
from lightning_tp3d.io.hf import load_hf_weights
from lightning_tp3d.models.llama import LlamaForCausalLM
from lightning_tp3d.plan.config import ModelConfig

__all__ = [
    "DEFAULT_PROMPT_LENGTHS",
    "TOLERANCES",
    "ConsistencyReport",
    "compare_models",
    "compare_outputs",
    "default_tolerance",
    "exact_fp32_matmuls",
    "fixed_prompts",
    "model_from_checkpoint",
    "model_from_hf_folder",
    "run_with_layer_outputs",
]

TOLERANCES = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 1e-3}
_FP32_ACROSS_DEVICES = 1e-4


def default_tolerance(dtype: str, device_type: str = "cpu") -> float:
    """The max |logit diff| allowed for an export in `dtype` against a model run on `device_type`."""
    if dtype == "fp32" and device_type != "cpu":
        return _FP32_ACROSS_DEVICES
    return TOLERANCES[dtype]


@contextmanager
def exact_fp32_matmuls() -> Iterator[None]:
    """fp32 matmuls and convolutions in full fp32 (no TF32) inside the block."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
DEFAULT_PROMPT_LENGTHS = (1, 7, 32)
ModelOutputs = tuple[list[torch.Tensor], list[dict[int, torch.Tensor]]]  # logits and layer outputs per prompt


@dataclass
class ConsistencyReport:
    max_abs_diff: float
    kl: float  # largest mean KL(reference || candidate) of the next-token distributions over the prompts
    tolerance: float
    layer_max_abs_diff: dict[str, float] = field(default_factory=dict)
    first_bad_layer: str | None = None

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance

    def summary(self) -> str:
        verdict = "OK" if self.passed else "FAILED"
        text = (f"consistency {verdict}: max |logit diff| {self.max_abs_diff:.3e} (tolerance {self.tolerance:.0e}),"
                f" KL {self.kl:.3e}")
        if self.first_bad_layer is not None:
            text += f"; first layer over tolerance: {self.first_bad_layer}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "max_abs_diff": self.max_abs_diff, "kl": self.kl, "tolerance": self.tolerance,
                "first_bad_layer": self.first_bad_layer, "layer_max_abs_diff": self.layer_max_abs_diff}


def fixed_prompts(vocab_size: int, lengths: Sequence[int] = DEFAULT_PROMPT_LENGTHS,
                  seed: int = 1234) -> list[torch.Tensor]:
    """Token-id prompts of the given lengths, shape [1, length], the same on every call and rank."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (1, length), generator=generator) for length in lengths]


def _decoder_layers(model: nn.Module) -> dict[int, nn.Module]:
    layers = model.model.layers  # the Hugging Face layout, also this package's reference decoder
    if isinstance(layers, nn.ModuleDict):
        return {int(key): layer for key, layer in layers.items()}
    return dict(enumerate(layers))


@torch.no_grad()
def run_with_layer_outputs(model: nn.Module | Callable[[torch.Tensor], Any], prompts: Sequence[torch.Tensor],
                           layers: dict[int, nn.Module] | None = None) -> ModelOutputs:
    """Logits and each decoder layer's output (float32, CPU) for every prompt."""
    layers = _decoder_layers(model) if layers is None else layers
    captured: dict[int, torch.Tensor] = {}

    def keep(index: int) -> Callable[..., None]:
        def hook(_: nn.Module, __: Any, output: Any) -> None:
            captured[index] = (output[0] if isinstance(output, tuple) else output).detach().float().cpu()
        return hook

    handles = [layer.register_forward_hook(keep(index)) for index, layer in layers.items()]
    logits, layer_outputs = [], []
    try:
        for prompt in prompts:
            captured.clear()
            output = model(prompt)
            logits.append((output.logits if hasattr(output, "logits") else output).detach().float().cpu())
            layer_outputs.append(dict(captured))
    finally:
        for handle in handles:
            handle.remove()
    return logits, layer_outputs


def compare_outputs(reference: ModelOutputs, candidate: ModelOutputs, tolerance: float) -> ConsistencyReport:
    """Compare two models' `run_with_layer_outputs` results on the same prompts."""
    max_diff, kl = 0.0, 0.0
    for reference_logits, candidate_logits in zip(reference[0], candidate[0]):
        max_diff = max(max_diff, (reference_logits - candidate_logits).abs().max().item())
        kl = max(kl, F.kl_div(F.log_softmax(candidate_logits, -1), F.log_softmax(reference_logits, -1),
                              log_target=True, reduction="none").sum(-1).mean().item())
    layer_diff: dict[int, float] = {}
    for reference_layers, candidate_layers in zip(reference[1], candidate[1]):
        for index in reference_layers.keys() & candidate_layers.keys():
            difference = (reference_layers[index] - candidate_layers[index]).abs().max().item()
            layer_diff[index] = max(layer_diff.get(index, 0.0), difference)
    report = ConsistencyReport(max_diff, kl, tolerance,
                               {f"model.layers.{index}": value for index, value in sorted(layer_diff.items())})
    if not report.passed:
        over = [index for index, value in sorted(layer_diff.items()) if value > tolerance]
        report.first_bad_layer = f"model.layers.{over[0]}" if over else "model.norm / lm_head"
    return report


def compare_models(reference: nn.Module, candidate: nn.Module, prompts: Sequence[torch.Tensor],
                   tolerance: float) -> ConsistencyReport:
    return compare_outputs(run_with_layer_outputs(reference, prompts), run_with_layer_outputs(candidate, prompts),
                           tolerance)


def model_from_checkpoint(checkpoint: str | Path) -> nn.Module:
    """The trained network with a checkpoint's whole weights (any layout), in this process: the
    `transformers` model of its recorded Hugging Face config, or the reference decoder."""
    reader = ModelTensorReader(checkpoint)
    saved = reader.meta.model_config or {}
    if "model_type" in saved:
        from transformers import AutoConfig, AutoModelForCausalLM

        fields = {key: value for key, value in saved.items() if key != "model_type"}
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(saved["model_type"], **fields))
    else:
        model = LlamaForCausalLM(ModelConfig.from_dict(saved))
    prefix = reader.meta.network_prefix
    names = [prefix + name for name in model.state_dict()]
    state = {name.removeprefix(prefix): tensor for name, tensor in reader.load(names).items()}
    model.load_state_dict(state)
    return model.eval()


def model_from_hf_folder(folder: str | Path, use_transformers: bool = True) -> nn.Module:
    """A Hugging Face folder loaded by transformers when it is installed (what a server would run), or
    into the reference decoder otherwise."""
    folder = Path(folder)
    if use_transformers:
        try:
            from transformers import AutoModelForCausalLM
        except ImportError:
            use_transformers = False
        else:
            return AutoModelForCausalLM.from_pretrained(folder).eval()
    model = LlamaForCausalLM(ModelConfig.from_json(folder / "config.json"))
    load_hf_weights(model, folder)
    return model.eval()
