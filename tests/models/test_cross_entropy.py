"""The chunked token cross entropy (`models.cross_entropy`): the plain loss's numbers, less memory.

* Values and gradients equal `F.cross_entropy(logits.float(), ...)` with ignored labels, for chunks of one
  row, of a number of rows that does not divide the tokens, and of all rows. fp32: rtol 1e-6 on the loss
  and on each gradient's norm-wise difference (the same float32 arithmetic per row; only the order of the
  row sum differs, ~N x 6e-8 at worst for N = 52 rows, 3e-6 worst case, 1e-7 typical); a wrong
  normalisation (sum instead of mean, ignored rows counted) moves the loss by 10% or more. bf16 logits: the
  gradient is the plain loss's float32 gradient rounded to bf16 once, so every entry within half a bf16
  unit of it (2^-9 relative) plus the float32 difference.
* Memory (MemTracker, forward and backward of N = 512 tokens over V = 4096, the logits included): with
  chunks of 64 rows at most the logits, their gradient and 2 (fp32) or 3 (bf16) float32 chunks plus 1%,
  and at most 0.6x (fp32: (8 + 1) / 16 bytes per logit) / 0.45x (bf16: (4 + 1.5) / 14) of the plain loss's
  peak, which holds three float32 copies beside the logits; with the default chunk (here all rows) at
  most `plan.loss.loss_activation_bytes` plus 1%.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from lightning_tp3d.models.cross_entropy import chunked_cross_entropy
from lightning_tp3d.parallel.vocab_parallel import VocabParallelHead, loss_takes_sharded_logits, sharded_logits
from lightning_tp3d.plan.loss import loss_activation_bytes
from tests.distributed import run_distributed

IGNORE = -100
VOCAB = 300


def _logits_and_labels(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    logits = (torch.randn(4, 13, VOCAB) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (4, 13))
    labels[0, :5] = IGNORE
    return logits, labels


def _plain(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE)


@pytest.mark.parametrize("rows", [1, 5, 52, 1000])
def test_the_chunked_loss_and_its_gradient_are_the_plain_ones_in_fp32(rows):
    logits, labels = _logits_and_labels(torch.float32)
    expected = _plain(logits, labels)
    (expected_grad,) = torch.autograd.grad(expected * 2.5, logits)
    loss = chunked_cross_entropy(logits, labels, ignore_index=IGNORE, chunk_elements=rows * VOCAB)
    (grad,) = torch.autograd.grad(loss * 2.5, logits)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0.0)
    assert ((grad - expected_grad).norm() / expected_grad.norm()).item() <= 1e-6
    assert grad[0, :5].abs().max().item() == 0.0  # ignored labels get no gradient
    assert abs(loss.item() - _plain(logits, labels.masked_fill(labels == IGNORE, 0)).item()) > 1e-3 * loss.item()


def test_bf16_logits_get_the_plain_float32_gradient_rounded_once():
    logits, labels = _logits_and_labels(torch.bfloat16)
    expected = _plain(logits, labels)
    (expected_grad,) = torch.autograd.grad(expected, logits)  # float32, rounded to bf16 by the upcast's backward
    loss = chunked_cross_entropy(logits, labels, ignore_index=IGNORE, chunk_elements=7 * VOCAB)
    (grad,) = torch.autograd.grad(loss, logits)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(grad.float(), expected_grad.float(), rtol=2 ** -8, atol=1e-9)


def test_all_labels_ignored_gives_nan_as_the_plain_loss_and_a_bad_chunk_is_refused():
    logits, labels = _logits_and_labels(torch.float32)
    ignored = torch.full_like(labels, IGNORE)
    assert _plain(logits, ignored).isnan() and chunked_cross_entropy(logits, ignored).isnan()
    with pytest.raises(ValueError, match="chunk_elements=0 must be >= 1"):
        chunked_cross_entropy(logits, labels, chunk_elements=0)


def _peak_bytes(loss_of, dtype: torch.dtype, tokens: int, vocab: int, label_range: int | None = None) -> int:
    """Peak bytes of the loss's forward and backward, the logits included."""
    torch.manual_seed(0)
    labels = torch.randint(0, label_range or vocab, (tokens,))
    tracker = MemTracker()
    with tracker:
        logits = torch.randn(tokens, vocab, dtype=dtype).requires_grad_()
        loss_of(logits, labels).backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")][next(
        kind for kind in tracker.get_tracker_snapshot("peak")[torch.device("cpu")] if str(kind).endswith("Total"))]


