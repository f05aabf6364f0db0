"""Sharded initialisation: each rank materialises only its shard, with the whole network's values."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_tp3d.models.llama import LlamaForCausalLM
from lightning_tp3d.parallel.materialize import ROWS_PER_BLOCK, materialize_network, seeded_normal_
from lightning_tp3d.plan.config import MODEL_PRESETS, ModelConfig
from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

# ~271M parameters: big enough that the whole fp32 network (1.1 GB) dwarfs a rank's shard at (2, 2, 2).
LARGE = ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                    num_attention_heads=16, num_key_value_heads=16)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def _peak_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _setup_growth(config: ModelConfig) -> dict[str, int]:
    """Peak resident growth while this rank builds `config` on the meta device and materialises its
    shard at (tp, pp, dp) = (2, 2, 2) with FSDP2; and the shard's bytes."""
    from lightning_tp3d.strategies.core import ParallelCore

    core = ParallelCore(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_mode="fsdp")
    core.setup_mesh(8, "cpu", None)
    before = _resident_bytes()
    with torch.device("meta"):
        network = LlamaForCausalLM(config)
    core.parallelize(network, config, lambda: 1.0, torch.device("cpu"))
    shard = sum(parameter.to_local().nbytes for parameter in network.parameters())
    return {"growth": _peak_bytes() - before, "shard": shard}


def _sharded_world() -> dict[str, object]:
    import torch.distributed as dist

    from lightning_tp3d.strategies.core import ParallelCore

    dist.init_process_group("gloo")
    tiny = _setup_growth(MODEL_PRESETS["tiny"])  # the fixed cost of building any network this way
    large = _setup_growth(LARGE)
    # values: each rank's shards, gathered, equal the network one process initialises whole
    core = ParallelCore(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_mode="fsdp")
    core.setup_mesh(8, "cpu", None)
    config = dataclasses.replace(MODEL_PRESETS["tiny"], vocab_size=200)  # rows not a multiple of the block
    with torch.device("meta"):
        network = LlamaForCausalLM(config, init_seed=3)
    core.parallelize(network, config, lambda: 1.0, torch.device("cpu"))
    whole = {name: parameter.full_tensor() for name, parameter in network.named_parameters()}
    dist.destroy_process_group()
    return {"tiny": tiny, "large": large, "whole": whole}


@pytest.fixture(scope="module")
def sharded_world() -> list[dict[str, object]]:
    return run_distributed(8, "tests.parallel.test_materialize:_sharded_world", timeout=600)


def test_meta_initialisation_gives_every_rank_its_part_of_the_single_process_weights(sharded_world):
    reference = dict(LlamaForCausalLM(dataclasses.replace(MODEL_PRESETS["tiny"], vocab_size=200),
                                      init_seed=3).named_parameters())
    covered = set()
    for rank, results in enumerate(sharded_world):
        for name, value in results["whole"].items():
            torch.testing.assert_close(value, reference[name].detach(), rtol=0, atol=0, msg=f"rank {rank}: {name}")
            covered.add(name)
    assert covered == set(reference)


def test_each_rank_holds_at_most_its_shard_plus_fixed_overhead_while_setting_up(sharded_world):
    whole_network = LARGE.num_parameters() * 4
    for rank, results in enumerate(sharded_world):
        tiny, large = results["tiny"], results["large"]
        assert large["shard"] < whole_network / 6  # about 1/8 of the network: the rank's stage, tp and dp share
        bound = 1.5 * large["shard"] + tiny["growth"]
        assert large["growth"] <= bound, (
            f"rank {rank}: setting up grew resident memory by {large['growth'] / 2**20:.0f} MiB, over 1.5 x the"
            f" {large['shard'] / 2**20:.0f} MiB shard + {tiny['growth'] / 2**20:.0f} MiB overhead"
            f" (the whole network is {whole_network / 2**20:.0f} MiB)"
        )


def test_seeded_values_do_not_depend_on_how_the_rows_are_split():
    whole = torch.empty(3 * ROWS_PER_BLOCK + 5, 7)
    seeded_normal_(whole, "w", seed=1, std=0.02)
    assert 0.015 < whole.std().item() < 0.025
    other_seed = torch.empty_like(whole)
    seeded_normal_(other_seed, "w", seed=2, std=0.02)
    assert not torch.equal(whole, other_seed)
    other_name = torch.empty_like(whole)
    seeded_normal_(other_name, "v", seed=1, std=0.02)
    assert not torch.equal(whole, other_name)


def test_seeded_values_ignore_a_default_device_context():
    """Lightning builds a module under `torch.device(root_device)` (a CUDA device with its own strategies):
    the values are drawn on the CPU generator all the same (found on an H200: 'Expected a cuda device type
    for generator but found cpu')."""
    expected = torch.empty(ROWS_PER_BLOCK + 3, 5)
    seeded_normal_(expected, "w", seed=1, std=0.02)
    filled = torch.empty_like(expected)
    with torch.device("meta"):  # stands in for the CUDA default device on a CPU-only machine
        seeded_normal_(filled, "w", seed=1, std=0.02)
    torch.testing.assert_close(filled, expected, rtol=0, atol=0)


def test_materialising_keeps_tied_weights_tied_and_initialises_norms():
    config = dataclasses.replace(MODEL_PRESETS["tiny"], tie_word_embeddings=True)
    with torch.device("meta"):
        network = LlamaForCausalLM(config)
    assert materialize_network(network, torch.device("cpu"))
    assert network.lm_head.weight is network.model.embed_tokens.weight
    reference = LlamaForCausalLM(config)
    for (name, value), expected in zip(network.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=name)
    assert not materialize_network(network, torch.device("cpu"))  # nothing left on the meta device


def test_a_network_without_init_weights_is_reset_module_by_module_and_warns_about_the_rest():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.factor = nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        network = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.warns(UserWarning, match=r"\['Scale'\] define neither"):
        materialize_network(network, torch.device("cpu"))
    assert network[0].weight.device.type == "cpu" and network[0].weight.abs().sum() > 0
