"""`tp3d profile --config run.yaml --steps N --output DIR`: where a run's step time goes.

    tp3d profile --config examples/tiny_2x2x2.yaml --warmup 2 --steps 3 --output profile

runs the run's `fit` (LightningCLI, the same YAML and overrides as `tp3d fit`) for `warmup + steps`
optimizer steps with `callbacks.StepProfiler`, which writes breakdown.json, the ranks' Chrome traces,
timeline.png and breakdown.png into DIR and prints the table. The profile leaves the run's own files
alone: no checkpoint callback, no logger, no validation, and LightningCLI's config.yaml goes into DIR.
Every other argument (`--trainer.devices 4`, `--tp3d.num_microbatches 8`, ...) goes to LightningCLI.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence

__all__ = ["profile_arguments", "run_profile"]


def profile_arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tp3d profile", description="where each step's time goes, per rank")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps before the profile (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps profiled (default 3)")
    parser.add_argument("--output", default="profile", help="the folder of the report (default ./profile)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="a GPU's peak for the advisor's prediction (default 989, an H100 / H200 in bf16;"
                             " on a CPU the rate is calibrated from the measured compute)")
    parser.add_argument("--mfu", type=float, default=None, help="the MFU the advisor assumes (default 0.4)")
    parser.add_argument("--link-gbps", nargs="+", default=[], metavar="GROUP=GBPS",
                        help="each group's bandwidth for the prediction, e.g. tp=150 dp=20 (tp3d doctor's figures)")
    parser.add_argument("--no-plots", action="store_true", help="write no PNG (no matplotlib needed)")
    return parser


def _links(values: Sequence[str]) -> dict[str, float]:
    links = {}
    for value in values:
        group, _, gbps = value.partition("=")
        if group not in ("tp", "pp", "dp") or not gbps:
            raise ValueError(f"--link-gbps {value!r}: give GROUP=GBPS with GROUP one of tp, pp, dp (e.g. tp=150).")
        links[group] = float(gbps)
    return links


def run_profile(argv: Sequence[str]) -> int:
    """`argv`: the arguments after `profile`."""
    from lightning_tp3d.callbacks.profile import StepProfiler
    from lightning_tp3d.cli.lightning import run_lightning_cli

    args, rest = profile_arguments().parse_known_args(list(argv))
    profiler = StepProfiler(args.output, warmup_steps=args.warmup, steps=args.steps, peak_tflops=args.peak_tflops,
                            mfu=args.mfu, link_gbps=_links(args.link_gbps), plots=not args.no_plots,
                            command=["tp3d", "profile", *argv])
    fit = ["fit", *rest, "--trainer.max_steps", str(args.warmup + args.steps), "--trainer.limit_val_batches", "0",
           "--trainer.num_sanity_val_steps", "0", "--trainer.logger", "false",
           "--trainer.default_root_dir", str(args.output)]
    with warnings.catch_warnings():  # the launcher's children rerun this command line, so `args=` is meant
        warnings.filterwarnings("ignore", message=".*args.* parameter is intended to run from within Python")
        return run_lightning_cli(fit, profiler=profiler)
