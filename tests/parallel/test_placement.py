"""Device placement of everything the package hands to torch.distributed, checked on a CPU-only machine.

On GPUs the groups are NCCL and refuse CPU tensors; gloo on the CPU accepts them, so the CPU tests alone
never see a tensor created without `device=`. Here the strategy's device is the meta device (shapes, no
data; a non-CPU device every build has), the process group is torch's "fake" backend at world size 8
(the 2 x 2 x 2 mesh, this process is one rank of it), and `tests.device_guard.collectives_on` rejects any
tensor not on the meta device. A tensor made on the CPU by default fails here exactly where it would
crash under NCCL.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

FAKE_RANKS = (0, 4)  # the first rank of pipeline stage 0 and of stage 1 at (tp, pp, dp) = (2, 2, 2)


def _placement_checks() -> dict[str, object]:
    import os

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_tp3d.models.llama import LlamaForCausalLM
    from lightning_tp3d.parallel.grad_norm import global_grad_norm
    from lightning_tp3d.plan.config import MODEL_PRESETS
    from lightning_tp3d.strategies.core import ParallelCore
    from tests.device_guard import DeviceMismatch, collectives_on

    dist.init_process_group("fake", store=FakeStore(), rank=FAKE_RANKS[int(os.environ["RANK"])], world_size=8)
    device = torch.device("meta")
    core = ParallelCore(tensor_parallel_size=2, pipeline_parallel_size=2, num_microbatches=2)
    core.setup_mesh(8, "cpu", None)
    with device:
        network = LlamaForCausalLM(MODEL_PRESETS["tiny"])
    core.parallelize(network, network.config, lambda: 1.0, device)
    results: dict[str, object] = {"parameter_devices": sorted({str(p.device) for p in network.parameters()})}
    batch = torch.zeros(4, 16, dtype=torch.long, device=device)
    network.eval()
    with collectives_on(device) as calls, torch.no_grad():
        try:
            network(batch, labels=batch)  # validation (no grad): the pipelined forward without a schedule
            results["forward"] = "completed"
        except DeviceMismatch as error:
            results["forward"] = f"mismatch: {error}"
        except (NotImplementedError, RuntimeError) as error:
            # The receiving stage reads the header's values, which the meta device does not have: past
            # this point the guard has already checked the header's placement.
            results["forward"] = "stopped at reading received values" if "meta" in str(error) else repr(error)
        results["forward_calls"] = [(name, str(where)) for name, where in calls]
    with collectives_on(device) as calls:
        try:
            global_grad_norm([], core.group("pp"), device)  # a stage without gradients (frozen)
            results["grad_norm"] = "completed"
        except DeviceMismatch as error:
            results["grad_norm"] = f"mismatch: {error}"
        results["grad_norm_calls"] = [(name, str(where)) for name, where in calls]
    dist.destroy_process_group()
    return results


def test_everything_sent_over_the_pipeline_and_reduced_for_the_norm_is_on_the_group_device():
    first_stage, second_stage = run_distributed(2, "tests.parallel.test_placement:_placement_checks", timeout=300)
    for results in (first_stage, second_stage):
        assert results["parameter_devices"] == ["meta"]
        assert results["grad_norm"] == "completed"
        assert results["grad_norm_calls"] == [("all_reduce", "meta")]
    # stage 0 sends its hidden states (header, then tensor), then receives the loss broadcast
    assert first_stage["forward"] == "completed", first_stage["forward"]
    assert [name for name, _ in first_stage["forward_calls"]] == ["send", "send", "broadcast"]
    # stage 1 receives the header on the meta device first
    assert second_stage["forward"] == "stopped at reading received values", second_stage["forward"]
    assert second_stage["forward_calls"] == [("recv", "meta")]
