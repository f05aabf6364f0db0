"""Training a DeepSeek-V2 / V3 mixture-of-experts model: each rank's activations and its memory ledger, and
the training FLOPs, for `tp3d plan` and the layout advisor (`plan.advisor`).

Notation as in `plan.moe`: h hidden, a heads, d_n / d_r / d_v a head's non-rotary, rotary and value dims,
r_q / r_kv the query and key-value latent ranks, N routed experts of intermediate size I, K chosen per
token, n_s shared experts, f the dense blocks' intermediate size, t tp, T = s b the tokens of a
micro-batch.

Activations one block keeps for backward, per token, on one rank (`block_activations`), split as
`models.deepseek`'s plan splits the block and with a fused attention kernel (no s x s matrix is kept):

    norms          4 h                         both RMSNorms' inputs and outputs (replicated over tp), in
                                               the residual stream's dtype (float32 under autocast)
    casts          4 h, under 16-bit autocast  the 16-bit copies of the inputs of the four projections that
                                               read a norm's output (q_a or q_proj, kv_a; gate and up)
    latents        2 r_q + 2 r_kv + 2 d_r      q_a's output and its norm's, kv_a's output (r_kv + d_r) and
                                               the normed latent, the rotary key after RoPE (replicated)
    heads          a (4 d_n + 3 d_r + 4 d_v + 1) / t    q_b's and kv_b's outputs, the attention kernel's
                                               q, k, v, output and softmax statistics, o_proj's input
    router         2 N + 2 K  (float32)        DeepSeek's router runs in float32: scores, the biased
                                               scores top-k chooses from, the chosen weights
                   + h (float32, under bf16-true)          its float32 copy of the input
    routed         K (2 h + 4 I)               per chosen expert (a dispatched row under EP, as many with
                                               uniform routing): its input, gate and up, the activation
                                               and the product, its output before weighting; in the dtype
                                               the experts compute in (the weights', `parallel.experts`)
    shared         4 n_s I / t                 gate, up, activation, product (Megatron's MLP over tp)
    dense block    4 f / t instead of router, routed and shared

The elements are the activation element's bytes (`plan.ledger.PRECISIONS`) unless said. Recompute:
`full` keeps a block's input (h, the residual stream's dtype); `selective` recomputes the block's
`self_attn` (the whole MLA: a Hugging Face DeepSeek has no separate attention core) and keeps its input,
dropping the latents and heads terms and the MLA's two casts. The stage's peak then follows `plan.ledger`:
the blocks' activations and the last stage's loss path (`plan.loss`) for each micro-batch in flight under
the schedule (`plan.schedules.activations_in_flight`), and once what the recomputed block being
back-propagated adds back beyond the loss path it follows.

Measured (`benchmarks/moe_activation_census.py`: DeepSeek-V2-Lite's shapes, s = 600, one process on the
CPU): an MoE block keeps 218.1 MB per sequence under bf16-mixed against this count's 208.2 MB (1.048x),
241.7 MB against 236.6 MB in fp32 (1.021x), the dense first block 114.3 MB against 106.8 MB under
bf16-mixed (1.070x). Most of the rest is the CPU's SDPA math path, which keeps q, k and v in float32
under autocast and the s x s probabilities (23.0 MB, reported apart), where a GPU's fused kernels keep
neither.

FSDP gathers, as `plan.ledger` counts them: with resharding after forward two blocks' parameters (the
largest block, routed experts included) at a time, else the stage's whole parameters through the step.

FLOPs per token (`moe_training_flops_per_token`), as `plan.ledger.training_flops_per_token` counts a
dense model's: 6 x the matmul parameters a token's forward uses (each block's MLA projections, its dense
MLP or router, K routed and n_s shared experts, and the head) + 3 x the attention core's forward,
2 s a (d_n + d_r) + 2 s a d_v per block; full recompute adds one forward of the blocks, selective the
MLA's (projections and core).
"""

from __future__ import annotations

