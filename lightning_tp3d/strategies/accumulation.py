"""A global batch that stays the same when the data-parallel size changes, through gradient accumulation.

With `TP3DStrategy(global_batch_size=G)` every optimizer step trains on G samples whatever dp is: the
Trainer accumulates k = G / (b x dp) batches of the training DataLoader's per-rank batch size b. A run
resumed at a smaller dp (a lost node, an elastic restart) therefore takes the same steps on the same
samples: the sampler continues the global sample order (`data.sampler`), and k grows as dp shrinks.

Lightning counts the batches of an epoch (`fit_loop.epoch_loop.batch_progress`) and steps when that count
is a multiple of k; a checkpoint saved with k_old accumulated batches per step holds a count in those
batches. `rescale_batch_progress` converts it to the resumed run's k (a count of s steps becomes s x k),
so steps stay aligned with the global batches.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = ["accumulation_for", "rescale_batch_progress"]

_COUNTERS = ("ready", "started", "processed", "completed")


def accumulation_for(global_batch_size: int, per_rank_batch: int | None, data_parallel_size: int,
                     requested: int) -> int:
    """Batches to accumulate per step for `global_batch_size` samples (see the module docstring);
    `requested` is the Trainer's own `accumulate_grad_batches`, which must be left at 1 or agree."""
    if per_rank_batch is None:
        raise ValueError("TP3DStrategy(global_batch_size=...) needs the training DataLoader's `batch_size` (it has a"
                         " batch_sampler instead); give the DataLoader a batch_size or leave global_batch_size unset.")
    replica_batch = per_rank_batch * data_parallel_size
    if global_batch_size % replica_batch:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not a multiple of the per-rank batch {per_rank_batch} x dp"
            f" {data_parallel_size} = {replica_batch}: choose a global batch that is, or a per-rank batch size that"
            f" divides {global_batch_size // data_parallel_size or 1}."
        )
    accumulate = global_batch_size // replica_batch
    if requested not in (1, accumulate):
        raise ValueError(
            f"Trainer(accumulate_grad_batches={requested}) disagrees with global_batch_size={global_batch_size}, which"
            f" accumulates {accumulate} batches of {per_rank_batch} at dp {data_parallel_size}: set one of the two."
        )
    return accumulate


def rescale_batch_progress(progress: Any, saved_accumulation: int, accumulation: int) -> None:
    """Convert Lightning's batch counts (`batch_progress`), saved at `saved_accumulation` batches per step,
    to `accumulation` batches per step, in place: s steps done in the epoch become s x `accumulation`
    batches. Every counter moves by the same amount, keeping Lightning's own offsets between them (a save
    in `on_train_batch_end` has counted its batch ready, not yet completed)."""
    if saved_accumulation == accumulation:
        return
    ready = progress.current.ready
    if ready % saved_accumulation:
        rank_zero_warn(f"The checkpoint was saved between optimizer steps ({ready} batches of the epoch at"
                       f" {saved_accumulation} per step), so its batch counts are left as saved: the resumed"
                       f" steps may not line up with {accumulation} accumulated batches.")
        return
    shift = ready // saved_accumulation * (accumulation - saved_accumulation)
    for tracker in (progress.current, progress.total):
        for name in _COUNTERS:
            setattr(tracker, name, getattr(tracker, name) + shift)
