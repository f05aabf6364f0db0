"""The communication ledger of a DeepSeek-V2 / V3 mixture-of-experts model: what one rank of each pipeline
stage sends over each group in a training step, as `plan.communication` counts a dense model's.

Notation as in `plan.moe_training` (T = b s tokens of a micro-batch, k m passes per step, L the rank's
blocks, r of them under full recompute). Groups: tp, pp, dp, and with E > 1 "ep" (the all-to-alls,
`plan.moe.expert_ledger`) and "edp" (an expert's d = dp / E replicas).

tp, per pass, as `models.deepseek`'s plan runs (measured with the flight recorder, tests/models/test_deepseek.py):
    forward   2 all-reduces of T h per block (o_proj, and the dense MLP's or the shared experts' down
              projection: row parallel), one more per recomputed block (its o_proj, under full recompute,
              whose recomputation stops before the MLP's, and selective, which recomputes `self_attn`), the
              embedding's on the first stage;
    backward  per block 2 all-reduces of T h (the input gradients of the column-parallel gate and up,
              each made on its own), one of T r_q (`q_b_proj`'s input gradient; T h for `q_proj` without a
              query latent), one of T r_kv (`kv_b_proj`'s) and one of T d_r (the rotary key's gradient summed
              over the heads, `parallel.tensor.SharedAcrossHeads`); the head's input gradient on the last stage;
    loss      under pipelining the vocab-parallel loss's 2 T float32 statistics (`plan.communication`);
              without it the model computes its own loss over whole logits: an all-gather of its T V / t.
    The routed experts are whole on every tp rank: no tp traffic.
pp: as `plan.communication`.
ep: `plan.moe.expert_ledger`'s five all-to-alls per MoE block and pass; a block under full recompute
    replays its forward three (counts, dispatch, combine).
dp: as `plan.communication` for the rank's parameters, the routed experts apart when E > 1: with E = 1 they
    are the block's parameters (whole over tp); with E > 1 they are reduced over "edp" after the backward
    (replicate: one all-reduce of all of them; zero1: their own buckets; FSDP2: their own unit per block,
    sharded over edp, or, with a single replica, outside the units and all-reduced over the one-rank edp).
    FSDP2's shards are counted unpadded (each parameter's dim 0 rounds up to a multiple of d: a few rows).
"""

from __future__ import annotations

import math

from lightning_tp3d.plan.communication import (
    EXPERT_DATA_GROUP,
    EXPERT_GROUP,
    CommunicationLedger,
    Transfer,
    activation_bytes,
    fsdp_shard_elements,
    reduce_scatter_on,
    replicate_buckets,
    zero_transfers,
)
from lightning_tp3d.plan.data_parallel import GradientReduction
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.ledger import PRECISIONS, TrainingOptions
from lightning_tp3d.plan.moe import MoEModelConfig, expert_ledger
from lightning_tp3d.plan.moe_training import check_moe_options
from lightning_tp3d.plan.recompute import recomputed_layers
from lightning_tp3d.plan.schedules import RankStages, rank_stages

__all__ = ["moe_communication_ledger"]

Tensors = list[tuple[tuple[int, ...], int | None]]  # (local shape, the dim tp splits or None)


def _routed_experts(config: MoEModelConfig, expert_parallel_size: int) -> Tensors:
    """A block's fused routed experts on one rank: `gate_up_proj` [N / E, 2 I, h], `down_proj` [N / E, h, I]
    (split over E along dim 0 when E > 1)."""
    held, h, intermediate = config.n_routed_experts // expert_parallel_size, config.hidden_size, \
        config.moe_intermediate_size
    split = 0 if expert_parallel_size > 1 else None
    return [((held, 2 * intermediate, h), split), ((held, h, intermediate), split)]


def _block(config: MoEModelConfig, layer: int, tp: int, experts_in_block: bool) -> Tensors:
    """Block `layer`'s parameters in registration order (attention, then the routed experts, the router
    and the shared experts), the routed experts left out unless `experts_in_block`."""
    tensors = config.block_tensors(layer, tp)
    if layer < config.first_k_dense_replace or not experts_in_block:
        return tensors
    attention = 5 if config.q_lora_rank is None else 7
    return tensors[:attention] + _routed_experts(config, 1) + tensors[attention:]


