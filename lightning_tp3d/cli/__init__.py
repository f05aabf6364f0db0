"""The `tp3d` command.

    tp3d fit --config examples/tiny_2x2x2.yaml
    tp3d plan deepseek-llm-7b --tp 8 --pp 4 --dp 2 --micro-batch-size 1 --num-microbatches 8
    tp3d plan path/to/config.json --tp 2 --json
    tp3d export checkpoints/last.ckpt export/hf --dtype bf16 --deploy-tp 2 --max-shard-size 5GB
    tp3d check export/hf --checkpoint checkpoints/last.ckpt
    tp3d export checkpoints/last.ckpt export/onnx --format onnx
    tp3d check export/onnx --checkpoint checkpoints/last.ckpt --engine onnxruntime
    tp3d verify checkpoints/last.ckpt
    tp3d profile --config examples/tiny_2x2x2.yaml --steps 3 --output profile
    tp3d plan deepseek-llm-67b --serve --gpu-memory 80GiB --max-model-len 4096 --deploy-tp 4 8
    torchrun --nproc-per-node 8 -m lightning_tp3d.cli doctor --tp 2 --pp 2
    tp3d run --nnodes 1:2 --nproc-per-node 4 --max-restarts 3 --rdzv-backend c10d ... train.py

`fit`, `validate`, `test` and `predict` run LightningCLI (see `lightning_tp3d.cli.lightning`).
`profile` runs a `fit` config for a few steps under the step profiler (`lightning_tp3d.cli.profile`)
and writes where each rank's step time goes, beside the advisor's prediction.
`plan` validates a layout against a model (a preset or a Hugging Face config.json) and prints the
per-rank memory ledger for training and the serving alignment, without starting any process.
`plan --serve` sizes a server: weights and KV cache per GPU for each deploy tensor-parallel size, the
concurrent sequences that fit and the vLLM command line. `doctor` measures the launched world's links
per mesh dimension and warns with fixes.
`export` merges a checkpoint of any layout into a Hugging Face folder (and deploy-TP shards); `check`
compares an export's logits, as transformers computes them, with the checkpoint's weights rounded to the
export's dtype: PASS <= 1e-3 < WARN <= 1e-2 < FAIL on the max |logit diff| (exit status 1 on FAIL, naming
the first layer over the PASS band; a warning on WARN or when the export's dtype is not the training one).
`export --format onnx` writes the merged model as an ONNX graph (`lightning_tp3d.io.onnx_export`) and
`check --engine onnxruntime` runs it in ONNX Runtime, `--engine vllm` serves a Hugging Face export with vLLM
on a GPU (`lightning_tp3d.diagnostics.engines`), against the same bands.
`run` is torchrun with its agent's store unshared, which its restarts after a lost node need
(`lightning_tp3d.cli.launch`).
`verify` checks a checkpoint's files against the SHA-256 recorded when they were written, without loading
a model (`export` and `check --checkpoint` check the files they read unless `--no-verify`).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from lightning_tp3d.cli.plan import SERVING_DTYPE, plan_parser
from lightning_tp3d.cli.profile import profile_arguments
from lightning_tp3d.plan.layout import LayoutError, ParallelLayout
from lightning_tp3d.plan.units import parse_size

__all__ = ["main"]

def _export_parser(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser("export", help="merge a checkpoint into a Hugging Face folder")
    export.add_argument("checkpoint", help="a lightning_tp3d checkpoint folder (any layout)")
    export.add_argument("output", help="the Hugging Face (or ONNX) folder to write")
    export.add_argument("--format", choices=["hf", "onnx"], default="hf",
                        help="hf: safetensors and config.json (default); onnx: model.onnx for ONNX Runtime"
                             " (needs the [onnx] extra)")
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    export.add_argument("--deploy-tp", type=int, nargs="+", default=None, metavar="N",
                        help="also write per-rank folders for an N-way tensor-parallel server (one folder per N,"
                             " OUTPUT-deploy-tpN)")
    export.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace OUTPUT even if it holds files that are not an earlier export")
    export.add_argument("--no-verify", action="store_true",
                        help="read the checkpoint without checking its files against their recorded hashes")
    export.add_argument("--base", default=None, metavar="FOLDER",
                        help="the Hugging Face folder of the frozen base, for a checkpoint saved without it"
                             " (save_frozen_weights=False, a QLoRA base); checked against its fingerprint")
    export.add_argument("--adapter", action="store_true",
                        help="write the LoRA adapter alone, as a PEFT adapter folder (a PEFT LoRA checkpoint);"
                             " without it a LoRA model is exported merged")
    export.set_defaults(run=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from lightning_tp3d.io.export import export_checkpoint, export_lora_adapter

    if args.format == "onnx":
        if args.adapter or args.deploy_tp is not None:
            raise ValueError("--format onnx writes one merged graph; it does not go with --adapter or --deploy-tp.")
        from lightning_tp3d.io.onnx_export import export_onnx

        result = export_onnx(args.checkpoint, args.output, dtype=args.dtype, overwrite=args.overwrite,
                             verify=not args.no_verify, base=args.base)
        print(f"wrote {result.folder}: {', '.join(result.files)}, {result.total_bytes:,} bytes (ONNX Runtime:"
              " InferenceSession(folder/model.onnx), input input_ids, output logits)")
        return 0
    if args.adapter:
        if args.deploy_tp is not None:
            raise ValueError("--deploy-tp shards a whole model; it does not go with --adapter.")
        result = export_lora_adapter(args.checkpoint, args.output, dtype=args.dtype, overwrite=args.overwrite,
                                     verify=not args.no_verify)
        print(f"wrote {result.folder}: a PEFT LoRA adapter, {result.total_bytes:,} bytes of {args.dtype} tensors"
              " (PeftModel.from_pretrained(base_model, folder))")
        return 0
    result = export_checkpoint(args.checkpoint, args.output, dtype=args.dtype, max_shard_size=args.max_shard_size,
                               deploy_tp=args.deploy_tp, overwrite=args.overwrite, verify=not args.no_verify,
                               base=args.base)
    print(f"wrote {result.folder}: {len(result.files)} file(s), {result.total_bytes:,} bytes of {args.dtype} tensors")
    for size, folder in zip(args.deploy_tp or (), result.deploy_folders, strict=True):
        print(f"wrote {folder}: {size} rank folders (vllm: --tensor-parallel-size {size})")
    return 0


def _check_parser(subparsers: argparse._SubParsersAction) -> None:
    check = subparsers.add_parser("check", help="compare an export's logits with its checkpoint's")
    check.add_argument("export", help="a Hugging Face folder (an ONNX export folder with --engine onnxruntime)")
    check.add_argument("--checkpoint", default=None,
                       help="the checkpoint it came from (default: compare transformers with this package's decoder)")
    check.add_argument("--engine", choices=["transformers", "onnxruntime", "vllm"], default="transformers",
                       help="what runs the export: transformers (default), onnxruntime (an ONNX export) or vllm"
                            " (a Hugging Face export, on a CUDA machine); the last two need --checkpoint")
    check.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM's tensor-parallel size")
    check.add_argument("--tolerance", type=float, default=None,
                       help="FAIL above this max |logit diff| (default 1e-2)")
    check.add_argument("--warn-above", type=float, default=None,
                       help="WARN above this max |logit diff|, PASS at or below (default 1e-3)")
    check.add_argument("--prompt-lengths", type=int, nargs="+", default=None)
    check.add_argument("--batch-size", type=int, default=None,
                       help="prompts per length (default 2 with --engine onnxruntime, else 1)")
    check.add_argument("--no-transformers", action="store_true", help="load the export into this package's decoder")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.add_argument("--no-verify", action="store_true",
                       help="read --checkpoint without checking its files against their recorded hashes")
    check.set_defaults(run=_run_check)


def _run_check(args: argparse.Namespace) -> int:
    from lightning_tp3d.diagnostics import consistency, engines
    from lightning_tp3d.io.checkpoint_format import read_meta
    from lightning_tp3d.io.hf import EXPORT_DTYPES

    export = Path(args.export)
    if not (export / "config.json").is_file():
        raise FileNotFoundError(f"{export} is not a Hugging Face folder (no config.json in it); write one with"
                                " `tp3d export CHECKPOINT OUTPUT`.")
    if args.engine != "transformers" and args.checkpoint is None:
        raise ValueError(f"--engine {args.engine} compares what the engine serves with the trained model: pass"
                         " --checkpoint CHECKPOINT, the checkpoint the export came from.")
    if args.engine == "onnxruntime":  # refused before anything is loaded
        engines.onnxruntime_providers(export)
    elif args.engine == "vllm":
        engines.require_vllm()
    config = json.loads((export / "config.json").read_text())
    dtype_name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype_name, "fp32")
    _quiet_transformers()
    if args.checkpoint is not None:
        reference = consistency.model_from_checkpoint(args.checkpoint, verify=not args.no_verify)
        trained = SERVING_DTYPE.get(read_meta(args.checkpoint).precision or "", None)
        if trained is not None and trained != dtype:
            print(f"warning: the export is {dtype} but the model was trained in {trained}; serve in the precision"
                  f" you trained in, or expect its logits to move by the difference reported below.", file=sys.stderr)
    else:
        reference = consistency.model_from_hf_folder(export, use_transformers=False)
    batch_size = args.batch_size or (2 if args.engine == "onnxruntime" else 1)
    prompts = consistency.fixed_prompts(config["vocab_size"], args.prompt_lengths or consistency.DEFAULT_PROMPT_LENGTHS,
                                        batch_size=batch_size)
    fail_above = args.tolerance if args.tolerance is not None else consistency.FAIL_ABOVE
    warn_above = args.warn_above if args.warn_above is not None else consistency.WARN_ABOVE
    if args.engine == "vllm":
        served = engines.vllm_prompt_logprobs(export, prompts, args.tensor_parallel_size)
        with consistency.rounded_to(reference, EXPORT_DTYPES[dtype]):
            logits = consistency.run_with_layer_outputs(reference, prompts)[0]
        report = engines.compare_prompt_logprobs(logits, served, fail_above, warn_above)
    else:
        exported = (engines.onnxruntime_outputs(export, prompts) if args.engine == "onnxruntime" else
                    consistency.run_with_layer_outputs(
                        consistency.model_from_hf_folder(export, use_transformers=not args.no_transformers), prompts))
        with consistency.rounded_to(reference, EXPORT_DTYPES[dtype]):
            rounded = consistency.run_with_layer_outputs(reference, prompts)
        report = consistency.compare_outputs(rounded, exported, fail_above, warn_above)
        if dtype != "fp32":
            unrounded = consistency.run_with_layer_outputs(reference, prompts)
            report.precision_max_abs_diff = consistency.compare_outputs(unrounded, exported).max_abs_diff
    print(json.dumps(report.to_dict(), indent=2) if args.json else f"{report.summary()}\n{report.layer_table()}")
    if report.verdict == "WARN":
        print(f"warning: max |logit diff| {report.max_abs_diff:.3e} is above the PASS band ({warn_above:.0e});"
              f" look at {report.first_bad_layer} first.", file=sys.stderr)
    return 0 if report.passed else 1


def _quiet_transformers() -> None:
    """No loading progress bars from transformers in this command's output (it prints its own report)."""
    try:
        from transformers.utils import logging
    except ImportError:
        return
    logging.disable_progress_bar()


