"""`build_data_parallel`: one class per reduction, and the steps of the modes that have nothing to do."""

import pytest
import torch
from torch import nn

from lightning_tp3d.parallel.data_parallel import (
    DataParallel,
    FullyShard,
    ReplicateAfterBackward,
    ReplicateOverlapped,
    ShardedOptimizerState,
    build_data_parallel,
)
from lightning_tp3d.plan.data_parallel import choose_data_parallel


@pytest.mark.parametrize(("mode", "dp", "pp", "kind"), [
    ("replicate", 1, 1, DataParallel), ("zero1", 1, 2, DataParallel), ("replicate", 2, 1, ReplicateOverlapped),
    ("replicate", 2, 2, ReplicateAfterBackward), ("zero1", 2, 1, ShardedOptimizerState), ("fsdp", 1, 1, FullyShard),
    ("fsdp", 2, 2, FullyShard),
])
def test_each_plan_is_carried_out_by_its_class(mode: str, dp: int, pp: int, kind: type) -> None:
    data_parallel = build_data_parallel(choose_data_parallel(mode, dp, pp), mesh=None)  # the mesh is read lazily
    assert type(data_parallel) is kind
    assert data_parallel.shards_optimizers == (kind is ShardedOptimizerState)


def test_with_nothing_to_reduce_the_steps_keep_gradients_optimizers_and_owner_as_they_are() -> None:
    data_parallel = build_data_parallel(choose_data_parallel("zero1", 1), mesh=None)
    module = nn.Linear(3, 2)
    module(torch.ones(1, 3)).sum().backward()
    gradients = [parameter.grad.clone() for parameter in module.parameters()]
    optimizer = torch.optim.AdamW(module.parameters())
    data_parallel.wrap([module], [])
    data_parallel.before_backward(module.parameters(), completes_gradients=True)
    data_parallel.shard_optimizers(module, [optimizer])
    assert data_parallel.reduce_gradients(list(module.parameters())) == list(module.parameters())
    data_parallel.after_optimizer_step()
    assert all(torch.equal(parameter.grad, gradient) for parameter, gradient in zip(module.parameters(), gradients))
    assert optimizer.param_groups[0]["params"] == list(module.parameters())
    assert data_parallel.optimizer_owner(module) is module
