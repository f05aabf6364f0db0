"""`TP3DFabricStrategy`: the same 3-D parallelism for Lightning Fabric loops, registered as `"tp3d"`.

It shares `ParallelCore` with the Trainer strategy: layout, mesh, pipeline split, tensor parallel plan,
recompute, FSDP2, the pipelined forward, gradient all-reduce, global-norm clipping and the checkpoint
format are the same code. The network given to `fabric.setup` is parallelised in place; under pipeline
parallelism `model(input_ids, labels=labels)` runs the schedule's forward and backward and returns the
batch loss on every rank, and `fabric.backward(loss)` then adds the schedule's gradients, scaled as the
loop scaled the loss (`fabric.backward(loss / k)` when accumulating k batches under
`fabric.no_backward_sync`).

Example usage::

    fabric = Fabric(accelerator="cpu", devices=4, strategy=TP3DFabricStrategy(tensor_parallel_size=2,
                                                                              pipeline_parallel_size=2))
    fabric.launch()
    model = fabric.setup(LlamaForCausalLM(config))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    for batch in fabric.setup_dataloaders(loader):
        loss = model(batch["input_ids"], labels=batch["labels"])
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.utilities.types import Optimizable, ReduceOp
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_tp3d._compat.lightning import ParallelBackwardSyncControl
from lightning_tp3d.io.storage import location
from lightning_tp3d.parallel.grad_norm import clip_grad_value_
from lightning_tp3d.strategies.base import TP3DStrategyBase, name_stuck_collectives_in
from lightning_tp3d.strategies.checkpointing import model_config
from lightning_tp3d.strategies.core import ParallelCore
from lightning_tp3d.strategies.options import ParallelOptions, document_options, with_option_signature
from lightning_tp3d.strategies.precision import check_supported_precision, current_loss_scale

__all__ = ["TP3DFabricStrategy"]

_KEYS = "tp3d_state_keys"  # where a Fabric checkpoint records which of its keys were the model and optimizers


class _BackwardSyncControl(ParallelBackwardSyncControl):
    """`fabric.no_backward_sync(model)`: FSDP2 skips its reduce-scatter, replicate mode its all-reduce."""

    def __init__(self, strategy: TP3DFabricStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        @contextmanager
        def skipping() -> Generator[None, None, None]:
            previous, self._strategy._gradient_sync = self._strategy._gradient_sync, not enabled
            try:
                with super(_BackwardSyncControl, self).no_backward_sync(module, enabled):
                    yield
            finally:
                self._strategy._gradient_sync = previous

        return skipping()


@document_options
class TP3DFabricStrategy(TP3DStrategyBase, ModelParallelStrategy):
    """Fabric strategy for 3-D parallel training; the arguments are `TP3DStrategy`'s (without the
    Trainer-only `model_attribute` and `async_checkpoint`): the network is the module given to `setup`.

    Args:
        process_group_backend: "gloo" / "nccl"; default from the device (gloo on CPU, nccl on CUDA).
        timeout: timeout of every collective (see `TP3DStrategy`).
    """

    @with_option_signature
    def __init__(self, *, process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 **options: Any) -> None:
        parallel_options = ParallelOptions.from_keywords(type(self).__name__, options)
        if not parallel_options.save_frozen_weights:
            raise ValueError("save_frozen_weights=False is an option of the Trainer strategy; with Fabric, leave the"
                             " frozen weights out with fabric.save(path, state, filter={'model': ...}).")
        tp, _, dp = parallel_options.sizes
        super().__init__(parallelize_fn=self._parallelize, data_parallel_size=dp, tensor_parallel_size=tp,
                         save_distributed_checkpoint=True, process_group_backend=process_group_backend, timeout=timeout)
        self.core = ParallelCore(parallel_options)
        self._backward_sync_control = _BackwardSyncControl(self)
        self._gradient_sync = True
        self._network: nn.Module | None = None
        self._last_loss: torch.Tensor | None = None
        self._optimizer_steps = 0

    @override
    def teardown(self) -> None:
        self.core.release()
        super().teardown()

    @override
    def setup_environment(self) -> None:
        self.accelerator.setup_device(self.root_device)
        self._setup_distributed_mesh()

    def _parallelize(self, module: nn.Module, _: Any) -> nn.Module:
        check_supported_precision(self.precision.precision, float8=self.core.options.float8)
        if self.core.parallelize(module, model_config(module), self._loss_scale, self.root_device):
            self.core.load_pretrained(module)
        self._network = module
        return module

    def _loss_scale(self) -> torch.Tensor | float:
        return current_loss_scale(getattr(self.precision, "scaler", None))

    # ------------------------------------------------------------------ step
    @override
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Under pipelining the schedule already ran backward in the forward call: the backward of `tensor`
        (the returned loss, scaled by the loop, e.g. `loss / k` when accumulating) fixes the factor the
        schedule's gradients are added with."""
        network = module if module is not None else self._network
        if network is not None:
            self.core.before_backward(network.parameters(), completes_gradients=self._gradient_sync)
        super().backward(tensor, module, *args, **kwargs)
        self._last_loss = tensor.detach()
        if self.core.pipeline is not None:
            self.core.take_pipeline_gradients()
        # `fabric.backward(loss)` without `model=` passes no module: reduce the network this strategy set up.
        if self._gradient_sync and network is not None:
            self.core.all_reduce_gradients(network.parameters())

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """The update, unless the last backward's loss or a gradient is not finite on any rank: then every
        rank skips it and returns None (`step_guard.last_step_skipped`; a loop's own LR scheduler should
        skip its step too). See `strategies.non_finite`."""
        step, self._optimizer_steps = self._optimizer_steps, self._optimizer_steps + 1
        parameters = [parameter for group in getattr(optimizer, "param_groups", []) for parameter in group["params"]]
        if self._skips_non_finite_step(self._last_loss, parameters, step, getattr(self.precision, "scaler", None)):
            return None
        output = super().optimizer_step(optimizer, **kwargs)
        self.core.data_parallel.after_optimizer_step()
        return output

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """In `data_parallel_mode="zero1"` the optimizer is handed this dp rank's parts of the parameters."""
        if self._network is not None:
            self.core.data_parallel.shard_optimizers(self._network, [optimizer])
        elif self.core.data_parallel.shards_optimizers:
            raise RuntimeError("data_parallel_mode='zero1': set up the module with `fabric.setup(module)` before its"
                               " optimizer (the optimizer is handed parts of the set-up module's parameters).")
        return super().setup_optimizer(optimizer)

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """Clip by the global 2-norm over tp shards, dp shards and pipeline stages; returns that norm."""
        if norm_type != 2.0:
            raise ValueError(f"TP3DFabricStrategy clips by the global 2-norm only, got norm_type={norm_type}.")
        self.precision.unscale_gradients(optimizer)
        norm = self.core.clip_gradients_by_norm(self.precision.main_params(optimizer), max_norm)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"The global gradient norm is {norm.item()}; pass error_if_nonfinite=False to go on.")
        return norm

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.unscale_gradients(optimizer)
        clip_grad_value_(self.precision.main_params(optimizer), clip_val)

    @override
    def all_reduce(self, tensor: torch.Tensor, group: Any | None = None,
                   reduce_op: ReduceOp | str | None = "mean") -> torch.Tensor:
        """Over the dp group by default (see `TP3DStrategyBase._reduction_group`)."""
        return super().all_reduce(tensor, group=self._reduction_group(group), reduce_op=reduce_op)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """The Trainer strategy's checkpoint format: one model, its optimizers, the rest of `state`.

        `filter` keeps, for a key of `state`, the entries `(name, value)` it returns True for, as Fabric
        does: for the model, tensors of its state dict by name (every rank filters its own shards; load the
        checkpoint with `strict=False`), for a dict value its items. An optimizer's state is sharded like the
        parameters and saved whole, so a filter on an optimizer's key is refused."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options (it writes DCP shards).")
        path = location(self.broadcast(str(path)))
        model_key, module, optimizers = _split_state(state)
        filter = filter or {}
        if any(key in optimizers for key in filter):
            raise ValueError(
                f"filter={{{', '.join(repr(key) for key in filter if key in optimizers)}: ...}} names an optimizer:"
                f" {type(self).__name__} saves an optimizer's (sharded) state whole. Filter the model's key"
                f" ({model_key!r}) or plain dicts only."
            )
        rest = {key: _filtered(value, filter.get(key)) for key, value in state.items()
                if key != model_key and key not in optimizers}
        rest[_KEYS] = {"model": model_key, "optimizers": list(optimizers)}
        step = state.get("step", 0)
        meta = self.core.checkpoint_meta(self.world_size, step if isinstance(step, int) else 0, 0, "", module,
                                         str(self.precision.precision))
        model_state, optimizer_states = self.core.states_of(module, list(optimizers.values()))
        self.core.save(path, _filtered(model_state, filter.get(model_key)), optimizer_states, rest, meta)

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Fill `state`'s model and optimizers (any saved layout) and its other keys; return what is left."""
        if not isinstance(state, dict):
            raise TypeError(f"{type(self).__name__}.load_checkpoint needs state={{'model': model, ...}}.")
        path = location(self.broadcast(str(path)))
        model_key, module, optimizers = _split_state(state)
        _, saved = self.core.load(path, module, list(optimizers.values()), strict, self.global_rank)
        saved.pop(_KEYS, None)
        for key in [key for key in state if key != model_key and key not in optimizers and key in saved]:
            state[key] = saved.pop(key)
        return saved


def _filtered(value: Any, keep: Callable[[str, Any], bool] | None) -> Any:
    if keep is None or not isinstance(value, dict):
        return value
    return {key: item for key, item in value.items() if keep(key, item)}


def _split_state(state: Mapping[str, Any]) -> tuple[str, nn.Module, dict[str, Optimizer]]:
    modules = [key for key, value in state.items() if isinstance(value, nn.Module)]
    if len(modules) != 1:
        raise ValueError(f"A TP3DFabricStrategy checkpoint holds exactly one model; state has {len(modules)}"
                         f" modules ({modules}).")
    optimizers = {key: value for key, value in state.items() if isinstance(value, Optimizer)}
    return modules[0], state[modules[0]], optimizers


name_stuck_collectives_in(TP3DFabricStrategy, ("backward", "optimizer_step", "clip_gradients_norm", "save_checkpoint",
                                               "load_checkpoint", "all_reduce", "all_gather", "reduce_boolean_decision",
                                               "barrier", "broadcast"))
