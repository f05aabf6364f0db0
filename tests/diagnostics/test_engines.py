"""The serving engines of the train-vs-deploy check, where no GPU is: vLLM's comparison and its refusals.

ONNX Runtime runs in `tests/io/test_onnx_export.py`. vLLM needs CUDA: here its prompt log-probabilities are
built from a model's own log-softmax (what a faithful server returns), so the comparison must give 0 and
PASS, and a moved entry must be found and banded; without vLLM or CUDA the check is refused in one line.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F

from lightning_tp3d.cli import main as tp3d
from lightning_tp3d.diagnostics import engines
from lightning_tp3d.diagnostics.engines import EngineUnavailableError, compare_prompt_logprobs, require_vllm


def _served(logits: list[torch.Tensor], top_k: int = 5) -> engines.PromptLogprobs:
    """What vLLM's `prompt_logprobs=top_k` gives for these logits: per row, None for the first position,
    then the top-k next-token log-probabilities after the position before."""
    rows = []
    for prompt_logits in logits:
        for row in F.log_softmax(prompt_logits.double(), dim=-1):
            positions: list[dict[int, float] | None] = [None]
            for previous in row[:-1]:
                values, tokens = previous.topk(top_k)
                positions.append(dict(zip(tokens.tolist(), values.tolist())))
            rows.append(positions)
    return rows


def test_a_faithful_server_compares_equal_and_a_moved_log_probability_is_banded():
    torch.manual_seed(0)
    logits = [torch.randn(2, length, 32) for length in (3, 6)]
    report = compare_prompt_logprobs(logits, _served(logits))
    assert report.verdict == "PASS" and report.max_abs_diff < 1e-12 and abs(report.kl) < 1e-12
    shifted = [prompt.double() + 3.0 for prompt in logits]  # a logit shift common to a row is not served: not counted
    assert compare_prompt_logprobs(shifted, _served(logits)).max_abs_diff < 1e-12
    for moved, verdict in ((5e-3, "WARN"), (5e-2, "FAIL")):
        served = _served(logits)
        token = next(iter(served[3][4]))
        served[3][4][token] += moved
        report = compare_prompt_logprobs(logits, served)
        assert report.verdict == verdict and report.max_abs_diff == pytest.approx(moved, rel=1e-9)
    assert "--engine onnxruntime" in report.first_bad_layer  # vLLM has no layer outputs: where to look instead


def test_rows_or_positions_the_engine_did_not_return_are_refused():
    logits = [torch.zeros(2, 4, 8)]
    with pytest.raises(ValueError, match="returned 1 prompt rows for 2 asked"):
        compare_prompt_logprobs(logits, _served(logits)[:1])
    with pytest.raises(ValueError, match="returned 3 positions for a prompt of 4"):
        compare_prompt_logprobs(logits, [row[:3] for row in _served(logits)])


def test_vllm_is_refused_without_vllm_or_without_cuda(monkeypatch, tmp_path, capsys):
    has_vllm = importlib.util.find_spec("vllm") is not None
    if not has_vllm:
        with pytest.raises(EngineUnavailableError, match="needs vLLM on a CUDA machine: pip install vllm"):
            require_vllm()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EngineUnavailableError, match="needs a CUDA device and this machine has none"):
        require_vllm()
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 256}))
    assert tp3d(["check", str(tmp_path), "--checkpoint", str(tmp_path / "none.ckpt"), "--engine", "vllm"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("tp3d check: error: --engine vllm needs a CUDA device") and "\n" not in error
