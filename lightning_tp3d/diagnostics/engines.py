"""The serving engines the train-vs-deploy check runs an export in: ONNX Runtime and vLLM.

* `onnxruntime_outputs(folder, prompts)`: an ONNX export (`io.onnx_export`) in an ONNX Runtime session
  (the CPU provider; CUDA's first where onnxruntime-gpu has it), its `logits` and `hidden_states.{i}`
  outputs per prompt in float32: the `ModelOutputs` that `consistency.run_with_layer_outputs` gives for
  a torch model, so `consistency.compare_outputs` judges both alike and names the first layer that departs.
* `vllm_prompt_logprobs(folder, prompts, tensor_parallel_size)`: a merged Hugging Face folder served by
  vLLM offline (`LLM(model=folder, tensor_parallel_size=k)`); per prompt row and position after the
  first, the log-probabilities vLLM gives the `top_k` likeliest next tokens and the prompt's own token
  (`prompt_logprobs`). `compare_prompt_logprobs` compares them with the training model's log-softmax,
  the same bands on the largest absolute difference (log-probabilities are the logits less their
  log-sum-exp, so a logit shift common to a row, which serving does not see, is not counted). vLLM
  needs CUDA: without it, or without vLLM, the check is refused in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from lightning_tp3d.diagnostics.consistency import FAIL_ABOVE, WARN_ABOVE, ConsistencyReport, ModelOutputs

__all__ = ["EngineUnavailableError", "PromptLogprobs", "compare_prompt_logprobs", "onnxruntime_outputs",
           "onnxruntime_providers", "require_vllm", "vllm_prompt_logprobs"]

class EngineUnavailableError(RuntimeError):
    """The engine asked for cannot run here (not installed, no CUDA device, no kernels for the dtype)."""


# per prompt row: per position, None (the first) or {token id: log-probability}
PromptLogprobs = list[list[dict[int, float] | None]]


def onnxruntime_providers(folder: str | Path) -> list[str]:
    """The ONNX Runtime providers that can run the ONNX export `folder` here (CUDA's first, where
    onnxruntime-gpu has it), or a refusal in one line: no [onnx] extra, no such export, a bf16 graph on the CPU."""
    from lightning_tp3d.io.onnx_export import OnnxManifest, require_onnx

    require_onnx()
    import onnxruntime

    manifest = OnnxManifest.read(Path(folder))
    available = onnxruntime.get_available_providers()
    providers = [name for name in ("CUDAExecutionProvider", "CPUExecutionProvider") if name in available]
    if manifest.dtype == "bf16" and "CUDAExecutionProvider" not in providers:
        raise EngineUnavailableError(
            f"{folder} is a bf16 graph and ONNX Runtime's CPU provider has no bf16 kernels: export with --dtype"
            " fp16 or fp32 to check on the CPU, or run the check where onnxruntime-gpu and a GPU are.")
    return providers


def onnxruntime_outputs(folder: str | Path, prompts: Sequence[torch.Tensor]) -> ModelOutputs:
    """The logits and decoder layer outputs an ONNX export gives in ONNX Runtime, float32, per prompt."""
    import onnxruntime

    from lightning_tp3d.io.onnx_export import ONNX_FILE, OnnxManifest, layer_output_name

    folder = Path(folder)
    providers = onnxruntime_providers(folder)
    session = onnxruntime.InferenceSession(str(folder / ONNX_FILE), providers=providers)
    names = ["logits"] + [layer_output_name(index) for index in range(OnnxManifest.read(folder).num_layers)]
    logits, layers = [], []
    for prompt in prompts:
        values = session.run(names, {"input_ids": prompt.cpu().numpy()})
        tensors = [torch.from_numpy(value).float() for value in values]
        logits.append(tensors[0])
        layers.append(dict(enumerate(tensors[1:])))
    return logits, layers


def require_vllm() -> None:
    """Refuse, in one line, where vLLM cannot run: not installed, or no CUDA device."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise EngineUnavailableError("--engine vllm needs vLLM on a CUDA machine: pip install vllm (or check"
                                     " with --engine onnxruntime / transformers on this one).")
    if not torch.cuda.is_available():
        raise EngineUnavailableError("--engine vllm needs a CUDA device and this machine has none; run the check"
                                     " where the model will serve, or use --engine onnxruntime / transformers here.")


def vllm_prompt_logprobs(folder: str | Path, prompts: Sequence[torch.Tensor], tensor_parallel_size: int = 1,
                         top_k: int = 20, dtype: str = "auto") -> PromptLogprobs:
    """vLLM's prompt log-probabilities of every prompt row (see the module docstring)."""
    require_vllm()
    from vllm import LLM, SamplingParams

    engine = LLM(model=str(folder), tensor_parallel_size=tensor_parallel_size, dtype=dtype, max_logprobs=top_k,
                 enforce_eager=True)
    rows = [row.tolist() for prompt in prompts for row in prompt]
    results = engine.generate([{"prompt_token_ids": row} for row in rows],
                              SamplingParams(max_tokens=1, prompt_logprobs=top_k), use_tqdm=False)
    return [[None if position is None else {token: entry.logprob for token, entry in position.items()}
             for position in result.prompt_logprobs] for result in results]


def compare_prompt_logprobs(reference_logits: Sequence[torch.Tensor], engine: PromptLogprobs,
                            tolerance: float = FAIL_ABOVE, warn_above: float = WARN_ABOVE) -> ConsistencyReport:
    """The training model's logits (one [batch, length, vocab] tensor per prompt, rows in the order the
    engine's results follow) against an engine's prompt log-probabilities: the largest absolute difference
    over every token the engine reports, and the largest mean KL over its reported tokens' mass."""
    rows = [row for logits in reference_logits for row in F.log_softmax(logits.double(), dim=-1)]
    if len(rows) != len(engine):
        raise ValueError(f"the engine returned {len(engine)} prompt rows for {len(rows)} asked.")
    max_diff, kl = 0.0, 0.0
    for reference, positions in zip(rows, engine):
        if len(positions) != reference.shape[0]:
            raise ValueError(f"the engine returned {len(positions)} positions for a prompt of {reference.shape[0]}.")
        row_kl = []
        for position, reported in enumerate(positions):
            if reported is None:
                continue
            tokens = torch.tensor(list(reported), dtype=torch.long)
            served = torch.tensor(list(reported.values()), dtype=torch.float64)
            trained = reference[position - 1, tokens]  # the next-token distribution after the position before
            max_diff = max(max_diff, (served - trained).abs().max().item())
            row_kl.append((trained.exp() * (trained - served)).sum().item())
        kl = max(kl, sum(row_kl) / max(1, len(row_kl)))
    report = ConsistencyReport(max_diff, kl, tolerance, warn_above=warn_above)
    if report.verdict != "PASS":
        report.first_bad_layer = "unknown (vLLM gives no layer outputs: compare the export with --engine onnxruntime)"
    return report
