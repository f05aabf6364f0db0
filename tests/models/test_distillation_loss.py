"""The soft-target distillation loss (`models.distillation_loss`): T^2 KL(teacher || student), in chunks.

* Against T^2 KL(softmax(t / T) || softmax(s / T)) computed whole in float64 on one process, ignored rows
  left out, T in {1, 4}, chunks of one row, of a number of rows that does not divide the tokens, and of
  all rows. fp32: the loss within rtol 1e-5 and the student's gradient norm-wise within 1e-5. Error
  analysis: per row the float32 terms p_v (b_v - a_v) (|b - a| <= ~20 here) and the two logsumexps each
  round to 2^-24 relative; summed over V = 300 columns that is ~sqrt(V) x 6e-8 x 20 ~ 2e-5 absolute on a
  row's KL of ~7 at worst in expectation (~3e-6 relative), averaged over 47 rows; the gradient T (q - p) /
  n carries exp()'s rounding of the same logsumexps (~1e-6 relative). A wrong factor (T for T^2), the other
  KL direction, or the ignored rows counted (their KL is 0 here) moves the loss by more than 1% (checked).
* bf16 logits: the gradient is the float32 gradient of the same bf16 inputs rounded to bf16 once (2^-8).
* Student = teacher: exactly 0 with an exactly zero gradient (the same float32 operations on both sides).
* Memory (MemTracker, 512 tokens over V = 4096, the logits included): with chunks of 64 rows, at most the
  two logits and the student's gradient, four float32 chunks and a few float32 numbers per row, plus 1%,
  and at most 0.55x (fp32) / 0.4x (bf16) of `F.kl_div` over whole float32 log-softmaxes.
* Logits split over 2 ranks' vocabularies: the whole logits' loss on every rank and their gradient's
  columns, and 0 for student = teacher.
* A temperature <= 0, logits of two vocabularies or of different tokens, one split and one whole, and
  labels of another length are refused with the reason.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from lightning_tp3d.models.distillation_loss import chunked_distillation_loss
from tests.distributed import run_distributed

IGNORE = -100
VOCAB = 300
TEMPERATURES = (1.0, 4.0)


def _student_teacher_labels(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    # a sharper teacher than student, so that the two directions of the KL differ
    student = torch.randn(4, 13, VOCAB).to(dtype).requires_grad_()
    teacher = (torch.randn(4, 13, VOCAB) * 4).to(dtype)
    labels = torch.randint(0, VOCAB, (4, 13))
    labels[0, :5] = IGNORE
    teacher[0, :5] = student.detach()[0, :5]  # KL 0 on the ignored rows: a loss counting them is 5 / 52 low
    return student, teacher, labels


def _whole_float64(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor | None, temperature: float,
                   reverse: bool = False) -> torch.Tensor:
    """T^2 KL(softmax(t / T) || softmax(s / T)) averaged over the valid rows, in float64 (`reverse`: KL(q || p))."""
    a = F.log_softmax(student.double().flatten(0, -2) / temperature, dim=-1)
    b = F.log_softmax(teacher.double().flatten(0, -2) / temperature, dim=-1)
    divergence = (a.exp() * (a - b)).sum(-1) if reverse else (b.exp() * (b - a)).sum(-1)
    valid = torch.ones_like(divergence, dtype=torch.bool) if labels is None else labels.flatten() != IGNORE
    return temperature**2 * divergence[valid].mean()


def _norm_wise(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("rows", [1, 5, 52])
def test_the_soft_term_is_t_squared_kl_computed_whole_in_float64(temperature, rows):
    student, teacher, labels = _student_teacher_labels(torch.float32)
    loss = chunked_distillation_loss(student, teacher, labels, temperature, IGNORE, chunk_elements=rows * VOCAB)
    (grad,) = torch.autograd.grad(loss * 2.5, student)
    expected_input = student.detach().double().requires_grad_()
    expected = _whole_float64(expected_input, teacher, labels, temperature)
    (expected_grad,) = torch.autograd.grad(expected * 2.5, expected_input)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=0.0)
    assert _norm_wise(grad, expected_grad) <= 1e-5
    assert grad[0, :5].abs().max().item() == 0.0  # ignored rows get no gradient
    for wrong in (expected / temperature if temperature > 1 else None,  # T instead of T^2
                  _whole_float64(student, teacher, labels, temperature, reverse=True),
                  _whole_float64(student, teacher, None, temperature)):
        if wrong is not None:
            assert abs(loss.item() - wrong.item()) > 0.01 * loss.item()


def test_every_row_counts_without_labels():
    student, teacher, _ = _student_teacher_labels(torch.float32)
    loss = chunked_distillation_loss(student, teacher, temperature=2.0)
    torch.testing.assert_close(loss.double(), _whole_float64(student, teacher, None, 2.0), rtol=1e-5, atol=0.0)


def test_bf16_logits_get_the_float32_gradient_rounded_once():
    student, teacher, labels = _student_teacher_labels(torch.bfloat16)
    loss = chunked_distillation_loss(student, teacher, labels, 4.0, IGNORE, chunk_elements=7 * VOCAB)
    (grad,) = torch.autograd.grad(loss, student)
    upcast = student.detach().float().requires_grad_()
    reference = chunked_distillation_loss(upcast, teacher.float(), labels, 4.0, IGNORE)
    (reference_grad,) = torch.autograd.grad(reference, upcast)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(grad.float(), reference_grad, rtol=2**-8, atol=1e-9)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_the_soft_term_is_zero_when_the_student_is_the_teacher(temperature):
    student, _, labels = _student_teacher_labels(torch.float32)
    loss = chunked_distillation_loss(student, student.detach().clone(), labels, temperature, IGNORE)
    (grad,) = torch.autograd.grad(loss, student)
    assert loss.item() == 0.0 and grad.abs().max().item() == 0.0


def _peak_bytes(loss_of, dtype: torch.dtype, tokens: int, vocab: int) -> int:
    """Peak bytes of the loss's forward and backward, both logits included."""
    torch.manual_seed(0)
    tracker = MemTracker()
    with tracker:
        student = torch.randn(tokens, vocab, dtype=dtype).requires_grad_()
        teacher = torch.randn(tokens, vocab, dtype=dtype)
        loss_of(student, teacher).backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return peak[next(kind for kind in peak if str(kind).endswith("Total"))]


