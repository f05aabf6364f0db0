"""The 4-bit NF4 format of a QLoRA base (`models.qlora`), and its bytes for the ledgers (no torch).

An NF4 weight of n elements (n divisible by block_size, n / block_size divisible by scaler_block_size) is
stored as torchao's `NF4Tensor` stores it:

    quantized_data        n / 2 bytes                      two 4-bit level indices per byte
    quantized_scalers     n / block_size bytes             each block's absmax, int8 (double quantisation)
    quantization_factor   n / (block_size x scaler_block_size) x e bytes   one factor per scaler block
    scaler_mean, levels   17 x e bytes                     the scales' mean and the 16 NormalFloat levels

where e is the element size of the base's dtype (4 for fp32, 2 for bf16): 0.5156 bytes per weight at the
QLoRA paper's block sizes (64, 256), against 2 in bf16.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["NF4_FORMAT", "NF4Format", "nf4_bytes"]

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


NF4_FORMAT = NF4Format()  # the QLoRA paper's: 64 weights per scale, 256 scales per factor


def nf4_bytes(numel: int, element_size: int, nf4_format: NF4Format = NF4_FORMAT) -> int:
    """Bytes of one NF4 weight of `numel` elements whose original dtype has `element_size` bytes."""
    blocks = numel // nf4_format.block_size
    factors = blocks // nf4_format.scaler_block_size
    return numel // 2 + blocks + (factors + 1 + NF4_LEVELS) * element_size