@pytest.mark.parametrize(("dtype", "most_of_plain"), [(torch.float32, 0.6), (torch.bfloat16, 0.45)])
def test_the_chunked_loss_holds_no_whole_float32_copy(dtype, most_of_plain):
    tokens, vocab, rows = 512, 4096, 64
    element = torch.finfo(dtype).bits // 8
    chunked = _peak_bytes(lambda x, y: chunked_cross_entropy(x, y, chunk_elements=rows * vocab), dtype, tokens, vocab)
    plain = _peak_bytes(lambda x, y: F.cross_entropy(x.float(), y), dtype, tokens, vocab)
    formula = 2 * tokens * vocab * element + (2 if element == 4 else 3) * rows * vocab * 4
    assert chunked <= 1.01 * formula, (chunked, formula)
    whole_chunk = _peak_bytes(chunked_cross_entropy, dtype, tokens, vocab)  # the default: one chunk here
    assert whole_chunk <= 1.01 * loss_activation_bytes(tokens, vocab, element), whole_chunk
    assert chunked <= most_of_plain * plain, (chunked, plain)
    assert plain >= tokens * vocab * (element + 3 * 4)  # the logits and three float32 copies


# Vocab parallel: logits split over 2 ranks (`parallel.vocab_parallel`), one world of 2 processes.
SPLIT = 2


