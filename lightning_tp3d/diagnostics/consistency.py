"""Train-vs-deploy consistency: the same fixed prompts through two models, logits and layers compared.

The usual export bugs (a split along the wrong dim, an embedding or head duplicated or lost when pipeline
stages are merged, norms split that should be copied) change the logits by far more than rounding; the
check reports the largest absolute logit difference and the KL divergence of the next-token
distributions, and when the difference leaves the PASS band it compares the output of every decoder
layer and names the first one over it (or the final norm / head when every layer agrees).

Bands on the max absolute logit difference, the design documents' rule: PASS <= 1e-3 < WARN <= 1e-2 < FAIL
(both bounds overridable). A precision change is told apart from a mismatch: the export is compared with
the trained weights rounded to the export's dtype, both computed in fp32 (`rounded_to`), so a faithful
bf16 export passes with a difference of rounding order; the difference against the unrounded weights,
what the dtype alone changes, is reported beside it. `exact_fp32_matmuls` turns TF32 off while a GPU
model runs (TF32 alone moves logits by ~1e-3).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_tp3d.io.checkpoint_format import CheckpointError, ModelTensorReader
from lightning_tp3d.io.hf import load_hf_weights
from lightning_tp3d.io.lora import adapter_config
from lightning_tp3d.models.families import resolve_model_adapter
from lightning_tp3d.models.llama import LlamaForCausalLM
from lightning_tp3d.parallel.attributes import indexed_blocks, resolve_attribute
from lightning_tp3d.plan.config import ModelConfig

__all__ = [
    "DEFAULT_PROMPT_LENGTHS",
    "FAIL_ABOVE",
    "WARN_ABOVE",
    "ConsistencyReport",
    "ModelOutputs",
    "compare_models",
    "compare_outputs",
    "decoder_layers",
    "default_tolerance",
    "exact_fp32_matmuls",
    "fixed_prompts",
    "model_from_checkpoint",
    "model_from_hf_folder",
    "rounded_to",
    "run_with_layer_outputs",
]

WARN_ABOVE = 1e-3  # max |logit diff| at or below: PASS
FAIL_ABOVE = 1e-2  # above: FAIL; between the two: WARN


def default_tolerance(dtype: str, device_type: str = "cpu") -> float:
    """Deprecated (0.1): the checks use bands now; returns the FAIL bound, `FAIL_ABOVE`."""
    warnings.warn("default_tolerance is deprecated: the consistency checks use the bands WARN_ABOVE / FAIL_ABOVE.",
                  DeprecationWarning, stacklevel=2)
    return FAIL_ABOVE


@contextmanager
def rounded_to(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Inside the block every floating parameter of `model` holds its value rounded to `dtype` (and stored
    back in its own dtype): the weights an export in `dtype` carries, computed as before."""
    originals = []
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.is_floating_point() and parameter.dtype != dtype:
                originals.append((parameter, parameter.detach().clone()))
                parameter.copy_(parameter.to(dtype).to(parameter.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for parameter, original in originals:
                parameter.copy_(original)


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
    """`tolerance` is the FAIL bound and `warn_above` the PASS one; `precision_max_abs_diff` the difference
    against the unrounded trained weights when the export is in a lower precision."""

    max_abs_diff: float
    kl: float  # largest mean KL(reference || candidate) of the next-token distributions over the prompts
    tolerance: float = FAIL_ABOVE
    layer_max_abs_diff: dict[str, float] = field(default_factory=dict)
    first_bad_layer: str | None = None
    warn_above: float = WARN_ABOVE
    precision_max_abs_diff: float | None = None

    @property
    def verdict(self) -> str:
        return self.band(self.max_abs_diff)

    def band(self, max_abs_diff: float) -> str:
        """PASS at or below `warn_above`, WARN up to `tolerance`, FAIL above."""
        if max_abs_diff <= min(self.warn_above, self.tolerance):
            return "PASS"
        return "WARN" if max_abs_diff <= self.tolerance else "FAIL"

    def layer_table(self) -> str:
        """Each decoder layer's output: its max |diff| and band, in order (the first one out of PASS is where
        to look)."""
        lines = [f"{'layer':<24} {'max |diff|':>10}  band"]
        lines += [f"{name:<24} {value:>10.3e}  {self.band(value)}" for name, value in self.layer_max_abs_diff.items()]
        return "\n".join(lines)

    @property
    def passed(self) -> bool:
        """Not FAIL (a WARN passes, with its warning)."""
        return self.verdict != "FAIL"

    def summary(self) -> str:
        text = (f"consistency {self.verdict}: max |logit diff| {self.max_abs_diff:.3e} (PASS <= {self.warn_above:.0e}"
                f" < WARN <= {self.tolerance:.0e} < FAIL), KL {self.kl:.3e}")
        if self.first_bad_layer is not None:
            text += f"; first layer over the PASS band: {self.first_bad_layer}"
        if self.precision_max_abs_diff is not None:
            text += f"; against the unrounded trained weights {self.precision_max_abs_diff:.3e} (the dtype alone)"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "passed": self.passed, "max_abs_diff": self.max_abs_diff, "kl": self.kl,
                "warn_above": self.warn_above, "tolerance": self.tolerance, "first_bad_layer": self.first_bad_layer,
                "layer_max_abs_diff": self.layer_max_abs_diff, "precision_max_abs_diff": self.precision_max_abs_diff}


def fixed_prompts(vocab_size: int, lengths: Sequence[int] = DEFAULT_PROMPT_LENGTHS,
                  seed: int = 1234, batch_size: int = 1) -> list[torch.Tensor]:
    """Token-id prompts of the given lengths, shape [batch_size, length], the same on every call and rank."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (batch_size, length), generator=generator) for length in lengths]


def decoder_layers(model: nn.Module) -> dict[int, nn.Module]:
    """The blocks by index, where the model's family keeps them (`models.families`)."""
    layers_attribute = resolve_model_adapter(model).layers_attribute
    return indexed_blocks(resolve_attribute(model, layers_attribute, "layers_attribute"))


@torch.no_grad()
def run_with_layer_outputs(model: nn.Module | Callable[[torch.Tensor], Any], prompts: Sequence[torch.Tensor],
                           layers: dict[int, nn.Module] | None = None) -> ModelOutputs:
    """Logits and each decoder layer's output (float32, CPU) for every prompt."""
    layers = decoder_layers(model) if layers is None else layers
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


def compare_outputs(reference: ModelOutputs, candidate: ModelOutputs, tolerance: float = FAIL_ABOVE,
                    warn_above: float = WARN_ABOVE) -> ConsistencyReport:
    """Compare two models' `run_with_layer_outputs` results on the same prompts (bands: see the module)."""
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
                               {f"model.layers.{index}": value for index, value in sorted(layer_diff.items())},
                               warn_above=warn_above)
    if report.verdict != "PASS":
        bound = min(warn_above, tolerance)
        over = [index for index, value in sorted(layer_diff.items()) if value > bound]
        report.first_bad_layer = f"model.layers.{over[0]}" if over else "model.norm / lm_head"
    return report


