"""Regional compilation: every transformer block's forward compiled by `torch.compile`, in place.

The blocks are compiled one by one (torchtitan's per-block compile), not the whole network: a pipeline
stage, FSDP2's units and the schedule's sends stay eager Python between blocks, and every block of the
same class shares one compiled graph (dynamo traces a block's parameters as graph inputs, so the second
block reuses the first one's code: one graph per block class and input shape, not per block).

Order (`strategies.parallelize`): after tensor parallelism and recompute, before FSDP, as torchtitan
documents. Inside the graph run the tensor-parallel layers' DTensor redistributions (as functional
collectives) and recompute's `torch.utils.checkpoint` (as its higher-order op); FSDP2's all-gathers and
reduce-scatters, the block's own hooks, and the pipeline's sends run outside it, eagerly.

The block's `forward` is replaced on the instance, as recompute does, instead of wrapping the block in an
`OptimizedModule` (`torch.compile(block)`) or compiling its `__call__` (`block.compile()`): the module keeps
its class and its parameters their names (no `_orig_mod.` in a checkpoint or an export), and FSDP2's
hooks on the block stay outside the graph. A checkpoint written compiled is the one written eagerly.

A block's input may be the not-yet-waited result of a tensor-parallel all-reduce (an
`AsyncCollectiveTensor`: the vocab-parallel embedding's output, which `use_local_output` hands on
without waiting). AOTAutograd then expects that subclass as the gradient of the input and fails on the
plain tensor the backward brings (pytorch/pytorch#184980, torch 2.13), so such inputs are waited for
eagerly at the graph's entry, with their gradient passed through unchanged (no copy).

`settings` are `torch.compile`'s keywords (`backend`, `mode`, `fullgraph`, `dynamic`, `options`).

A Hugging Face model trained without pipelining runs its own forward, which hands every layer a KV cache
while `config.use_cache` is True (training too); each layer's cache object is a guard of its own, so
dynamo compiles one graph per layer and falls back to eager past its recompile limit (8). Such a model
is warned about with the fix (`config.use_cache = False`, as transformers itself sets under gradient
checkpointing); the pipeline stages call the layers without a cache.

Schedules that split the backward into an input pass and a weight pass (`plan.schedules.
SPLIT_BACKWARD_SCHEDULES`: interleaved zero-bubble, ZBV, DualPipeV) are refused with compile: the split
walks the stage's autograd graph node by node, and a compiled block is one node whose backward computes
every gradient at once (torch 2.13: with donated buffers the retained graph is refused; without them the
weight gradients of DualPipeV and interleaved zero-bubble come out wrong, 40-100% off eager).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_tp3d._compat.torch import AsyncCollectiveTensor
from lightning_tp3d.plan.schedules import PIPELINE_SCHEDULES, SPLIT_BACKWARD_SCHEDULES

__all__ = ["COMPILE_KEYWORDS", "check_compile_schedule", "compile_blocks", "compile_settings", "warn_of_training_cache"]

COMPILE_KEYWORDS = tuple(name for name in inspect.signature(torch.compile).parameters if name != "model")


def compile_settings(option: bool | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`TP3DStrategy(compile=...)` as `torch.compile` keywords: None when off, `{}` for True (torch's
    defaults: inductor, dynamic shapes after a recompile), the mapping itself otherwise, checked."""
    if option is None or option is False:
        return None
    if option is True:
        return {}
    if not isinstance(option, Mapping):
        raise TypeError(f"compile={option!r} must be True, False or a mapping of torch.compile keywords "
                        f"({', '.join(COMPILE_KEYWORDS)}).")
    unknown = sorted(set(option) - set(COMPILE_KEYWORDS))
    if unknown:
        raise ValueError(f"compile={dict(option)!r}: {unknown} are not torch.compile keywords; the keywords are "
                         f"{list(COMPILE_KEYWORDS)}.")
    return dict(option)


def check_compile_schedule(settings: Mapping[str, Any] | None, schedule: str) -> None:
    """Refuse compiled blocks under a schedule that splits the backward (see the module docstring)."""
    if settings is not None and schedule in SPLIT_BACKWARD_SCHEDULES:
        whole = sorted(set(PIPELINE_SCHEDULES) - SPLIT_BACKWARD_SCHEDULES)
        raise ValueError(
            f"compile is not supported with pipeline_schedule={schedule!r}: it splits each backward into an input"
            " pass and a weight pass over the autograd graph, which a compiled block presents as one node whose"
            f" backward computes every gradient at once. Use one of {whole} with compile, or compile=False.")


def warn_of_training_cache(config: Any | None) -> None:
    """Warn when a model run by its own forward keeps a KV cache in training (see the module docstring)."""
    if getattr(config, "use_cache", False):
        rank_zero_warn(
            f"compile=True with {type(config).__name__}.use_cache=True: the model hands each layer a KV cache during"
            " training, which makes dynamo compile one graph per layer (eager past its recompile limit). Set"
            " model.config.use_cache = False for training (the cache serves generation only).")


def compile_blocks(blocks: Iterable[nn.Module], settings: Mapping[str, Any]) -> None:
    """Replace each block's `forward` by `torch.compile(forward, **settings)` (see the module docstring)."""
    for block in blocks:
        block.forward = _waiting_for_inputs(block.forward, torch.compile(block.forward, **settings))


def _waiting_for_inputs(forward: Callable[..., Any], compiled: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def compiled_forward(*args: Any, **kwargs: Any) -> Any:
        return compiled(*map(_waited, args), **{name: _waited(value) for name, value in kwargs.items()})

    return compiled_forward


def _waited(value: Any) -> Any:
    return _WaitAsyncCollective.apply(value) if isinstance(value, AsyncCollectiveTensor) else value


class _WaitAsyncCollective(torch.autograd.Function):
    """An `AsyncCollectiveTensor`'s value after its wait, as a plain tensor; the gradient passes through."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.wait()  # as the pipeline runner waits for the tp-gathered logits

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> torch.Tensor:
        return gradient
