"""The parallel layout: one validated description of how a run is split across processes.

Every other part of the package reads a `ParallelLayout`: the mesh is built from it, the model is
sharded by it, the sampler and the batch arithmetic follow it, the planner prints its ledger and
checkpoints record it. All validation happens here, before any process group exists.

Ranks are laid out as a grid `arange(world).view(pp, dp, tp)`: tp is innermost so that a tensor-parallel
group is a run of consecutive ranks (one node), pp outermost.

Example usage::

    layout = ParallelLayout.resolve(world_size=8, tensor_parallel_size=2, pipeline_parallel_size=2,
                                    micro_batch_size=4, global_batch_size=32)
    layout.data_parallel_size            # 2
    layout.gradient_accumulation_steps   # 4 = 32 / (4 x 1 x 2)
    layout.coordinates(5)                # RankCoordinates(pp=1, dp=0, tp=1)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal, NamedTuple, Protocol

__all__ = ["LayoutError", "ParallelLayout", "RankCoordinates"]


class LayoutError(ValueError):
    """A parallel configuration that cannot run; the message names the numbers and the fix."""


class RankCoordinates(NamedTuple):
    pp: int
    dp: int
    tp: int


class _ModelShape(Protocol):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"{name} must be a positive integer, got {value!r}.")


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the three parallel dimensions and the batch arithmetic.

    One optimizer step consumes `global_batch_size = micro_batch_size x num_microbatches x
    data_parallel_size x gradient_accumulation_steps` samples. Each data-parallel rank's dataloader
    yields batches of `micro_batch_size x num_microbatches` samples; the pipeline splits such a batch
    into `num_microbatches` micro-batches, and `gradient_accumulation_steps` batches are accumulated.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    micro_batch_size: int = 1
    num_microbatches: int = 1
    gradient_accumulation_steps: int = 1
    layers_per_stage: tuple[int, ...] | None = None
    expert_parallel_size: int = 1  # carved out of dp: routed experts split over E of the dp ranks

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                     "micro_batch_size", "num_microbatches", "gradient_accumulation_steps", "expert_parallel_size"):
            _check_positive_int(name, getattr(self, name))
        if self.data_parallel_size % self.expert_parallel_size:
            raise LayoutError(
                f"expert_parallel_size={self.expert_parallel_size} does not divide data_parallel_size="
                f"{self.data_parallel_size}: the expert-parallel group is carved out of the data-parallel ranks;"
                f" use an expert_parallel_size that divides {self.data_parallel_size}, or launch more processes.")
        if self.layers_per_stage is not None:
            object.__setattr__(self, "layers_per_stage", tuple(self.layers_per_stage))
            if len(self.layers_per_stage) % self.pipeline_parallel_size:
                raise LayoutError(
                    f"layers_per_stage has {len(self.layers_per_stage)} entries, not a multiple of"
                    f" pipeline_parallel_size={self.pipeline_parallel_size}; give one layer count per pipeline stage."
                )
            for count in self.layers_per_stage:
                _check_positive_int("every entry of layers_per_stage", count)

    # ------------------------------------------------------------------ construction
    @classmethod
    def resolve(
        cls,
        world_size: int,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int | Literal["auto"] = "auto",
        micro_batch_size: int = 1,
        num_microbatches: int = 1,
        global_batch_size: int | None = None,
        gradient_accumulation_steps: int | None = None,
        layers_per_stage: tuple[int, ...] | list[int] | None = None,
        expert_parallel_size: int = 1,
    ) -> ParallelLayout:
        """Build a layout for `world_size` processes, deriving what was left open.

        `data_parallel_size="auto"` becomes `world_size / (tp x pp)`. Of `global_batch_size` and
        `gradient_accumulation_steps`, give at most one unless they agree; the other is derived.
        """
        _check_positive_int("world_size", world_size)
        _check_positive_int("tensor_parallel_size", tensor_parallel_size)
        _check_positive_int("pipeline_parallel_size", pipeline_parallel_size)
        model_parallel = tensor_parallel_size * pipeline_parallel_size
        if data_parallel_size == "auto":
            if world_size % model_parallel:
                raise LayoutError(
                    f"world size {world_size} is not divisible by tensor_parallel_size x pipeline_parallel_size"
                    f" = {tensor_parallel_size} x {pipeline_parallel_size} = {model_parallel}; launch a multiple"
                    f" of {model_parallel} processes or change the tp/pp sizes."
                )
            data_parallel_size = world_size // model_parallel
        elif not isinstance(data_parallel_size, int) or isinstance(data_parallel_size, bool):
            raise LayoutError(f"data_parallel_size must be a positive integer or 'auto', got {data_parallel_size!r}.")
        _check_positive_int("data_parallel_size", data_parallel_size)
        _check_positive_int("micro_batch_size", micro_batch_size)
        _check_positive_int("num_microbatches", num_microbatches)
        samples_per_pass = micro_batch_size * num_microbatches * data_parallel_size
        if global_batch_size is not None:
            _check_positive_int("global_batch_size", global_batch_size)
            if global_batch_size % samples_per_pass:
                raise LayoutError(
                    f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size x num_microbatches"
                    f" x data_parallel_size = {micro_batch_size} x {num_microbatches} x {data_parallel_size}"
                    f" = {samples_per_pass}; use a global batch size that is a multiple of {samples_per_pass}."
                )
            derived = global_batch_size // samples_per_pass
            if gradient_accumulation_steps is not None and gradient_accumulation_steps != derived:
                raise LayoutError(
                    f"global_batch_size={global_batch_size} must equal micro_batch_size x num_microbatches x"
                    f" data_parallel_size x gradient_accumulation_steps = {samples_per_pass} x"
                    f" {gradient_accumulation_steps} = {samples_per_pass * gradient_accumulation_steps}; set"
                    f" gradient_accumulation_steps={derived} or drop one of the two."
                )
            gradient_accumulation_steps = derived
        layout = cls(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
            micro_batch_size=micro_batch_size,
            num_microbatches=num_microbatches,
            gradient_accumulation_steps=gradient_accumulation_steps or 1,
            layers_per_stage=tuple(layers_per_stage) if layers_per_stage is not None else None,
            expert_parallel_size=expert_parallel_size,
        )
        layout.validate_world_size(world_size)
        return layout

    # ------------------------------------------------------------------ sizes
    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def batch_size_per_rank(self) -> int:
        """Samples in one dataloader batch of one data-parallel rank."""
        return self.micro_batch_size * self.num_microbatches

    @property
    def global_batch_size(self) -> int:
        return self.batch_size_per_rank * self.data_parallel_size * self.gradient_accumulation_steps

    @property
    def shape(self) -> tuple[int, int, int]:
        """Mesh shape in the order of `mesh_dim_names`."""
        return (self.pipeline_parallel_size, self.data_parallel_size, self.tensor_parallel_size)

    mesh_dim_names: ClassVar[tuple[str, str, str]] = ("pp", "dp", "tp")

    # ------------------------------------------------------------------ ranks
    def coordinates(self, rank: int) -> RankCoordinates:
        """(pp, dp, tp) indices of a global rank: rank = (pp x dp_size + dp) x tp_size + tp."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside the layout's world of {self.world_size} processes.")
        tp = rank % self.tensor_parallel_size
        dp = (rank // self.tensor_parallel_size) % self.data_parallel_size
        pp = rank // (self.tensor_parallel_size * self.data_parallel_size)
        return RankCoordinates(pp=pp, dp=dp, tp=tp)

    def rank(self, pp: int, dp: int, tp: int) -> int:
        for name, index, size in (("pp", pp, self.pipeline_parallel_size), ("dp", dp, self.data_parallel_size),
                                  ("tp", tp, self.tensor_parallel_size)):
            if not 0 <= index < size:
                raise LayoutError(f"{name} index {index} is outside 0..{size - 1}.")
        return (pp * self.data_parallel_size + dp) * self.tensor_parallel_size + tp

    # ------------------------------------------------------------------ validation
    def validate_world_size(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise LayoutError(
                f"tensor_parallel_size x pipeline_parallel_size x data_parallel_size = {self.tensor_parallel_size}"
                f" x {self.pipeline_parallel_size} x {self.data_parallel_size} = {self.world_size}, but the world"
                f" size is {world_size}; launch {self.world_size} processes or set data_parallel_size='auto'."
            )

    def validate_cluster(self, gpus_per_node: int) -> None:
        """tp groups are consecutive ranks: with `gpus_per_node` GPUs a node, a tp group stays inside one node
        (NVLink) only if tp <= gpus_per_node and tp divides it; tp all-reduces across nodes are refused."""
        _check_positive_int("gpus_per_node", gpus_per_node)
        tp = self.tensor_parallel_size
        if tp > gpus_per_node or gpus_per_node % tp:
            raise LayoutError(
                f"tensor_parallel_size={tp} does not fit inside a node of {gpus_per_node} GPUs: its all-reduces (two"
                f" per layer and micro-batch) would cross nodes. Use a tensor_parallel_size that divides"
                f" {gpus_per_node} and scale with pipeline or data parallelism instead."
            )

    def validate_model(self, config: _ModelShape, num_stages: int | None = None) -> None:
        """Check that the model can be split this way (any object with Hugging Face config names)."""
        tp = self.tensor_parallel_size
        for name in ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size"):
            value = getattr(config, name)
            if value % tp:
                raise LayoutError(
                    f"tensor_parallel_size={tp} does not divide {name}={value}; choose a tensor_parallel_size"
                    f" that divides {value} (valid: {_divisors_up_to(value, 64)})."
                )
        if config.vocab_size % tp:
            padded = -(-config.vocab_size // tp) * tp
            raise LayoutError(
                f"tensor_parallel_size={tp} does not divide vocab_size={config.vocab_size}; the vocabulary is split"
                f" across tp ranks, so pad vocab_size to {padded} (a multiple of {tp}) or change tensor_parallel_size."
            )
        self.stage_layer_counts(config.num_hidden_layers, num_stages or self.num_stages)

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all: pp, or pp x stages per rank under an interleaved / V schedule."""
        return len(self.layers_per_stage) if self.layers_per_stage is not None else self.pipeline_parallel_size

    def stage_layer_counts(self, num_layers: int, num_stages: int | None = None) -> tuple[int, ...]:
        """Transformer layers owned by each of `num_stages` pipeline stages (default: pp).

        Explicit `layers_per_stage` wins. Otherwise the split is balanced with the embedding and the
        head each counted as one layer of work: `num_layers + 2` units are spread evenly, the first
        stage's share includes the embedding and the last stage's the head.
        """
        stages = num_stages or self.pipeline_parallel_size
        if self.layers_per_stage is not None:
            if len(self.layers_per_stage) != stages:
                raise LayoutError(
                    f"layers_per_stage has {len(self.layers_per_stage)} entries but the pipeline has {stages}"
                    " stages; give one layer count per stage (pp x stages per rank for interleaved schedules)."
                )
            if sum(self.layers_per_stage) != num_layers:
                raise LayoutError(
                    f"layers_per_stage={list(self.layers_per_stage)} sums to {sum(self.layers_per_stage)} but the"
                    f" model has {num_layers} layers; make the counts add up to {num_layers}."
                )
            return self.layers_per_stage
        if num_layers < stages:
            raise LayoutError(
                f"the pipeline has {stages} stages (pipeline_parallel_size={self.pipeline_parallel_size}) but the"
                f" model has only {num_layers} layers; every stage needs at least one layer, so use at most"
                f" {num_layers} stages."
            )
        if stages == 1:
            return (num_layers,)
        units = num_layers + 2
        shares = [units // stages + (1 if stage >= stages - units % stages else 0) for stage in range(stages)]
        shares[0] -= 1
        shares[-1] -= 1
        # A tiny model can leave an end stage with no layer; move one from the busiest stage.
        for end in (0, stages - 1):
            while shares[end] < 1:
                donor = max(range(stages), key=lambda stage: shares[stage])
                shares[donor] -= 1
                shares[end] += 1
        return tuple(shares)

    def stage_layer_ranges(self, num_layers: int, num_stages: int | None = None) -> list[range]:
        """Global layer indices of each stage: stage s owns `ranges[s]`."""
        ranges, start = [], 0
        for count in self.stage_layer_counts(num_layers, num_stages):
            ranges.append(range(start, start + count))
            start += count
        return ranges

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values["layers_per_stage"] = list(self.layers_per_stage) if self.layers_per_stage else None
        return values

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ParallelLayout:
        fields = set(cls.__dataclass_fields__)
        unknown = set(values) - fields
        if unknown:
            raise LayoutError(f"unknown layout fields {sorted(unknown)}; expected a subset of {sorted(fields)}.")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> ParallelLayout:
        return cls.from_dict(json.loads(text))


def _divisors_up_to(value: int, limit: int) -> list[int]:
    return [candidate for candidate in range(1, min(value, limit) + 1) if value % candidate == 0]