def compare_models(reference: nn.Module, candidate: nn.Module, prompts: Sequence[torch.Tensor],
                   tolerance: float = FAIL_ABOVE, warn_above: float = WARN_ABOVE) -> ConsistencyReport:
    return compare_outputs(run_with_layer_outputs(reference, prompts), run_with_layer_outputs(candidate, prompts),
                           tolerance, warn_above)


def model_from_checkpoint(checkpoint: str | Path, verify: bool = True) -> nn.Module:
    """The trained network with a checkpoint's whole weights (any layout), in this process: the
    `transformers` model of its recorded Hugging Face config, or the reference decoder, wrapped by PEFT
    with the recorded LoRA adapter when it was a LoRA model (unmerged: the factors apart, as trained), the
    files read checked against their recorded hashes unless `verify=False`."""
    reader = ModelTensorReader(checkpoint, verify)
    if reader.meta.frozen_weights is not None:
        raise CheckpointError(f"{checkpoint} holds only what trained (save_frozen_weights=False), not the whole"
                              " model; check an export of a full checkpoint.")
    saved = reader.meta.model_config or {}
    if "model_type" in saved:
        from transformers import AutoConfig, AutoModelForCausalLM

        fields = {key: value for key, value in saved.items() if key != "model_type"}
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(saved["model_type"], **fields))
    else:
        model = LlamaForCausalLM(ModelConfig.from_dict(saved))
    if reader.meta.lora is not None:
        import peft

        model = peft.get_peft_model(model, peft.PeftConfig.from_peft_type(**adapter_config(reader.meta.lora)))
    prefix = reader.meta.network_prefix
    names = [prefix + name for name in model.state_dict()]
    state = {name.removeprefix(prefix): tensor for name, tensor in reader.load(names).items()}
    model.load_state_dict(state)
    return model.eval()


def model_from_hf_folder(folder: str | Path, use_transformers: bool = True) -> nn.Module:
    """A Hugging Face folder loaded by transformers when it is installed (what a server would run), or
    into the reference decoder otherwise; computed in fp32 (its weights keep the values of their dtype)."""
    folder = Path(folder)
    if use_transformers:
        try:
            from transformers import AutoModelForCausalLM
        except ImportError:
            use_transformers = False
        else:
            return AutoModelForCausalLM.from_pretrained(folder).float().eval()
    model = LlamaForCausalLM(ModelConfig.from_json(folder / "config.json"))
    load_hf_weights(model, folder)
    return model.eval()
