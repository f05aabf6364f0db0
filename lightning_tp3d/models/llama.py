"""Reference DeepSeek-LLM / Llama-style decoder with Hugging Face parameter names.

`LlamaForCausalLM` here has the same module tree as transformers' `LlamaForCausalLM`
(`model.embed_tokens`, `model.layers.{i}.self_attn.q_proj`, `model.layers.{i}.mlp.gate_proj`,
`model.layers.{i}.input_layernorm`, `model.norm`, `lm_head`) and the same math (RMSNorm, rotate-half
RoPE, grouped-query attention, SwiGLU), so exporting is a gather of shards and not a translation.

Pipeline-friendly by construction: the blocks live in a `ModuleDict` keyed by their global index, so
`model.layers.7.self_attn.q_proj.weight` keeps its name on whichever stage owns it, and the embedding,
final norm and head may be `None` on stages that do not own them.

Tensor-parallel friendly: attention reshapes with `view(batch, seq, -1, head_dim)`, so under a column-
parallel q/k/v projection each tp rank runs attention over its own `heads / tp` heads on local tensors.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_tp3d.models.cross_entropy import chunked_cross_entropy
from lightning_tp3d.parallel.materialize import local_region, seeded_normal_
from lightning_tp3d.parallel.vocab_parallel import loss_takes_sharded_logits, sharded_logits, takes_sharded_logits
from lightning_tp3d.plan.config import ModelConfig

__all__ = ["IGNORE_INDEX", "LlamaForCausalLM", "causal_lm_loss"]

IGNORE_INDEX = -100


@takes_sharded_logits
def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean token cross entropy over labels != -100; `labels[b, s]` is the target of position s. In float32,
    chunk by chunk (`models.cross_entropy`): the logits are never copied whole to float32, nor gathered
    when tp splits them over the vocabulary."""
    return chunked_cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 as transformers does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        local_region(self.weight)[0].fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


@functools.lru_cache(maxsize=8)
def _rotary_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype):
    """cos/sin of angle(p, i) = p / theta^(2i / head_dim), duplicated over both halves (rotate-half RoPE).

    Computed once per (length, device, dtype) and shared by every layer; made outside inference mode so a
    table first built during validation can be saved for a later training backward. A compiled block
    (`TP3DStrategy(compile=True)`) computes the tables inside its graph instead: dynamo does not trace
    through a cache."""
    with torch.inference_mode(False):
        return _rotary_tables(seq_len, head_dim, theta, device, dtype)


def _rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class Attention(nn.Module):
    """Causal grouped-query attention; heads are inferred from the projections' (local) widths."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.head_dim = hd
        self.rope_theta = config.rope_theta
        self.dropout = config.attention_dropout
        self.q_proj = nn.Linear(h, config.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * hd, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        rotary = _rotary_tables if torch.compiler.is_compiling() else _rotary_cos_sin
        cos, sin = rotary(seq, self.head_dim, self.rope_theta, x.device, q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = self.core_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def core_attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """softmax(q k^T / sqrt(d) + causal mask) v, with each kv head shared by a group of q heads (SDPA's
        grouped-query mode: k and v are not copied per q head); the part that selective recompute
        recomputes instead of keeping (`TP3DStrategy(recompute="selective")`).

        On CUDA only the flash kernel takes grouped queries, and only in 16-bit: in fp32 SDPA would fall
        back to its math kernel, which keeps the b x heads x s x s probabilities for backward (measured on
        an H200, 1.1B model, s 2048: 11.8 GB per sequence). There k and v are repeated per q head instead
        (2 x s x heads x d more), so the memory-efficient kernel runs."""
        grouped = q.shape[1] != k.shape[1]
        if grouped and q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16):
            repeats = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
            grouped = False
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
                                              enable_gqa=grouped)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.dropout(self.self_attn(self.input_layernorm(x)))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class LlamaModel(nn.Module):
    """Embedding, blocks keyed by global index, final norm; each part optional for pipeline stages."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config) for i in range(config.num_hidden_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        return x


class LlamaForCausalLM(nn.Module):
    """Decoder language model: `forward(input_ids)` gives logits, `forward(input_ids, labels)` the loss.

    On a pipeline stage without the embedding the input is the previous stage's hidden states
    `[batch, seq, hidden]`; without the head the output is hidden states.
    """

    loss_function = staticmethod(causal_lm_loss)

    def __init__(self, config: ModelConfig, init_seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.init_seed = init_seed
        self.model = LlamaModel(config)
        self.lm_head: nn.Linear | None = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, initializer_range) for projections and embedding, ones for norms (as transformers).

        Each weight is drawn from (`init_seed`, its global name) alone (`seeded_normal_`), so a network
        built on the meta device and materialised as a shard (pruned to pipeline stages, sliced by tp and
        FSDP) holds exactly its part of the weights one process builds for the whole network."""
        initialised: set[int] = set()  # a tied weight takes the values of its first name
        for module_name, module in self.named_modules():
            if not isinstance(module, (nn.Linear, nn.Embedding, RMSNorm)) or id(module.weight) in initialised:
                continue
            initialised.add(id(module.weight))
            if isinstance(module, RMSNorm):
                module.reset_parameters()
            else:
                seeded_normal_(module.weight, f"{module_name}.weight", self.init_seed, self.config.initializer_range)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> Tensor:
        x = self.model(input_ids)
        loss_takes_them = labels is not None and loss_takes_sharded_logits(self.loss_function)
        if self.lm_head is not None:
            with sharded_logits() if loss_takes_them else contextlib.nullcontext():
                x = self.lm_head(x)  # split over the vocabulary under tp when the loss takes them so
        if labels is None:
            return x
        return self.loss_function(x, labels)
