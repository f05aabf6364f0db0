"""`OverlappedGradientReduction` on 2 processes: buckets all-reduced during backward give the gradients of
the plain after-backward all-reduce (exactly: same sums), several buckets are launched before backward
ends, an accumulating backward launches nothing, and a second backward into launched buckets is refused.
The Trainer and Fabric paths are covered by the parity tests (dp 2 replicate, with accumulation)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_tp3d.parallel.data_parallel.overlap import OverlappedGradientReduction
from lightning_tp3d.parallel.data_parallel.replicate import all_reduce_gradients
from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'


def _network() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])


def _backward(network: torch.nn.Module, scale: float = 1.0) -> None:
    torch.manual_seed(1 + dist.get_rank())
    (network(torch.randn(8, 32)).square().mean() * scale).backward()


def run_world() -> dict[str, Any]:
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    plain, overlapped = _network(), _network()
    _backward(plain)
    all_reduce_gradients(list(plain.parameters()), group, 2)
    # Two Linear layers (4 parameters, 8,448 bytes) per bucket: 3 buckets.
    reduction = OverlappedGradientReduction(overlapped.parameters(), group, 2, bucket_bytes=8_500)
    launched_during_backward = []
    hook = overlapped[0].weight.register_hook(lambda grad: launched_during_backward.append(
        sum(bucket.launched for bucket in reduction.buckets)))
    _backward(overlapped)
    reduction.finish()
    hook.remove()
    equal = all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), overlapped.parameters()))
    # Accumulation: the first backward launches nothing, the second (sync) completes the sum.
    accumulated = _network()
    accumulating = OverlappedGradientReduction(accumulated.parameters(), group, 2, bucket_bytes=8_500)
    accumulating.sync = False
    _backward(accumulated, 0.5)
    launched_while_accumulating = sum(bucket.launched for bucket in accumulating.buckets)
    accumulating.sync = True
    _backward(accumulated, 0.5)
    accumulating.finish()
    accumulated_equal = all(torch.allclose(a.grad, b.grad, rtol=1e-6, atol=0)
                            for a, b in zip(plain.parameters(), accumulated.parameters()))
    try:
        _backward(overlapped)
        _backward(overlapped)
        refused = None
    except RuntimeError as error:
        refused = str(error)
    return {"buckets": len(reduction.buckets), "launched_during_backward": launched_during_backward,
            "equal": equal, "launched_while_accumulating": launched_while_accumulating,
            "accumulated_equal": accumulated_equal, "refused": refused}


def test_overlapped_reduction_launches_during_backward_and_equals_the_plain_all_reduce():
    for rank in run_distributed(2, "tests.parallel.data_parallel.test_overlap:run_world"):
        assert rank["buckets"] == 3
        # When the first layer's weight gradient is computed, the buckets of the later layers are in flight.
        assert rank["launched_during_backward"] == [2]
        assert rank["equal"] and rank["accumulated_equal"]
        assert rank["launched_while_accumulating"] == 0
        assert "A gradient arrived after its bucket was all-reduced over dp" in rank["refused"]


def run_fit_world() -> dict[str, Any]:
    """A Trainer fit at dp 2 (replicate, overlapped); what of its network outlives the run."""
    import gc
    import weakref

    import lightning as L

    from lightning_tp3d import TP3DStrategy
    from lightning_tp3d.data import TokenDataModule
    from lightning_tp3d.models import CausalLMModule
    from tests.helpers import SEQ_LEN, trainer_kwargs

    module = CausalLMModule("tiny")
    trainer = L.Trainer(**trainer_kwargs(devices=2, strategy=TP3DStrategy(), max_steps=2, logger=False))
    trainer.fit(module, TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=2))
    parameters = [weakref.ref(parameter) for parameter in module.parameters()]
    del module, trainer
    gc.collect()
    return {"parameters": len(parameters), "alive": sum(parameter() is not None for parameter in parameters)}


def test_a_finished_run_leaves_no_hook_and_its_network_is_freed():
    """The strategy's teardown removes the reduction's gradient hooks: the cycle parameter -> hook ->
    reduction -> parameter lives partly in autograd's C++ state, where Python's collector cannot free it,
    so a kept hook would keep every finished run's network and dp group (and its gloo threads) alive."""
    for rank in run_distributed(2, "tests.parallel.data_parallel.test_overlap:run_fit_world"):
        assert rank["parameters"] > 0 and rank["alive"] == 0, rank
