"""`ParallelOptions`: the options both strategies take, declared once: name, type, default, help, validation.

Each field of the dataclass is an option. Everything else is read from it:

* the strategies' signatures: `TP3DStrategy.__init__(self, *, model_attribute=..., **options)` gets the
  `__signature__` that `with_option_signature` builds from the fields and the strategy's own parameters,
  so `inspect.signature`, IDEs and LightningCLI / jsonargparse see every option with its type and default;
* their docstrings: `document_options` writes each field's help under the class docstring's `Args:`,
  which is also where jsonargparse reads the help of `tp3d fit --help`;
* the option table of `docs/options.md` (`options_table`, checked by a test);
* the validation: everything is checked at construction, so a typo fails before any process starts.

The memory and communication ledgers read the same choices through `plan.data_parallel` and
`plan.recompute`, which these options call.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import textwrap
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_tp3d.models.adapter import ModelAdapter
from lightning_tp3d.models.families import ModelAdapterOption, check_model_adapter, resolve_model_adapter
from lightning_tp3d.parallel.attributes import import_object
from lightning_tp3d.parallel.compile import check_compile_schedule, compile_settings
from lightning_tp3d.parallel.float8 import check_float8
from lightning_tp3d.parallel.pipeline import PipelineStages
from lightning_tp3d.parallel.tensor import resolve_tp_plan
from lightning_tp3d.plan.data_parallel import check_expert_parallel, choose_data_parallel
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.recompute import DEFAULT_SELECTIVE_TARGET, check_recompute_options
from lightning_tp3d.plan.schedules import PIPELINE_SCHEDULES, stages_per_rank_of

__all__ = ["ParallelOptions", "document_options", "options_table", "with_option_signature"]

TensorParallelPlanOption = Mapping[str, ParallelStyle] | Callable[[], Mapping[str, ParallelStyle]] | str | None


def _option(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ParallelOptions:
    """The options of both strategies (see the module docstring). `num_microbatches=None` becomes
    `pipeline_parallel_size`; sequences become tuples, `pretrained` a `Path`, `compile` torch.compile's
    keywords (None when off), a `tp_plan` the plan and a
    `model_adapter` / `pipeline_stages` import path the instance (a class is instantiated). The model's
    parts (`layers_attribute`, the first and last pipeline modules, `tp_plan`, `pipeline_stages`) left None
    are its family adapter's (`model_adapter_for`)."""

    tensor_parallel_size: int = _option(1, "processes that split every layer (innermost mesh dimension).")
    pipeline_parallel_size: int = _option(1, "pipeline stages (ranks along \"pp\").")
    data_parallel_size: int | Literal["auto"] = _option("auto", "model replicas; \"auto\" is world size / (tp x pp).")
    expert_parallel_size: int = _option(
        1, "ranks a mixture-of-experts block's routed experts are split over, carved out of dp (it divides dp"
        " and the expert count): tokens reach their experts by all-to-all (`parallel.experts`); in every"
        " data-parallel mode, the experts averaged and (\"fsdp\", \"zero1\") sharded over their own replicas.")
    data_parallel_mode: Literal["replicate", "fsdp", "zero1"] = _option(
        "replicate", "\"replicate\" (gradients all-reduced over dp, DDP semantics), \"fsdp\" (FSDP2: parameters,"
        " gradients and optimizer state sharded over dp) or \"zero1\" (the optimizer state and update split over"
        " dp with DDP's traffic, `parallel.data_parallel.zero`; elementwise optimizers only).")
    fsdp_reshard_after_forward: bool | None = _option(
        None, "free a block's gathered parameters after its forward (FSDP2); None: yes without pipelining, no"
        " under it (gather once per step; `plan.schedules.fsdp_reshards_after_forward`, refused with the"
        " split-backward schedules).")
    overlap_gradient_reduction: bool = _option(
        True, "in \"replicate\" mode without pipelining, all-reduce the gradients in buckets while backward runs"
        " (as DDP does, `parallel.data_parallel.overlap`) instead of after it.")
    num_microbatches: int | None = _option(
        None, "micro-batches each dataloader batch is split into for the pipeline (default: pp).")
    pipeline_schedule: str = _option(
        "1f1b", "the pipeline schedule, one of " + ", ".join(f"`{name}`" for name in PIPELINE_SCHEDULES) + ".")
    stages_per_rank: int = _option(2, "stages on each rank for the looped schedules (V-shaped ones always use 2).")
    layers_per_stage: Sequence[int] | None = _option(
        None, "explicit layer count of every stage (default: balanced, embedding and head counted as one layer"
        " each).")
    model_adapter: ModelAdapterOption = _option(
        None, "what the strategy knows of the network's family (`models.adapter.ModelAdapter`, its class or"
        " import path \"package.module:name\"); default: recognised from the network (`models.families`:"
        " Hugging Face causal LMs, else Llama names).")
    tp_plan: TensorParallelPlanOption = _option(
        None, "module-name pattern -> `ParallelStyle` mapping, a function returning one, or its import path"
        " \"package.module:function\"; default: the model adapter's (Megatron's plan for Llama names).")
    layers_attribute: str | None = _option(
        None, "attribute of the network holding its transformer blocks (FSDP units, stages); default: the model"
        " adapter's (`model.layers`).")
    pipeline_first_modules: Sequence[str] | None = _option(
        None, "modules of the network run before the blocks on the first stage; default: the model adapter's"
        " (`model.embed_tokens`).")
    pipeline_last_modules: Sequence[str] | None = _option(
        None, "modules run after the blocks on the last stage; default: the model adapter's (`model.norm`,"
        " `lm_head`).")
    pipeline_stages: PipelineStages | str | None = _option(
        None, "how a stage computes from its modules (`PipelineStages`, or \"package.module:Class\"), for blocks"
        " that take more than the hidden states; default: the model adapter's (Hugging Face causal LMs run"
        " their own rotary tables, masks and loss).")
    recompute: Literal["none", "full", "selective"] = _option(
        "none", "activation recompute: \"none\", \"full\" (whole blocks) or \"selective\" (the part of each"
        " block named by `recompute_target`).")
    recompute_method: Literal["uniform", "block"] = _option(
        "uniform", "\"uniform\" recomputes every N-th block (global index), \"block\" the first N blocks of each"
        " pipeline stage (N = `recompute_num_layers`).")
    recompute_num_layers: int = _option(1, "N of `recompute_method`.")
    recompute_target: str = _option(
        DEFAULT_SELECTIVE_TARGET, "attribute path inside a block of the method or module \"selective\" recomputes.")
    compile: bool | dict[str, Any] = _option(
        False, "compile each transformer block's forward with torch.compile after tensor parallelism and"
        " recompute, before FSDP (`parallel.compile`: one graph shared by the blocks, parameter names"
        " unchanged); a mapping is passed to torch.compile as keywords (backend, mode, fullgraph, dynamic,"
        " options).")
    float8: Literal["tensorwise", "rowwise"] | None = _option(
        None, "FP8 training of the blocks' linear layers with torchao's Float8Linear (`parallel.float8`):"
        " \"tensorwise\" (at any layout) or \"rowwise\" (tp 1); refused on GPUs below compute capability 8.9.")
    pretrained: str | Path | None = _option(
        None, "a Hugging Face folder (safetensors) whose weights initialise the network after it is sharded, each"
        " rank reading only its own slices (a resumed checkpoint then overrides them).")
    preflight: bool = _option(
        False, "measure each mesh dimension's links when the mesh is built (`tp3d doctor`'s figures at 1 MiB),"
        " log the table and warn with fixes; the report is kept in `preflight_report`.")
    skip_non_finite_steps: bool = _option(
        True, "when the loss or a gradient is NaN/inf on any rank, every rank skips the update and the"
        " step-interval LR schedulers (`strategies.non_finite`), logged as `skipped_steps`.")
    max_consecutive_skips: int = _option(
        5, "skipped steps in a row after which training stops with `NonFiniteStepsError`.")
    save_frozen_weights: bool = _option(
        True, "False: a checkpoint holds what trains (a LoRA model's adapters), its optimizer and loop state, and a"
        " fingerprint of the frozen weights instead of them; a resume rebuilds those (`from_pretrained`,"
        " `pretrained=`, the same seeded init) and is refused if they differ (Trainer strategy). A QLoRA"
        " model's 4-bit base is always left out this way.")
    verify_checkpoints: bool = _option(
        True, "check every file of a checkpoint against the SHA-256 recorded when it was written before loading"
        " it (each rank hashes a share); False loads a damaged checkpoint unchecked.")

    def __post_init__(self) -> None:
        normalised = {
            "num_microbatches": self.num_microbatches or self.pipeline_parallel_size,
            "layers_per_stage": tuple(self.layers_per_stage) if self.layers_per_stage is not None else None,
            "pipeline_first_modules": _tuple_or_none(self.pipeline_first_modules),
            "pipeline_last_modules": _tuple_or_none(self.pipeline_last_modules),
            "pretrained": Path(self.pretrained) if self.pretrained is not None else None,
            "model_adapter": check_model_adapter(self.model_adapter),
            "tp_plan": resolve_tp_plan(self.tp_plan),
            "pipeline_stages": _resolve_stages(self.pipeline_stages),
            "compile": compile_settings(self.compile),
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
            check_compile_schedule(self.compile, self.pipeline_schedule)
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
        check_expert_parallel(self.expert_parallel_size)
        check_float8(self.float8, self.tensor_parallel_size)
        if self.pretrained is not None and not (self.pretrained / "config.json").is_file():
            raise FileNotFoundError(
                f"pretrained={str(self.pretrained)!r} is not a Hugging Face folder (no config.json in it)."
            )

    @classmethod
    def from_keywords(cls, owner: str, keywords: Mapping[str, Any]) -> ParallelOptions:
        """The options given to `owner` (a strategy) as keywords; an unknown name is refused with the closest
        option named."""
        names = [option.name for option in dataclasses.fields(cls)]
        for name in keywords:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; the options are {names}."
                raise TypeError(f"{owner} got an unknown option {name!r}{hint}")
        return cls(**keywords)

    def model_adapter_for(self, network: nn.Module) -> ModelAdapter:
        """`network`'s family adapter (`models.families`), with the fields these options set."""
        return resolve_model_adapter(network, self.model_adapter).overridden(
            self.layers_attribute, self.pipeline_first_modules, self.pipeline_last_modules, self.tp_plan,
            self.pipeline_stages)

    @property
    def sizes(self) -> tuple[int, int, int | str]:
        """(tp, pp, dp) as given; dp may still be `"auto"`."""
        return self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size


def _tuple_or_none(paths: Sequence[str] | None) -> tuple[str, ...] | None:
    return tuple(paths) if paths is not None else None


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


def _option_parameters() -> list[inspect.Parameter]:
    hints = typing.get_type_hints(ParallelOptions)
    return [inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=option.default,
                              annotation=hints[option.name]) for option in dataclasses.fields(ParallelOptions)]