def _roots(config: MoEModelConfig, held: RankStages, tp: int) -> tuple[Tensors, Tensors]:
    """(before the blocks, after them): the vocab-parallel embedding on the first stage, the final norm and
    the column-parallel head on the last."""
    vocab = ((config.vocab_size // tp, config.hidden_size), 0)
    before = [vocab] if held.first else []
    after = [((config.hidden_size,), None)] + ([] if config.tie_word_embeddings and held.first else [vocab])
    return before, after if held.last else []


def _tensor_parallel(config: MoEModelConfig, layout: ParallelLayout, options: TrainingOptions, held: RankStages,
                     blocks: int, recomputed: int) -> list[Transfer]:
    passes = layout.gradient_accumulation_steps * layout.num_microbatches
    tokens, h = layout.micro_batch_size * options.seq_len, config.hidden_size
    low, stream = activation_bytes(options.precision)
    query = config.q_lora_rank if config.q_lora_rank is not None else h
    transfers = [
        Transfer("tp", "all_reduce", passes * (2 * blocks + recomputed), tokens * h, low,
                 "row-parallel outputs (o, down), forward and recomputed attention"),
        Transfer("tp", "all_reduce", passes * (2 * blocks + held.last), tokens * h, stream,
                 "input gradients of gate and up" + (" and the head" if held.last else "")),
        Transfer("tp", "all_reduce", passes * blocks, tokens * query, stream, "query latent's input gradient"),
        Transfer("tp", "all_reduce", passes * blocks, tokens * config.kv_lora_rank, stream,
                 "key-value latent's input gradient"),
        Transfer("tp", "all_reduce", passes * blocks, tokens * config.qk_rope_head_dim, stream,
                 "rotary key's gradient over the heads")]
    if held.first:
        transfers.append(Transfer("tp", "all_reduce", passes, tokens * h, stream, "vocab-parallel embedding"))
    if held.last and layout.pipeline_parallel_size > 1:
        transfers.append(Transfer("tp", "all_gather", passes, 2 * tokens, 4,
                                  "loss statistics (vocab-parallel cross entropy)"))
    elif held.last:
        vocabulary = config.vocab_size // layout.tensor_parallel_size
        transfers.append(Transfer("tp", "all_gather", passes, tokens * vocabulary, low,
                                  "logits for the model's own loss"))
    return transfers


def _data_parallel(config: MoEModelConfig, layout: ParallelLayout, options: TrainingOptions, held: RankStages,
                   layers: list[int], backend: str) -> list[Transfer]:
    tp, dp, experts = layout.tensor_parallel_size, layout.data_parallel_size, layout.expert_parallel_size
    replicas = dp // experts
    stream = PRECISIONS[options.precision][0]
    before, after = _roots(config, held, tp)
    blocks = [_block(config, layer, tp, experts_in_block=experts == 1) for layer in layers]
    routed = [_routed_experts(config, experts) for layer in layers  # split over E: apart from the blocks
              if layer >= config.first_k_dense_replace and experts > 1]
    every = before + [tensor for block in blocks for tensor in block] + after
    elements = [math.prod(shape) for shape, _ in every]
    data_parallel = options.data_parallel(layout)
    reduction, transfers = data_parallel.reduction, []
    if reduction is GradientReduction.OVERLAPPED_ALL_REDUCE:
        buckets = replicate_buckets(elements, stream)
        transfers += [Transfer("dp", "all_reduce", 1, bucket, stream, "gradients, one bucket",
                               hideable=index < len(buckets) - 1) for index, bucket in enumerate(buckets)]
    elif reduction is GradientReduction.ALL_REDUCE:
        transfers.append(Transfer("dp", "all_reduce", 1, sum(elements), stream, "gradients, after backward"))
    elif reduction is GradientReduction.REDUCE_SCATTER:
        transfers += zero_transfers(every, dp, stream, backend)
        if routed:
            transfers += zero_transfers([tensor for block in routed for tensor in block], replicas, stream, backend,
                                        group=EXPERT_DATA_GROUP)
    else:
        steps = layout.gradient_accumulation_steps
        gathers = steps * ((layout.num_microbatches + 1 if layout.pipeline_parallel_size > 1 else 2)
                           if data_parallel.reshard_after_forward else 1)
        units = [(dp, "dp", [shape for shape, _ in block], f"block {layer}") for layer, block in zip(layers, blocks)]
        if replicas > 1:
            units += [(replicas, EXPERT_DATA_GROUP, [shape for shape, _ in block], "routed experts of a block")
                      for block in routed]
        # a stage's own parameters are one unit: one with the first and last stage, two on a V's first rank
        for root in [before + after] if layout.pipeline_parallel_size == 1 else [before, after]:
            if root:
                units.append((dp, "dp", [shape for shape, _ in root], "stage root (embedding / norm / head)"))
        reduce = reduce_scatter_on(backend)
        for shards, group, shapes, name in units:
            shard = fsdp_shard_elements(shapes, shards)
            transfers.append(Transfer(group, "all_gather", gathers, shard, stream, f"parameters of {name}",
                                      hideable=True))
            transfers.append(Transfer(group, reduce, steps, shard * shards, stream, f"gradients of {name}",
                                      hideable=True))
    if routed and reduction is not GradientReduction.REDUCE_SCATTER and not (
            reduction is GradientReduction.FULLY_SHARDED and replicas > 1):
        transfers.append(Transfer(EXPERT_DATA_GROUP, "all_reduce", 1,
                                  sum(math.prod(shape) for block in routed for shape, _ in block), stream,
                                  "routed experts' gradients, after backward"))
    return transfers


def moe_communication_ledger(config: MoEModelConfig, layout: ParallelLayout, options: TrainingOptions,
                             backend: str = "nccl") -> CommunicationLedger:
    """Per pp rank, the transfers one of its ranks issues in a training step (module docstring)."""
    check_moe_options(config, layout, options)
    tp, pp, dp, experts = (layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.data_parallel_size,
                           layout.expert_parallel_size)
    passes = layout.gradient_accumulation_steps * layout.num_microbatches
    tokens = layout.micro_batch_size * options.seq_len
    exchanges = expert_ledger(config, layout, options.seq_len, options.precision, options.schedule,
                              options.stages_per_rank).stages
    stages = []
    for held, exchange in zip(rank_stages(options.schedule, layout, options.stages_per_rank,
                                          config.num_hidden_layers), exchanges):
        layers = [layer for layer_range in held.layer_ranges for layer in layer_range]
        recomputed = []
        if options.recompute != "none":
            recomputed = recomputed_layers(held.layer_ranges, options.recompute_method, options.recompute_num_layers)
        transfers = _tensor_parallel(config, layout, options, held, len(layers), len(recomputed)) if tp > 1 else []
        if pp > 1:
            transfers.append(Transfer("pp", "send", passes * held.sends, tokens * config.hidden_size,
                                      activation_bytes(options.precision)[1],
                                      "activations forward, their gradients back", hideable=True))
        transfers += exchange
        replayed = passes * sum(layer >= config.first_k_dense_replace for layer in recomputed)
        if experts > 1 and replayed and options.recompute == "full":
            transfers += [Transfer(EXPERT_GROUP, "all_to_all", replayed, transfer.elements, transfer.element_bytes,
                                   f"{transfer.what.removesuffix(', forward')}, recomputed")
                          for transfer in exchange if transfer.what.endswith("forward")]
        if dp > 1:
            transfers += _data_parallel(config, layout, options, held, layers, backend)
        stages.append(transfers)
    groups = {"tp": tp, "pp": pp, "dp": dp} | ({EXPERT_GROUP: experts, EXPERT_DATA_GROUP: dp // experts}
                                                if experts > 1 else {})
    return CommunicationLedger(groups, stages)
