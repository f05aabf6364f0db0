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

Logits split over the vocabulary (a DTensor `Shard(-1)` on tp's mesh, from the vocab-parallel head:
`parallel.vocab_parallel`) are never gathered: rank r computes, chunk by chunk over its V / t columns,
logsumexp(z_i,r) and z_i[y_i] where it owns y_i (0 elsewhere); one all-gather of these 2 N float32 numbers
gives every rank logsumexp(z_i) = logsumexp_r(logsumexp(z_i,r)) and z_i[y_i] = sum_r of the targets, so
the loss is the same on every rank, and backward is the formula above on the rank's own columns, with no
communication. Each rank then holds 1 / t of the logits, their gradient and the float32 chunks; the
numbers differ from the whole logits' by the float32 rounding of the logsumexp of t partial logsumexps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_tp3d.parallel.vocab_parallel import gather_shard_statistics, takes_sharded_logits, vocab_shard
from lightning_tp3d.plan.loss import LOSS_CHUNK_ELEMENTS

__all__ = ["chunked_cross_entropy", "row_chunks"]


@takes_sharded_logits
def chunked_cross_entropy(logits: Tensor, labels: Tensor, ignore_index: int = -100,
                          chunk_elements: int = LOSS_CHUNK_ELEMENTS) -> Tensor:
    """Mean cross entropy of `logits[..., V]` against `labels[...]` over labels != `ignore_index` (see the
    module docstring); NaN when every label is ignored, as `F.cross_entropy`. `logits` whole, or a DTensor
    split over the vocabulary (vocab parallel: no gather)."""
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements={chunk_elements} must be >= 1.")
    group, start = None, 0
    if isinstance(logits, DTensor):
        logits, group, start = vocab_shard(logits)
    vocab = logits.shape[-1]
    rows = max(1, chunk_elements // vocab)
    return _ChunkedCrossEntropy.apply(logits.reshape(-1, vocab), labels.reshape(-1), ignore_index, rows, group, start)


def row_chunks(total: int, rows: int) -> list[slice]:
    """Consecutive slices of at most `rows` rows covering `total`: the loss paths' float32 chunks."""
    return [slice(start, min(start + rows, total)) for start in range(0, total, rows)]


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor, ignore_index: int, rows: int,
                group: dist.ProcessGroup | None, start: int) -> Tensor:
        valid = labels != ignore_index
        owned = valid  # rows whose target is one of these columns
        if group is not None:
            owned = valid & (labels >= start) & (labels < start + logits.shape[-1])
        targets = (labels - start).masked_fill(~owned, 0).unsqueeze(-1)
        logsumexp = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        target_logits = torch.empty_like(logsumexp)
        for chunk in row_chunks(logits.shape[0], rows):
            z = logits[chunk].float()
            logsumexp[chunk] = torch.logsumexp(z, dim=-1)
            target_logits[chunk] = z.gather(-1, targets[chunk]).squeeze(-1)
        if group is not None:
            logsumexp, target_logits = _combine_vocab_shards(logsumexp, target_logits.masked_fill(~owned, 0), group)
        count = valid.sum()
        ctx.save_for_backward(logits, targets, owned, valid, logsumexp, count)
        ctx.rows = rows
        return ((logsumexp - target_logits) * valid).sum() / count

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        logits, targets, owned, valid, logsumexp, count = ctx.saved_tensors
        scale = (grad_loss / count) * valid  # per row: d loss / d row's loss
        minus_one_if_owned = -owned.unsqueeze(-1).float()
        grad = torch.empty_like(logits)
        for chunk in row_chunks(logits.shape[0], ctx.rows):
            probabilities = (logits[chunk].float() - logsumexp[chunk].unsqueeze(-1)).exp_()
            probabilities.scatter_add_(-1, targets[chunk], minus_one_if_owned[chunk])
            grad[chunk] = probabilities.mul_(scale[chunk].unsqueeze(-1))
        return grad, None, None, None, None, None


def _combine_vocab_shards(logsumexp: Tensor, target_logits: Tensor, group: dist.ProcessGroup
                          ) -> tuple[Tensor, Tensor]:
    """The whole rows' logsumexp and target logit from every vocabulary shard's (one all-gather of 2 N)."""
    gathered = gather_shard_statistics([logsumexp, target_logits], group)
    return torch.logsumexp(gathered[:, 0], dim=0), gathered[:, 1].sum(dim=0)
