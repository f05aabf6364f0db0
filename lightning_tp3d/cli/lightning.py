"""`tp3d fit|validate|test|predict --config run.yaml`: LightningCLI runs with the 3-D strategy.

Two ways to choose the strategy in YAML, both complete:

    trainer:                                  trainer:
      strategy: tp3d                            strategy:
    tp3d:                                         class_path: lightning_tp3d.TP3DStrategy
      tensor_parallel_size: 2                     init_args:
      pipeline_parallel_size: 2                     tensor_parallel_size: 2
                                                    pipeline_parallel_size: 2

The registered name alone (`strategy: tp3d`) takes its arguments from the top-level `tp3d:` section
(every `TP3DStrategy` argument, validated by jsonargparse like any other). The model and data are
`class_path` / `init_args` entries, e.g. `lightning_tp3d.models.CausalLMModule` and
`lightning_tp3d.data.TokenDataModule`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, Checkpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_tp3d.strategies.trainer import TP3DStrategy

__all__ = ["TP3DLightningCLI", "run_lightning_cli"]


class TP3DLightningCLI(LightningCLI):
    """`LightningCLI` with a `tp3d:` section holding the arguments of `trainer.strategy: tp3d`; with `profiler`
    (`tp3d profile`), `fit` runs with that callback and without the run's checkpoint callbacks."""

    def __init__(self, *args: Any, profiler: Callback | None = None, **kwargs: Any) -> None:
        self.profiler = profiler
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_class_arguments(TP3DStrategy, "tp3d")

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        config = self.config_init.get(str(self.subcommand), self.config_init)
        if config.get("trainer", {}).get("strategy") == TP3DStrategy.strategy_name and "strategy" not in kwargs:
            kwargs["strategy"] = config.get("tp3d")
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        if self.profiler is not None:  # a profile writes no checkpoint over the run's own
            self.trainer.callbacks = [callback for callback in self.trainer.callbacks
                                      if not isinstance(callback, Checkpoint)] + [self.profiler]


def run_lightning_cli(args: Sequence[str], profiler: Callback | None = None) -> int:
    """LightningCLI on `args` (the subcommand first); the process's own command line is left for it to read,
    which it does without warning that `args=` is meant for calls from Python."""
    TP3DLightningCLI(L.LightningModule, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                     args=None if list(args) == sys.argv[1:] else list(args), save_config_kwargs={"overwrite": True},
                     profiler=profiler)
    return 0
