"""Pipeline parallelism with `torch.distributed.pipelining`, driven from one network per rank.

`plan.schedules` places the stages on pp ranks (pure arithmetic), `split` prunes the
network to this rank's stages, `runner` runs batches through a schedule (or stage after stage without
one for evaluation), and `forward` makes `network(input_ids, labels=...)` run it and hands the
schedule's gradients to the loop's backward. `stages` is the extension point: how a stage computes from
its modules, for models whose blocks take more than the hidden states.
"""

from lightning_tp3d.parallel.pipeline.forward import GradientHandOver, install_pipelined_forward
from lightning_tp3d.parallel.pipeline.runner import PipelineRunner, StageTiming
from lightning_tp3d.parallel.pipeline.split import StageModule, prune_to_stages, split_network
from lightning_tp3d.parallel.pipeline.stages import PipelineStages, StageLoss

__all__ = [
    "GradientHandOver",
    "PipelineRunner",
    "PipelineStages",
    "StageLoss",
    "StageModule",
    "StageTiming",
    "install_pipelined_forward",
    "prune_to_stages",
    "split_network",
]
