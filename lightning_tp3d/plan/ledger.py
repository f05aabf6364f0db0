"""The memory ledger: what one rank holds for a layout, before anything is launched.

All figures are bytes per rank, for the rank of each pipeline stage (ranks of one stage differ only by
their tp / dp shard, which are equal in size). Notation: h hidden, f ffn, a heads, k kv heads, d head
dim (a d = h), V vocab, L layers, t tp, s sequence length, b micro-batch.

* Parameters of one layer on a tp rank: (2 h a d + 2 h k d + 3 h f) / t + 2 h (norms replicated).
  The embedding and the head are vocab parallel (V h / t each) on the first and last stage; the final
  norm (h) on the last. FSDP divides parameters, gradients and optimizer state by dp; ZeRO-1
  (`data_parallel_mode="zero1"`) divides the optimizer state by dp and keeps whole parameters and
  gradients (the whole gradients live until the reduce-scatter after backward).
* Bytes per parameter: `32-true`, `bf16-mixed`, `16-mixed` keep fp32 parameters (the master weights
  autocast reads), fp32 gradients and Adam's two fp32 moments: 4 + 4 + 8. `bf16-true`: 2 + 2 + 4.
* Activations saved for backward by one layer and one micro-batch, in units of the activation
  element (4 bytes in fp32, 2 under 16-bit precisions), for this package's decoder with fused
  attention (no s x s score matrix is kept):
      s b [4 h  +  (a + k) d / t  +  5 h / t  +  4 f / t]
  (two RMSNorm inputs/outputs replicated over tp, q/k before RoPE, SDPA's q, k, v and output, the
  o-projection input, and the SwiGLU's gate, up, activation and product). A layer under `full`
  recompute keeps only its input, s b h; under `selective` recompute (attention core) it drops the
  core's output and softmax statistics, s b (h + a) / t. The last stage adds the loss path
  (`plan.loss.loss_activation_bytes`: the logits and their gradient, 2 s b V / t x element, split over
  tp by the vocab-parallel loss, and the chunked loss's float32 temporaries), all freed before the
  layers' backward starts; recomputing a layer adds back what it dropped. So with r of a stage's L
  layers recomputed, one micro-batch's peak is
      (L - r) x layer + r x kept + max(logits on the last stage, layer - kept if r > 0),
  and with n micro-batches in flight (below) the others keep their layers' and logits' share while one
  runs its backward: n x ((L - r) x layer + r x kept + logits) + max(0, layer - kept - logits).
  Measured on the tiny model (MemTracker, s = 64, b = 4, fp32) the estimate is 7% below the peak of
  activations and backward temporaries for none, full and selective alike.
* FSDP gathers parameters for compute: with `fsdp_reshard_after_forward` (the default without
  pipelining) one block at a time plus the next one prefetched, 2 x one layer's parameters; without it
  (the default under pipelining: gathered once per step, not once per micro-batch) the stage's whole
  parameters stay gathered through the step (`gathered_weight_bytes`).
* LoRA (`lora_rank` > 0, `plan.lora`): each block adds its factors' parameters, the only ones with
  gradients and optimizer state (the rest keep their weight bytes), and r values per token and target to
  its activations (A x, kept for B's backward).
* QLoRA (`qlora`, an `NF4Format`, with `lora_rank` > 0; `plan.qlora`): the seven projections of each block
  are held in 4-bit NF4, `nf4_bytes(n / d_FSDP)` per weight of n elements instead of e n (e the
  precision's parameter bytes, which the NF4 scales keep); FSDP gathers NF4 bytes. Tensor parallelism is
  refused. The dequantised copy of the one weight being multiplied is a transient, not counted.
* In-flight micro-batches: with 1F1B stage i holds min(m, pp - i) micro-batches' activations, with
  GPipe all m; without pipelining one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from lightning_tp3d.plan.config import ModelConfig
from lightning_tp3d.plan.data_parallel import DataParallelPlan, check_data_parallel_mode, choose_data_parallel
from lightning_tp3d.plan.layout import LayoutError, ParallelLayout
from lightning_tp3d.plan.lora import DEFAULT_LORA_TARGETS, check_lora_options, lora_layer_shapes
from lightning_tp3d.plan.loss import loss_activation_bytes
from lightning_tp3d.plan.qlora import TENSOR_PARALLEL_REASON, NF4Format, quantized_layer
from lightning_tp3d.plan.recompute import check_recompute_options, recomputed_layers
from lightning_tp3d.plan.schedules import PIPELINE_SCHEDULES, activations_in_flight, rank_stages
from lightning_tp3d.plan.sharding import EMBEDDING, FINAL_NORM, HEAD, layer_parameters_per_rank, parameters_per_rank

__all__ = [
    "PRECISIONS",
    "StageLedger",
    "TrainingLedger",
    "TrainingOptions",
    "training_flops_per_token",
    "training_ledger",
]

# precision -> (parameter, gradient, optimizer-state bytes per parameter, activation element bytes)
PRECISIONS: dict[str, tuple[int, int, int, int]] = {
    "32-true": (4, 4, 8, 4),
    "bf16-mixed": (4, 4, 8, 2),
    "16-mixed": (4, 4, 8, 2),
    "bf16-true": (2, 2, 4, 2),
}


@dataclass(frozen=True)
class TrainingOptions:
    seq_len: int = 4096
    precision: str = "bf16-mixed"
    recompute: Literal["none", "full", "selective"] = "none"
    data_parallel_mode: Literal["replicate", "fsdp", "zero1"] = "replicate"
    schedule: str = "1f1b"  # any of `plan.schedules.PIPELINE_SCHEDULES`
    stages_per_rank: int = 2  # the looped schedules' stages per rank (V-shaped ones have 2)
    recompute_method: Literal["uniform", "block"] = "uniform"
    recompute_num_layers: int = 1
    fsdp_reshard_after_forward: bool | None = None  # None: yes without pipelining, no under it
    overlap_gradient_reduction: bool = True  # replicate mode without pipelining: buckets during backward
    lora_rank: int = 0  # > 0: a LoRA fine-tune of the blocks' `lora_targets` (`plan.lora`), the rest frozen
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    qlora: NF4Format | None = None  # a QLoRA fine-tune: the blocks' projections frozen in this 4-bit format

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not one of {sorted(PRECISIONS)}.")
        check_recompute_options(self.recompute, self.recompute_method, self.recompute_num_layers)
        check_data_parallel_mode(self.data_parallel_mode)
        check_lora_options(self.lora_rank, tuple(self.lora_targets))
        if self.qlora is not None and not self.lora_rank:
            raise ValueError("qlora needs lora_rank > 0: QLoRA trains LoRA factors on a frozen 4-bit base.")
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of {list(PIPELINE_SCHEDULES)}.")
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {self.seq_len}.")

    def data_parallel(self, layout: ParallelLayout) -> DataParallelPlan:
        """What the data-parallel mode does at `layout` (`plan.data_parallel.choose_data_parallel`)."""
        return choose_data_parallel(self.data_parallel_mode, layout.data_parallel_size,
                                    layout.pipeline_parallel_size, self.overlap_gradient_reduction,
                                    self.fsdp_reshard_after_forward, self.schedule)


@dataclass(frozen=True)
class StageLedger:
    stage: int
    first_layer: int
    num_layers: int
    parameters: int
    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    layer_spans: tuple[tuple[int, int], ...]  # [start, stop) of each of the rank's stages
    in_flight_microbatches: float  # micro-batches through all of the rank's layers (`activations_in_flight`)
    gathered_weight_bytes: int = 0
    trainable_parameters: int | None = None  # None: all of `parameters`; a LoRA fine-tune's factors

    @property
    def layers_text(self) -> str:
        """The rank's blocks, e.g. "0-2,15-18" (one range per stage it holds)."""
        return ",".join(f"{start}-{stop - 1}" for start, stop in self.layer_spans)

    @property
    def total_bytes(self) -> int:
        return (self.weight_bytes + self.gradient_bytes + self.optimizer_bytes + self.activation_bytes
                + self.gathered_weight_bytes)


