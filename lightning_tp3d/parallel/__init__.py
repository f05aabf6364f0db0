"""How a model is split: tensor parallel (DTensor), data parallel (replicate / FSDP2), gradient norms."""

from lightning_tp3d.parallel.data import DATA_PARALLEL_MODES, DataParallelMode, all_reduce_gradients, apply_fsdp
from lightning_tp3d.parallel.grad_norm import clip_grad_norm_, global_grad_norm
from lightning_tp3d.parallel.tensor import (
    TensorParallelPlan,
    apply_tensor_parallel,
    llama_tp_plan,
    resolve_tp_plan,
    shard_gradients_like_parameters,
)

__all__ = [
    "DATA_PARALLEL_MODES",
    "DataParallelMode",
    "TensorParallelPlan",
    "all_reduce_gradients",
    "apply_fsdp",
    "apply_tensor_parallel",
    "clip_grad_norm_",
    "global_grad_norm",
    "llama_tp_plan",
    "resolve_tp_plan",
    "shard_gradients_like_parameters",
]
