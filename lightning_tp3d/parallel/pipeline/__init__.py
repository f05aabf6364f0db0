"""Pipeline parallelism with `torch.distributed.pipelining`, driven from one network per rank.

`plan.schedules` places the stages on pp ranks (pure arithmetic, re-exported here), `split` prunes the
network to this rank's stages, `runner` runs batches through a schedule (or stage after stage without
one for evaluation), and `forward` makes `network(input_ids, labels=...)` run it and hands the
schedule's gradients to the loop's backward. `stages` is the extension point: how a stage computes from
its modules, for models whose blocks take more than the hidden states.
"""

from lightning_tp3d.parallel.pipeline.forward import GradientHandOver, install_pipelined_forward
from lightning_tp3d.parallel.pipeline.runner import PipelineRunner, StageTiming
from lightning_tp3d.parallel.pipeline.split import StageModule, prune_to_stages, split_network
from lightning_tp3d.parallel.pipeline.stages import PipelineStages, StageLoss
from lightning_tp3d.plan.schedules import (
    PIPELINE_SCHEDULES,
    PipelinePlan,
    plan_pipeline,
    stages_per_rank_of,
)

__all__ = [
    "PIPELINE_SCHEDULES",
    "GradientHandOver",
    "PipelinePlan",
    "PipelineRunner",
    "PipelineStages",
    "StageLoss",
    "StageModule",
    "StageTiming",
    "install_pipelined_forward",
    "plan_pipeline",
    "prune_to_stages",
    "split_network",
    "stages_per_rank_of",
]
