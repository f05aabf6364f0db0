"""The serving ledger and plan: what a vLLM server of the trained model holds per GPU, before it starts.

Notation as in `plan.ledger`: h hidden, f ffn, a heads, k kv heads, d head dim, V vocab, L layers.

* Serving KV cache: 2 x L x k x d x bytes per token, split over the deploy tp size (kv heads are
  replicated when tp exceeds k, as vLLM does).
* Serving plan, per GPU at deploy tp N: the cache budget is memory x utilization - weights, and the
  concurrent sequences of `max_model_len` tokens that fit are budget / (kv per token per GPU x
  max_model_len). vLLM also keeps the peak activations of its profiling pass out of the cache, so this
  is an upper bound.
* A DeepSeek mixture-of-experts model (`serving_plan` of a `plan.moe.MoEModelConfig`) is served with
  vLLM's expert parallelism (`--enable-expert-parallel`) over N GPUs in one of two ways, each planned:
  `--tensor-parallel-size N` (attention heads, the dense MLPs, the shared experts, the embedding and the
  head split over N as in training's plan, `MoEModelConfig.block_parameters_per_rank`; the routed experts
  over N, whole) or `--data-parallel-size N` (each GPU holds the whole model but 1 / N of the routed
  experts, and serves sequences of its own). Multi-head latent attention caches one latent per token and
  layer, L (r_kv + d_r) x bytes, which tensor parallelism does not split (every GPU of a tp server
  caches every sequence's latents), so under `--data-parallel-size` the server holds N times the
  sequences of one GPU. N = 1 is one GPU, no flags.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_tp3d.plan.config import ModelConfig
from lightning_tp3d.plan.layout import LayoutError
from lightning_tp3d.plan.moe import MoEModelConfig

__all__ = ["DeployOption", "ServePlan", "ServingLedger", "deploy_options", "deploy_problem", "moe_deploy_options",
           "moe_deploy_problem", "serving_ledger", "serving_plan"]

_DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
_VLLM_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}
_CANDIDATES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class DeployOption:
    tensor_parallel_size: int
    valid: bool
    reason: str
    weight_bytes_per_gpu: int = 0
    kv_bytes_per_token_per_gpu: int = 0
    data_parallel_size: int = 1
    expert_parallel: bool = False


@dataclass(frozen=True)
class ServingLedger:
    dtype: str
    seq_len: int
    num_seqs: int
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int
    kv_bytes_total: int
    options: list[DeployOption] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values["options"] = [asdict(option) for option in self.options]
        return values


def deploy_problem(config: ModelConfig, tp: int) -> str | None:
    """Why a `tp`-way tensor-parallel server cannot split `config` (None: it can)."""
    if config.num_attention_heads % tp:
        return f"{tp} does not divide num_attention_heads={config.num_attention_heads}"
    kv = config.num_key_value_heads
    if kv % tp and tp % kv:
        return f"{tp} neither divides nor is a multiple of num_key_value_heads={kv}"
    if config.intermediate_size % tp:
        return f"{tp} does not divide intermediate_size={config.intermediate_size}"
    return None


def deploy_options(config: ModelConfig, dtype_bytes: int, candidates: tuple[int, ...] = _CANDIDATES
                   ) -> list[DeployOption]:
    """For each deploy tp size: valid or why not, weights and KV bytes per token on each GPU (PP merged)."""
    options = []
    h, d = config.hidden_size, config.head_dim
    for tp in candidates:
        problem = deploy_problem(config, tp)
        if problem is not None:
            options.append(DeployOption(tp, False, problem))
            continue
        kv_heads = max(1, config.num_key_value_heads // tp)
        layer = (2 * h * config.num_attention_heads * d + 3 * h * config.intermediate_size) // tp
        layer += 2 * h * kv_heads * d + 2 * h
        vocab = config.vocab_size * h // tp * (1 if config.tie_word_embeddings else 2)
        weights = (config.num_hidden_layers * layer + vocab + h) * dtype_bytes
        kv_per_token = 2 * config.num_hidden_layers * kv_heads * d * dtype_bytes
        options.append(DeployOption(tp, True, "ok", weights, kv_per_token))
    return options


def serving_ledger(config: ModelConfig, seq_len: int, num_seqs: int = 1, dtype: str = "bf16") -> ServingLedger:
    """KV cache 2 x layers x kv_heads x head_dim x seq x seqs x bytes, and the deploy tp alignment."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(_DTYPE_BYTES)}.")
    if seq_len < 1 or num_seqs < 1:
        raise LayoutError(f"serving seq_len and num_seqs must be positive, got {seq_len} and {num_seqs}.")
    element = _DTYPE_BYTES[dtype]
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element
    return ServingLedger(
        dtype=dtype, seq_len=seq_len, num_seqs=num_seqs, kv_bytes_per_token=per_token,
        kv_bytes_per_sequence=per_token * seq_len, kv_bytes_total=per_token * seq_len * num_seqs,
        options=deploy_options(config, element),
    )


