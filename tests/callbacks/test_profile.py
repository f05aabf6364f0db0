"""`StepProfiler` at (tp, pp, dp) = (2, 2, 1) and (1, 2, 2) (1F1B, m 4), the latter also with FSDP2, on 4
processes, and `tp3d profile` on the tiny example:

* every profiled step's components add up to the step the host clock measured (within 5%: the
  components are exclusive times of the traced step, which starts and ends where the clock reads);
* the pipeline idle agrees with the pipeline's own timing of the same steps (`pipeline_timing`: the
  schedule minus its stages' chunks) within 20%; under FSDP2 the two differ by the reduce-scatter the
  schedule runs after the last backward chunk (dp communication here, idle there): idle <= timing's idle
  <= idle + dp communication;
* the dp bytes per step equal the communication ledger's on every rank, and tp / dp time shows where
  the layout has those groups;
* breakdown.json, every rank's Chrome trace and the two pictures are written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest

from lightning_tp3d import TP3DStrategy
from lightning_tp3d.callbacks import StepProfiler
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from tests.distributed import run_distributed
from tests.helpers import trainer_kwargs

LAYOUTS = {"2x2x1": (2, 2, "replicate"), "1x2x2": (1, 2, "replicate"), "1x2x2-fsdp": (1, 2, "fsdp")}
WARMUP, STEPS = 2, 3
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_world(output: str) -> dict[str, Any]:
    results = {}
    for name, (tp, pp, mode) in LAYOUTS.items():
        profiler = StepProfiler(Path(output) / name, warmup_steps=WARMUP, steps=STEPS)
        strategy = TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, num_microbatches=4,
                                data_parallel_mode=mode)
        trainer = L.Trainer(**trainer_kwargs(devices=4, strategy=strategy, max_steps=WARMUP + STEPS, logger=False,
                                             callbacks=[profiler]))
        trainer.fit(CausalLMModule("tiny"), TokenDataModule(source="tiny", seq_len=64, batch_size=8))
        results[name] = {"local": profiler.local, "report": profiler.report}
    return results


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    output = tmp_path_factory.mktemp("profile")
    return output, run_distributed(4, "tests.callbacks.test_profile:run_world", str(output))


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_components_add_up_to_the_step_and_the_idle_is_the_pipeline_timing(profiled, name):
    for rank in profiled[1]:
        local = rank[name]["local"]
        assert len(local["steps"]) == STEPS
        for step in local["steps"]:
            assert step["traced_seconds"] == pytest.approx(sum(step["components"].values()))
            # 5%, widened by how far apart the host clock's readings around the trace's marks were (a rank
            # descheduled between them: four processes share two cores)
            bound = 0.05 * step["host_seconds"] + step["clock_uncertainty_seconds"]
            assert abs(step["traced_seconds"] - step["host_seconds"]) <= bound, step
        idle, dp = (sum(step["components"][component] for step in local["steps"])
                    for component in ("pipeline idle", "dp communication"))
        timing = sum(step["idle_seconds"] for step in local["pipeline_timing"])
        # two clocks reading nearly the same moments. The pipeline's timers nest around the trace's marks (the
        # step's outside its label, each chunk's inside), so the trace's idle never exceeds the timing's but by
        # the trace's microsecond rounding; a rank descheduled between a chunk's label and its timer (four
        # processes share two cores; a scheduler slice is a few ms) lengthens only the timing's idle, per step
        slack = 0.05 * timing + 2e-3 * STEPS
        if LAYOUTS[name][2] == "replicate":  # the dp reduction runs after the schedule
            assert abs(idle - timing) <= 0.2 * timing, (local["rank"], idle, timing)
        else:  # FSDP2 reduce-scatters inside the schedule, after the last backward chunk: the pipeline's
            # timing counts that as idle, the breakdown as dp communication
            assert idle - 1e-3 <= timing <= idle + dp + slack, (local["rank"], idle, dp, timing)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dp_bytes_equal_the_ledger_and_each_group_shows_where_the_layout_has_it(profiled, name):
    tp, _, _ = LAYOUTS[name]
    report = profiled[1][0][name]["report"]
    assert [rank["rank"] for rank in report["ranks"]] == [0, 1, 2, 3]
    for rank in report["ranks"]:
        assert rank["dp_bytes_per_step"] == rank["ledger_dp_bytes"], rank["rank"]
        assert (rank["dp_bytes_per_step"] > 0) == (LAYOUTS[name][2] == "fsdp" or name == "1x2x2")
        assert (rank["components"]["tp collectives"] > 0) == (tp > 1)
        assert rank["components"]["compute"] > 0 and rank["components"]["pipeline idle"] > 0
        if name != "2x2x1":
            assert rank["components"]["dp communication"] > 0
    assert set(report["prediction"]["components"]) == {"compute", "tp collectives", "pipeline send/recv",
                                                       "pipeline idle", "dp communication"}
    assert all(other[name]["report"] is None for other in profiled[1][1:])  # rank 0 writes the report


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_report_traces_and_pictures_are_written(profiled, name):
    folder = profiled[0] / name
    report = json.loads((folder / "breakdown.json").read_text())
    assert report["steps"] == STEPS and report["warmup_steps"] == WARMUP and report["command"]
    for rank in range(4):
        events = json.loads((folder / f"trace_rank{rank}.json").read_text())["traceEvents"]
        assert sum(event.get("name") == "tp3d::step" for event in events) == STEPS
    for picture in ("timeline.png", "breakdown.png"):
        assert (folder / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.distributed
def test_tp3d_profile_runs_a_fit_config_and_leaves_the_run_files_alone(tmp_path):
    """The docs' command on the tiny example at (2, 2, 1): the table printed, the report written, and no
    checkpoint (the YAML's ModelCheckpoint writes into checkpoints/tiny) nor config.yaml outside DIR."""
    process = subprocess.run([sys.executable, "-m", "lightning_tp3d.cli", "profile", "--config",
                              str(EXAMPLES / "tiny_2x2x2.yaml"), "--trainer.devices", "4", "--output", "prof",
                              "--link-gbps", "tp=2", "pp=2"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert process.returncode == 0, process.stderr[-3000:]
    assert "step-time breakdown at tp=2 pp=2 dp=1 (1f1b, m=2, replicate): 3 steps after 2 warm-up" in process.stdout
    assert sorted(path.name for path in tmp_path.iterdir()) == ["prof"]
    report = json.loads((tmp_path / "prof" / "breakdown.json").read_text())
    assert report["command"][:2] == ["tp3d", "profile"] and report["prediction"]["cluster"]["group_gbps"] == {
        "tp": 2.0, "pp": 2.0}
    written = {path.name for path in (tmp_path / "prof").iterdir()}
    assert {"breakdown.png", "timeline.png", "trace_rank3.json"} <= written


def test_a_profile_that_cannot_run_is_refused_before_the_fit():
    with pytest.raises(ValueError, match="warmup_steps >= 1"):
        StepProfiler(warmup_steps=0)
    profiler = StepProfiler(warmup_steps=2, steps=3)
    with pytest.raises(ValueError, match="StepProfiler profiles a fit with TP3DStrategy"):
        profiler.setup(SimpleNamespace(strategy=object(), max_steps=-1), None, "fit")
    trainer = SimpleNamespace(strategy=TP3DStrategy(), max_steps=4)
    with pytest.raises(ValueError, match="raise max_steps to at least 5"):
        profiler.setup(trainer, None, "fit")


def test_a_fit_that_ends_before_the_profile_says_so():
    profiler = StepProfiler(warmup_steps=2, steps=3)
    profiler.on_train_start(SimpleNamespace(global_step=10), None)  # a fit resumed at step 10
    profiler.on_train_batch_end(SimpleNamespace(global_step=11), None, None, None, 0)  # one step, no profile yet
    with pytest.warns(UserWarning, match="the fit ended after 1 of the 5 steps it needs"):
        profiler.teardown(SimpleNamespace(profiler=None), None, "fit")
