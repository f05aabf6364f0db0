"""The communication ledger: what each rank sends over each mesh group (tp, pp, dp) in one training step.

Per optimizer step and per rank of each pipeline stage, every collective and point-to-point transfer
this package issues, from the layout, the model shape and the training options. Notation as in
`plan.ledger`: h hidden, V vocab, t tp, p pp, d dp, m micro-batches, b micro-batch size, s sequence
length, k gradient-accumulation steps, L_i the layers of stage i, P_i the stage's parameters on a tp
rank. A "payload" is the tensor each rank hands to the collective (its input); the bytes a rank puts on
the wire follow the ring algorithms NCCL and gloo use:

    all-reduce     2 (n - 1) / n x payload      (reduce-scatter + all-gather)
    all-gather     (n - 1) x payload            (payload = this rank's shard)
    reduce-scatter (n - 1) / n x payload        (payload = the full tensor)
    send           payload

tp (Megatron's count, per micro-batch and pass, k m passes per step):
    forward:  2 all-reduces of b s h per layer (the row-parallel o and down outputs); stage 0 adds one
              for the vocab-parallel embedding; the last stage all-gathers its loss's 2 b s float32
              statistics (`models.cross_entropy`: each row's logsumexp and target logit over the rank's
              V / t columns), never the logits.
    backward: 2 all-reduces of b s h per layer (the input gradients of the attention and MLP
              sub-blocks, each made once: `parallel.tensor.ReplicateBlockInput`); the last stage adds one
              for the head's input gradient. A layer under `full` recompute repeats its attention output's
              all-reduce, not the MLP's: the recomputation (non-reentrant checkpoint) stops as soon as the
              tensors backward needs exist, before the layer's last all-reduce.
pp (per micro-batch, k m per step): a stage that is not last sends its b s h output forward; a stage
    that is not first sends the b s h input gradient back. So under GPipe and 1F1B first and last stages
    send k m b s h elements, middle stages 2 k m b s h; a rank holding several stages sends for each but
    to a stage on the same rank (`plan.schedules.pipeline_sends`). The head's terms go to the rank that
    holds the last stage (rank 0 in a V-shaped schedule).
dp `replicate`: the stage's gradients, P_i, all-reduced once per step: in buckets of at most 25 MiB
    during backward without pipelining (`parallel.data_parallel.overlap`: parameters packed in reverse order, a
    bucket closed when the next one would overflow it), else in one flat all-reduce after backward.
dp `fsdp` (FSDP2, one unit per block plus one for the stage's other parameters): per unit and step
    the all-gathers of its shard (each parameter's dim 0 padded to a multiple of d) and one
    reduce-scatter of the padded unit, k times each when accumulating. All-gathers: 1 when the
    parameters stay gathered through the step (the default under pipelining); resharded after each
    forward, 2 without pipelining (forward, then again in backward; the default) and m + 1 under it
    (each micro-batch's forward, and once for the backwards, between which pipelining keeps the unit
    gathered; measured with 1F1B). A QLoRA block (`qlora`) gathers its 4-bit projections as NF4 bytes
    (`plan.qlora.nf4_all_gather_bytes` of each shard), in one byte-typed all-gather with the rest.
    gloo runs a reduce-scatter as an all-reduce of the whole input (its flight recorder says so), so
    the ledger counts an all-reduce of the same payload there (`backend="gloo"`, `reduce_scatter_on`).
dp `zero1` (`parallel.data_parallel.zero`): once per step, after backward, per bucket of `plan.optimizer_sharding`
    (d segments of S elements): a reduce-scatter of d S gradient elements (on gloo an all-reduce), and
    after the update an all-gather of the rank's S parameter elements. Sum over buckets: d S >= P_i,
    so the bytes are the all-reduce's 2 (d - 1) / d x P_i, DDP's (plus the padding to S).
Element sizes: under `32-true` everything is fp32. Under 16-bit autocast (`bf16-mixed`, `16-mixed`) the
    row-parallel outputs and the logits are 16-bit, while the residual stream, its gradients (the tp
    backward all-reduces and pp transfers), the embedding output and the fp32 gradients stay 4 bytes.
    `bf16-true` is 2 bytes throughout.
Control scalars (the non-finite-step flag over all ranks, the loss broadcast over pp, logged metrics)
    are a few bytes per step and are not counted.

Estimated time per group = sent bytes / link bandwidth. What overlap can hide: FSDP2 prefetches the
next unit's all-gather and reduce-scatters while computing, and pipeline sends are asynchronous; the tp
all-reduces sit on the critical path. The `replicate` buckets overlap with backward, except the last
one (about one bucket's time is exposed); with pipelining, or `overlap_gradient_reduction=False`, the
reduction runs after backward (exposed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_tp3d.plan.config import ModelConfig
from lightning_tp3d.plan.data_parallel import GradientReduction
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.ledger import TrainingOptions
from lightning_tp3d.plan.lora import lora_layer_shapes
from lightning_tp3d.plan.optimizer_sharding import pack_buckets, part_sizes
from lightning_tp3d.plan.qlora import QUANTIZED_LAYER_WEIGHTS, NF4Format, nf4_all_gather_bytes
from lightning_tp3d.plan.recompute import recomputed_layers
from lightning_tp3d.plan.schedules import rank_stages
from lightning_tp3d.plan.sharding import EMBEDDING, FINAL_NORM, HEAD, LAYER_WEIGHTS, WeightSplit

__all__ = ["BUCKET_BYTES", "DEFAULT_LINKS_GBPS", "EXPERT_DATA_GROUP", "EXPERT_GROUP", "GROUPS", "CommunicationLedger",
           "Transfer", "activation_bytes", "communication_ledger", "fsdp_shard_elements", "group_bandwidths",
           "groups_inside_a_node", "reduce_scatter_on", "replicate_buckets", "zero_transfers"]

GROUPS = ("tp", "pp", "dp")
EXPERT_GROUP = "ep"  # an expert-parallel group (`plan.moe.expert_ledger`): E dp ranks of one tp and pp rank
EXPERT_DATA_GROUP = "edp"  # the d = dp / E replicas of an expert, over which its gradients are averaged
BUCKET_BYTES = 25 * 2**20  # the overlapped replicate reduction's bucket size, DDP's default bucket_cap_mb
# Bus bandwidth of a link (GB/s, 10^9 bytes), `tp3d doctor`'s floors: NVLink inside a node, InfiniBand across.
DEFAULT_LINKS_GBPS = {"intra_node": 100.0, "inter_node": 10.0}
_RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: n - 1,
                "reduce_scatter": lambda n: (n - 1) / n, "send": lambda n: 1,
                "all_to_all": lambda n: (n - 1) / n}  # the share a rank keeps for itself stays (even split)


@dataclass(frozen=True)
class Transfer:
    """`count` calls per step of `operation` over `group`, each with a payload of `elements`."""

    group: str
    operation: str
    count: int
    elements: int
    element_bytes: int
    what: str
    hideable: bool = False  # overlaps with compute (see the module docstring)

    @property
    def payload_bytes(self) -> int:
        return self.count * self.elements * self.element_bytes

    def sent_bytes(self, group_size: int) -> float:
        return _RING_FACTOR[self.operation](group_size) * self.payload_bytes


@dataclass(frozen=True)
class CommunicationLedger:
    group_sizes: dict[str, int]
    stages: list[list[Transfer]]  # per pipeline stage, what one of its ranks issues per step

    def totals(self, stage: int) -> dict[str, dict[str, float]]:
        """Per group: calls, payload bytes and bytes sent per step by one rank of `stage`."""
        result = {group: {"calls": 0, "payload_bytes": 0, "sent_bytes": 0.0} for group in self.group_sizes}
        for transfer in self.stages[stage]:
            total = result[transfer.group]
            total["calls"] += transfer.count
            total["payload_bytes"] += transfer.payload_bytes
            total["sent_bytes"] += transfer.sent_bytes(self.group_sizes[transfer.group])
        return result

    def calls_by_transfer(self, stage: int) -> dict[tuple[str, str, int, int], int]:
        """{(group, operation, payload elements, element bytes): calls per step}, as `TrafficRecorder` counts."""
        calls: dict[tuple[str, str, int, int], int] = {}
        for transfer in self.stages[stage]:
            key = (transfer.group, transfer.operation, transfer.elements, transfer.element_bytes)
            calls[key] = calls.get(key, 0) + transfer.count
        return calls

    def seconds(self, stage: int, bandwidth: dict[str, float],
                latency: dict[str, float] | None = None) -> dict[str, dict[str, float]]:
        """Per group: estimated seconds on links of `bandwidth` bytes/s with `latency` seconds per call (the
        alpha-beta model: calls x latency + sent bytes / bandwidth; latency 0 where not given), and the
        part overlap can hide."""
        result = {}
        for group in self.group_sizes:
            size, per_call = self.group_sizes[group], (latency or {}).get(group, 0.0)

            def cost(transfer: Transfer, size: int = size, per_call: float = per_call, group: str = group) -> float:
                return transfer.count * per_call + transfer.sent_bytes(size) / bandwidth[group]

            transfers = [transfer for transfer in self.stages[stage] if transfer.group == group]
            result[group] = {"seconds": sum(map(cost, transfers)),
                             "hideable_seconds": sum(cost(transfer) for transfer in transfers if transfer.hideable)}
        return result

    def to_dict(self) -> dict[str, Any]:
        return {"group_sizes": self.group_sizes,
                "stages": [{"stage": stage, "per_group": self.totals(stage),
                            "transfers": [transfer.__dict__ | {"payload_bytes": transfer.payload_bytes,
                                                               "sent_bytes": transfer.sent_bytes(
                                                                   self.group_sizes[transfer.group])}
                                          for transfer in transfers]}
                           for stage, transfers in enumerate(self.stages)]}


def _local_shape(weight: WeightSplit, config: ModelConfig, tp: int) -> tuple[int, ...]:
    shape = list(weight.shape(config))
    if weight.dim is not None:
        shape[weight.dim] //= tp
    return tuple(shape)


def fsdp_shard_elements(shapes: list[tuple[int, ...]], dp: int) -> int:
    """Elements of one dp rank's FSDP2 shard of a unit: each parameter's dim 0 padded to a multiple of d."""
    return sum(-(-shape[0] // dp) * math.prod(shape[1:]) for shape in shapes)


def _gathered_block(layer_shapes: list[tuple[int, ...]], lora_shapes: list[tuple[int, ...]], dp: int,
                    element_bytes: int, qlora: NF4Format | None) -> tuple[int, int]:
    """(elements, element bytes) of a block's FSDP2 all-gather: its shard (`layer_shapes` in `LAYER_WEIGHTS`
    order, then the LoRA factors) in the parameters' dtype, or for a QLoRA block, bytes: the NF4
    projections' packed parts and the rest together (FSDP2 gathers mixed dtypes as one byte buffer)."""
    if qlora is None:
        return fsdp_shard_elements(layer_shapes + lora_shapes, dp), element_bytes
    quantized = [weight in QUANTIZED_LAYER_WEIGHTS for weight in LAYER_WEIGHTS]
    dense = [shape for shape, packed in zip(layer_shapes, quantized) if not packed] + lora_shapes
    packed_bytes = sum(nf4_all_gather_bytes(math.prod(shape) // dp, element_bytes, qlora)
                       for shape, packed in zip(layer_shapes, quantized) if packed)
    return fsdp_shard_elements(dense, dp) * element_bytes + packed_bytes, 1


def _registration_order(root_shapes: list[tuple[int, ...]], layer_shapes: list[tuple[int, ...]],
                        num_layers: int) -> list[int]:
    """Parameter sizes in the order a network registers them: embedding, the blocks, final norm, head."""
    sizes = [math.prod(shape) for shape in layer_shapes] * num_layers
    roots = [math.prod(shape) for shape in root_shapes]
    return roots[:1] + sizes + roots[1:]


def replicate_buckets(sizes: list[int], element_bytes: int) -> list[int]:
    """Elements of each bucket: parameters taken in reverse order, a bucket closed when the next parameter
    would take it over `BUCKET_BYTES` (`parallel.data_parallel.overlap.OverlappedGradientReduction`)."""
    buckets: list[int] = []
    for size in reversed(sizes):
        if not buckets or (buckets[-1] + size) * element_bytes > BUCKET_BYTES:
            buckets.append(0)
        buckets[-1] += size
    return buckets


def reduce_scatter_on(backend: str) -> str:
    """The collective a reduce-scatter is on the wire: gloo's `reduce_scatter_single` all-reduces the whole
    input and keeps the rank's segment (torch 2.13: its flight recorder records `all_reduce` of d S)."""
    return "all_reduce" if backend == "gloo" else "reduce_scatter"


def zero_transfers(trained: list[tuple[tuple[int, ...], int | None]], dp: int, element_bytes: int,
                   backend: str, group: str = "dp") -> list[Transfer]:
    """`zero1`'s buckets for a stage: the parameters it trains (local shape, tp's split dim) in registration
    order, each cut over the `dp` ranks of `group`."""
    parts = [part_sizes(shape, tp_dim, dp) for shape, tp_dim in trained]
    reduce = reduce_scatter_on(backend)
    transfers = []
    for bucket in pack_buckets(parts, dp, element_bytes, BUCKET_BYTES):
        transfers.append(Transfer(group, reduce, 1, bucket.payload(dp), element_bytes, "gradients, one bucket"))
        transfers.append(Transfer(group, "all_gather", 1, bucket.segment, element_bytes, "updated parameter parts"))
    return transfers


def activation_bytes(precision: str) -> tuple[int, int]:
    """(bytes of an autocast output, bytes of the residual stream and its gradients) under `precision`
    (module docstring: "Element sizes")."""
    return (2 if precision != "32-true" else 4), (2 if precision == "bf16-true" else 4)


def communication_ledger(config: ModelConfig, layout: ParallelLayout, options: TrainingOptions,
                         backend: str = "nccl") -> CommunicationLedger:
    """Per-step transfers of one rank of every pipeline stage (see the module docstring)."""
    layout.validate_model(config)
    tp, pp, dp = layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.data_parallel_size
    h = config.hidden_size
    passes = layout.gradient_accumulation_steps * layout.num_microbatches
    tokens = layout.micro_batch_size * options.seq_len
    low, stream = activation_bytes(options.precision)
    layer_shapes = [_local_shape(weight, config, tp) for weight in LAYER_WEIGHTS]
    # what trains, (local shape, tp's split dim): every weight, or a LoRA fine-tune's factors alone
    lora = lora_layer_shapes(config, tp, options.lora_rank, tuple(options.lora_targets))
    trained_layer = lora or [(_local_shape(weight, config, tp), weight.dim if tp > 1 else None)
                             for weight in LAYER_WEIGHTS]
    trained_layer_shapes = [shape for shape, _ in trained_layer]
    stages: list[list[Transfer]] = []
    data_parallel = options.data_parallel(layout)
    reduction = data_parallel.reduction
    for held in rank_stages(options.schedule, layout, options.stages_per_rank, config.num_hidden_layers):
        first, last = held.first, held.last
        layers = [index for layer_range in held.layer_ranges for index in layer_range]
        recomputed = 0
        if options.recompute == "full":
            recomputed = len(recomputed_layers(held.layer_ranges, options.recompute_method,
                                               options.recompute_num_layers))
        transfers: list[Transfer] = []
        if tp > 1:
            transfers.append(Transfer("tp", "all_reduce", passes * (2 * len(layers) + recomputed), tokens * h, low,
                                      "row-parallel outputs (o, down), forward and recomputed attention"))
            transfers.append(Transfer("tp", "all_reduce", passes * (2 * len(layers) + last), tokens * h, stream,
                                      "input gradients of attention, MLP" + (" and the head" if last else "")))
            if first:
                transfers.append(Transfer("tp", "all_reduce", passes, tokens * h, stream, "vocab-parallel embedding"))
            if last:
                transfers.append(Transfer("tp", "all_gather", passes, 2 * tokens, 4,
                                          "loss statistics (vocab-parallel cross entropy)"))
        if pp > 1:
            transfers.append(Transfer("pp", "send", passes * held.sends, tokens * h, stream,
                                      "activations forward, their gradients back", hideable=True))
        if dp > 1:
            before = [EMBEDDING] if first else []  # registered before the blocks, and after them
            after = ([FINAL_NORM] + ([] if config.tie_word_embeddings and first else [HEAD])) if last else []

            def trained_roots(weights: list[WeightSplit]) -> list[tuple[tuple[int, ...], int | None]]:
                return [] if lora else [(_local_shape(weight, config, tp), weight.dim if tp > 1 else None)
                                        for weight in weights]

            trained_root_shapes = [shape for shape, _ in trained_roots(before + after)]
            if reduction is GradientReduction.OVERLAPPED_ALL_REDUCE:
                buckets = replicate_buckets(
                    _registration_order(trained_root_shapes, trained_layer_shapes, len(layers)), stream)
                for index, elements in enumerate(buckets):  # all but the last launched overlap with backward
                    transfers.append(Transfer("dp", "all_reduce", 1, elements, stream, "gradients, one bucket",
                                              hideable=index < len(buckets) - 1))
            elif reduction is GradientReduction.REDUCE_SCATTER:
                trained = trained_roots(before) + trained_layer * len(layers) + trained_roots(after)
                transfers.extend(zero_transfers(trained, dp, stream, backend))
            elif reduction is GradientReduction.ALL_REDUCE:
                elements = len(layers) * sum(math.prod(shape) for shape in trained_layer_shapes)
                elements += sum(math.prod(shape) for shape in trained_root_shapes)
                transfers.append(Transfer("dp", "all_reduce", 1, elements, stream, "gradients, after backward"))
            elif reduction is GradientReduction.FULLY_SHARDED:
                reduce = reduce_scatter_on(backend)
                steps = layout.gradient_accumulation_steps  # FSDP2 reduces after every accumulated batch
                gathers = steps * ((layout.num_microbatches + 1 if pp > 1 else 2) if data_parallel.reshard_after_forward
                                   else 1)
                # per unit: its all-gather's (elements, element bytes), the gradients it reduces, its name
                units: list[tuple[tuple[int, int], list[tuple[int, ...]], str]] = [
                    (_gathered_block(layer_shapes, [shape for shape, _ in lora], dp, stream, options.qlora),
                     trained_layer_shapes, f"block {index}") for index in layers]
                # a stage's own parameters are one unit: one with the first and last stage, two on a V's first rank
                for root in [before + after] if pp == 1 else [before, after]:
                    if root:
                        shapes = [_local_shape(weight, config, tp) for weight in root]
                        units.append(((fsdp_shard_elements(shapes, dp), stream),
                                      [shape for shape, _ in trained_roots(root)],
                                      "stage root (embedding / norm / head)"))
                for (elements, element_bytes), trained_shapes, name in units:
                    transfers.append(Transfer("dp", "all_gather", gathers, elements, element_bytes,
                                              f"parameters of {name}", hideable=True))
                    if trained_shapes:  # FSDP2 reduce-scatters the gradients that exist
                        transfers.append(Transfer("dp", reduce, steps, fsdp_shard_elements(trained_shapes, dp) * dp,
                                                  stream, f"gradients of {name}", hideable=True))
        stages.append(transfers)
    return CommunicationLedger({"tp": tp, "pp": pp, "dp": dp}, stages)


def groups_inside_a_node(layout: ParallelLayout, gpus_per_node: int) -> dict[str, bool]:
    """Whether each group's ranks share a node. Ranks are numbered over the ("pp", "dp", "tp") mesh with tp
    innermost, so a tp group spans t consecutive ranks, a dp group t d, a pp group the whole world, and an
    expert-parallel group (with E > 1) t E (E consecutive dp indices) and an expert's replicas t d."""
    tp, dp = layout.tensor_parallel_size, layout.data_parallel_size
    spans = {"tp": tp, "dp": tp * dp, "pp": layout.world_size}
    if layout.expert_parallel_size > 1:
        spans[EXPERT_GROUP] = tp * layout.expert_parallel_size
        spans[EXPERT_DATA_GROUP] = tp * dp
    return {group: span <= gpus_per_node and gpus_per_node % span == 0 for group, span in spans.items()}


def group_bandwidths(layout: ParallelLayout, gpus_per_node: int, links_gbps: dict[str, float] | None = None,
                     given_gbps: dict[str, float] | None = None) -> dict[str, float]:
    """Bytes/s of each group's links: `given_gbps` where given, else the intra- or inter-node link."""
    links = {**DEFAULT_LINKS_GBPS, **(links_gbps or {})}
    inside = groups_inside_a_node(layout, gpus_per_node)
    return {group: 1e9 * (given_gbps or {}).get(group, links["intra_node" if inside[group] else "inter_node"])
            for group in inside}
