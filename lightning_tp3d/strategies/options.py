"""`ParallelOptions`: the options both strategies take, their defaults and their validation, in one place.

The strategies keep explicit keyword arguments (LightningCLI / jsonargparse read their signatures) and
hand them over by name with `ParallelOptions.from_arguments(locals())`; a test keeps the three
signatures equal. Everything is checked at construction, so a typo fails before any process starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_tp3d.parallel.attributes import import_object
from lightning_tp3d.parallel.pipeline import PipelineStages
from lightning_tp3d.plan.data_parallel import choose_data_parallel
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.recompute import DEFAULT_SELECTIVE_TARGET, check_recompute_options
from lightning_tp3d.plan.schedules import stages_per_rank_of

__all__ = ["ParallelOptions"]

TensorParallelPlanOption = Mapping[str, ParallelStyle] | Callable[[], Mapping[str, ParallelStyle]] | str | None


@dataclass(frozen=True)
class ParallelOptions:
    """See `TP3DStrategy` for the meaning of each option. `num_microbatches=None` becomes
    `pipeline_parallel_size`; sequences become tuples, `pretrained` a `Path` and a `pipeline_stages` import
    path the instance (a class is instantiated)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int | str = "auto"
    data_parallel_mode: str = "replicate"
    fsdp_reshard_after_forward: bool | None = None
    overlap_gradient_reduction: bool = True
    num_microbatches: int | None = None
    pipeline_schedule: str = "1f1b"
    stages_per_rank: int = 2
    layers_per_stage: Sequence[int] | None = None
    tp_plan: TensorParallelPlanOption = None
    layers_attribute: str = "model.layers"
    pipeline_first_modules: Sequence[str] = ("model.embed_tokens",)
    pipeline_last_modules: Sequence[str] = ("model.norm", "lm_head")
    pipeline_stages: PipelineStages | str | None = None
    recompute: str = "none"
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    recompute_target: str = DEFAULT_SELECTIVE_TARGET
    pretrained: str | Path | None = None
    preflight: bool = False
    skip_non_finite_steps: bool = True
    max_consecutive_skips: int = 5
    verify_checkpoints: bool = True

    def __post_init__(self) -> None:
        normalised = {
            "num_microbatches": self.num_microbatches or self.pipeline_parallel_size,
            "layers_per_stage": tuple(self.layers_per_stage) if self.layers_per_stage is not None else None,
            "pipeline_first_modules": tuple(self.pipeline_first_modules),
            "pipeline_last_modules": tuple(self.pipeline_last_modules),
            "pretrained": Path(self.pretrained) if self.pretrained is not None else None,
            "pipeline_stages": _resolve_stages(self.pipeline_stages),
        }
        for name, value in normalised.items():
            object.__setattr__(self, name, value)
        self._validate()

    def _validate(self) -> None:
        pp, m = self.pipeline_parallel_size, self.num_microbatches
        ParallelLayout(tensor_parallel_size=self.tensor_parallel_size, pipeline_parallel_size=pp,
                       num_microbatches=m, layers_per_stage=self.layers_per_stage)
        choose_data_parallel(self.data_parallel_mode, 1, pp, self.overlap_gradient_reduction,
                             self.fsdp_reshard_after_forward, self.pipeline_schedule)  # dp is known at launch
        if pp > 1:
            stages_per_rank_of(self.pipeline_schedule, pp, m, self.stages_per_rank)
            if m < pp:
                bubble = (pp - 1) / (m + pp - 1)
                rank_zero_warn(
                    f"num_microbatches={m} < pipeline_parallel_size={pp}: the pipeline bubble is at least"
                    f" {bubble:.0%} of each step; use num_microbatches >= pipeline_parallel_size."
                )
        if self.max_consecutive_skips < 1:
            raise ValueError(
                f"max_consecutive_skips={self.max_consecutive_skips} must be >= 1 (non-finite steps in a row after"
                " which training stops); turn the check off with skip_non_finite_steps=False."
            )
        check_recompute_options(self.recompute, self.recompute_method, self.recompute_num_layers)
        if self.pretrained is not None and not (self.pretrained / "config.json").is_file():
            raise FileNotFoundError(
                f"pretrained={str(self.pretrained)!r} is not a Hugging Face folder (no config.json in it)."
            )

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> ParallelOptions:
        """The options among a strategy's constructor arguments (`locals()`); every option must be there."""
        names = [field.name for field in dataclasses.fields(cls)]
        missing = [name for name in names if name not in arguments]
        if missing:
            raise TypeError(f"ParallelOptions.from_arguments: no value for {missing}.")
        return cls(**{name: arguments[name] for name in names})

    @property
    def sizes(self) -> tuple[int, int, int | str]:
        """(tp, pp, dp) as given; dp may still be `"auto"`."""
        return self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size


def _resolve_stages(stages: PipelineStages | str | type | None) -> PipelineStages | None:
    if isinstance(stages, str):
        stages = import_object(stages, "pipeline_stages")
    if isinstance(stages, type):
        stages = stages()
    if stages is not None and not isinstance(stages, PipelineStages):
        raise TypeError(
            f"pipeline_stages must be a lightning_tp3d.parallel.pipeline.PipelineStages, got {type(stages).__name__}."
        )
    return stages
