"""Where tensor parallelism splits each weight of a Llama-family decoder, in Hugging Face names.

One table serves the training plan (`parallel.tensor.llama_tp_plan`), the deploy shards
(`io.export.write_deploy_shards`) and the memory ledger (`plan.ledger`), so training, serving and
planning cannot disagree. Megatron's rules, for t tp ranks:

* column parallel (q, k, v, gate, up; the head over the vocabulary): Y = X A, A split along its
  output dimension, the weight along dim 0; rank r holds its own heads / MLP units / vocabulary slice;
* row parallel (o, down): Y = sum_r X_r B_r, B split along its input dimension, the weight along dim 1;
* vocab parallel (the embedding): the V x h table split along dim 0 over the vocabulary;
* replicated (the norms): every rank holds the whole vector.

Shapes are (out, in) as `nn.Linear` stores them: with h hidden, f ffn, a heads, k kv heads, d head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from lightning_tp3d.plan.config import ModelConfig

__all__ = ["EMBEDDING", "FINAL_NORM", "HEAD", "LAYER_WEIGHTS", "SPLIT_DIMS", "Split", "WeightSplit",
           "hf_tensor_names", "layer_parameters_per_rank", "parameters_per_rank", "split_dim"]

Split = Literal["column", "row", "vocab", "replicated"]
SPLIT_DIMS: dict[str, int | None] = {"column": 0, "row": 1, "vocab": 0, "replicated": None}


@dataclass(frozen=True)
class WeightSplit:
    """A module's weight: its path (inside a block for layer weights, else from the root), its split, its shape."""

    module: str
    split: Split
    shape: Callable[[ModelConfig], tuple[int, ...]]

    @property
    def dim(self) -> int | None:
        return SPLIT_DIMS[self.split]


def _q(config: ModelConfig) -> int:
    return config.num_attention_heads * config.head_dim


def _kv(config: ModelConfig) -> int:
    return config.num_key_value_heads * config.head_dim


LAYER_WEIGHTS: tuple[WeightSplit, ...] = (  # in Hugging Face file order
    WeightSplit("input_layernorm", "replicated", lambda c: (c.hidden_size,)),
    WeightSplit("self_attn.q_proj", "column", lambda c: (_q(c), c.hidden_size)),
    WeightSplit("self_attn.k_proj", "column", lambda c: (_kv(c), c.hidden_size)),
    WeightSplit("self_attn.v_proj", "column", lambda c: (_kv(c), c.hidden_size)),
    WeightSplit("self_attn.o_proj", "row", lambda c: (c.hidden_size, _q(c))),
    WeightSplit("post_attention_layernorm", "replicated", lambda c: (c.hidden_size,)),
    WeightSplit("mlp.gate_proj", "column", lambda c: (c.intermediate_size, c.hidden_size)),
    WeightSplit("mlp.up_proj", "column", lambda c: (c.intermediate_size, c.hidden_size)),
    WeightSplit("mlp.down_proj", "row", lambda c: (c.hidden_size, c.intermediate_size)),
)
EMBEDDING = WeightSplit("model.embed_tokens", "vocab", lambda c: (c.vocab_size, c.hidden_size))
FINAL_NORM = WeightSplit("model.norm", "replicated", lambda c: (c.hidden_size,))
HEAD = WeightSplit("lm_head", "column", lambda c: (c.vocab_size, c.hidden_size))
_LAYER_PREFIX = "model.layers."


def split_dim(name: str) -> int | None:
    """The dim along which tensor parallelism splits the tensor `name` (e.g.
    `model.layers.3.self_attn.q_proj.weight`); None: replicated. A bias (Qwen2's q/k/v) follows its
    weight's output dimension: split along dim 0 when column parallel, replicated when row parallel."""
    module, _, kind = name.rpartition(".")
    dim = _module_split_dim(module)
    if kind == "bias":
        return 0 if dim == 0 else None
    return dim


def _module_split_dim(module: str) -> int | None:
    for weight in (EMBEDDING, FINAL_NORM, HEAD):
        if module == weight.module:
            return weight.dim
    if module.startswith(_LAYER_PREFIX):
        for weight in LAYER_WEIGHTS:
            if module.endswith("." + weight.module):
                return weight.dim
    return None


def hf_tensor_names(config: ModelConfig) -> list[str]:
    """Hugging Face Llama tensor names in file order (embedding, layers, final norm, head)."""
    names = [f"{EMBEDDING.module}.weight"]
    for layer in range(config.num_hidden_layers):
        names += [f"{_LAYER_PREFIX}{layer}.{weight.module}.weight" for weight in LAYER_WEIGHTS]
    names.append(f"{FINAL_NORM.module}.weight")
    if not config.tie_word_embeddings:
        names.append(f"{HEAD.module}.weight")
    return names


def parameters_per_rank(weight: WeightSplit, config: ModelConfig, tp: int) -> int:
    """Elements of `weight` on one tp rank: numel / t when split, numel when replicated."""
    numel = math.prod(weight.shape(config))
    return numel if weight.dim is None else numel // tp


def layer_parameters_per_rank(config: ModelConfig, tp: int) -> int:
    """Parameters of one block on a tp rank."""
    return sum(parameters_per_rank(weight, config, tp) for weight in LAYER_WEIGHTS)
