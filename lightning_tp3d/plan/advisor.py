"""The layout advisor: every valid layout of a cluster for a model, the ones that fit, ranked by step time.

Searched: tp dividing the GPUs of a node (tp groups stay on NVLink) and the model's heads, pp dividing
the rest (at most one layer per stage), dp = GPUs / (tp pp), for a mixture-of-experts model (a
`plan.moe.MoEModelConfig`) the expert-parallel size E dividing dp and the routed experts, the dp mode
(replicate, FSDP, ZeRO-1, and under pipelining FSDP resharding after each forward: less memory, m + 1
all-gathers per step) and the recompute (none, selective, full). The global batch B (sequences) is split
into micro-batches of b: each dp rank takes B / (d b) of them, all in one pipeline pass when pp > 1
(m = B / (d b), needs m >= pp for 1F1B), else accumulated (k = B / (d b)).

A layout fits when the memory ledger's peak rank (`plan.ledger`; `plan.moe_training` for an MoE model) is
within `usable_fraction` (0.9) of a GPU's memory, the rest being for the CUDA context, NCCL buffers and
fragmentation. Fitting layouts are ranked by the predicted step time of their slowest stage:

    compute  = FLOPs per step / (GPUs x peak x MFU), FLOPs per token from `training_flops_per_token`
               (`moe_training_flops_per_token`: the experts a token uses), the forward that recompute
               repeats included
    bubble   = compute x (pp - 1) / m                                      (GPipe / 1F1B)
    exposed  = sum over groups of the communication time overlap cannot hide (`plan.communication`,
               `plan.moe_communication`; calls x latency + bytes / bandwidth): tp all-reduces, the
               expert-parallel all-to-alls and the replicate and ZeRO-1 reductions in full, FSDP and
               pipeline transfers only beyond the compute they overlap with (nothing is hidden on a cluster
               without `overlap`, e.g. CPU processes sharing their cores)
    step     = compute + bubble + exposed

With uniform routing every rank of an expert-parallel group computes the same expert FLOPs; a skewed
routing makes the busiest rank slower, which the advisor does not predict.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from lightning_tp3d.plan.communication import CommunicationLedger, communication_ledger, group_bandwidths
from lightning_tp3d.plan.config import ModelConfig
from lightning_tp3d.plan.data_parallel import GradientReduction, choose_data_parallel
from lightning_tp3d.plan.layout import LayoutError, ParallelLayout
from lightning_tp3d.plan.ledger import TrainingLedger, TrainingOptions, training_flops_per_token, training_ledger
from lightning_tp3d.plan.lora import DEFAULT_LORA_TARGETS
from lightning_tp3d.plan.moe import MoEModelConfig
from lightning_tp3d.plan.moe_communication import moe_communication_ledger
from lightning_tp3d.plan.moe_training import check_moe_options, moe_training_flops_per_token, moe_training_ledger
from lightning_tp3d.plan.qlora import NF4Format

__all__ = ["Cluster", "LayoutCandidate", "advise", "evaluate_layout", "plan_ledgers"]


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpu_memory_bytes: int
    gpus_per_node: int = 8
    peak_tflops: float = 989.0  # dense bf16 of an H100 / H200 SXM
    mfu: float = 0.4  # the design documents' bar for training
    links_gbps: dict[str, float] = field(default_factory=dict)  # intra_node / inter_node, default: doctor floors
    group_gbps: dict[str, float] = field(default_factory=dict)  # measured per group (overrides the links)
    latency_seconds: dict[str, float] = field(default_factory=dict)  # per call and group, measured (default 0)
    overlap: bool = True  # communication engines apart from compute (GPUs); False: nothing is hidden
    usable_fraction: float = 0.9


@dataclass(frozen=True)
class LayoutCandidate:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    data_parallel_mode: str  # the option values: "replicate", "fsdp" or "zero1",
    fsdp_reshard_after_forward: bool | None  # and FSDP2's resharding as asked (None: the default)
    recompute: str
    num_microbatches: int
    gradient_accumulation_steps: int
    peak_bytes: int
    fits: bool
    compute_seconds: float
    bubble_seconds: float
    exposed_seconds: dict[str, float]
    lora_rank: int = 0  # a LoRA fine-tune of `lora_targets` (`plan.lora`); 0: every weight trains
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    qlora: NF4Format | None = None  # QLoRA: the blocks' projections frozen in 4-bit NF4 (`plan.qlora`)
    expert_parallel_size: int = 1  # a mixture-of-experts model's routed experts over E of the dp ranks

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.bubble_seconds + sum(self.exposed_seconds.values())

    @property
    def name(self) -> str:
        experts = f" ep={self.expert_parallel_size}" if self.expert_parallel_size > 1 else ""
        return (f"tp={self.tensor_parallel_size} pp={self.pipeline_parallel_size} dp={self.data_parallel_size}{experts}"
                f" {self.data_parallel_mode}{' reshard' if self.reshards else ''} recompute={self.recompute}"
                f" m={self.num_microbatches} k={self.gradient_accumulation_steps}")

    @property
    def reshards(self) -> bool | None:
        """Whether FSDP frees a unit's gathered weights after each forward (as asked, or FSDP's default);
        None for a mode that keeps whole parameters."""
        plan = choose_data_parallel(self.data_parallel_mode, self.data_parallel_size, self.pipeline_parallel_size,
                                    fsdp_reshard_after_forward=self.fsdp_reshard_after_forward)
        return plan.reshard_after_forward if plan.reduction is GradientReduction.FULLY_SHARDED else None

    def settings(self) -> dict[str, object]:
        """What a layout chooses, by the table's column names."""
        return {"tp": self.tensor_parallel_size, "pp": self.pipeline_parallel_size, "dp": self.data_parallel_size,
                "ep": self.expert_parallel_size, "dp mode": self.data_parallel_mode, "reshard": self.reshards,
                "recompute": self.recompute}

    def options(self, seq_len: int, precision: str) -> TrainingOptions:
        """The ledger options this candidate was evaluated with."""
        return TrainingOptions(seq_len=seq_len, precision=precision, recompute=self.recompute,
                               data_parallel_mode=self.data_parallel_mode,
                               fsdp_reshard_after_forward=self.fsdp_reshard_after_forward,
                               lora_rank=self.lora_rank, lora_targets=self.lora_targets, qlora=self.qlora)

    def parts(self) -> dict[str, float]:
        """The step's seconds by cause: compute (with recompute), bubble, each group's exposed communication."""
        return {"compute": self.compute_seconds, "bubble": self.bubble_seconds,
                **{f"{group} comm": seconds for group, seconds in self.exposed_seconds.items()}}

    def compared_with(self, best: LayoutCandidate, costs: bool = True) -> str:
        """Why this layout is where it is: for the best, its costs beyond compute; for another, how much
        slower it is, the settings in which it differs from the best and (with `costs`) the part of the step
        that grows most against the best's."""
        if self is best:
            parts = [(name, seconds) for name, seconds in self.parts().items() if name != "compute" and seconds > 0]
            listed = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in sorted(parts, key=lambda part: -part[1]))
            return f"best; beyond compute: {listed or 'nothing'}" if costs else "best"
        differ = ", ".join(name for name, value in self.settings().items() if value != best.settings()[name])
        why = f"+{self.step_seconds / best.step_seconds - 1:.0%}: {differ or 'm, k'}"
        if not costs:
            return why
        parts, best_parts = self.parts(), best.parts()  # an MoE layout without EP has no ep / edp parts
        name, difference = max(((name, parts.get(name, 0.0) - best_parts.get(name, 0.0))
                                for name in parts | best_parts), key=lambda item: item[1])
        return f"{why}; {name} +{difference:.3f} s"