@dataclass(frozen=True)
class ServePlan:
    """One server of a serving plan (bytes per GPU): `tensor_parallel_size` x `data_parallel_size` GPUs,
    with vLLM's expert parallelism over all of them when `expert_parallel`; `max_num_seqs` per GPU's
    engine (one engine per data-parallel rank)."""

    tensor_parallel_size: int
    weight_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    kv_bytes_per_sequence_per_gpu: int
    kv_budget_bytes_per_gpu: int
    max_num_seqs: int
    vllm_command: str
    data_parallel_size: int = 1
    expert_parallel: bool = False

    @property
    def fits(self) -> bool:
        return self.max_num_seqs > 0


def _check_serving(gpu_memory_bytes: int, gpu_memory_utilization: float, max_model_len: int, dtype: str,
                   max_position_embeddings: int | None) -> None:
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(_DTYPE_BYTES)}.")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}.")
    if max_model_len < 1 or gpu_memory_bytes < 1:
        raise ValueError(f"max_model_len and the GPU memory must be positive, got {max_model_len} and"
                         f" {gpu_memory_bytes}.")
    if max_position_embeddings is not None and max_model_len > max_position_embeddings:
        raise LayoutError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
            f"{max_position_embeddings}, which vLLM refuses; serve at most {max_position_embeddings}"
            " tokens per sequence (or a model with longer positions)."
        )