def with_option_signature(init: Callable[..., None]) -> Callable[..., None]:
    """Give a strategy's `__init__(self, *, own..., **options)` the signature `self, *, <every option>,
    own...`, which `inspect.signature` and jsonargparse (LightningCLI) read."""
    own = [parameter for parameter in inspect.signature(init).parameters.values()
           if parameter.kind is not inspect.Parameter.VAR_KEYWORD]
    self_parameter, own = own[0], [parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY) for parameter in own[1:]]
    hints = typing.get_type_hints(init)
    own = [parameter.replace(annotation=hints.get(parameter.name, parameter.annotation)) for parameter in own]
    init.__signature__ = inspect.Signature([self_parameter, *_option_parameters(), *own], return_annotation=None)
    return init


def _help(option: dataclasses.Field) -> str:
    return option.metadata["help"]


def document_options(cls: type) -> type:
    """Write every option's help at the head of the `Args:` section of `cls.__doc__` (Google style, which
    jsonargparse parses for `--help`)."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    head, marker, own = doc.partition("\nArgs:\n")
    if not marker:
        raise ValueError(f"{cls.__name__}'s docstring needs an 'Args:' section for the options.")
    lines = [textwrap.fill(f"{option.name}: {_help(option)}", width=108, initial_indent="    ",
                           subsequent_indent="        ") for option in dataclasses.fields(ParallelOptions)]
    cls.__doc__ = head + marker + "\n".join(lines) + "\n" + own
    return cls


def options_table() -> str:
    """The Markdown table of the options (`docs/options.md`): name, default, meaning."""
    rows = ["| option | default | meaning |", "| --- | --- | --- |"]
    for option in dataclasses.fields(ParallelOptions):
        rows.append(f"| `{option.name}` | `{option.default!r}` | {_help(option).replace('|', '/')} |")
    return "\n".join(rows) + "\n"
