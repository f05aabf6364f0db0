"""Model shape: the numbers every layer of the package reads.

`ModelConfig` uses Hugging Face Llama field names (`hidden_size`, `num_key_value_heads`, ...) so that a
`config.json` from the Hub reads into it directly and the export writes it back unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ModelConfig", "MODEL_PRESETS", "resolve_model_config"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a DeepSeek-LLM / Llama-style decoder.

    `head_dim = hidden_size // num_attention_heads`; attention is grouped-query when
    `num_key_value_heads < num_attention_heads` (each kv head serves `num_attention_heads //
    num_key_value_heads` query heads). The MLP is SwiGLU: `down(silu(gate(x)) * up(x))`.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}.")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}; choose sizes with hidden_size = heads x head_dim."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} does not divide num_attention_heads="
                f"{self.num_attention_heads}; each kv head must serve a whole group of query heads."
            )
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"ModelConfig.{name} must be in [0, 1), got {getattr(self, name)}.")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self) -> int:
        """Total parameter count: embedding, layers, final norm and (unless tied) the head."""
        h, f, kv = self.hidden_size, self.intermediate_size, self.num_key_value_heads * self.head_dim
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * per_layer + h + head

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """Read a dict with Hugging Face names; unknown keys (architectures, torch_dtype, ...) are ignored."""
        known = {field.name for field in dataclasses.fields(cls)}
        kwargs = {key: value for key, value in values.items() if key in known}
        if "num_key_value_heads" not in kwargs and "num_attention_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            values = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"Model config file {path} does not exist.") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"Model config file {path} is not valid JSON: {error}.") from None
        return cls.from_dict(values)


MODEL_PRESETS: dict[str, ModelConfig] = {
    # Byte-level model that trains in seconds on a CPU; the default of examples and tests.
    "tiny": ModelConfig(),
    "deepseek-llm-7b": ModelConfig(
        vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=30,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
    ),
    "deepseek-llm-67b": ModelConfig(
        vocab_size=102400, hidden_size=8192, intermediate_size=22016, num_hidden_layers=95,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096,
    ),
}


def resolve_model_config(name_or_path: str | Path | ModelConfig) -> ModelConfig:
    """A preset name (`tiny`, `deepseek-llm-7b`, `deepseek-llm-67b`), a `config.json` path, or a config."""
    if isinstance(name_or_path, ModelConfig):
        return name_or_path
    if str(name_or_path) in MODEL_PRESETS:
        return MODEL_PRESETS[str(name_or_path)]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        return ModelConfig.from_json(path)
    raise ValueError(
        f"Unknown model {str(name_or_path)!r}: pass one of the presets {sorted(MODEL_PRESETS)} or the path"
        " of a Hugging Face config.json (or the folder holding it)."
    )
