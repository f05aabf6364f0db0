"""The 4-bit NF4 format of a QLoRA base (`models.qlora`), and its bytes for the ledgers (no torch).

An NF4 weight of n elements (n divisible by block_size, n / block_size divisible by scaler_block_size) is
stored as torchao's `NF4Tensor` stores it:

    quantized_data        n / 2 bytes                      two 4-bit level indices per byte
    quantized_scalers     n / block_size bytes             each block's absmax, int8 (double quantisation)
    quantization_factor   n / (block_size x scaler_block_size) x e bytes   one factor per scaler block
    scaler_mean, levels   17 x e bytes                     the scales' mean and the 16 NormalFloat levels

where e is the element size of the base's dtype (4 for fp32, 2 for bf16): 0.5156 bytes per weight at the
QLoRA paper's block sizes (64, 256), against 2 in bf16.

Where a 4-bit base goes (`parallel.nf4.check_quantized_base` at launch, `plan.ledger` before it): the seven
projections of every block (q, k, v, o, gate, up, down) are held in NF4, the embedding, norms and head stay
dense. FSDP2 shards an NF4 weight along its rows over dp (torchao's all-gather extension: each rank keeps
n / d elements as an NF4 tensor of its own, so `nf4_bytes(n / d)`), which needs whole rows and whole scaler
blocks per shard; tensor parallelism cannot split one (`TENSOR_PARALLEL_REASON`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lightning_tp3d.plan.config import ModelConfig
from lightning_tp3d.plan.layout import LayoutError
from lightning_tp3d.plan.sharding import LAYER_WEIGHTS

__all__ = ["NF4_FORMAT", "NF4Format", "QUANTIZED_LAYER_WEIGHTS", "TENSOR_PARALLEL_REASON", "nf4_all_gather_bytes",
           "nf4_bytes", "quantized_layer"]

TENSOR_PARALLEL_REASON = (
    "tensor parallelism cannot split a 4-bit NF4 weight: torchao's NF4 tensor packs blocks along the flattened"
    " rows and has no column split nor DTensor sharding. Use tensor_parallel_size=1 with data_parallel_mode="
    "'fsdp' (which shards the 4-bit weights) and pipeline parallelism, or LoRA on an unquantised base under"
    " tensor parallelism."
)

NF4_LEVELS = 16


@dataclass(frozen=True)
class NF4Format:
    """Block sizes of NF4 quantisation: `block_size` weights share one absmax scale, `scaler_block_size`
    scales share one int8 quantisation factor."""

    block_size: int = 64
    scaler_block_size: int = 256

    def __post_init__(self) -> None:
        if self.block_size < 2 or self.block_size % 2 or self.scaler_block_size < 1:
            raise ValueError(f"NF4 block_size={self.block_size} must be an even number >= 2 and scaler_block_size="
                             f"{self.scaler_block_size} >= 1.")

    @property
    def elements_per_scaler_block(self) -> int:
        return self.block_size * self.scaler_block_size

    def check(self, shape: tuple[int, ...], what: str) -> None:
        """Refuse a tensor that NF4 cannot hold in whole blocks."""
        numel = 1
        for size in shape:
            numel *= size
        if len(shape) != 2 or numel % self.elements_per_scaler_block:
            raise ValueError(
                f"{what} of shape {shape} cannot be held in NF4 with block_size {self.block_size} and"
                f" scaler_block_size {self.scaler_block_size}: it must be 2-D with a multiple of"
                f" {self.elements_per_scaler_block} elements; pick smaller blocks (NF4Format) for a small model."
            )

    def check_shard(self, shape: tuple[int, int], shards: int, what: str) -> None:
        """Refuse an FSDP2 split of a (rows x columns) NF4 weight over `shards` ranks that cuts a row or a
        scaler block."""
        rows, columns = shape
        if shards > 1 and (rows % shards or (rows // shards * columns) % self.elements_per_scaler_block):
            raise LayoutError(
                f"{what} ({rows} x {columns}, NF4) cannot be sharded by FSDP over dp={shards}: each shard must hold"
                f" whole rows and whole scaler blocks of {self.elements_per_scaler_block} weights (block_size"
                f" {self.block_size} x scaler_block_size {self.scaler_block_size}). Quantise with smaller blocks,"
                " or use data_parallel_mode='replicate' (the frozen weights are not sharded, only the adapters"
                " train)."
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


NF4_FORMAT = NF4Format()  # the QLoRA paper's: 64 weights per scale, 256 scales per factor


def nf4_bytes(numel: int, element_size: int, nf4_format: NF4Format = NF4_FORMAT) -> int:
    """Bytes of one NF4 weight of `numel` elements whose original dtype has `element_size` bytes."""
    blocks = numel // nf4_format.block_size
    factors = blocks // nf4_format.scaler_block_size
    return numel // 2 + blocks + (factors + 1 + NF4_LEVELS) * element_size


def nf4_all_gather_bytes(numel: int, element_size: int, nf4_format: NF4Format = NF4_FORMAT) -> int:
    """Bytes one rank's FSDP2 shard of `numel` NF4 elements hands to the all-gather: its data, scales and
    factors (the scales' mean and the levels travel as metadata, the same on every rank)."""
    return nf4_bytes(numel, element_size, nf4_format) - (1 + NF4_LEVELS) * element_size


QUANTIZED_LAYER_WEIGHTS = tuple(weight for weight in LAYER_WEIGHTS if weight.split != "replicated")


def quantized_layer(config: ModelConfig, shards: int, element_size: int,
                    nf4_format: NF4Format = NF4_FORMAT) -> tuple[int, int]:
    """(elements, bytes) of one block's NF4 projections on a rank that holds 1 / `shards` of each (FSDP2's
    dp, else 1), refused where a shard would cut a block."""
    elements = stored = 0
    for weight in QUANTIZED_LAYER_WEIGHTS:
        out, inp = weight.shape(config)
        nf4_format.check((out, inp), f"the 4-bit {weight.module}")
        nf4_format.check_shard((out, inp), shards, f"the 4-bit {weight.module}")
        elements += out * inp // shards
        stored += nf4_bytes(out * inp // shards, element_size, nf4_format)
    return elements, stored
