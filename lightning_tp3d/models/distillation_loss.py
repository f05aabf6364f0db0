"""The soft-target distillation loss in chunks: T^2 KL(teacher || student) without a whole float32 copy.

For token row i with student logits s_i and teacher logits t_i in float32, a = s_i / T and b = t_i / T,
the teacher's distribution p = softmax(b), the student's q = softmax(a), and n valid rows (labels !=
ignore_index, every row without labels):

    loss = (T^2 / n) sum_valid KL(p || q),   KL(p || q) = sum_v p_v (b_v - a_v) - logsumexp(b) + logsumexp(a)
    d loss / d s_i = (T / n) (q - p)   (zero on ignored rows; the teacher's logits get no gradient)

the soft term of Hinton et al.'s distillation, whose T^2 keeps the gradient's scale independent of T.
It is exactly 0, with a zero gradient, when the student's logits are the teacher's. As for the chunked
cross entropy (`models.cross_entropy`), forward keeps only the two logits (which exist anyway) and two
float32 logsumexps per row, and backward recomputes p and q chunk by chunk, writing the gradient in the
student logits' dtype: float32 is used for one chunk of `chunk_elements` logits of each model at a time.

Logits split over the vocabulary (both as DTensors `Shard(-1)` on one 1-D mesh, from vocab-parallel heads:
`parallel.vocab_parallel`) are never gathered: rank r computes over its own columns logsumexp(a)_r,
logsumexp(b)_r and w_r = sum_(v of r) exp(b_v - logsumexp(b)_r) (b_v - a_v); one all-gather of these 3 N
float32 numbers gives every rank

    logsumexp(x) = logsumexp_r(logsumexp(x)_r),   sum_v p_v (b_v - a_v) = sum_r exp(logsumexp(b)_r - logsumexp(b)) w_r,

so the loss is the same on every rank, and backward is the formula above on the rank's own columns with
no communication. The numbers differ from the whole logits' by the float32 rounding of these sums.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_tp3d.models.cross_entropy import row_chunks
from lightning_tp3d.parallel.vocab_parallel import gather_shard_statistics, vocab_shard
from lightning_tp3d.plan.loss import LOSS_CHUNK_ELEMENTS

__all__ = ["chunked_distillation_loss"]


def chunked_distillation_loss(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor | None = None,
                              temperature: float = 1.0, ignore_index: int = -100,
                              chunk_elements: int = LOSS_CHUNK_ELEMENTS) -> Tensor:
    """`T^2` times the mean over rows with labels != `ignore_index` (every row when `labels` is None) of
    KL(softmax(teacher / T) || softmax(student / T)) over the last dimension (see the module docstring).
    Both logits whole, or both DTensors split over the vocabulary on the same 1-D mesh (no gather); the
    teacher's are treated as constants."""
    if not temperature > 0 or math.isinf(temperature):
        raise ValueError(f"temperature={temperature} must be a finite number > 0: the soft targets are"
                         " softmax(logits / T); T = 1 is the models' own distribution, 2 to 10 the usual range.")
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements={chunk_elements} must be >= 1.")
    if student_logits.shape[-1] != teacher_logits.shape[-1]:
        raise ValueError(f"the student's vocabulary has {student_logits.shape[-1]} entries and the teacher's"
                         f" {teacher_logits.shape[-1]}: distillation compares their distributions entry by entry,"
                         " so the two models need the same tokenizer and vocabulary size.")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"the student's logits {tuple(student_logits.shape)} and the teacher's"
                         f" {tuple(teacher_logits.shape)} must cover the same tokens: run both on the same batch.")
    group = None
    if isinstance(student_logits, DTensor) or isinstance(teacher_logits, DTensor):
        if not (isinstance(student_logits, DTensor) and isinstance(teacher_logits, DTensor)
                and student_logits.device_mesh == teacher_logits.device_mesh):
            raise ValueError("the student's and the teacher's logits must both be whole or both split over the"
                             " vocabulary on the same mesh (Shard(-1)): shard the teacher's head as the student's.")
        (student_logits, group, _), (teacher_logits, _, _) = vocab_shard(student_logits), vocab_shard(teacher_logits)
    vocab = student_logits.shape[-1]
    student_logits, teacher_logits = student_logits.reshape(-1, vocab), teacher_logits.detach().reshape(-1, vocab)
    if labels is None:
        valid = torch.ones(student_logits.shape[0], dtype=torch.bool, device=student_logits.device)
    elif labels.numel() != student_logits.shape[0]:
        raise ValueError(f"labels {tuple(labels.shape)} must have one entry per token row of the logits"
                         f" ({student_logits.shape[0]} rows of {vocab}).")
    else:
        valid = labels.reshape(-1) != ignore_index
    rows = max(1, chunk_elements // vocab)
    return _ChunkedDistillation.apply(student_logits, teacher_logits, valid, float(temperature), rows, group)


class _ChunkedDistillation(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, student: Tensor, teacher: Tensor, valid: Tensor, temperature: float, rows: int,
                group: dist.ProcessGroup | None) -> Tensor:
        student_lse = torch.empty(student.shape[0], dtype=torch.float32, device=student.device)
        teacher_lse, weighted_gap = torch.empty_like(student_lse), torch.empty_like(student_lse)
        for chunk in row_chunks(student.shape[0], rows):
            a, b = student[chunk].float() / temperature, teacher[chunk].float() / temperature
            student_lse[chunk] = torch.logsumexp(a, dim=-1)
            teacher_lse[chunk] = torch.logsumexp(b, dim=-1)
            weighted_gap[chunk] = ((b - teacher_lse[chunk].unsqueeze(-1)).exp_() * (b - a)).sum(dim=-1)
        if group is not None:
            student_lse, teacher_lse, weighted_gap = _combine_vocab_shards(
                student_lse, teacher_lse, weighted_gap, group)
        count = valid.sum()
        ctx.save_for_backward(student, teacher, valid, student_lse, teacher_lse, count)
        ctx.temperature, ctx.rows = temperature, rows
        divergence = (weighted_gap - teacher_lse + student_lse).masked_fill(~valid, 0.0)
        return temperature**2 * divergence.sum() / count

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        student, teacher, valid, student_lse, teacher_lse, count = ctx.saved_tensors
        temperature = ctx.temperature
        scale = (grad_loss * temperature / count) * valid  # per row: d loss / d (q - p)
        grad = torch.empty_like(student)
        for chunk in row_chunks(student.shape[0], ctx.rows):
            q = (student[chunk].float() / temperature - student_lse[chunk].unsqueeze(-1)).exp_()
            p = (teacher[chunk].float() / temperature - teacher_lse[chunk].unsqueeze(-1)).exp_()
            grad[chunk] = q.sub_(p).mul_(scale[chunk].unsqueeze(-1))
        return grad, None, None, None, None, None


def _combine_vocab_shards(student_lse: Tensor, teacher_lse: Tensor, weighted_gap: Tensor, group: dist.ProcessGroup
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """The whole rows' logsumexps and teacher-weighted gap from every vocabulary shard's (one all-gather of 3 N)."""
    gathered = gather_shard_statistics([student_lse, teacher_lse, weighted_gap], group)
    teacher_whole = torch.logsumexp(gathered[:, 1], dim=0)
    gap = ((gathered[:, 1] - teacher_whole).exp() * gathered[:, 2]).sum(dim=0)
    return torch.logsumexp(gathered[:, 0], dim=0), teacher_whole, gap
