"""The balancing loss over the whole batch (`models.router_loss`) in one process, d dp ranks simulated: each
rank's share from its rows and the counts summed over the ranks; their mean is transformers'
`load_balancing_loss_func` on the whole batch, and so is the mean of their gradients (what data parallelism
averages), with and without padding. The ranks' parity in training is in tests/models/test_huggingface.py."""

from __future__ import annotations

import pytest
import torch

from lightning_tp3d.models.router_loss import adds_router_loss, balancing_statistics, batch_share, check_router_loss
from lightning_tp3d.plan.layout import LayoutError, ParallelLayout
from tests.models.test_huggingface import hf_network

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: E402

EXPERTS, TOP_K, LAYERS, RANKS, ROWS = 6, 2, 3, 4, 20  # rows per rank (one sequence of 20 tokens each)


def _close(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> bool:
    """Within `tolerance` of the tensor's largest entry (float32: the sums run over the ranks' rows in
    another order than over the whole batch's)."""
    return bool((got - want).abs().max() <= tolerance * want.abs().max())


def _shares(logits: list[torch.Tensor], mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Each rank's aux_r: its rows of every layer, the counts and rows summed over the ranks."""
    statistics = []
    for rank in range(RANKS):
        rows = slice(rank * ROWS, (rank + 1) * ROWS)
        statistics.append(balancing_statistics(tuple(layer[rows] for layer in logits), EXPERTS, TOP_K,
                                               None if mask is None else mask[rank:rank + 1]))
    totals = sum(torch.cat([counts, rows.reshape(1)]) for counts, _, rows in statistics).detach()
    return [batch_share(probabilities, totals, EXPERTS, RANKS) for _, probabilities, _ in statistics]


@pytest.mark.parametrize("padded", [False, True])
def test_the_ranks_shares_average_to_the_whole_batchs_loss_and_gradient(padded):
    torch.manual_seed(0)
    logits = [torch.randn(RANKS * ROWS, EXPERTS, requires_grad=True) for _ in range(LAYERS)]
    mask = None
    if padded:  # each rank's sequence padded differently: 20, 15, 10 and 5 real tokens
        mask = torch.zeros(RANKS, ROWS, dtype=torch.long)
        for rank in range(RANKS):
            mask[rank, :ROWS - 5 * rank] = 1
    whole = load_balancing_loss_func(tuple(logits), EXPERTS, TOP_K, mask)
    expected = torch.autograd.grad(whole, logits)
    shares = _shares(logits, mask)
    mean = torch.stack(shares).mean()
    assert torch.allclose(mean, whole, rtol=1e-6, atol=0)  # float32 sums of 240 rows in another order
    averaged = torch.autograd.grad(mean, logits)  # each rank's gradient of its own share, averaged over dp
    for got, want in zip(averaged, expected):
        assert _close(got, want, 1e-5)
    # a rank's own loss (the model's per-rank aux) is another loss: its gradients are not the batch's
    local = [load_balancing_loss_func(tuple(layer[rank * ROWS:(rank + 1) * ROWS] for layer in logits), EXPERTS,
                                      TOP_K, None if mask is None else mask[rank:rank + 1]) for rank in range(RANKS)]
    wrong = torch.autograd.grad(torch.stack(local).mean(), logits)
    assert not any(_close(got, want, 1e-2) for got, want in zip(wrong, expected))


def test_the_loss_is_refused_under_pipelining_and_kept_elsewhere():
    network = hf_network("mixtral")
    assert not adds_router_loss(network)
    network.config.output_router_logits = True
    assert adds_router_loss(network)
    with pytest.raises(LayoutError, match=r"output_router_logits=True .* pipeline_parallel_size=2 is not supported:"
                                          r".*set model.config.output_router_logits = False"):
        check_router_loss(network, ParallelLayout(pipeline_parallel_size=2, data_parallel_size=2))
    check_router_loss(network, ParallelLayout(tensor_parallel_size=2, data_parallel_size=4))
    network.config.output_router_logits = False
    check_router_loss(network, ParallelLayout(pipeline_parallel_size=2))
