"""The loss path's memory on the last pipeline stage, shared by the chunked loss and the ledger.

`models.cross_entropy` computes the token cross entropy in float32 chunks of at most
`LOSS_CHUNK_ELEMENTS` logits, so the loss path holds the logits and their gradient in the activation's
dtype and a few float32 chunks, never a whole float32 copy of the logits:

    2 x tokens x V x element  +  c x min(tokens x V, LOSS_CHUNK_ELEMENTS) x 4

with c = 2 in fp32 (the chunk's shifted exponentials and logsumexp's temporary) and c = 3 under 16-bit
precisions (the chunk's upcast as well). Measured with MemTracker: `tests/models/test_cross_entropy.py`.
"""

from __future__ import annotations

__all__ = ["LOSS_CHUNK_ELEMENTS", "loss_activation_bytes"]

LOSS_CHUNK_ELEMENTS = 1 << 24  # 64 MiB of float32 logits at once


def loss_activation_bytes(tokens: int, vocab_size: int, element: int) -> int:
    """The loss path's peak for `tokens` tokens of a micro-batch whose activations have `element` bytes."""
    logits = tokens * vocab_size
    chunks = 2 if element == 4 else 3
    return 2 * logits * element + chunks * min(logits, LOSS_CHUNK_ELEMENTS) * 4
