"""Tensor parallelism with DTensor: a plan maps module-name patterns to parallel styles.

The plan a model family uses is its adapter's (`models.adapter.llama_tp_plan` for Llama names, Megatron's):

* q/k/v and gate/up projections are column parallel: Y = X A with A = [A_1, ..., A_t] split along its
  output dimension (the weight along dim 0); tp rank r computes Y_r = X A_r, i.e. its own heads / its
  own slice of the MLP's hidden units;
* o and down projections are row parallel: Y = sum_r X_r B_r with B split along its input dimension
  (the weight along dim 1); the partial sums are all-reduced over tp;
* the embedding is vocab parallel (the weight split along dim 0 over the vocabulary, the looked-up
  rows all-reduced) and the head column parallel over the vocabulary, its logits gathered;
* norms stay replicated;
* the attention and MLP sub-blocks take their input as a DTensor replicated over tp
  (`ReplicateBlockInput`): the column-parallel projections reading it (q, k, v; gate, up) then add their
  input gradients as partial sums and one all-reduce per sub-block completes them, Megatron's fused
  count. Without it each projection all-reduces its own input gradient: 5 backward all-reduces of
  b x s x h per layer instead of 2.

DTensor has no sharded rule for the embedding's backward, so the vocab-parallel embedding's gradient
comes back replicated: the full V x h matrix on every tp rank (for a 102,400 x 4,096 vocabulary 1.7 GB in
fp32 where the shard is 0.2 GB at tp = 8). `shard_gradients_like_parameters` cuts such gradients to the
rank's rows (a local slice, no communication) after backward, before the dp all-reduce and the update.

Outputs are plain local tensors (`use_local_output=True`) so attention runs on each rank's heads
without a DTensor rule for SDPA.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from lightning_tp3d.parallel.attributes import import_object
from lightning_tp3d.parallel.materialize import retie, tied_parameter_groups

__all__ = [
    "ReplicateBlockInput",
    "SharedAcrossHeads",
    "local_part",
    "TensorParallelPlan",
    "apply_tensor_parallel",
    "check_plan_matches",
    "plan_entries_present",
    "resolve_tp_plan",
    "shard_gradients_like_parameters",
]

TensorParallelPlan = Mapping[str, ParallelStyle]


class ReplicateBlockInput(ParallelStyle):
    """Hand a sub-block its input (first positional argument, else the `hidden_states` keyword, as Hugging
    Face layers pass it) as a DTensor replicated over tp. In backward the gradients its column-parallel
    projections send back are partial sums; they add up as such and are all-reduced once, where the
    DTensor was made, instead of once per projection."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(partial(_replicate_input, device_mesh), with_kwargs=True)
        return module


def _replicate_input(mesh: DeviceMesh, module: nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    def replicated(tensor: Any) -> Any:
        if not isinstance(tensor, torch.Tensor) or isinstance(tensor, DTensor):
            return tensor
        return DTensor.from_local(tensor, mesh, [Replicate()], run_check=False)

    if args:
        return (replicated(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": replicated(kwargs["hidden_states"])}
    return args, kwargs


class SharedAcrossHeads(ParallelStyle):
    """A replicated module whose output's last `columns` are read by every tp rank's own heads (MLA's
    rotary key: one head shared by all). Each rank's gradient for those columns is then the sum over its
    heads only, so backward all-reduces it over tp here; the other columns' gradients come back whole
    (through column-parallel projections, whose input gradients are all-reduced where they are made)."""

    def __init__(self, columns: int) -> None:
        super().__init__()
        self.columns = columns

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        module.register_forward_hook(lambda _module, _inputs, output: _SumLastColumnsGradient.apply(
            output, self.columns, group))
        return module


class _SumLastColumnsGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, columns: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.columns, ctx.group = columns, group
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        shared = grad[..., -ctx.columns:].contiguous()
        dist.all_reduce(shared, group=ctx.group)
        return torch.cat([grad[..., :-ctx.columns], shared], dim=-1), None, None


def resolve_tp_plan(plan: TensorParallelPlan | Callable[[], TensorParallelPlan] | str | None
                    ) -> TensorParallelPlan | None:
    """A plan, a function returning one, or its import path `"package.module:function"`; None stays None
    (the model adapter's plan, `models.adapter`)."""
    if plan is None:
        return None
    if isinstance(plan, str):
        plan = import_object(plan, "tp_plan")
    if callable(plan):
        plan = plan()
    if not isinstance(plan, Mapping) or not all(isinstance(style, ParallelStyle) for style in plan.values()):
        raise TypeError("tp_plan must map module-name patterns to torch.distributed.tensor.parallel styles.")
    return plan


def _matches(model: nn.Module, pattern: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for name, _ in model.named_modules() if name)


def plan_entries_present(model: nn.Module, plan: TensorParallelPlan) -> dict[str, ParallelStyle]:
    """The entries of `plan` that match a module of `model` (a pipeline stage lacks some modules)."""
    return {pattern: style for pattern, style in plan.items() if _matches(model, pattern)}


def check_plan_matches(model: nn.Module, plan: TensorParallelPlan, family: str) -> None:
    """Every plan entry must match a module of the whole model: a typo must not silently skip sharding.
    `family` names whose plan it is (the model adapter's), for the error."""
    names = [name for name, _ in model.named_modules() if name]
    for pattern in plan:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise ValueError(
                f"tp_plan entry {pattern!r} matches no module of {type(model).__name__} (model adapter: {family});"
                f" module names look like {names[:6]}. Patterns are relative to the model root and may use '*' for"
                " one name level: pass TP3DStrategy(tp_plan=...) or a model_adapter for this model."
            )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: TensorParallelPlan) -> nn.Module:
    """Shard `model` in place over `tp_mesh` following `plan`; tied parameters stay tied."""
    tied_groups = tied_parameter_groups(model)
    parallelize_module(model, tp_mesh, dict(plan))
    for (first_module, first_name), *others in tied_groups:
        shared = getattr(first_module, first_name)
        for module, name in others:
            if getattr(getattr(module, name), "placements", None) != getattr(shared, "placements", None):
                raise ValueError(
                    f"tied parameters {type(first_module).__name__}.{first_name} and {type(module).__name__}.{name}"
                    " are sharded differently by the tp_plan; give them the same placement (e.g. vocab-parallel"
                    " embedding with a column-parallel head) or untie them."
                )
    retie(tied_groups)
    return model


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of a DTensor (a view of its storage); a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_gradients_like_parameters(parameters: Iterable[torch.Tensor]) -> None:
    """Give every DTensor gradient its parameter's placements, in storage of the shard's size.

    A replicated gradient of a sharded parameter becomes the rank's slice, copied so that the full
    gradient's storage is freed; the values are unchanged."""
    for parameter in parameters:
        grad = parameter.grad
        if isinstance(grad, DTensor) and grad.placements != parameter.placements:
            local = grad.redistribute(parameter.device_mesh, parameter.placements).to_local()
            parameter.grad = DTensor.from_local(local.clone(), parameter.device_mesh, parameter.placements,
                                                shape=parameter.shape, stride=parameter.stride())
