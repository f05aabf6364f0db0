"""`parallelize_network` in one process, on torch's "fake" process group (a rank of an 8-process world whose
collectives do nothing): the order pipeline split -> TP -> recompute -> FSDP -> pipelined forward ->
materialise, and the model adapter handing each family's parts to `parallel/`, checked in seconds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel

from lightning_tp3d.models.huggingface import HuggingFaceStages
from lightning_tp3d.models.llama import LlamaForCausalLM
from lightning_tp3d.plan.config import MODEL_PRESETS, ModelConfig
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.ledger import TrainingOptions, training_ledger
from lightning_tp3d.strategies.core import ParallelCore


@pytest.fixture
def fake_world() -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _parallel(network: torch.nn.Module, **options: object) -> ParallelCore:
    core = ParallelCore(tensor_parallel_size=2, pipeline_parallel_size=2, num_microbatches=2, **options)
    core.setup_mesh(8, "cpu", None)
    core.parallelize(network, getattr(network, "config", None), lambda: 1.0, torch.device("cpu"))
    return core


def test_the_order_split_then_tp_then_recompute_inside_fsdp_then_materialise(fake_world: None) -> None:
    with torch.device("meta"):
        network = LlamaForCausalLM(MODEL_PRESETS["tiny"])
    original_forward = type(network).forward
    core = _parallel(network, data_parallel_mode="fsdp", recompute="full")
    # 1. split: rank 0 runs stage 0 of 2, the first half of the blocks, the embedding and not the head
    num_layers = MODEL_PRESETS["tiny"].num_hidden_layers
    assert list(network.model.layers) == [str(index) for index in range(num_layers // 2)]
    assert network.model.norm is None and network.lm_head is None and network.model.embed_tokens is not None
    block = network.model.layers["0"]
    # 2. then 4. TP before FSDP: a projection is sharded over (dp, tp), tp along its output rows; a norm over dp only
    q_proj, norm = block.self_attn.q_proj.weight, block.input_layernorm.weight
    assert isinstance(q_proj, DTensor) and q_proj.device_mesh.mesh_dim_names == ("dp", "tp")
    assert q_proj.placements[1] == Shard(0) and norm.device_mesh.mesh_dim_names == ("dp",)
    # 3. recompute inside the FSDP unit: the block is the unit, its own forward is the checkpointed one
    assert isinstance(block, FSDPModule) and hasattr(block.forward, "__wrapped__")
    # 5. the pipelined forward replaces the network's call; 6. materialised from the meta device
    assert network.forward is not original_forward and core.pipeline is not None
    assert {parameter.device.type for parameter in network.parameters()} == {"cpu"}
    assert all(torch.isfinite(parameter.to_local()).all() for parameter in network.parameters())


def test_the_adapter_hands_each_family_its_own_stages_and_an_option_overrides_one_field(fake_world: None) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2)
    network = transformers.LlamaForCausalLM(config)
    core = _parallel(network)
    (stage,) = core.pipeline.stage_modules
    assert type(stage).__module__ == HuggingFaceStages.__module__ and list(stage.blocks) == [network.model.layers["0"]]
    with pytest.raises(ValueError, match=r"tp_plan entry 'layers\.\*\.fc' matches no module of LlamaForCausalLM"
                                         r" \(model adapter: decoder with Llama names\)"):
        _parallel(LlamaForCausalLM(MODEL_PRESETS["tiny"]), tp_plan={"layers.*.fc": ColwiseParallel()})


def test_the_ledger_counts_what_a_parallel_lora_model_holds(fake_world: None) -> None:
    """At (2, 2, 2) rank 0 holds stage 0's tp shard: its trainable (LoRA) and total elements are the memory
    ledger's `trainable_parameters` and `parameters` for stage 0, and only the factors have gradient and
    optimizer bytes."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False)
    targets = ("q_proj", "v_proj", "o_proj", "down_proj")
    network = peft.get_peft_model(transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)),
                                  peft.LoraConfig(r=4, target_modules=list(targets)))
    _parallel(network, data_parallel_mode="replicate")  # replicate: whole tp shards, no dp padding
    trainable = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                    for p in network.parameters() if p.requires_grad)
    total = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in network.parameters())
    layout = ParallelLayout(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2)
    ledger = training_ledger(ModelConfig(**shape), layout, TrainingOptions(lora_rank=4, lora_targets=targets))
    assert (ledger.stages[0].trainable_parameters, ledger.stages[0].parameters) == (trainable, total)
    assert ledger.stages[0].gradient_bytes == 4 * trainable and ledger.stages[0].optimizer_bytes == 8 * trainable
