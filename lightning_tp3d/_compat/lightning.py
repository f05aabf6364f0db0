"""Lightning's private names used by the package (read from Lightning 2.6.6), and the four places where
Lightning has no hook, so the package replaces one of its functions (each with its reason).

* `ModelSummary` (and `RichModelSummary`) compute their table in the private `_summary(trainer,
  pl_module)` on every rank; under pipelining a rank holds one stage, so the strategy gives the callback a
  summary of the whole model (`use_model_summary`).
* `LightningModule.load_from_checkpoint(path)` reads `path` with `lightning.pytorch.core.saving.pl_load`,
  which opens a single file; `read_checkpoint_folders_with` lets it read a checkpoint folder too.
* `BaseFinetuning.filter_on_optimizer` compares parameters with `torch.equal`, which refuses a plain
  tensor against a DTensor; `compare_finetuning_parameters_with` gives it a comparison that takes both.

One warning is filtered (`quiet_known_deprecations`): Lightning 2.6's `utilities/_pytree.py` builds
`LeafSpec()`, which torch 2.13 deprecates, so every process of every run printed it twice; it says nothing
about the user's run, and Lightning's next release changes the call.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import lightning.pytorch.core.saving as _saving
from lightning.fabric.strategies.model_parallel import _ParallelBackwardSyncControl as ParallelBackwardSyncControl
from lightning.fabric.utilities.init import _materialize_distributed_module as materialize_distributed_module
from lightning.pytorch.utilities.data import _update_dataloader as update_dataloader

__all__ = [
    "LIGHTNING_VERSION",
    "quiet_known_deprecations",
    "ParallelBackwardSyncControl",
    "attached_trainer",
    "compare_finetuning_parameters_with",
    "detects_anomaly",
    "last_checkpoint_saved",
    "log_metrics",
    "materialize_distributed_module",
    "read_checkpoint_folders_with",
    "resolve_last_checkpoint_with",
    "set_device_mesh",
    "setup_process_groups",
    "should_accumulate",
    "should_update_logs",
    "summary_flop_counts",
    "summary_layers",
    "set_summary_layers",
    "update_dataloader",
    "use_model_summary",
]

LIGHTNING_VERSION = version("lightning")


def detects_anomaly(trainer: Any) -> bool:
    """`Trainer(detect_anomaly=...)` (Lightning turns torch's anomaly mode on only around the loop)."""
    return bool(trainer._detect_anomaly)


def should_accumulate(trainer: Any) -> bool:
    """Whether the coming backward accumulates (no optimizer step follows it)."""
    return trainer.fit_loop._should_accumulate()


def attached_trainer(module: Any) -> Any | None:
    """The Trainer `module` is attached to, or None (`LightningModule.trainer` raises when there is none; a
    plain `nn.Module` has none)."""
    return getattr(module, "_trainer", None)


def last_checkpoint_saved(callback: Any) -> str:
    """The path `ModelCheckpoint` wrote last ("" before its first save, or without a checkpoint callback)."""
    return getattr(callback, "_last_checkpoint_saved", "") if callback is not None else ""


def set_device_mesh(module: Any, mesh: Any) -> None:
    """Make `mesh` the module's `device_mesh`, as Lightning's `ModelParallelStrategy.setup_environment` does."""
    module._device_mesh = mesh


def setup_process_groups(strategy: Any) -> None:
    """The default process group of a `ModelParallelStrategy` (its environment, backend and timeout)."""
    strategy._setup_distributed()


def should_update_logs(trainer: Any) -> bool:
    """Whether this step logs (`Trainer(log_every_n_steps=...)`), as Lightning's own loggers decide."""
    return trainer._logger_connector.should_update_logs


def log_metrics(trainer: Any, metrics: dict[str, Any], step: int | None) -> None:
    """Hand `metrics` to the Trainer's loggers at `step`, as `ThroughputMonitor` does."""
    trainer._logger_connector.log_metrics(metrics, step=step)


def summary_layers(summary: Any) -> dict[str, Any]:
    """A `ModelSummary`'s rows: module name -> its `LayerSummary`."""
    return summary._layer_summary


def set_summary_layers(summary: Any, names: list[str]) -> None:
    """Give a `ModelSummary` the row names it numbers its table by (the values are not read)."""
    summary._layer_summary = dict.fromkeys(names)


def summary_flop_counts(summary: Any) -> dict[str, dict[Any, int]]:
    """A `ModelSummary`'s FLOPs per module, keyed as its `total_flops` reads them."""
    return summary._flop_counter.get_flop_counts()


def use_model_summary(callback: Any, summarize: Callable[[Any, int], Any]) -> None:
    """Make a `ModelSummary` callback build its table with `summarize(pl_module, max_depth)`."""

    def _summary(self: Any, trainer: Any, pl_module: Any) -> Any:
        return summarize(pl_module, self._max_depth)

    callback._summary = types.MethodType(_summary, callback)


def quiet_known_deprecations() -> None:
    """Filter the deprecation the module docstring names, raised in Lightning's own `_pytree` module only."""
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            module=r"lightning\.pytorch\.utilities\._pytree")