@dataclass(frozen=True)
class TrainingLedger:
    model_parameters: int
    layout: dict[str, Any]
    options: dict[str, Any]
    stages: list[StageLedger]

    @property
    def peak_stage(self) -> StageLedger:
        return max(self.stages, key=lambda stage: stage.total_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_parameters": self.model_parameters,
            "layout": self.layout,
            "options": self.options,
            "stages": [asdict(stage) | {"total_bytes": stage.total_bytes} for stage in self.stages],
            "peak_bytes_per_rank": self.peak_stage.total_bytes,
        }


def _layer_activation_elements(config: ModelConfig, tp: int, seq_len: int, micro_batch: int) -> int:
    h, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    heads = (config.num_attention_heads + config.num_key_value_heads) * d
    return seq_len * micro_batch * (4 * h + (heads + 5 * h + 4 * f) // tp)


def training_flops_per_token(config: ModelConfig, seq_len: int, recompute: str = "none", lora_rank: int = 0,
                             lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS) -> int:
    """Training FLOPs (forward + backward) per token, as Megatron and PaLM count them:
    6 x the matmul parameters (every layer's q, k, v, o, gate, up, down and the head; the embedding is a
    lookup) + 12 x layers x hidden x sequence length for the attention scores and their weighted sum.
    Recompute adds the forward it repeats: 2 x the layers' matmul parameters + 4 L h s for `full`, the
    attention core's 4 L h s for `selective`. A LoRA fine-tune (`lora_rank` > 0) computes no weight
    gradient for the frozen matmuls (4 x their parameters: forward and input gradient) and 6 x the factors'."""
    h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    layers = config.num_hidden_layers * (2 * h * h + 2 * h * kv + 3 * h * config.intermediate_size)
    factors = config.num_hidden_layers * sum(rows * columns for (rows, columns), _ in
                                             lora_layer_shapes(config, 1, lora_rank, tuple(lora_targets)))
    attention_core_forward = 4 * config.num_hidden_layers * h * seq_len
    repeated = {"none": 0, "selective": attention_core_forward,
                "full": 2 * (layers + factors) + attention_core_forward}[recompute]
    per_frozen_parameter = 4 if lora_rank else 6
    return (per_frozen_parameter * (layers + config.vocab_size * h) + 6 * factors + 3 * attention_core_forward
            + repeated)


def training_ledger(config: ModelConfig, layout: ParallelLayout, options: TrainingOptions) -> TrainingLedger:
    """Per-stage memory of one rank for training `config` at `layout` (see the module docstring)."""
    layout.validate_model(config)
    tp, pp = layout.tensor_parallel_size, layout.pipeline_parallel_size
    if options.qlora and tp > 1:
        raise LayoutError(f"qlora at tensor_parallel_size={tp}: {TENSOR_PARALLEL_REASON}")
    weight, gradient, optimizer, activation = PRECISIONS[options.precision]
    data_parallel = options.data_parallel(layout)
    shard = data_parallel.parameter_shards
    s, b, m = options.seq_len, layout.micro_batch_size, layout.num_microbatches
    lora_shapes = lora_layer_shapes(config, tp, options.lora_rank, tuple(options.lora_targets))
    lora_layer = sum(rows * columns for (rows, columns), _ in lora_shapes)  # trainable parameters of a block
    full_layer = _layer_activation_elements(config, tp, s, b) + s * b * options.lora_rank * len(lora_shapes) // 2
    kept_when_recomputed = {
        "none": full_layer,
        "full": s * b * config.hidden_size,
        "selective": full_layer - s * b * (config.hidden_size + config.num_attention_heads) // tp,
    }[options.recompute]
    # a QLoRA block's 4-bit projections: (elements, bytes) held on this rank and gathered by FSDP
    held, whole = ((quantized_layer(config, shard, weight, options.qlora),
                    quantized_layer(config, 1, weight, options.qlora)) if options.qlora else ((0, 0), (0, 0)))

    def weight_bytes(elements: int, blocks: int, nf4: tuple[int, int]) -> int:
        """Bytes of `elements` parameters of which `blocks` blocks' projections are NF4 (`nf4` each)."""
        return (elements - blocks * nf4[0]) * weight + blocks * nf4[1]

    stages = []
    for stage, rank in enumerate(rank_stages(options.schedule, layout, options.stages_per_rank,
                                             config.num_hidden_layers)):
        layers, first, last, num_layers = rank.layer_ranges, rank.first, rank.last, rank.num_layers
        parameters = num_layers * (layer_parameters_per_rank(config, tp) + lora_layer)
        if first:
            parameters += parameters_per_rank(EMBEDDING, config, tp)
        if last:
            parameters += parameters_per_rank(FINAL_NORM, config, tp)
            if not (config.tie_word_embeddings and first):
                parameters += parameters_per_rank(HEAD, config, tp)
        recomputed = 0
        if options.recompute != "none":
            recomputed = len(recomputed_layers(layers, options.recompute_method, options.recompute_num_layers))
        elements = (num_layers - recomputed) * full_layer + recomputed * kept_when_recomputed
        logits_bytes = loss_activation_bytes(s * b, config.vocab_size // tp, activation) if last else 0
        recompute_bytes = (full_layer - kept_when_recomputed) * activation if recomputed else 0
        in_flight = activations_in_flight(options.schedule, pp, stage, m, options.stages_per_rank)
        activation_bytes = in_flight * (elements * activation + logits_bytes) + max(0, recompute_bytes - logits_bytes)
        trainable = num_layers * lora_layer if options.lora_rank else parameters
        local, trainable_local = -(-parameters // shard), -(-trainable // shard)
        optimizer_local = -(-trainable // data_parallel.optimizer_shards)
        gathered = 0
        if shard > 1:
            gathered = (2 * weight_bytes(layer_parameters_per_rank(config, tp) + lora_layer, 1, whole)
                        if data_parallel.reshard_after_forward else weight_bytes(parameters, num_layers, whole))
        stages.append(StageLedger(
            stage=stage, first_layer=layers[0].start, num_layers=num_layers, parameters=parameters,
            layer_spans=tuple((layer_range.start, layer_range.stop) for layer_range in layers),
            weight_bytes=weight_bytes(local, num_layers, held), gradient_bytes=trainable_local * gradient,
            optimizer_bytes=optimizer_local * optimizer, activation_bytes=math.ceil(activation_bytes),
            in_flight_microbatches=in_flight, gathered_weight_bytes=gathered,
            trainable_parameters=trainable if options.lora_rank else None,
        ))
    return TrainingLedger(config.num_parameters(), layout.to_dict(), asdict(options), stages)
