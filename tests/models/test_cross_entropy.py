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

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from lightning_tp3d.models.cross_entropy import chunked_cross_entropy
from lightning_tp3d.plan.loss import loss_activation_bytes

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


def _peak_bytes(loss_of, dtype: torch.dtype, tokens: int, vocab: int) -> int:
    """Peak bytes of the loss's forward and backward, the logits included."""
    torch.manual_seed(0)
    labels = torch.randint(0, vocab, (tokens,))
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