def read_checkpoint_folders_with(is_folder: Callable[[str | Path], bool],
                                 read_folder: Callable[[str | Path], dict]) -> None:
    """`load_from_checkpoint(path)` reads `path` (a path or URL) with `read_folder` when `is_folder(path)`,
    else as before."""
    original = getattr(_saving.pl_load, "__wrapped__", _saving.pl_load)

    def pl_load(path_or_url: Any, map_location: Any = None, **kwargs: Any) -> Any:
        if isinstance(path_or_url, (str, Path)) and is_folder(path_or_url):
            return read_folder(path_or_url)
        return original(path_or_url, map_location, **kwargs)

    pl_load.__wrapped__ = original
    _saving.pl_load = pl_load


def resolve_last_checkpoint_with(find_last: Callable[[Any], str | None]) -> None:
    """`ckpt_path="last"` resolves to `find_last(trainer)` where that is not None, else as Lightning does
    (which warns and starts afresh when it finds nothing)."""
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    original = _CheckpointConnector.__dict__["_parse_ckpt_path"]
    original = getattr(original, "__wrapped__", original)

    def _parse_ckpt_path(self: Any, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool
                         ) -> Any:
        found = find_last(self.trainer) if ckpt_path == "last" else None
        return found if found is not None else original(self, state_fn, ckpt_path, model_provided, model_connected)

    _parse_ckpt_path.__wrapped__ = original
    _CheckpointConnector._parse_ckpt_path = _parse_ckpt_path


_GRAD_NORM_ROUTE = "_lightning_tp3d_grad_norm_route"  # the name the routed code finds in Lightning's module


def _routed_grad_norm(module: Any, norm_type: Any, group_separator: str = "/") -> Any:
    """The code Lightning's `grad_norm` runs once routed: a call of the route its module's globals hold."""
    return _lightning_tp3d_grad_norm_route(module, norm_type, group_separator)  # noqa: F821 - Lightning's global


def route_grad_norm_with(route: Callable[[Any, Any, str], Any]) -> None:
    """Make Lightning's own `grad_norm` (`lightning.pytorch.utilities.grads.grad_norm`) call
    `route(module, norm_type, group_separator)`. Users import the function before any strategy exists
    (`from lightning.pytorch.utilities import grad_norm`), so its code object is replaced in place and every
    reference taken earlier is routed too; Lightning's own code stays callable as `lightning_grad_norm()`.
    Lightning 2.6.6's signature (module, norm_type, group_separator="/")."""
    from lightning.pytorch.utilities import grads

    function = grads.grad_norm
    if not hasattr(function, "__wrapped__"):
        original = types.FunctionType(function.__code__, function.__globals__, function.__name__,
                                      function.__defaults__, function.__closure__)
        original.__doc__ = function.__doc__
        function.__wrapped__ = original
        function.__code__ = _routed_grad_norm.__code__
    function.__globals__[_GRAD_NORM_ROUTE] = route


def lightning_grad_norm() -> Callable[..., Any]:
    """Lightning's own `grad_norm`, as Lightning wrote it (also once `route_grad_norm_with` has routed it)."""
    from lightning.pytorch.utilities import grads

    return getattr(grads.grad_norm, "__wrapped__", grads.grad_norm)


def compare_finetuning_parameters_with(equal: Callable[[Any, Any], bool]) -> Callable[[], None]:
    """Make `BaseFinetuning.filter_on_optimizer` (a static method Lightning calls through the class, so no
    instance can override it) test "this parameter is already in the optimizer" with `equal` in place of
    `torch.equal`, which fails on a mix of plain tensors and DTensors; returns what restores Lightning's.
    The body is Lightning's 2.6.6 one, warning included."""
    from lightning.pytorch.callbacks.finetuning import BaseFinetuning
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    original = BaseFinetuning.__dict__["filter_on_optimizer"]

    def filter_on_optimizer(optimizer: Any, params: Any) -> list:
        held = [held for group in optimizer.param_groups for held in group["params"]]
        out_params, removed_params = [], []
        for param in params:
            (removed_params if any(equal(other, param) for other in held) else out_params).append(param)
        if removed_params:
            rank_zero_warn(
                "The provided params to be frozen already exist within another group of this optimizer."
                " Those parameters will be skipped.\n"
                "HINT: Did you init your optimizer in `configure_optimizer` as such:\n"
                f" {type(optimizer)}(filter(lambda p: p.requires_grad, self.parameters()), ...) ",
            )
        return out_params

    BaseFinetuning.filter_on_optimizer = staticmethod(filter_on_optimizer)

    def restore() -> None:
        BaseFinetuning.filter_on_optimizer = original

    return restore
