"""transformers' internals used by the package (read from transformers 5.25): the reverse of the checkpoint
conversion that `PreTrainedModel.save_pretrained` applies, and which experts implementation a model's
mixture-of-experts blocks run (the dtype they compute in under autocast).

transformers 5 holds some families' tensors under other names and shapes than their checkpoints on the Hub
(a mixture-of-experts block's experts fused into 3-D `mlp.experts.gate_up_proj` / `down_proj`, Mixtral's
`block_sparse_moe` held as `mlp`) and converts while loading; `save_pretrained` reverts the conversion with
`core_model_loading.revert_weight_conversion(model, state_dict)`, which needs a model of the family (for
its conversion table) but none of its values: a model on the meta device serves. transformers is imported
only when these are called (the package does not need it otherwise).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
from torch import nn

__all__ = ["TRANSFORMERS_VERSION", "experts_run_in_weight_dtype", "meta_causal_lm", "saved_tensors"]

# transformers' experts implementations (`config._experts_implementation`) that cast their input to the
# weights' dtype and multiply outside autocast (`torch._grouped_mm` has no autocast rule): under bf16-mixed a
# model's experts then compute in the float32 of its master weights. "eager" and "batched_mm" (linear, bmm)
# follow autocast. "grouped_mm" is transformers 5's default.
_WEIGHT_DTYPE_EXPERTS = ("grouped_mm",)

try:
    TRANSFORMERS_VERSION: str | None = version("transformers")
except PackageNotFoundError:
    TRANSFORMERS_VERSION = None


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            "this is a transformers model's checkpoint or folder: converting between the names the model holds"
            " and those save_pretrained writes needs transformers; pip install 'transformers>=5'."
        ) from error
    return transformers


def experts_run_in_weight_dtype(experts: nn.Module) -> bool:
    """Whether a `transformers` experts module computes in its weights' dtype whatever autocast says (its
    config's experts implementation is one of `_WEIGHT_DTYPE_EXPERTS`); False for a module without a
    config (it follows autocast, as `nn.functional.linear` does)."""
    config = getattr(experts, "config", None)
    return getattr(config, "_experts_implementation", None) in _WEIGHT_DTYPE_EXPERTS


def meta_causal_lm(config: dict[str, Any]) -> nn.Module:
    """The causal LM of a `config.json` (its `model_type` and fields) built on the meta device: no memory,
    whatever the model's size."""
    transformers = _transformers()
    fields = {key: value for key, value in config.items() if key != "model_type"}
    built = transformers.AutoConfig.for_model(config["model_type"], **fields)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(built)


def saved_tensors(model: nn.Module, held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`held` (names and tensors as `model` holds them) under the names and shapes `save_pretrained` writes;
    meta tensors give the names and shapes without values."""
    _transformers()
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, held)
