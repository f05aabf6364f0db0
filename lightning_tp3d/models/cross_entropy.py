"""Token cross entropy in chunks: the loss of `[N, V]` logits without a whole `N x V` float32 copy.

`F.cross_entropy(logits.float(), labels)` keeps a float32 copy of the logits' log-softmax for backward
and builds two more `N x V` float32 tensors in it (the gradient of the log-softmax and of the upcast),
on top of the logits themselves: under bf16 that is 12 bytes per logit beside the logits' 2, the largest
activation of a step at a 128k vocabulary. Here, with z = logits[i] in float32 and valid rows
(labels != ignore_index), n of them:

    loss = (1 / n) sum_valid (logsumexp(z_i) - z_i[y_i])
    d loss / d logits[i] = (softmax(z_i) - onehot(y_i)) / n   (zero on ignored rows)

Forward keeps only the logits (which exist anyway) and one float32 logsumexp per row; backward recomputes
softmax chunk by chunk and writes the gradient in the logits' dtype. Float32 is used only for one chunk of
`chunk_elements` logits at a time (`plan.loss.LOSS_CHUNK_ELEMENTS`, 64 MiB), so the loss path holds the
logits and their gradient, 2 x N x V x element bytes, and two or three float32 chunks at its peak
(`plan.loss.loss_activation_bytes`), where the plain loss holds 2 + 3 x 4 bytes per logit under bf16 and
3 x 4 under fp32 beside the logits. The numbers are the plain loss's: the
same float32 arithmetic per row, rows summed in the same order up to float32 rounding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_tp3d.plan.loss import LOSS_CHUNK_ELEMENTS

__all__ = ["chunked_cross_entropy"]


def chunked_cross_entropy(logits: Tensor, labels: Tensor, ignore_index: int = -100,
                          chunk_elements: int = LOSS_CHUNK_ELEMENTS) -> Tensor:
    """Mean cross entropy of `logits[..., V]` against `labels[...]` over labels != `ignore_index` (see the
    module docstring); NaN when every label is ignored, as `F.cross_entropy`."""
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements={chunk_elements} must be >= 1.")
    vocab = logits.shape[-1]
    rows = max(1, chunk_elements // vocab)
    return _ChunkedCrossEntropy.apply(logits.reshape(-1, vocab), labels.reshape(-1), ignore_index, rows)


def _chunks(total: int, rows: int) -> list[slice]:
    return [slice(start, min(start + rows, total)) for start in range(0, total, rows)]


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor, ignore_index: int, rows: int) -> Tensor:
        valid = labels != ignore_index
        targets = labels.masked_fill(~valid, 0).unsqueeze(-1)
        logsumexp = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        target_logits = torch.empty_like(logsumexp)
        for chunk in _chunks(logits.shape[0], rows):
            z = logits[chunk].float()
            logsumexp[chunk] = torch.logsumexp(z, dim=-1)
            target_logits[chunk] = z.gather(-1, targets[chunk]).squeeze(-1)
        count = valid.sum()
        ctx.save_for_backward(logits, targets, valid, logsumexp, count)
        ctx.rows = rows
        return ((logsumexp - target_logits) * valid).sum() / count

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        logits, targets, valid, logsumexp, count = ctx.saved_tensors
        scale = (grad_loss / count) * valid  # per row: d loss / d row's loss
        grad = torch.empty_like(logits)
        for chunk in _chunks(logits.shape[0], ctx.rows):
            probabilities = (logits[chunk].float() - logsumexp[chunk].unsqueeze(-1)).exp_()
            probabilities.scatter_add_(-1, targets[chunk], torch.full_like(targets[chunk], -1, dtype=torch.float32))
            grad[chunk] = probabilities.mul_(scale[chunk].unsqueeze(-1))
        return grad, None, None, None