def _servers(options: list[DeployOption], model_path: str, gpu_memory_bytes: int, gpu_memory_utilization: float,
             max_model_len: int, dtype: str) -> list[ServePlan]:
    """The valid `options` as servers: the cache budget per GPU, the sequences it holds, the vLLM command."""
    plans = []
    for option in options:
        if not option.valid:
            continue
        per_sequence = option.kv_bytes_per_token_per_gpu * max_model_len
        budget = int(gpu_memory_bytes * gpu_memory_utilization) - option.weight_bytes_per_gpu
        max_num_seqs = max(0, budget // per_sequence)
        split = (f"--data-parallel-size {option.data_parallel_size}" if option.data_parallel_size > 1
                 else f"--tensor-parallel-size {option.tensor_parallel_size}")
        command = (f"vllm serve {model_path} {split}{' --enable-expert-parallel' if option.expert_parallel else ''}"
                   f" --dtype {_VLLM_DTYPES.get(dtype, 'float32')} --gpu-memory-utilization {gpu_memory_utilization}"
                   f" --max-model-len {max_model_len} --max-num-seqs {max_num_seqs}")
        plans.append(ServePlan(option.tensor_parallel_size, option.weight_bytes_per_gpu,
                               option.kv_bytes_per_token_per_gpu, per_sequence, budget, max_num_seqs, command,
                               option.data_parallel_size, option.expert_parallel))
    return plans


def moe_deploy_problem(config: MoEModelConfig, size: int, tensor_parallel: bool) -> str | None:
    """Why `size` GPUs cannot serve `config` with vLLM's expert parallelism over them, under tensor
    parallelism (`tensor_parallel`) or data parallelism (None: they can)."""
    if config.n_routed_experts % size:
        return f"{size} does not divide n_routed_experts={config.n_routed_experts}"
    if not tensor_parallel:
        return None
    split = {"num_attention_heads": config.num_attention_heads,
             "n_shared_experts x moe_intermediate_size": config.n_shared_experts * config.moe_intermediate_size}
    if config.first_k_dense_replace:
        split["intermediate_size"] = config.intermediate_size
    return next((f"{size} does not divide {name}={value}" for name, value in split.items() if value % size), None)


def moe_deploy_options(config: MoEModelConfig, dtype_bytes: int, sizes: tuple[int, ...] = _CANDIDATES
                       ) -> list[DeployOption]:
    """For each size N: a tensor-parallel and (N > 1) a data-parallel server with expert parallelism over
    N GPUs (module docstring), valid or why not, weights and latent-cache bytes per token on each GPU."""
    h, layers = config.hidden_size, config.num_hidden_layers
    latent = layers * (config.kv_lora_rank + config.qk_rope_head_dim) * dtype_bytes
    options = []
    for size in sizes:
        for tensor_parallel in (True, False) if size > 1 else (True,):
            problem = moe_deploy_problem(config, size, tensor_parallel)
            tp, dp = (size, 1) if tensor_parallel else (1, size)
            if problem is not None:
                options.append(DeployOption(tp, False, problem, data_parallel_size=dp, expert_parallel=size > 1))
                continue
            blocks = sum(sum(config.block_parameters_per_rank(layer, tp, size)) for layer in range(layers))
            vocab = config.vocab_size * h // tp * (1 if config.tie_word_embeddings else 2)
            options.append(DeployOption(tp, True, "ok", (blocks + vocab + h) * dtype_bytes, latent, dp, size > 1))
    return options


def _refusal(config: ModelConfig | MoEModelConfig, size: int) -> str | None:
    """Why a requested deploy size cannot serve `config` at all (None: it can)."""
    if isinstance(config, MoEModelConfig):
        problems = [moe_deploy_problem(config, size, tensor_parallel) for tensor_parallel in (True, False)]
        return f"{size} GPUs cannot serve this model with expert parallelism: {problems[0]}" if all(problems) else None
    problem = deploy_problem(config, size)
    return None if problem is None else f"deploy tensor_parallel_size={size} is not valid for this model: {problem}"


def serving_plan(
    config: ModelConfig | MoEModelConfig,
    model_path: str,
    gpu_memory_bytes: int,
    gpu_memory_utilization: float = 0.9,
    max_model_len: int = 4096,
    dtype: str = "bf16",
    sizes: tuple[int, ...] | None = None,
) -> list[ServePlan]:
    """Weights, KV cache and concurrent sequences per GPU for each deploy size, with the vLLM command: for a
    dense `ModelConfig` a tensor-parallel server of each size, for a DeepSeek mixture-of-experts
    `MoEModelConfig` a tensor-parallel and a data-parallel one, both with vLLM's expert parallelism over
    its GPUs (module docstring).

    Without `sizes` every valid size of 1, 2, 4, 8, 16 is planned; a requested size the model cannot be
    served at is refused with the reason.
    """
    _check_serving(gpu_memory_bytes, gpu_memory_utilization, max_model_len, dtype, config.max_position_embeddings)
    for size in sizes or ():
        refusal = _refusal(config, size)
        if refusal is not None:
            raise LayoutError(f"{refusal}.")
    options = moe_deploy_options if isinstance(config, MoEModelConfig) else deploy_options
    return _servers(options(config, _DTYPE_BYTES[dtype], tuple(sizes or _CANDIDATES)), model_path, gpu_memory_bytes,
                    gpu_memory_utilization, max_model_len, dtype)