def _verify_parser(subparsers: argparse._SubParsersAction) -> None:
    verify = subparsers.add_parser("verify", help="check a checkpoint's files against their recorded hashes")
    verify.add_argument("checkpoint", help="a lightning_tp3d checkpoint folder")
    verify.set_defaults(run=_run_verify)


def _run_verify(args: argparse.Namespace) -> int:
    """Every file against its recorded SHA-256, and the DCP index read safely, without loading a model."""
    from lightning_tp3d.io.checkpoint_format import (
        CheckpointError,
        check_shard_files,
        checkpoint_folder,
        read_index,
        read_meta,
        verify_files,
    )

    meta, folder = read_meta(args.checkpoint), checkpoint_folder(args.checkpoint)
    if meta.file_hashes is None:
        raise CheckpointError(f"{folder} records no file hashes (written by an earlier lightning_tp3d): nothing to"
                              " verify against.")
    verify_files(folder, meta)
    check_shard_files(folder, read_index(folder))
    print(f"{folder}: {len(meta.file_hashes)} files match their recorded SHA-256 (step {meta.global_step}).")
    return 0


def _doctor_parser(subparsers: argparse._SubParsersAction) -> None:
    doctor = subparsers.add_parser("doctor", help="measure each mesh dimension's links (run under torchrun)")
    doctor.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    doctor.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    doctor.add_argument("--dp", default="auto", help="data parallel size (default: world / (tp x pp))")
    doctor.add_argument("--sizes", nargs="+", default=["4KiB", "1MiB", "16MiB"], help="message sizes")
    doctor.add_argument("--iterations", type=int, default=5)
    doctor.add_argument("--backend", default=None, help="default: nccl with CUDA, gloo otherwise")
    doctor.add_argument("--timeout", type=float, default=300.0, help="seconds before a collective fails")
    doctor.add_argument("--floor-intra-node", type=float, default=None, metavar="GBPS",
                        help="warn below this bus bandwidth inside a node (GPUs; default 100 GB/s, NVLink)")
    doctor.add_argument("--floor-inter-node", type=float, default=None, metavar="GBPS",
                        help="warn below this across nodes (GPUs; default 10 GB/s, InfiniBand)")
    doctor.add_argument("--nccl-log", default=None, help="an NCCL_DEBUG=INFO log of this run: report its transports")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.set_defaults(run=_run_doctor)