def _vocab_parallel_world() -> dict[str, Any]:
    """On each of 2 ranks: the loss and gradients of logits split over the vocabulary against the whole
    logits' plain loss, the vocab-parallel head in and out of `sharded_logits()`, the loss path's peak,
    and transformers' causal-LM loss through the pipeline's stage loss."""
    torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (SPLIT,))
    rank, columns = mesh.get_local_rank(), slice(mesh.get_local_rank() * VOCAB // SPLIT,
                                                (mesh.get_local_rank() + 1) * VOCAB // SPLIT)
    result: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits, labels = _logits_and_labels(dtype)
        expected = _plain(logits, labels)
        (expected_grad,) = torch.autograd.grad(expected * 2.5, logits)
        local = logits.detach()[..., columns].clone().requires_grad_()
        loss = chunked_cross_entropy(DTensor.from_local(local, mesh, [Shard(-1)]), labels, ignore_index=IGNORE,
                                     chunk_elements=7 * VOCAB // SPLIT)
        (loss * 2.5).backward()
        result[str(dtype)] = dict(loss=loss.detach(), expected=expected.detach(), grad=local.grad,
                                  expected_grad=expected_grad[..., columns])
    result["head"] = _head_in_and_out_of_the_mode(mesh, columns)
    result["peak"] = _vocab_parallel_peak(mesh)
    result["huggingface"] = _huggingface_stage_loss(mesh, columns)
    result["rank"] = rank
    torch.distributed.destroy_process_group()
    return result


def _head_in_and_out_of_the_mode(mesh, columns: slice) -> dict[str, Any]:
    torch.manual_seed(1)
    reference = torch.nn.Linear(16, VOCAB, bias=False)
    head = parallelize_module(copy.deepcopy(reference), mesh, VocabParallelHead())
    hidden = torch.randn(4, 13, 16)
    _, labels = _logits_and_labels(torch.float32)
    whole = head(hidden)
    whole = whole.wait() if hasattr(whole, "wait") else whole
    expected_input = hidden.clone().requires_grad_()
    expected = _plain(reference(expected_input), labels)
    expected.backward()
    with sharded_logits():
        sharded = head(hidden_input := hidden.clone().requires_grad_())
    loss = chunked_cross_entropy(sharded, labels, ignore_index=IGNORE)
    loss.backward()
    return dict(whole=whole, whole_is_plain=type(whole) is torch.Tensor, expected_logits=reference(hidden).detach(),
                sharded_placements=str(sharded.placements), sharded_local_shape=tuple(sharded.to_local().shape),
                loss=loss.detach(), expected=expected.detach(), input_grad=hidden_input.grad,
                expected_input_grad=expected_input.grad, weight_grad=head.weight.grad.to_local(),
                expected_weight_grad=reference.weight.grad[columns])


def _vocab_parallel_peak(mesh) -> dict[str, int]:
    """Peak bytes of the loss's forward and backward over this rank's V / 2 columns (the logits included),
    and of the same loss over whole logits, as a gathered head gives them."""
    tokens, vocab = 512, 4096
    sharded = _peak_bytes(lambda x, y: chunked_cross_entropy(DTensor.from_local(x, mesh, [Shard(-1)]), y),
                          torch.float32, tokens, vocab // SPLIT, label_range=vocab)
    whole = _peak_bytes(chunked_cross_entropy, torch.float32, tokens, vocab)
    return dict(sharded=sharded, whole=whole, tokens=tokens, vocab=vocab)


def _huggingface_stage_loss(mesh, columns: slice) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_tp3d.models.huggingface import HuggingFaceStages

    network = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=2))
    loss_of = HuggingFaceStages().loss_function(network)
    logits, labels = _logits_and_labels(torch.float32)
    labels = labels.clamp(min=0)  # transformers' labels are the inputs; its loss shifts them
    expected = network.loss_function(logits=logits, labels=labels, vocab_size=VOCAB)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    local = logits.detach()[..., columns].clone().requires_grad_()
    loss = loss_of(DTensor.from_local(local, mesh, [Shard(-1)]), labels)
    loss.backward()
    return dict(marked=loss_takes_sharded_logits(loss_of), loss=loss.detach(), expected=expected.detach(),
                whole=loss_of(logits.detach(), labels), grad=local.grad, expected_grad=expected_grad[..., columns])


@pytest.fixture(scope="module")
def vocab_parallel() -> list[dict[str, Any]]:
    return run_distributed(SPLIT, "tests.models.test_cross_entropy:_vocab_parallel_world")


def _norm_wise(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.distributed
def test_logits_split_over_the_vocabulary_give_the_whole_logits_loss_and_gradient(vocab_parallel):
    """fp32: the loss within 1e-6 (the logsumexp of 2 partial float32 logsumexps rounds a few ulp of
    lse ~ 6, ~1e-7 relative) and each rank's gradient columns norm-wise within 5e-6 (softmax = exp(z - lse)
    inherits lse's absolute ~1e-6); a wrong column offset or a target counted on both ranks is off by
    O(1). bf16: the plain float32 gradient rounded to bf16 once (2^-8 relative)."""
    for result in vocab_parallel:
        fp32 = result[str(torch.float32)]
        torch.testing.assert_close(fp32["loss"], fp32["expected"], rtol=1e-6, atol=0.0)
        assert _norm_wise(fp32["grad"], fp32["expected_grad"]) <= 5e-6, result["rank"]
        bf16 = result[str(torch.bfloat16)]
        assert bf16["grad"].dtype == torch.bfloat16
        torch.testing.assert_close(bf16["loss"], bf16["expected"], rtol=1e-6, atol=0.0)
        torch.testing.assert_close(bf16["grad"].float(), bf16["expected_grad"].float(), rtol=2 ** -8, atol=1e-9)


@pytest.mark.distributed
def test_the_vocab_parallel_head_is_whole_outside_the_loss_and_split_inside(vocab_parallel):
    """Outside `sharded_logits()` every rank gets the whole logits as a plain tensor (what a user's own loss
    and `forward(input_ids)` see); inside, its V / 2 columns as a DTensor, and the loss through them gives
    the head's weight rows and the input gradient of one process (fp32: 1e-6 / 5e-6 as above; the input
    gradient adds the 2 ranks' partial sums, one more rounding)."""
    for result in vocab_parallel:
        head = result["head"]
        assert head["whole_is_plain"] and head["sharded_placements"] == "(Shard(dim=2),)"
        assert head["sharded_local_shape"] == (4, 13, VOCAB // SPLIT)
        torch.testing.assert_close(head["whole"], head["expected_logits"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(head["loss"], head["expected"], rtol=1e-6, atol=0.0)
        assert _norm_wise(head["weight_grad"], head["expected_weight_grad"]) <= 5e-6
        assert _norm_wise(head["input_grad"], head["expected_input_grad"]) <= 5e-6


@pytest.mark.distributed
def test_the_split_loss_holds_half_the_logits_path(vocab_parallel):
    """MemTracker, forward and backward of 512 tokens over V = 4096 split over 2 ranks: at most the ledger's
    loss path for V / 2 (`plan.loss.loss_activation_bytes`) plus the gathered statistics (3 x 2 N x 4 bytes
    for 2 ranks, the stacked copies) and 1%, and at most 0.55x the whole logits' loss path (the ratio is
    1 / 2 but for the statistics)."""
    for result in vocab_parallel:
        peak = result["peak"]
        tokens, vocab = peak["tokens"], peak["vocab"]
        assert peak["sharded"] <= 1.01 * loss_activation_bytes(tokens, vocab // SPLIT, 4) + 6 * 2 * tokens * 4, peak
        assert peak["sharded"] <= 0.55 * peak["whole"], peak


@pytest.mark.distributed
def test_transformers_causal_lm_loss_takes_split_logits_in_the_pipeline(vocab_parallel):
    """The pipeline's stage loss for a transformers model is marked as taking split logits and gives
    transformers' own `ForCausalLMLoss` (labels shifted inside) on split and on whole logits (fp32 1e-6)."""
    for result in vocab_parallel:
        hf = result["huggingface"]
        assert hf["marked"]
        torch.testing.assert_close(hf["loss"], hf["expected"], rtol=1e-6, atol=0.0)
        torch.testing.assert_close(hf["whole"], hf["expected"], rtol=1e-6, atol=0.0)
        assert _norm_wise(hf["grad"], hf["expected_grad"]) <= 5e-6
