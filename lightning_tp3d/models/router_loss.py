"""A mixture of experts' auxiliary load-balancing loss over the whole batch, under data parallelism.

transformers' MoE causal LMs (Mixtral, Qwen2-MoE, Qwen3-MoE, ...) add, with `output_router_logits=True`,
c x aux to the loss, Switch Transformer's balancing loss over the batch's T rows of every layer:

    aux = N sum_e f_e P_e,   f_e = (1 / T) #{rows routing to e among their top K},
                             P_e = (1 / T) sum_rows softmax(router logits)_e

(padding rows left out where an attention mask is given). It is not a mean over tokens: computed on each dp
rank's share of the batch, it is another loss than one process's on the whole batch. With dp ranks r holding
T_r rows (T = sum_r T_r), the loss each rank adds instead (`GlobalRouterLoss`) is

    aux_r = N sum_e f_e (d / T) sum_{rows of r} softmax_e,      f_e from counts all-reduced over dp,

whose mean over the d ranks is the whole batch's aux, exactly, and whose gradient averaged over dp (what
every data-parallel mode does) is the whole batch's gradient: f carries no gradient, and P is linear in the
rows. The counts and T travel in one all-reduce of N + 1 floats per forward. The rank's own aux, which the
model has already added, is taken out again (its gradient cancels exactly: c - c at one node), and the
output's `aux_loss` becomes aux_r. Over tp the router and its logits are replicated: nothing to do. Only
training forwards take part (every dp rank runs the same ones); evaluation and generation, where ranks may
run different numbers of forwards, keep each rank's own loss.

Under pipelining the stages pass hidden states on, not router logits, so the loss cannot be formed: refused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_tp3d.plan.layout import LayoutError, ParallelLayout

__all__ = ["GlobalRouterLoss", "adds_router_loss", "balancing_statistics", "batch_share", "check_router_loss"]

# what transformers' MoE causal LMs hold to add the balancing loss to their loss
_ROUTER_LOSS_ATTRIBUTES = ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")


def adds_router_loss(network: nn.Module) -> bool:
    """Whether `network` adds the balancing loss (module docstring) to its loss: a transformers MoE causal LM
    with `config.output_router_logits` on."""
    config = getattr(network, "config", None)
    return bool(getattr(config, "output_router_logits", False)) and all(
        hasattr(network, name) for name in _ROUTER_LOSS_ATTRIBUTES)


def check_router_loss(network: nn.Module, layout: ParallelLayout) -> None:
    """Refuse the balancing loss under pipelining (module docstring), with the fix."""
    if adds_router_loss(network) and layout.pipeline_parallel_size > 1:
        raise LayoutError(
            f"output_router_logits=True (the auxiliary load-balancing loss) with pipeline_parallel_size="
            f"{layout.pipeline_parallel_size} is not supported: pipeline stages pass hidden states on, not the"
            " router logits the loss needs; set model.config.output_router_logits = False, or train without"
            " pipelining (data and tensor parallelism keep the whole batch's loss).")


def balancing_statistics(gate_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                          attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top-K counts per expert, router probability sums per expert, rows) of this rank's rows, as
    transformers' `load_balancing_loss_func` sums them, layer by layer."""
    device = gate_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probabilities = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    row_weights = (torch.ones(gate_logits[0].shape[0], device=device) if attention_mask is None
                   else attention_mask.reshape(-1).to(device=device, dtype=torch.float32))  # the same in every layer
    for logits in gate_logits:
        routing = torch.softmax(logits.to(device), dim=-1)
        chosen = torch.topk(routing, top_k, dim=-1).indices.reshape(-1)
        counts = counts.scatter_add(0, chosen, row_weights.repeat_interleave(top_k))
        probabilities = probabilities + (routing.float() * row_weights.unsqueeze(-1)).sum(dim=0)
        rows = rows + row_weights.sum()
    return counts, probabilities, rows


def batch_share(probabilities: torch.Tensor, totals: torch.Tensor, num_experts: int, dp_size: int) -> torch.Tensor:
    """aux_r (module docstring) from this rank's router probability sums and `totals`, the top-K counts per
    expert and the rows summed over the dp ranks ([N + 1], no gradient)."""
    fraction = totals[:-1] / totals[-1]
    return num_experts * torch.sum(fraction * probabilities * dp_size / totals[-1])


class GlobalRouterLoss:
    """A forward hook on the causal LM (`install`) that replaces the rank's balancing loss by its share of
    the whole batch's (module docstring), over the data-parallel `group` of `dp_size` ranks."""

    def __init__(self, group: dist.ProcessGroup, dp_size: int) -> None:
        self.group = group
        self.dp_size = dp_size

    def install(self, network: nn.Module) -> None:
        network.register_forward_hook(self, with_kwargs=True)

    def __call__(self, network: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if not network.training or getattr(output, "aux_loss", None) is None or not output.router_logits:
            return output  # evaluation and generation keep the rank's own: ranks may run different forwards
        attention_mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        counts, probabilities, rows = balancing_statistics(tuple(output.router_logits), network.num_experts,
                                                           network.num_experts_per_tok, attention_mask)
        totals = torch.cat([counts, rows.reshape(1)]).detach()
        dist.all_reduce(totals, group=self.group)
        share = batch_share(probabilities, totals, network.num_experts, self.dp_size)
        if output.loss is not None:
            coefficient = network.router_aux_loss_coef
            output.loss = output.loss - coefficient * output.aux_loss.to(output.loss.device) + coefficient * share
        output.aux_loss = share
        return output
