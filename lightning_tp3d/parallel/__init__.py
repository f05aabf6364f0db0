"""How a model is split: tensor parallel (DTensor), data parallel (`data_parallel`), gradient norms."""

from lightning_tp3d.parallel.grad_norm import clip_grad_norm_, global_grad_norm
from lightning_tp3d.parallel.tensor import (
    TensorParallelPlan,
    apply_tensor_parallel,
    resolve_tp_plan,
    shard_gradients_like_parameters,
)

__all__ = [
    "TensorParallelPlan",
    "apply_tensor_parallel",
    "clip_grad_norm_",
    "global_grad_norm",
    "resolve_tp_plan",
    "shard_gradients_like_parameters",
]
