"""`TP3DStrategy`: tensor x pipeline x data parallel training inside `lightning.Trainer`.

Data flows one way: the constructor's sizes become a `ParallelLayout` (validated against the world
size before processes are launched and against the model config before any process group exists),
the layout becomes a ("pp", "dp", "tp") `DeviceMesh`, and the mesh shards the LightningModule's network
in the order tensor parallel -> data parallel (FSDP2 must wrap parameters that are already DTensors).

Example usage::

    trainer = Trainer(accelerator="cpu", devices=4, strategy=TP3DStrategy(tensor_parallel_size=2))
    trainer.fit(CausalLMModule("tiny"), TokenDataModule(batch_size=4))

or by name, `Trainer(strategy="tp3d")`, which is plain data parallelism over all processes.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle
from typing_extensions import override

from lightning_tp3d.layout import LayoutError, ParallelLayout
from lightning_tp3d.mesh import build_device_mesh
from lightning_tp3d.parallel.data import DATA_PARALLEL_MODES, all_reduce_gradients, apply_fsdp
from lightning_tp3d.parallel.grad_norm import clip_grad_norm_
from lightning_tp3d.parallel.tensor import apply_tensor_parallel, resolve_tp_plan

__all__ = ["TP3DStrategy"]

_MODEL_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads")


def _resolve_attribute(root: nn.Module, path: str, what: str) -> Any:
    value: Any = root
    for part in path.split("."):
        if not hasattr(value, part):
            raise AttributeError(
                f"{type(root).__name__} has no {what} at {path!r} (no attribute {part!r} on"
                f" {type(value).__name__}); build it in `configure_model` or pass TP3DStrategy({what}=...)."
            )
        value = getattr(value, part)
    return value


def _model_config(lightning_module: nn.Module, network: nn.Module | None) -> Any | None:
    for owner in (network, lightning_module):
        config = getattr(owner, "config", None)
        if config is not None and all(hasattr(config, field) for field in _MODEL_SHAPE_FIELDS):
            return config
    return None


class TP3DStrategy(ModelParallelStrategy):
    """Trainer strategy for 3-D parallel training on a ("pp", "dp", "tp") device mesh.

    Args:
        tensor_parallel_size: processes that split every layer (innermost mesh dimension).
        pipeline_parallel_size: pipeline stages. Only 1 is available in this release.
        data_parallel_size: model replicas; `"auto"` is world size / (tp x pp).
        data_parallel_mode: `"replicate"` (gradients all-reduced over dp, DDP semantics) or `"fsdp"`
            (FSDP2: parameters, gradients and optimizer state sharded over dp).
        tp_plan: module-name pattern -> `ParallelStyle` mapping, a function returning one, or its
            import path `"package.module:function"`; default: the plan for Hugging Face Llama names.
        model_attribute: attribute of the LightningModule holding the network to parallelise.
        layers_attribute: attribute of that network holding its transformer blocks (FSDP units, stages).
        process_group_backend: `"gloo"` / `"nccl"`; default from the device (gloo on CPU, nccl on CUDA).
        timeout: timeout of the process groups' collectives.
    """

    strategy_name = "tp3d"

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int | Literal["auto"] = "auto",
        data_parallel_mode: Literal["replicate", "fsdp"] = "replicate",
        tp_plan: Mapping[str, ParallelStyle] | Callable[[], Mapping[str, ParallelStyle]] | str | None = None,
        model_attribute: str = "model",
        layers_attribute: str = "model.layers",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        # Validates the sizes now, so a typo fails at construction and not after launching processes.
        ParallelLayout(tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size)
        if pipeline_parallel_size != 1:
            raise LayoutError(
                f"pipeline_parallel_size={pipeline_parallel_size} is not available in this release of"
                " lightning_tp3d; use pipeline_parallel_size=1."
            )
        if data_parallel_mode not in DATA_PARALLEL_MODES:
            raise ValueError(
                f"data_parallel_mode={data_parallel_mode!r} is not one of {list(DATA_PARALLEL_MODES)}."
            )
        self._pipeline_parallel_size = pipeline_parallel_size
        self._data_parallel_mode = data_parallel_mode
        self._tp_plan = resolve_tp_plan(tp_plan)
        self._model_attribute = model_attribute
        self._layers_attribute = layers_attribute
        self._layout: ParallelLayout | None = None
        self._parallelized_network: nn.Module | None = None

    # ------------------------------------------------------------------ layout and mesh
    @property
    def layout(self) -> ParallelLayout:
        if self._layout is None:
            raise RuntimeError("The layout is resolved when the Trainer configures the strategy (world size known).")
        return self._layout

    @property
    def data_parallel_mode(self) -> str:
        return self._data_parallel_mode

    def _resolve_layout(self) -> ParallelLayout:
        world_size = self.num_nodes * self.num_processes
        return ParallelLayout.resolve(
            world_size=world_size,
            tensor_parallel_size=self._tensor_parallel_size,
            pipeline_parallel_size=self._pipeline_parallel_size,
            data_parallel_size=self._data_parallel_size,
        )

    @override
    def _configure_launcher(self) -> None:
        # Called by the Trainer once devices and nodes are known, before any process is launched.
        self._layout = self._resolve_layout()
        super()._configure_launcher()

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        config = _model_config(model, getattr(model, self._model_attribute.split(".")[0], None))
        if config is not None and self._layout is not None:
            self._layout.validate_model(config)

    @override
    def setup_environment(self) -> None:
        self._setup_distributed()
        self._layout = self._resolve_layout()
        self._device_mesh = build_device_mesh(self._layout, self.root_device.type)
        # `LightningModule.device_mesh` makes the mesh reachable from `configure_model` and the steps.
        self.lightning_module._device_mesh = self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        coordinates = self.layout.coordinates(self.global_rank)
        return {"num_replicas": self.layout.data_parallel_size, "rank": coordinates.dp}

    def _group(self, name: str) -> torch.distributed.ProcessGroup:
        return self.device_mesh[name].get_group()

    # ------------------------------------------------------------------ model
    def _network(self) -> nn.Module:
        network = _resolve_attribute(self.lightning_module, self._model_attribute, "model_attribute")
        if not isinstance(network, nn.Module):
            raise TypeError(
                f"LightningModule.{self._model_attribute} is {type(network).__name__}, not an nn.Module; build the"
                " network in `configure_model` or point TP3DStrategy(model_attribute=...) at it."
            )
        return network

    def _blocks(self, network: nn.Module) -> list[nn.Module]:
        layers = _resolve_attribute(network, self._layers_attribute, "layers_attribute")
        return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)

    def _parallelize(self, network: nn.Module) -> None:
        """Tensor parallel first (DTensor weights over tp), then FSDP2 over dp, which wraps those DTensors.

        Runs once per network: `trainer.validate` / `test` after `fit` reuse the parallel model.
        """
        if network is self._parallelized_network:
            return
        layout = self.layout
        config = _model_config(self.lightning_module, network)
        if config is not None:
            layout.validate_model(config)
        if layout.tensor_parallel_size > 1:
            apply_tensor_parallel(network, self.device_mesh["tp"], self._tp_plan)
        if self._data_parallel_mode == "fsdp":
            apply_fsdp(network, self.device_mesh["dp"], self._blocks(network))
        self._parallelized_network = network

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self._parallelize(self._network())
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._route_gradient_clipping()

    # ------------------------------------------------------------------ step
    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._data_parallel_mode == "replicate" and self.layout.data_parallel_size > 1:
            closure = self._with_gradient_all_reduce(closure)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def _with_gradient_all_reduce(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        # Runs after the (last accumulated) backward and before clipping and the optimizer update.
        def closure_then_all_reduce() -> Any:
            result = closure()
            all_reduce_gradients(self.lightning_module.parameters(), self._group("dp"), self.layout.data_parallel_size)
            return result

        return closure_then_all_reduce

    def _route_gradient_clipping(self) -> None:
        """Make Lightning's `gradient_clip_val` clip by the global norm over tp, dp shards and pp.

        Lightning clips through the precision plugin, which sees only local gradients and cannot mix
        plain tensors with DTensors; its two clipping methods are bound to this strategy's versions.
        """
        strategy = self

        def clip_grad_by_norm(plugin: Any, optimizer: Any, clip_val: float) -> None:
            clip_grad_norm_(plugin.main_params(optimizer), clip_val, strategy._group("pp"))

        def clip_grad_by_value(plugin: Any, optimizer: Any, clip_val: float) -> None:
            for parameter in plugin.main_params(optimizer):
                grad = parameter.grad
                if grad is not None:
                    (grad.to_local() if isinstance(grad, DTensor) else grad).clamp_(-clip_val, clip_val)

        self.precision_plugin.clip_grad_by_norm = types.MethodType(clip_grad_by_norm, self.precision_plugin)
        self.precision_plugin.clip_grad_by_value = types.MethodType(clip_grad_by_value, self.precision_plugin)

    # ------------------------------------------------------------------ collectives
    @override
    def reduce(
        self, tensor: torch.Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> torch.Tensor | Any:
        """Reduce over the dp group by default: logged values are replicated over tp and pp ranks, so a
        reduction over the whole world would count each sample tp x pp times under `"sum"`."""
        if group is None and self._device_mesh is not None:
            group = self._group("dp")
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Tensor x pipeline x data parallel strategy of lightning_tp3d"
        )
