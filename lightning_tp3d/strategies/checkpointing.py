"""The core's checkpoint states: what a sharded checkpoint holds of the module, its optimizers, the random
states and the data position, and how a load puts them back at any layout.

The module's state dict and each optimizer's flattened one are this rank's shards keyed by global name
(`state.<name>.exp_avg`, not by position), so DCP reshards them to any (tp, pp, dp) and any data-parallel
mode; under ZeRO-1 the optimizers hold parts of the parameters and are read through
`DataParallel.optimizer_owner`, a module tree of the parts under the same names.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from lightning_tp3d.io.checkpoint import load_checkpoint, load_rng_state
from lightning_tp3d.io.checkpoint_format import MODEL_GROUP, CheckpointError, CheckpointMeta, read_meta
from lightning_tp3d.io.frozen_base import frozen_fingerprint, tensor_digest
from lightning_tp3d.io.random_state import restore_rng_state
from lightning_tp3d.models.adapter import shaped_config
from lightning_tp3d.parallel.nf4 import dequantized
from lightning_tp3d.plan.layout import ParallelLayout

__all__ = ["FLAT_OPTIMIZER_STATE", "UNSTEPPED", "frozen_weights_fingerprint", "load_states", "model_config",
           "optimizer_state", "restore_random_states", "sharded_state", "without_frozen"]

# Flattened optimizer state is keyed by parameter name (`state.<name>.exp_avg`), not by position, so the
# state of a stage's parameters is found again under any pipeline split.
FLAT_OPTIMIZER_STATE = StateDictOptions(flatten_optimizer_state_dict=True)
# The flag in a saved optimizer state telling that the optimizer had taken no step (see `optimizer_state`).
UNSTEPPED = "tp3d_unstepped"

def model_config(*owners: nn.Module | None) -> Any | None:
    """The first `config` with the decoder's shape fields found on `owners` (network, LightningModule)."""
    return next((config for config in map(shaped_config, owners) if config is not None), None)


def optimizer_state(owner: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer`'s flattened state dict (its parameters are `owner`'s), with `UNSTEPPED`: whether it has
    taken no step. torch builds a missing state with a step at learning rate 0, after which Adam's step
    count would start at 1 (its bias correction off for the whole run): such an optimizer is left without
    state, and so is one loaded from its checkpoint (`load_states`)."""
    unstepped = not optimizer.state and all(parameter.grad is None for group in optimizer.param_groups
                                            for parameter in group["params"])
    state = get_optimizer_state_dict(owner, optimizer, options=FLAT_OPTIMIZER_STATE)
    if unstepped:
        optimizer.state.clear()
    return {**state, UNSTEPPED: unstepped}


def sharded_state(model_state: dict[str, Any], optimizer_states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The groups `io.checkpoint` writes and reads: the module and each (flattened) optimizer."""
    optimizers = {f"optimizer_{index}": state for index, state in enumerate(optimizer_states)}
    return {MODEL_GROUP: model_state, **optimizers}


def without_frozen(model_state: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """`model_state` without the entries of `module`'s parameters that do not train."""
    frozen = {name for name, parameter in module.named_parameters() if not parameter.requires_grad}
    return {name: value for name, value in model_state.items() if name not in frozen}


def frozen_weights_fingerprint(module: nn.Module, pp_group: dist.ProcessGroup | None) -> dict[str, Any]:
    """The digest of the frozen weights, the same at every layout (`io.frozen_base.frozen_fingerprint`): each
    whole tensor (a DTensor gathered, one at a time; an NF4 weight dequantised) by name, from every pipeline
    stage (gathered over `pp_group`). A collective over each parameter's mesh and over `pp_group`."""
    digests = {}
    for name, parameter in module.named_parameters():
        if not parameter.requires_grad:
            whole = dequantized(parameter)  # a QLoRA base's NF4 weight: the values it stands for
            digests[name] = tensor_digest(whole.full_tensor() if isinstance(whole, DTensor) else whole)
    stages = [digests]
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        stages = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(stages, digests, group=pp_group)
    return frozen_fingerprint({name: digest for stage in stages for name, digest in stage.items()})


def load_states(path: Path, module: nn.Module, owner: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                strict: bool, verify: bool, pp_group: dist.ProcessGroup | None = None
                ) -> tuple[CheckpointMeta, dict[str, Any]]:
    """Fill `module` and `optimizers` (whose parameters are `owner`'s) from the checkpoint at `path`, of any
    layout; return its meta and the saved trainer state. A checkpoint without the frozen weights
    (`save_frozen_weights=False`) leaves them as the module built them, after checking that they are the
    weights it was trained on (`frozen_weights_fingerprint`)."""
    model_state = get_model_state_dict(module)
    recorded = read_meta(path).frozen_weights
    if recorded is not None:
        model_state = without_frozen(model_state, module)
        found = frozen_weights_fingerprint(module, pp_group)
        if found != recorded:
            raise CheckpointError(
                f"{path} was saved without its frozen weights ({recorded.get('tensors')} tensors, sha256"
                f" {str(recorded.get('sha256'))[:12]}...), and the module's frozen weights differ ({found['tensors']}"
                f" tensors, sha256 {found['sha256'][:12]}...): build the same base model (the same folder or seed)"
                " before resuming."
            )
    optimizer_states = [optimizer_state(owner, optimizer) for optimizer in optimizers]
    for state in optimizer_states:
        state[UNSTEPPED] = False  # unless the checkpoint says so
    meta, trainer_state = load_checkpoint(path, sharded_state(model_state, optimizer_states), strict=strict,
                                          verify=verify)
    set_model_state_dict(module, model_state, options=StateDictOptions(strict=strict and recorded is None))
    for optimizer, state in zip(optimizers, optimizer_states):
        unstepped = state.pop(UNSTEPPED)
        set_optimizer_state_dict(owner, optimizer, state, options=FLAT_OPTIMIZER_STATE)
        if unstepped:
            optimizer.state.clear()
    return meta, trainer_state


def restore_random_states(path: Path, meta: CheckpointMeta, layout: ParallelLayout, global_rank: int) -> None:
    """This rank's random states from the checkpoint when it was saved at `layout`'s sizes; otherwise they
    belong to other ranks, and a warning says so."""
    current = (layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.data_parallel_size)
    if meta.parallel_sizes == current:
        restore_rng_state(load_rng_state(path, global_rank))
        return
    rank_zero_warn(
        f"Resharding checkpoint {path}: saved at (tp, pp, dp) = {meta.parallel_sizes}, loading at {current}."
        " Model and optimizer state are resharded; random states belong to the old ranks and are not restored."
    )