def doctor_device_type(backend: str) -> str:
    """Where the doctor's buffers live: CUDA for NCCL, the CPU for gloo (also on a GPU machine)."""
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"--backend {backend!r} is not one of 'nccl', 'gloo'.")
    return "cuda" if backend == "nccl" else "cpu"


def _run_doctor(args: argparse.Namespace) -> int:
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from lightning_tp3d.diagnostics.doctor import run_doctor
    from lightning_tp3d.parallel.collectives import destroy_gloo_groups_at_exit, enable_collective_recording
    from lightning_tp3d.parallel.mesh import build_device_mesh

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device_type = doctor_device_type(backend)
    timeout = timedelta(seconds=args.timeout)
    if not dist.is_initialized():
        enable_collective_recording()
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timeout)
        destroy_gloo_groups_at_exit()
    layout = ParallelLayout.resolve(world_size=dist.get_world_size(), tensor_parallel_size=args.tp,
                                    pipeline_parallel_size=args.pp,
                                    data_parallel_size=args.dp if args.dp == "auto" else int(args.dp))
    mesh = build_device_mesh(layout, device_type, timeout)
    floors = {key: value for key, value in (("intra_node", args.floor_intra_node),
                                            ("inter_node", args.floor_inter_node)) if value is not None}
    log = None
    if args.nccl_log is not None:
        log = Path(args.nccl_log).read_text(errors="replace")
    report = run_doctor(layout, mesh, [parse_size(size) for size in args.sizes], args.iterations,
                        floors_gbps=floors, nccl_log=log)
    if dist.get_rank() == 0:
        print(json.dumps(report.to_dict(), indent=2) if args.json else report.table())
    return 0


