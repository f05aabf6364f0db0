"""Expert parallelism's refusals (`parallel.experts`, the layout, the options, the model adapters); its
parity with one process runs in `tests/models/test_deepseek.py`, which holds the mixture-of-experts model."""

from __future__ import annotations

import pytest

from lightning_tp3d import LayoutError, ParallelLayout
from lightning_tp3d.models.families import resolve_model_adapter
from lightning_tp3d.parallel.experts import ExpertParallelExperts, is_expert_parameter
from lightning_tp3d.strategies.options import ParallelOptions
from lightning_tp3d.strategies.parallelize import _check_experts
from tests.helpers import reference_network

transformers = pytest.importorskip("transformers")


def test_the_expert_parallel_group_is_carved_out_of_dp():
    layout = ParallelLayout.resolve(world_size=8, tensor_parallel_size=2, expert_parallel_size=2)
    assert layout.data_parallel_size == 4 and layout.to_dict()["expert_parallel_size"] == 2
    assert ParallelLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(LayoutError, match=r"expert_parallel_size=3 does not divide data_parallel_size=4: the"
                                          r" expert-parallel group is carved out of the data-parallel ranks"):
        ParallelLayout.resolve(world_size=8, tensor_parallel_size=2, expert_parallel_size=3)


@pytest.mark.parametrize("mode", ["replicate", "fsdp", "zero1"])
def test_expert_parallel_is_accepted_in_every_data_parallel_mode_and_must_be_positive(mode):
    assert ParallelOptions(expert_parallel_size=2, data_parallel_mode=mode).expert_parallel_size == 2
    with pytest.raises(ValueError, match=r"expert_parallel_size must be a positive integer, got 0"):
        ParallelOptions(expert_parallel_size=0)


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved_1f1b", "zbv_zero_bubble", "dualpipev"])
def test_expert_parallel_is_accepted_under_every_pipeline_schedule(schedule):
    options = ParallelOptions(expert_parallel_size=2, pipeline_parallel_size=2, pipeline_schedule=schedule,
                              num_microbatches=4)
    assert (options.expert_parallel_size, options.pipeline_schedule) == (2, schedule)


class _Mesh:
    """What `ExpertParallelExperts` reads of its mesh before it refuses: the size of "ep"."""

    def size(self, dim: int) -> int:
        return 3


def test_an_expert_count_the_group_does_not_divide_is_refused():
    from tests.models.test_deepseek import SHAPE

    experts = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Experts(
        transformers.DeepseekV3Config(**SHAPE))
    with pytest.raises(ValueError, match=r"expert_parallel_size=3 does not divide the 4 routed experts of a block"):
        ExpertParallelExperts(experts, _Mesh())
    assert not is_expert_parameter(experts.gate_up_proj)


def test_only_mixture_of_experts_families_name_routed_experts():
    from tests.models.test_deepseek import deepseek_network

    network = deepseek_network()
    blocks = list(network.model.layers)
    found = resolve_model_adapter(network).routed_experts(blocks)
    assert [parent for parent, _ in found] == [block.mlp for block in blocks[1:]]  # block 0 is dense
    assert all(attribute == "experts" for _, attribute in found)
    dense = reference_network()
    assert resolve_model_adapter(dense).routed_experts(list(dense.model.layers)) == []
    with pytest.raises(LayoutError, match=r"expert_parallel_size=2 needs a mixture-of-experts model, but the"
                                          r" decoder with Llama names network has no routed experts"):
        _check_experts(dense, resolve_model_adapter(dense),
                       ParallelLayout(data_parallel_size=2, expert_parallel_size=2))