def _plain_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    return 16 * F.kl_div(F.log_softmax(student.float() / 4, -1), F.log_softmax(teacher.float() / 4, -1),
                         reduction="batchmean", log_target=True)


@pytest.mark.parametrize(("dtype", "most_of_plain"), [(torch.float32, 0.55), (torch.bfloat16, 0.4)])
def test_the_loss_holds_no_whole_float32_copy(dtype, most_of_plain):
    tokens, vocab, rows = 512, 4096, 64
    element = torch.finfo(dtype).bits // 8
    chunked = _peak_bytes(lambda s, t: chunked_distillation_loss(s, t, temperature=4.0, chunk_elements=rows * vocab),
                          dtype, tokens, vocab)
    plain = _peak_bytes(_plain_kl, dtype, tokens, vocab)
    formula = 3 * tokens * vocab * element + 4 * rows * vocab * 4 + 8 * tokens * 4
    assert chunked <= 1.01 * formula, (chunked, formula)
    assert chunked <= most_of_plain * plain, (chunked, plain)
    assert plain >= tokens * vocab * (3 * element + 4 * 4)  # the logits, the gradient and four float32 copies


def test_bad_input_is_refused_with_the_reason():
    student, teacher, labels = _student_teacher_labels(torch.float32)
    for temperature in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="must be a finite number > 0"):
            chunked_distillation_loss(student, teacher, labels, temperature)
    with pytest.raises(ValueError, match="student's vocabulary has 300 entries and the teacher's 301"):
        chunked_distillation_loss(student, torch.randn(4, 13, VOCAB + 1), labels)
    with pytest.raises(ValueError, match="must cover the same tokens"):
        chunked_distillation_loss(student, teacher[:, :12], labels)
    with pytest.raises(ValueError, match="one entry per token row"):
        chunked_distillation_loss(student, teacher, labels[:, :12])


# Vocab parallel: both logits split over 2 ranks (`parallel.vocab_parallel`), on a world of 2 processes.
SPLIT = 2


def _vocab_parallel_world() -> dict[str, Any]:
    """On each of 2 ranks: the loss and the student gradient's columns of logits split over the vocabulary,
    beside the whole logits' loss on one process; 0 for student = teacher; one whole and one split refused."""
    torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (SPLIT,))
    rank = mesh.get_local_rank()
    columns = slice(rank * VOCAB // SPLIT, (rank + 1) * VOCAB // SPLIT)
    student, teacher, labels = _student_teacher_labels(torch.float32)
    result: dict[str, Any] = {"rank": rank}
    for temperature in TEMPERATURES:
        expected = chunked_distillation_loss(student, teacher, labels, temperature, IGNORE)
        (expected_grad,) = torch.autograd.grad(expected, student)
        local = student.detach()[..., columns].clone().requires_grad_()
        split_teacher = DTensor.from_local(teacher[..., columns].clone(), mesh, [Shard(-1)])
        loss = chunked_distillation_loss(DTensor.from_local(local, mesh, [Shard(-1)]), split_teacher, labels,
                                         temperature, IGNORE, chunk_elements=7 * VOCAB // SPLIT)
        loss.backward()
        same = chunked_distillation_loss(DTensor.from_local(local.detach(), mesh, [Shard(-1)]),
                                         DTensor.from_local(local.detach().clone(), mesh, [Shard(-1)]), labels,
                                         temperature, IGNORE)
        result[temperature] = dict(loss=loss.detach(), expected=expected.detach(), grad=local.grad,
                                   expected_grad=expected_grad[..., columns], same=same.item())
    try:
        chunked_distillation_loss(DTensor.from_local(student.detach()[..., columns], mesh, [Shard(-1)]), teacher)
    except ValueError as error:
        result["mixed"] = str(error)
    torch.distributed.destroy_process_group()
    return result


@pytest.mark.distributed
def test_logits_split_over_the_vocabulary_give_the_whole_logits_loss_and_gradient():
    """fp32, against the whole logits' loss on one process: the loss within 1e-6 (the logsumexp of 2 partial
    float32 logsumexps and the 2 shards' weighted gaps, each rescaled by one exp, round a few ulp of terms
    ~10: ~1e-7 relative) and each rank's gradient columns norm-wise within 5e-6 (q and p = exp(x - lse)
    inherit the logsumexps' absolute ~1e-6); a wrong rescaling of a shard's gap or a shard counted twice
    is off by O(1)."""
    for result in run_distributed(SPLIT, "tests.models.test_distillation_loss:_vocab_parallel_world"):
        for temperature in TEMPERATURES:
            split = result[temperature]
            torch.testing.assert_close(split["loss"], split["expected"], rtol=1e-6, atol=0.0)
            assert _norm_wise(split["grad"], split["expected_grad"]) <= 5e-6, (result["rank"], temperature)
            assert split["same"] == 0.0
        assert "both be whole or both split over the vocabulary" in result["mixed"]
