"""Deploy shards: a Hugging Face folder split for an N-way tensor-parallel server.

`write_deploy_shards` writes `rank-00` ... `rank-<N-1>`, each a safetensors folder with the config, and
`sharding.json` stating each tensor's split dim. The splits are the training plan's (`plan.sharding`,
one table from training to serving): column-parallel weights (q, k, v, gate, up and the head) along
dim 0, row-parallel ones (o, down) along dim 1, the vocab-parallel embedding along dim 0 (vocabulary),
norms copied. With N above the kv-head count k, k/v are replicated as vLLM does: rank r holds kv head
r x k / N.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from lightning_tp3d.io.folders import check_output_folder, replace_folder, staging_folder
from lightning_tp3d.io.hf import SAFETENSORS_DTYPES, HFFolder, open_hf_folder, write_safetensors
from lightning_tp3d.plan.config import ModelConfig
from lightning_tp3d.plan.serving import deploy_problem
from lightning_tp3d.plan.sharding import split_dim
from lightning_tp3d.plan.units import parse_size

__all__ = ["DEPLOY_SHARDS", "check_deploy_tp", "deploy_folder", "write_deploy_shards"]

DEPLOY_SHARDS = "deploy-shards"  # the kind of folder this module writes (see `io.folders`)
_KV_PROJECTIONS = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_proj.bias",
                   "self_attn.v_proj.bias")
_TORCH_DTYPES = {value: key for key, value in SAFETENSORS_DTYPES.items()}


def check_deploy_tp(config: ModelConfig, tensor_parallel_size: int) -> None:
    problem = deploy_problem(config, tensor_parallel_size)
    if problem is None and config.vocab_size % tensor_parallel_size:
        padded = -(-config.vocab_size // tensor_parallel_size) * tensor_parallel_size
        problem = (f"{tensor_parallel_size} does not divide vocab_size={config.vocab_size} (pad the vocabulary to"
                   f" {padded})")
    if problem is not None:
        raise ValueError(f"--deploy-tp {tensor_parallel_size} is not valid for this model: {problem}.")


def deploy_folder(hf_folder: Path, tensor_parallel_size: int) -> Path:
    """Where `write_deploy_shards` writes by default: `<export>-deploy-tp<N>` beside the export."""
    return hf_folder.with_name(f"{hf_folder.name}-deploy-tp{tensor_parallel_size}")


def write_deploy_shards(hf_folder: str | Path, tensor_parallel_size: int, output: str | Path | None = None,
                        max_shard_size: str | int = "5GB", overwrite: bool = False) -> Path:
    """Per-rank folders `rank-00` ... for an N-way tensor-parallel server, plus `sharding.json` stating
    each tensor's split dim (null: copied) and whether k/v heads are replicated. `output` follows the
    rules of `export_checkpoint`'s (new, empty or an earlier set of deploy shards, else `overwrite`)."""
    hf_folder = Path(hf_folder)
    config = ModelConfig.from_json(hf_folder / "config.json")
    check_deploy_tp(config, tensor_parallel_size)
    output = Path(output) if output is not None else deploy_folder(hf_folder, tensor_parallel_size)
    check_output_folder(output, DEPLOY_SHARDS, overwrite)
    partial = staging_folder(output, DEPLOY_SHARDS)
    kv_replicated = tensor_parallel_size > config.num_key_value_heads
    with open_hf_folder(hf_folder) as hf:
        names = list(hf.weight_map)  # every tensor of the export (a Qwen2's biases too), in file order
        dtype = hf.slice(names[0]).get_dtype()
        for rank in range(tensor_parallel_size):
            folder = partial / f"rank-{rank:02d}"
            folder.mkdir()
            shapes = [(name, _rank_piece_shape(hf, name, tensor_parallel_size, config, kv_replicated))
                      for name in names]
            write_safetensors(folder, shapes, _TORCH_DTYPES[dtype],
                               lambda name, rank=rank: _rank_piece(hf, name, rank, tensor_parallel_size, config,
                                                                   kv_replicated),
                               parse_size(max_shard_size),
                               {"tensor_parallel_size": str(tensor_parallel_size), "rank": str(rank)})
            shutil.copy(hf_folder / "config.json", folder / "config.json")
    sharding = {"tensor_parallel_size": tensor_parallel_size, "kv_heads_replicated": kv_replicated,
                "split_dim": {name: split_dim(name) for name in names}}
    (partial / "sharding.json").write_text(json.dumps(sharding, indent=2))
    replace_folder(partial, output)
    return output


def _pieces(name: str, rank: int, tp: int, config: ModelConfig, kv_replicated: bool) -> tuple[int, int]:
    """(number of equal pieces along the split dim, the piece rank `rank` holds)."""
    if kv_replicated and name.endswith(_KV_PROJECTIONS):
        return config.num_key_value_heads, rank * config.num_key_value_heads // tp
    return tp, rank


def _rank_piece_shape(hf: HFFolder, name: str, tp: int, config: ModelConfig, kv_replicated: bool) -> tuple[int, ...]:
    shape = list(hf.slice(name).get_shape())
    dim = split_dim(name)
    if dim is not None:
        shape[dim] //= _pieces(name, 0, tp, config, kv_replicated)[0]
    return tuple(shape)


def _rank_piece(hf: HFFolder, name: str, rank: int, tp: int, config: ModelConfig, kv_replicated: bool) -> torch.Tensor:
    dim = split_dim(name)
    if dim is None:
        return hf.tensor(name)
    pieces, index = _pieces(name, rank, tp, config, kv_replicated)
    view = hf.slice(name)
    size = view.get_shape()[dim] // pieces
    selection = [slice(None)] * len(view.get_shape())
    selection[dim] = slice(index * size, (index + 1) * size)
    return view[tuple(selection)]
