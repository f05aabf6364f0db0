"""Mixed precision for model-parallel training: autocast plus, for fp16, a loss scaler all ranks agree on.

A `GradScaler` decides per process whether the gradients it sees hold an inf or nan. Under tensor,
pipeline or sharded data parallelism each process sees a different part of the gradients, so one rank
would skip the optimizer step and keep the weights while the others step, and the shards of one
parameter would disagree (or a collective inside the step would hang). `ModelParallelGradScaler`
reduces the inf/nan flag with MAX over all ranks after unscaling, so every rank skips the same steps
and holds the same scale. Lightning refuses `precision="16-mixed"` for model-parallel strategies (and
turns it into bf16 on CPU); pass the plugin instead::

    Trainer(strategy=TP3DStrategy(tensor_parallel_size=2), plugins=[TP3DPrecision("16-mixed")])

`bf16-mixed` needs no scaler (`Trainer(precision="bf16-mixed")` or `TP3DPrecision("bf16-mixed")`).
Under pipelining the schedule runs backward inside the training step, so `TP3DStrategy` multiplies the
last stage's loss by the current scale itself.
"""

from __future__ import annotations

import types
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.distributed.tensor import DTensor

from lightning_tp3d._compat.torch import loss_scale_tensor, non_finite_check_and_unscale_
from lightning_tp3d.parallel.float8 import check_float8_precision
from lightning_tp3d.parallel.grad_norm import clip_grad_value_

__all__ = ["ModelParallelGradScaler", "TP3DPrecision", "check_supported_precision", "current_loss_scale",
           "route_gradient_clipping"]


def current_loss_scale(scaler: torch.amp.GradScaler | None) -> torch.Tensor | float:
    """What the loss is multiplied by: the scaler's scale tensor once it exists (read without a host
    synchronisation, unlike `get_scale()`), its initial scale before the first step, 1 without scaling."""
    if scaler is None or not scaler.is_enabled():
        return 1.0
    scale = loss_scale_tensor(scaler)
    return scale if scale is not None else scaler.get_scale()


def check_supported_precision(precision: str, scaler: Any = None, world_size: int = 1,
                              float8: str | None = None) -> None:
    """Refuse the precisions no parity test covers: `16-true` (fp16 weights and optimizer state with no
    loss scaling, whose small gradients underflow), a loss scaler that checks each rank alone, and FP8
    outside fp32 / bf16 autocast (`parallel.float8.check_float8_precision`)."""
    check_float8_precision(float8, precision)
    if scaler is not None and not isinstance(scaler, ModelParallelGradScaler) and world_size > 1:
        raise ValueError(
            f"The precision plugin's {type(scaler).__name__} checks for inf/nan on each rank alone, so ranks would"
            " disagree on skipping a step; use plugins=[TP3DPrecision('16-mixed')] (lightning_tp3d.TP3DPrecision)."
        )
    if precision == "16-true":
        raise ValueError(
            "precision='16-true' (fp16 weights, no loss scaling) is not supported by lightning_tp3d: small"
            " gradients underflow in fp16. Use 'bf16-true', 'bf16-mixed', or fp16 autocast with a loss scaler,"
            " Trainer(plugins=[TP3DPrecision('16-mixed')])."
        )


class ModelParallelGradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler` whose inf/nan check covers the gradients of every rank of `process_group`
    (default: all ranks). Gradients may be DTensors (tp / FSDP shards) or plain tensors; each rank
    unscales its local pieces, g <- g / scale, then the found-inf flags are all-reduced with MAX."""

    def __init__(self, device: str = "cpu", process_group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(device=device, **kwargs)
        self.process_group = process_group

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        local_grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                grad = parameter.grad
                if grad is None:
                    continue
                grad = grad.to_local() if isinstance(grad, DTensor) else grad
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients: keep fp32 parameters under 16-mixed.")
                local_grads[(grad.device, grad.dtype)].append(grad)
        with torch.no_grad():
            for (device, _), grads in local_grads.items():
                found_on_device = found_inf.to(device)
                non_finite_check_and_unscale_(grads, found_on_device, inv_scale.to(device))
                found_inf.copy_(torch.maximum(found_inf, found_on_device.to(found_inf.device)))
        if dist.is_initialized():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.process_group)
        return {found_inf.device: found_inf}


class TP3DPrecision(MixedPrecision):
    """Autocast in `"bf16-mixed"` or `"16-mixed"` (fp32 weights, gradients and optimizer state); the
    latter with a `ModelParallelGradScaler`, whose state Lightning stores in checkpoints.

    `device` is the autocast device type; by default the strategy sets it to the device it runs on
    ("cuda" on GPUs, "cpu" otherwise), so the same plugin autocasts wherever it is used.
    """

    def __init__(self, precision: Literal["16-mixed", "bf16-mixed"] = "bf16-mixed", device: str | None = None,
                 scaler: torch.amp.GradScaler | None = None) -> None:
        if precision not in ("16-mixed", "bf16-mixed"):
            raise ValueError(
                f"TP3DPrecision(precision={precision!r}): use '16-mixed' or 'bf16-mixed' here; for '32-true' and"
                " 'bf16-true' pass Trainer(precision=...)."
            )
        self._device_chosen = device is not None
        device = device or "cpu"
        if scaler is None and precision == "16-mixed":
            scaler = ModelParallelGradScaler(device=device)
        super().__init__(precision, device, scaler)

    def bind_device(self, device_type: str) -> None:
        """Autocast (and keep the scale) on `device_type`, the strategy's device, unless the constructor was
        given a device."""
        if self._device_chosen:
            return
        self.device = device_type
        if isinstance(self.scaler, ModelParallelGradScaler):
            self.scaler._device = device_type  # GradScaler keeps the device type for its own checks


def route_gradient_clipping(plugin: Any, core: Any, reduce_gradients: Callable[[], Any]) -> None:
    """Make Lightning's `gradient_clip_val` and `LightningModule.clip_gradients` clip by the global norm
    over tp, dp shards and pp (`core`: the strategy's `ParallelCore`).

    Lightning clips through the precision plugin, which sees only local gradients and cannot mix plain
    tensors with DTensors; its two clipping methods are bound to the core's versions (the optimizer's
    parameters: in "zero1" mode each dp rank's parts). Under manual optimization the module clips before
    `optimizer.step()`, so `reduce_gradients()` reduces them over dp first (a no-op once they are).
    """

    def clip_grad_by_norm(plugin: Any, optimizer: Any, clip_val: float) -> None:
        reduce_gradients()
        core.clip_gradients_by_norm(plugin.main_params(optimizer), clip_val)

    def clip_grad_by_value(plugin: Any, optimizer: Any, clip_val: float) -> None:
        reduce_gradients()
        clip_grad_value_(plugin.main_params(optimizer), clip_val)

    plugin.clip_grad_by_norm = types.MethodType(clip_grad_by_norm, plugin)
    plugin.clip_grad_by_value = types.MethodType(clip_grad_by_value, plugin)