def _divisors(value: int) -> list[int]:
    return [candidate for candidate in range(1, value + 1) if value % candidate == 0]


def plan_ledgers(config: ModelConfig | MoEModelConfig, layout: ParallelLayout, options: TrainingOptions,
                 backend: str = "nccl") -> tuple[TrainingLedger, CommunicationLedger, int]:
    """The memory and communication ledgers (collectives as `backend` runs them) and the training FLOPs per
    token of `config`, a dense decoder or a DeepSeek mixture of experts."""
    if isinstance(config, MoEModelConfig):
        return (moe_training_ledger(config, layout, options),
                moe_communication_ledger(config, layout, options, backend),
                moe_training_flops_per_token(config, options.seq_len, options.recompute))
    return (training_ledger(config, layout, options), communication_ledger(config, layout, options, backend),
            training_flops_per_token(config, options.seq_len, options.recompute, options.lora_rank,
                                     tuple(options.lora_targets)))


def evaluate_layout(config: ModelConfig | MoEModelConfig, cluster: Cluster, layout: ParallelLayout,
                    options: TrainingOptions, global_batch_size: int) -> LayoutCandidate:
    """One layout's memory and predicted step time on `cluster` (see the module docstring)."""
    training, ledger, flops_per_token = plan_ledgers(config, layout, options)
    peak = training.peak_stage.total_bytes
    compute = flops_per_token * global_batch_size * options.seq_len / (
        cluster.gpus * cluster.peak_tflops * 1e12 * cluster.mfu)
    pp, m = layout.pipeline_parallel_size, layout.num_microbatches
    bubble = compute * (pp - 1) / m
    bandwidth = group_bandwidths(layout, cluster.gpus_per_node, cluster.links_gbps, cluster.group_gbps)
    exposed = {group: 0.0 for group in ledger.group_sizes}
    for stage in range(len(ledger.stages)):
        for group, seconds in ledger.seconds(stage, bandwidth, cluster.latency_seconds).items():
            hidden = min(seconds["hideable_seconds"], compute) if cluster.overlap else 0.0
            exposed[group] = max(exposed[group], seconds["seconds"] - hidden)
    return LayoutCandidate(layout.tensor_parallel_size, pp, layout.data_parallel_size, options.data_parallel_mode,
                           options.fsdp_reshard_after_forward,
                           options.recompute, m, layout.gradient_accumulation_steps, peak,
                           peak <= cluster.usable_fraction * cluster.gpu_memory_bytes, compute, bubble, exposed,
                           options.lora_rank, tuple(options.lora_targets), options.qlora, layout.expert_parallel_size)