import math
from dataclasses import asdict

from lightning_tp3d.plan.communication import activation_bytes
from lightning_tp3d.plan.layout import LayoutError, ParallelLayout
from lightning_tp3d.plan.ledger import PRECISIONS, StageLedger, TrainingLedger, TrainingOptions
from lightning_tp3d.plan.loss import loss_activation_bytes
from lightning_tp3d.plan.moe import MoEModelConfig, expert_model_memory
from lightning_tp3d.plan.recompute import recomputed_layers
from lightning_tp3d.plan.schedules import activations_in_flight, rank_stages

__all__ = ["block_activations", "check_moe_options", "moe_training_flops_per_token", "moe_training_ledger"]


def check_moe_options(config: MoEModelConfig, layout: ParallelLayout, options: TrainingOptions) -> None:
    """What the MoE plan does not count, refused with what to change: LoRA and QLoRA fine-tunes, tp not
    dividing the heads or the dense and shared experts' widths, E not dividing the experts, more stages
    than blocks."""
    if options.lora_rank or options.qlora is not None:
        raise LayoutError("the mixture-of-experts plan counts full training only: plan a LoRA or QLoRA fine-tune"
                          " of an MoE model without --lora-rank / --qlora.")
    tp = layout.tensor_parallel_size
    widths = {"num_attention_heads": config.num_attention_heads, "intermediate_size": config.intermediate_size,
              "n_shared_experts x moe_intermediate_size": config.n_shared_experts * config.moe_intermediate_size}
    for name, width in widths.items():
        if width % tp:
            raise LayoutError(f"tensor_parallel_size={tp} does not divide {name}={width}: use a tp that divides it.")
    if config.n_routed_experts % layout.expert_parallel_size:
        raise LayoutError(f"expert_parallel_size={layout.expert_parallel_size} does not divide the"
                          f" {config.n_routed_experts} routed experts of a block: use a divisor of it.")
    if layout.num_stages > config.num_hidden_layers:
        raise LayoutError(f"{layout.num_stages} pipeline stages for {config.num_hidden_layers} blocks: use at"
                          " most one stage per block.")


def block_activations(config: MoEModelConfig, layer: int, tensor_parallel_size: int, precision: str
                      ) -> dict[str, float]:
    """Bytes per token block `layer` keeps for backward on one rank, by the module docstring's terms."""
    h, a, t = config.hidden_size, config.num_attention_heads, tensor_parallel_size
    d_n, d_r, d_v, r_kv = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.kv_lora_rank
    weight, _, _, element = PRECISIONS[precision]
    query_latent = 2 * config.q_lora_rank if config.q_lora_rank is not None else 0
    stream = activation_bytes(precision)[1]
    terms = {"norms": 4 * h * stream, "casts": 4 * h * element if element != stream else 0,
             "latents": (query_latent + 2 * r_kv + 2 * d_r) * element,
             "heads": a * (4 * d_n + 3 * d_r + 4 * d_v + 1) / t * element}
    if layer < config.first_k_dense_replace:
        return terms | {"mlp": 4 * config.intermediate_size / t * element}
    n, k, intermediate = config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size
    return terms | {"router": 4 * (2 * n + 2 * k + (h if stream != 4 else 0)),
                    "routed": k * (2 * h + 4 * intermediate) * weight,
                    "shared": 4 * config.n_shared_experts * intermediate / t * element}


def _kept_when_recomputed(config: MoEModelConfig, recompute: str, terms: dict[str, float], precision: str) -> float:
    """Bytes per token a recomputed block keeps (module docstring)."""
    if recompute == "full":
        return config.hidden_size * activation_bytes(precision)[1]
    return sum(terms.values()) - terms["latents"] - terms["heads"] - terms["casts"] / 2  # the MLA's two casts


