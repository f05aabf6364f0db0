"""Serving throughput and peak memory of an ONNX export in ONNX Runtime, beside transformers running the same export.

    python benchmarks/onnx_serving.py                    # tiny and 160M models, CPU; writes JSON
    python benchmarks/onnx_serving.py --models tiny --rounds 3 --output onnx_serving.json

For each model (the reference decoder's `tiny` preset and the 160M decoder of the checkpoint benchmark,
random weights, seeded), the Hugging Face folder is written by transformers and exported with
`lightning_tp3d.io.onnx_export.onnx_from_hf_folder` (fp32). Both engines then run the same prefill, a
forward of `--batch` prompts of `--seq-len` tokens, one thread each:

* throughput: both engines loaded in one process; each round times `--repeats` forwards of each, back to
  back in alternating order, and the figure is the median over rounds of the per-round ratio ONNX
  Runtime tokens/s / transformers tokens/s, with each engine's median tokens/s beside it;
* peak memory: each engine in a process of its own that loads the export and runs one forward; its peak
  resident set (Linux's VmHWM), and that less the same process's before the engine was built (both
  processes import torch, transformers and onnxruntime first).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lightning_tp3d import MODEL_PRESETS, ModelConfig
from lightning_tp3d.io.hf import hf_config
from lightning_tp3d.io.onnx_export import ONNX_FILE, onnx_from_hf_folder

from common import CONFIG_160M, MACHINE

MODELS: dict[str, ModelConfig] = {"tiny": MODEL_PRESETS["tiny"], "160M": CONFIG_160M}


def _write_hf_folder(config: ModelConfig, folder: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {key: value for key, value in hf_config(config, torch.float32).items()
              if key not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **fields)).save_pretrained(folder)


def _transformers_engine(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()

    def forward(input_ids: torch.Tensor) -> Any:
        with torch.no_grad():
            return model(input_ids=input_ids, use_cache=False).logits

    return forward


def _onnxruntime_engine(onnx_folder: Path) -> Any:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(str(onnx_folder / ONNX_FILE), options, providers=["CPUExecutionProvider"])
    return lambda input_ids: session.run(["logits"], {"input_ids": input_ids.numpy()})[0]


def _engine(name: str, folder: Path, onnx_folder: Path) -> Any:
    """The engine `name` as a function of the input ids that returns the logits (one thread)."""
    return _transformers_engine(folder) if name == "transformers" else _onnxruntime_engine(onnx_folder)


ENGINES = ("transformers", "onnxruntime")


def _tokens_per_second(forward: Any, input_ids: torch.Tensor, repeats: int) -> float:
    forward(input_ids)  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        forward(input_ids)
    return input_ids.numel() * repeats / (time.perf_counter() - started)


def _throughput(folder: Path, onnx_folder: Path, input_ids: torch.Tensor, rounds: int, repeats: int) -> dict[str, Any]:
    engines = {name: _engine(name, folder, onnx_folder) for name in ENGINES}
    pairs = []
    for index in range(rounds):
        order = ("transformers", "onnxruntime") if index % 2 == 0 else ("onnxruntime", "transformers")
        measured = {name: _tokens_per_second(engines[name], input_ids, repeats) for name in order}
        pairs.append({**measured, "ratio": measured["onnxruntime"] / measured["transformers"]})
    return {"median_ratio": statistics.median(pair["ratio"] for pair in pairs),
            "median_tokens_per_second": {name: statistics.median(pair[name] for pair in pairs) for name in engines},
            "rounds": pairs}


def _peak_memory(engine: str, folder: Path, onnx_folder: Path, batch: int, seq_len: int) -> dict[str, int]:
    """One engine in a fresh process: its peak resident bytes, and the process's before the engine was built
    (Python, torch and this script's imports, the same for both engines)."""
    command = [sys.executable, __file__, "--memory-worker", engine, str(folder), str(onnx_folder),
               "--batch", str(batch), "--seq-len", str(seq_len)]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1])


def _peak_resident_bytes() -> int:
    """This process's peak resident set: Linux's VmHWM (which starts again at exec, where `ru_maxrss` keeps
    the parent's peak from before the fork), else `ru_maxrss`."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _memory_worker(engine: str, folder: Path, onnx_folder: Path, batch: int, seq_len: int) -> None:
    torch.set_num_threads(1)
    import onnxruntime  # noqa: F401 - both workers import both libraries: the baseline is the same
    import transformers  # noqa: F401

    before = _peak_resident_bytes()
    _engine(engine, folder, onnx_folder)(torch.zeros(batch, seq_len, dtype=torch.long))
    peak = _peak_resident_bytes()
    print(json.dumps({"peak_bytes": peak, "before_engine_bytes": before, "engine_bytes": peak - before}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default="benchmarks/onnx_serving_cpu.json")
    parser.add_argument("--memory-worker", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_worker is not None:
        engine, folder, onnx_folder = args.memory_worker
        _memory_worker(engine, Path(folder), Path(onnx_folder), args.batch, args.seq_len)
        return
    torch.set_num_threads(1)
    results: dict[str, Any] = {"command": [sys.executable, *sys.argv], "machine": MACHINE, "threads": 1,
                               "batch": args.batch, "seq_len": args.seq_len, "models": {}}
    input_ids = torch.randint(0, 256, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    for name in args.models:
        with tempfile.TemporaryDirectory() as scratch:
            folder, onnx_folder = Path(scratch) / "hf", Path(scratch) / "onnx"
            _write_hf_folder(MODELS[name], folder)
            onnx_folder.mkdir()
            manifest = onnx_from_hf_folder(folder, onnx_folder)
            result = _throughput(folder, onnx_folder, input_ids, args.rounds, args.repeats)
            result["weight_bytes"] = manifest.weight_bytes
            result["memory"] = {engine: _peak_memory(engine, folder, onnx_folder, args.batch, args.seq_len)
                                for engine in ENGINES}
        results["models"][name] = result
        speeds = result["median_tokens_per_second"]
        print(f"{name:5s} transformers {speeds['transformers']:9.0f} tok/s, onnxruntime {speeds['onnxruntime']:9.0f}"
              f" tok/s, ratio {result['median_ratio']:.2f}; memory the engine adds"
              f" {result['memory']['transformers']['engine_bytes'] / 2**20:.0f} /"
              f" {result['memory']['onnxruntime']['engine_bytes'] / 2**20:.0f} MiB")
    Path(args.output).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