def advise(config: ModelConfig | MoEModelConfig, cluster: Cluster, global_batch_size: int, seq_len: int,
           precision: str = "bf16-mixed", micro_batch_size: int = 1, lora_rank: int = 0,
           lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS, qlora: NF4Format | None = None
           ) -> list[LayoutCandidate]:
    """Every valid layout of `cluster` for `config`, fitting ones first, each group by predicted step time;
    `lora_rank` > 0: for a LoRA fine-tune of `lora_targets` (`plan.lora`), on a 4-bit base with `qlora`
    (tp 1 only, FSDP where its shards hold whole NF4 blocks); a mixture-of-experts `config` also over each
    expert-parallel size (full training only)."""
    experts = isinstance(config, MoEModelConfig)
    if experts:  # what the MoE plan does not count is refused once, not skipped layout by layout
        check_moe_options(config, ParallelLayout(), TrainingOptions(seq_len=seq_len, lora_rank=lora_rank,
                                                                     qlora=qlora))
    candidates = []
    for tp in _divisors(cluster.gpus_per_node):
        if cluster.gpus % tp:
            continue
        for pp in _divisors(cluster.gpus // tp):
            dp = cluster.gpus // (tp * pp)
            per_rank, remainder = divmod(global_batch_size, dp * micro_batch_size)
            if remainder or per_rank == 0 or pp > config.num_hidden_layers or (pp > 1 and per_rank < pp):
                continue
            m, k = (per_rank, 1) if pp > 1 else (1, per_rank)
            modes = [("replicate", None)]
            if dp > 1:
                modes += [("fsdp", None), ("zero1", None)] + ([("fsdp", True)] if pp > 1 else [])
            sizes = [size for size in _divisors(dp) if config.n_routed_experts % size == 0] if experts else [1]
            for expert_parallel_size in sizes:
                layout = ParallelLayout(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                                        micro_batch_size=micro_batch_size, num_microbatches=m,
                                        gradient_accumulation_steps=k, expert_parallel_size=expert_parallel_size)
                try:
                    if not experts:  # an MoE layout is checked by its ledgers (`check_moe_options`)
                        layout.validate_model(config)
                except LayoutError:
                    continue
                for (mode, reshard), recompute in itertools.product(modes, ("none", "selective", "full")):
                    options = TrainingOptions(seq_len=seq_len, precision=precision, recompute=recompute,
                                              data_parallel_mode=mode, fsdp_reshard_after_forward=reshard,
                                              lora_rank=lora_rank, lora_targets=tuple(lora_targets), qlora=qlora)
                    try:
                        candidates.append(evaluate_layout(config, cluster, layout, options, global_batch_size))
                    except LayoutError:  # a 4-bit base at tp > 1, FSDP shards cutting its blocks, tp not
                        continue  # dividing an MoE model's heads
    return sorted(candidates, key=lambda candidate: (not candidate.fits, candidate.step_seconds))