def moe_training_flops_per_token(config: MoEModelConfig, seq_len: int, recompute: str = "none") -> int:
    """Training FLOPs per token (forward + backward, module docstring)."""
    h, a = config.hidden_size, config.num_attention_heads
    d_qk, d_v = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    query = h * a * d_qk if config.q_lora_rank is None else config.q_lora_rank * (h + a * d_qk)
    attention = query + h * (config.kv_lora_rank + config.qk_rope_head_dim) + config.kv_lora_rank * a * (
        config.qk_nope_head_dim + d_v) + a * d_v * h
    experts = (config.num_experts_per_tok + config.n_shared_experts) * config.expert_parameters()
    blocks = config.num_hidden_layers * attention + config.first_k_dense_replace * 3 * h * config.intermediate_size
    blocks += config.moe_layers * (experts + config.n_routed_experts * h)
    core = 2 * seq_len * a * (d_qk + d_v) * config.num_hidden_layers
    repeated = {"none": 0, "selective": 2 * config.num_hidden_layers * attention + core,
                "full": 2 * blocks + core}[recompute]
    return 6 * (blocks + config.vocab_size * h) + 3 * core + repeated


def moe_training_ledger(config: MoEModelConfig, layout: ParallelLayout, options: TrainingOptions) -> TrainingLedger:
    """Per pp rank, one rank's memory for training `config` at `layout` (`plan.ledger`'s figures for an MoE
    model: weights, gradients and optimizer state from `plan.moe.expert_model_memory`, FSDP's gathered
    weights and the activations from the module docstring)."""
    check_moe_options(config, layout, options)
    tp, experts = layout.tensor_parallel_size, layout.expert_parallel_size
    weight, _, _, element = PRECISIONS[options.precision]
    tokens = options.seq_len * layout.micro_batch_size
    data_parallel = options.data_parallel(layout)
    held = expert_model_memory(config, layout, options.precision, options.data_parallel_mode, options.schedule,
                               options.stages_per_rank)
    ranks = rank_stages(options.schedule, layout, options.stages_per_rank, config.num_hidden_layers)
    stages = []
    for stage, (rank, memory) in enumerate(zip(ranks, held)):
        layers = [layer for layer_range in rank.layer_ranges for layer in layer_range]
        recomputed = set()
        if options.recompute != "none":
            recomputed = set(recomputed_layers(rank.layer_ranges, options.recompute_method,
                                               options.recompute_num_layers))
        kept, added_back = 0.0, 0.0
        for layer in layers:
            terms = block_activations(config, layer, tp, options.precision)
            full = sum(terms.values())
            if layer in recomputed:
                block_kept = _kept_when_recomputed(config, options.recompute, terms, options.precision)
                kept += block_kept
                added_back = max(added_back, full - block_kept)
            else:
                kept += full
        loss = loss_activation_bytes(tokens, config.vocab_size // tp, element) if rank.last else 0
        in_flight = activations_in_flight(options.schedule, layout.pipeline_parallel_size, stage,
                                          layout.num_microbatches, options.stages_per_rank)
        activations = in_flight * (kept * tokens + loss) + max(0.0, added_back * tokens - loss)
        parameters = memory.parameters + memory.expert_parameters
        gathered = 0
        if data_parallel.parameter_shards > 1:
            blocks = [sum(config.block_parameters_per_rank(layer, tp, experts)) for layer in layers]
            gathered = weight * (2 * max(blocks) if data_parallel.reshard_after_forward else parameters)
        stages.append(StageLedger(
            stage=stage, first_layer=layers[0], num_layers=len(layers), parameters=parameters,
            weight_bytes=memory.weight_bytes, gradient_bytes=memory.gradient_bytes,
            optimizer_bytes=memory.optimizer_bytes, activation_bytes=math.ceil(activations),
            layer_spans=tuple((layer_range.start, layer_range.stop) for layer_range in rank.layer_ranges),
            in_flight_microbatches=in_flight, gathered_weight_bytes=gathered))
    return TrainingLedger(config.num_parameters(), layout.to_dict(), asdict(options), stages)