_LIGHTNING_SUBCOMMANDS = {"fit": "train a model (LightningCLI: tp3d fit --config run.yaml; tp3d fit --help)",
                          "validate": "run the validation loop (LightningCLI)",
                          "test": "run the test loop (LightningCLI)",
                          "predict": "run the prediction loop (LightningCLI)"}
_PACKAGE = Path(__file__).resolve().parents[1]
_REFUSAL_MODULES = {"lightning_tp3d.io.checkpoint_format": "CheckpointError",
                    "lightning_tp3d.strategies.features": "UnsupportedFeatureError",
                    "lightning_tp3d.io.onnx_export": "MissingExtraError",
                    "lightning_tp3d.diagnostics.engines": "EngineUnavailableError"}


def _refusal_types() -> tuple[type[BaseException], ...]:
    """The package's own error types: `LayoutError`, and those of the modules this command imported (one
    not imported raised nothing; importing it here would cost the planning path its start-up time)."""
    return (LayoutError, *(getattr(sys.modules[module], name) for module, name in _REFUSAL_MODULES.items()
                           if module in sys.modules))


def _raised_here(error: BaseException) -> bool:
    """Whether `error` is this package's own refusal (a layout, option, feature or checkpoint error), not one
    raised in a user's module or a library, whose traceback the user needs."""
    if isinstance(error, _refusal_types()):
        return True
    frames = traceback.extract_tb(error.__traceback__)
    return isinstance(error, ValueError) and bool(frames) and Path(frames[-1].filename).is_relative_to(_PACKAGE)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # every further argument is torchrun's
        from lightning_tp3d.cli.launch import run_torchrun

        return run_torchrun(argv[1:])
    if argv and (argv[0] in _LIGHTNING_SUBCOMMANDS or argv[0] == "profile" and "--help" not in argv[1:2]):
        from lightning_tp3d.cli.lightning import run_lightning_cli
        from lightning_tp3d.cli.profile import run_profile

        try:
            return run_profile(argv[1:]) if argv[0] == "profile" else run_lightning_cli(argv)
        except (ValueError, RuntimeError) as error:  # CheckpointError is a RuntimeError
            if not _raised_here(error):
                raise
            print(f"tp3d {argv[0]}: error: {error}", file=sys.stderr)
            return 2
    parser = argparse.ArgumentParser(prog="tp3d", description="3-D parallel training for Lightning")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, description in _LIGHTNING_SUBCOMMANDS.items():  # listed here, run by LightningCLI above
        subparsers.add_parser(name, help=description, add_help=False)
    subparsers.add_parser("run", help="torchrun, with its elastic restarts made to recover (arguments: torchrun's)",
                          add_help=False)
    subparsers.add_parser("profile", help="where each rank's step time goes (a fit config, under the step profiler)",
                          parents=[profile_arguments()], add_help=False)
    plan_parser(subparsers)
    _export_parser(subparsers)
    _check_parser(subparsers)
    _verify_parser(subparsers)
    _doctor_parser(subparsers)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError, RuntimeError, ImportError) as error:
        if isinstance(error, (RuntimeError, ImportError)) and not isinstance(error, _refusal_types()):
            raise
        print(f"tp3d {args.command}: error: {error}", file=sys.stderr)
        return 2
