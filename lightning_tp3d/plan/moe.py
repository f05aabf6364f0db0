"""Mixture-of-experts decoders with multi-head latent attention (DeepSeek-V2 / V3): their parameters, in all
and active per token, and the routed experts' share of them.

Shapes, with transformers' field names: h hidden, V vocab, L blocks of which the first k are dense, a
heads, r_q / r_kv the query / key-value latent ranks (no query latent: r_q = None), d_n / d_r / d_v a
head's non-rotary, rotary and value dims, f the dense MLP's and f_e an expert's intermediate size, E
routed experts of which K serve each token, S shared experts.

    attention  = h r_q + r_q + r_q a (d_n + d_r)      (q_a_proj, q_a_layernorm, q_b_proj;
                                                       h a (d_n + d_r) without a query latent: q_proj)
               + h (r_kv + d_r) + r_kv                 (kv_a_proj_with_mqa, kv_a_layernorm)
               + r_kv a (d_n + d_v) + a d_v h          (kv_b_proj, o_proj)
    expert     = 3 h f_e                               (gate, up, down; a shared expert alike)
    dense MLP  = 3 h f
    MoE MLP    = E expert + S expert + E h              (routed, shared, the router's weight)
    block      = attention + 2 h + (dense MLP or MoE MLP)
    total      = V h (embedding) + L blocks + h (final norm) + V h (head, unless tied)

The router's score-correction bias (DeepSeek-V3's auxiliary-loss-free balancing) is a buffer, not a
parameter. Active parameters per token count each MoE block's K routed experts instead of E, and leave
out the input embedding (a row lookup, no matmul): DeepSeek-V3 has 671.0B parameters and 36.6B active
("671B, 37B activated" in its report), DeepSeek-V2-Lite 15.7B and 2.45B ("15.7B, 2.4B"). Both presets'
figures are checked by hand in `tests/plan/test_moe.py`, and the formula against transformers' own
`DeepseekV3ForCausalLM` parameter count.

Expert parallelism over E ranks (`parallel.experts`) holds E_r / E of each block's routed experts per rank
(`routed_expert_parameters_per_rank`), and exchanges per MoE block and micro-batch of T tokens on a rank
(`expert_exchange`, payloads handed to the all-to-alls, in elements):

    counts    E_r int64                 the per-expert counts, forward only
    dispatch  T K h                     the rank's token choices, forward; the combine's backward the same
    returned  R h, sum over the group   what the rank received (R rows, set by the routing: dropless),
              of R = E T K              sent back by the combine, forward; the dispatch's backward the same

so 2 T K h + 2 R h activation elements per rank, 4 E T K h over the group, plus the counts. Of each
payload, the share a rank keeps for itself does not cross a link: (E - 1) / E of it does when the
routing is uniform.

Per step (`expert_ledger`, the "ep" group of `tp3d plan`): each rank runs these five all-to-alls for each
MoE block of its stages (one, or several under the looped and V-shaped schedules) and each of its k m
micro-batches of T = b s tokens, with R = T K (uniform routing; over an ep group the sum is exact whatever
the routing). The dispatch and its
backward carry the residual stream's dtype (`plan.communication.activation_bytes`), the combine and its
backward the experts' outputs, in the dtype the experts compute in: the weights' dtype for transformers'
default grouped_mm experts, which run outside autocast (`parallel.experts`: float32 under the mixed
precisions; an eager experts implementation would send the autocast dtype).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_tp3d.plan.communication import EXPERT_GROUP, CommunicationLedger, Transfer, activation_bytes
from lightning_tp3d.plan.config import ModelConfig
from lightning_tp3d.plan.data_parallel import choose_data_parallel
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.ledger import PRECISIONS
from lightning_tp3d.plan.schedules import rank_stages

__all__ = ["MOE_PRESETS", "ExpertExchange", "ExpertStageMemory", "MoEModelConfig", "expert_ledger",
           "expert_model_memory", "planner_config", "resolve_moe_config"]


@dataclass(frozen=True)
class MoEModelConfig:
    """The shape of a DeepSeek-V2 / V3 decoder (see the module docstring), with transformers' field names."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    first_k_dense_replace: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None  # unknown: a serving plan does not check the length

    def __post_init__(self) -> None:
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} must be between 0 and"
                             f" num_hidden_layers={self.num_hidden_layers}.")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and"
                             f" n_routed_experts={self.n_routed_experts}.")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> MoEModelConfig:
        """Read a transformers DeepSeek config (`config.json` or `config.to_dict()`); other keys are ignored."""
        known = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in values.items() if key in known})

    @property
    def moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    def attention_parameters(self) -> int:
        h, a, r_kv = self.hidden_size, self.num_attention_heads, self.kv_lora_rank
        query_width = a * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        query = h * query_width if self.q_lora_rank is None else (h + 1 + query_width) * self.q_lora_rank
        key_value = h * (r_kv + self.qk_rope_head_dim) + r_kv + r_kv * a * (self.qk_nope_head_dim + self.v_head_dim)
        return query + key_value + a * self.v_head_dim * h

    def expert_parameters(self) -> int:
        """One routed (or shared) expert: gate, up and down."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def _parameters(self, routed_experts: int, input_embedding: bool) -> int:
        h = self.hidden_size
        block = self.attention_parameters() + 2 * h
        dense = block + 3 * h * self.intermediate_size
        moe = block + (routed_experts + self.n_shared_experts) * self.expert_parameters() + self.n_routed_experts * h
        embedding = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else embedding
        return (embedding * input_embedding + self.first_k_dense_replace * dense + self.moe_layers * moe + h
                + head)

    def block_tensors(self, layer: int, tensor_parallel_size: int) -> list[tuple[tuple[int, ...], int | None]]:
        """Block `layer`'s parameters on one tp rank but its routed experts, as (local shape, the dim tp splits
        or None), in the order transformers registers them; split as `models.deepseek`'s plan splits them:
        the head-wise projections (`q_b_proj` or `q_proj`, `kv_b_proj`, `o_proj`), the dense MLP and the
        shared experts over tp (column parallel along dim 0, row parallel along dim 1); the latents
        (`q_a_proj`, `kv_a_proj_with_mqa`), their norms, the block's norms and the router replicated."""
        h, a, r_kv, t = self.hidden_size, self.num_attention_heads, self.kv_lora_rank, tensor_parallel_size
        query_width = a * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        if self.q_lora_rank is None:
            query = [((query_width // t, h), 0)]
        else:
            query = [((self.q_lora_rank, h), None), ((self.q_lora_rank,), None),
                     ((query_width // t, self.q_lora_rank), 0)]
        attention = query + [((r_kv + self.qk_rope_head_dim, h), None), ((r_kv,), None),
                             ((a * (self.qk_nope_head_dim + self.v_head_dim) // t, r_kv), 0),
                             ((h, a * self.v_head_dim // t), 1)]
        if layer < self.first_k_dense_replace:
            width, router = self.intermediate_size // t, []
        else:
            width = self.n_shared_experts * self.moe_intermediate_size // t
            router = [((self.n_routed_experts, h), None)]
        mlp = router + [((width, h), 0), ((width, h), 0), ((h, width), 1)]
        return attention + mlp + [((h,), None), ((h,), None)]

    def block_parameters_per_rank(self, layer: int, tensor_parallel_size: int, expert_parallel_size: int
                                  ) -> tuple[int, int]:
        """(parameters, routed-expert parameters) of block `layer` on one rank (`block_tensors`; the routed
        experts over E, whole over tp)."""
        dense = sum(math.prod(shape) for shape, _ in self.block_tensors(layer, tensor_parallel_size))
        if layer < self.first_k_dense_replace:
            return dense, 0
        return dense, self.routed_expert_parameters_per_rank(expert_parallel_size) // self.moe_layers

    def num_parameters(self) -> int:
        """Every parameter (see the module docstring)."""
        return self._parameters(self.n_routed_experts, input_embedding=True)

    def active_parameters(self) -> int:
        """The parameters one token's forward multiplies with: K routed experts per MoE block, no input
        embedding (a lookup)."""
        return self._parameters(self.num_experts_per_tok, input_embedding=False)

    def routed_expert_parameters(self) -> int:
        """The routed experts of every MoE block: what expert parallelism splits over its ranks."""
        return self.moe_layers * self.n_routed_experts * self.expert_parameters()

    def routed_expert_parameters_per_rank(self, expert_parallel_size: int) -> int:
        """What one rank of an expert-parallel group of `expert_parallel_size` holds of the routed experts."""
        if self.n_routed_experts % expert_parallel_size:
            raise ValueError(f"expert_parallel_size={expert_parallel_size} does not divide the"
                             f" {self.n_routed_experts} routed experts of a block.")
        return self.routed_expert_parameters() // expert_parallel_size

    def expert_exchange(self, tokens: int, expert_parallel_size: int) -> ExpertExchange:
        """One MoE block's all-to-all payloads for a micro-batch of `tokens` on each rank (module docstring)."""
        chosen = tokens * self.num_experts_per_tok * self.hidden_size
        return ExpertExchange(counts=self.n_routed_experts, dispatch=chosen,
                              returned_in_group=expert_parallel_size * chosen)


@dataclass(frozen=True)
class ExpertExchange:
    """One rank's all-to-all payloads, in elements, for one MoE block and micro-batch: `counts` (int64,
    forward), `dispatch` (forward, and again in the combine's backward), and `returned_in_group`, the ep
    group's combined-forward payloads together (and again in the dispatch's backward), each rank's share
    set by the routing."""

    counts: int
    dispatch: int
    returned_in_group: int


MOE_PRESETS: dict[str, MoEModelConfig] = {
    # deepseek-ai/DeepSeek-V3's config.json (the multi-token-prediction module left out)
    "deepseek-v3": MoEModelConfig(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840),
    # deepseek-ai/DeepSeek-V2-Lite's config.json (no query latent)
    "deepseek-v2-lite": MoEModelConfig(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, first_k_dense_replace=1, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840),
}


def resolve_moe_config(name_or_path: str | Path) -> MoEModelConfig | None:
    """A preset of `MOE_PRESETS`, or a DeepSeek `config.json` (a path, or the folder holding it, whose
    config has routed experts); None for anything else."""
    if str(name_or_path) in MOE_PRESETS:
        return MOE_PRESETS[str(name_or_path)]
    path = Path(name_or_path)
    path = path / "config.json" if path.is_dir() else path
    if path.suffix != ".json" or not path.is_file():
        return None
    values = json.loads(path.read_text())
    return MoEModelConfig.from_dict(values) if "n_routed_experts" in values else None


def planner_config(record: dict[str, Any]) -> ModelConfig | MoEModelConfig | None:
    """The shape the planner reads from a model's config record (`config.json`, `ModelAdapter.config_record`):
    a DeepSeek mixture of experts (routed experts and a latent KV rank) as a `MoEModelConfig`; another
    mixture of experts (Mixtral's `num_local_experts`, Qwen-MoE's `num_experts`), which the planner does not
    model, as None rather than as the dense decoder its other fields describe; else a `ModelConfig` (None
    without a decoder's shape)."""
    try:
        if record.get("n_routed_experts") and record.get("kv_lora_rank"):
            return MoEModelConfig.from_dict(record)
        if record.get("num_local_experts") or record.get("num_experts"):
            return None
        return ModelConfig.from_dict(record)
    except (TypeError, ValueError):
        return None


def expert_ledger(config: MoEModelConfig, layout: ParallelLayout, seq_len: int, precision: str,
                  schedule: str = "1f1b", stages_per_rank: int = 2) -> CommunicationLedger:
    """Per pp rank (its stages under `schedule`: one, or `stages_per_rank` for the looped and V-shaped
    ones, `plan.schedules.rank_stages`), the all-to-alls one rank issues over its expert-parallel group in a
    step (module docstring), as a `CommunicationLedger` of the one group "ep"."""
    experts = layout.expert_parallel_size
    config.routed_expert_parameters_per_rank(experts)  # E divides the experts
    passes = layout.gradient_accumulation_steps * layout.num_microbatches
    exchange = config.expert_exchange(layout.micro_batch_size * seq_len, experts)
    stream, weights = activation_bytes(precision)[1], PRECISIONS[precision][0]
    stages = []
    for held in rank_stages(schedule, layout, stages_per_rank, config.num_hidden_layers):
        calls = passes * sum(layer >= config.first_k_dense_replace for layers in held.layer_ranges for layer in layers)
        stages.append([] if not calls or experts == 1 else [
            Transfer(EXPERT_GROUP, "all_to_all", calls, exchange.counts, 8, "expert counts, forward"),
            Transfer(EXPERT_GROUP, "all_to_all", calls, exchange.dispatch, stream, "dispatch, forward"),
            Transfer(EXPERT_GROUP, "all_to_all", calls, exchange.dispatch, weights, "combine, forward"),
            Transfer(EXPERT_GROUP, "all_to_all", calls, exchange.dispatch, weights, "combine's backward"),
            Transfer(EXPERT_GROUP, "all_to_all", calls, exchange.dispatch, stream, "dispatch's backward")])
    return CommunicationLedger({EXPERT_GROUP: experts}, stages)


@dataclass(frozen=True)
class ExpertStageMemory:
    """One rank of pp rank `stage` (its stages' `layers`): its parameters (the routed experts apart) and the
    bytes of weights, gradients and optimizer state they take under the data-parallel mode
    (`expert_model_memory`)."""

    stage: int
    layers: tuple[range, ...]
    parameters: int  # per rank: split over tp, not over dp
    expert_parameters: int  # the routed experts a rank holds: split over E, not over their replicas
    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes


def expert_model_memory(config: MoEModelConfig, layout: ParallelLayout, precision: str, data_parallel_mode: str,
                        schedule: str = "1f1b", stages_per_rank: int = 2) -> list[ExpertStageMemory]:
    """Per pp rank (its stages under `schedule`, as `expert_ledger`), one rank's weights, gradients and
    optimizer state (bytes per parameter from `plan.ledger.PRECISIONS`): "replicate" holds them whole;
    "zero1" cuts the optimizer state over dp (the experts' over their d = dp / E replicas); "fsdp" cuts all
    three so (FSDP2's gathered units and the activations are not counted)."""
    tp, dp, experts = layout.tensor_parallel_size, layout.data_parallel_size, layout.expert_parallel_size
    replicas = dp // experts
    plan = choose_data_parallel(data_parallel_mode, dp, layout.pipeline_parallel_size)
    weight, gradient, optimizer, _ = PRECISIONS[precision]
    h, vocab_split = config.hidden_size, config.vocab_size * config.hidden_size // tp
    stages = []
    for rank, held_stages in enumerate(rank_stages(schedule, layout, stages_per_rank, config.num_hidden_layers)):
        split = [config.block_parameters_per_rank(layer, tp, experts)
                 for layers in held_stages.layer_ranges for layer in layers]
        parameters = sum(dense for dense, _ in split) + (vocab_split if held_stages.first else 0)
        if held_stages.last:
            parameters += h + (0 if config.tie_word_embeddings and held_stages.first else vocab_split)
        routed = sum(expert for _, expert in split)

        def held(shards: int, parameters: int = parameters, routed: int = routed) -> int:
            """Elements a rank keeps of both when the others are cut into `shards` (dp, or none)."""
            return -(-parameters // shards) + -(-routed // (replicas if shards > 1 else 1))

        stages.append(ExpertStageMemory(
            rank, held_stages.layer_ranges, parameters, routed, held(plan.parameter_shards) * weight,
            held(plan.parameter_shards) * gradient, held(plan.optimizer_shards) * optimizer))
    return stages
