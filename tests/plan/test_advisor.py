"""`tp3d plan MODEL --gpus N`: every layout searched is valid for the cluster, fitting ones are ranked by the
predicted step time, and the best one's memory is the ledger's for that layout."""

from __future__ import annotations

import json

import pytest

from lightning_tp3d.cli import main
from lightning_tp3d.plan.advisor import Cluster, advise
from lightning_tp3d.plan.config import MODEL_PRESETS
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.ledger import TrainingOptions, training_ledger

GIB = 1024**3


def test_advisor_ranks_valid_layouts_and_the_best_fits_by_the_ledger(capsys):
    assert main(["plan", "deepseek-llm-7b", "--gpus", "64", "--gpu-memory", "80GiB", "--gpus-per-node", "8",
                 "--global-batch-size", "512", "--precision", "bf16-mixed", "--json"]) == 0
    candidates = json.loads(capsys.readouterr().out)
    assert len(candidates) > 20
    for candidate in candidates:
        tp, pp, dp = (candidate[key] for key in ("tensor_parallel_size", "pipeline_parallel_size",
                                                  "data_parallel_size"))
        assert tp <= 8 and 8 % tp == 0 and tp * pp * dp == 64
        assert candidate["num_microbatches"] * candidate["gradient_accumulation_steps"] * dp == 512
    fitting = [candidate for candidate in candidates if candidate["fits"]]
    assert [candidate["step_seconds"] for candidate in fitting] == sorted(c["step_seconds"] for c in fitting)
    assert candidates[: len(fitting)] == fitting  # every fitting layout is ranked before any that does not fit
    best = fitting[0]
    layout = ParallelLayout(tensor_parallel_size=best["tensor_parallel_size"],
                            pipeline_parallel_size=best["pipeline_parallel_size"],
                            data_parallel_size=best["data_parallel_size"], num_microbatches=best["num_microbatches"],
                            gradient_accumulation_steps=best["gradient_accumulation_steps"])
    options = TrainingOptions(seq_len=4096, recompute=best["recompute"], data_parallel_mode=best["data_parallel_mode"])
    peak = training_ledger(MODEL_PRESETS["deepseek-llm-7b"], layout, options).peak_stage.total_bytes
    assert best["peak_bytes"] == peak <= 0.9 * 80 * GIB


def test_advisor_table_names_why_each_layout_wins_or_loses(capsys):
    """Within 100 columns: the dp modes as the options name them, FSDP's resharding in its own column, each
    column explained, and for each layout the columns in which it differs from the best (`--wide`: with the
    seconds of every part, and the part that grows most); `--json` carries the same."""
    args = ["plan", "deepseek-llm-67b", "--gpus", "32", "--gpu-memory", "80GiB", "--top", "5",
            "--global-batch-size", "512", "--precision", "bf16-mixed"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "168 layouts, 38 fit in 90% of the memory" in lines[1]  # replicate, zero1, fsdp, fsdp resharding
    assert lines[2].split()[:12] == ["#", "tp", "pp", "dp", "dp", "mode", "reshard", "recompute", "m", "k", "GiB",
                                     "step"]
    offset = lines[2].index("why")
    rows = [line[:offset].split() for line in lines[3:8]]
    whys = [line[offset:] for line in lines[3:8]]
    assert whys[0] == "best" and all(why.startswith("+") and "%: " in why for why in whys[1:])
    assert {row[4] for row in rows} <= {"replicate", "fsdp", "zero1"}
    assert all((row[5] in ("yes", "no")) == (row[4] == "fsdp") for row in rows)
    legend = " ".join(lines[8:])
    assert all(f"{column}:" in legend for column in ("m", "k", "reshard", "GiB", "step s", "why"))
    assert max(len(line) for line in lines) <= 100
    columns = {"tp": 1, "pp": 2, "dp": 3, "dp mode": 4, "reshard": 5, "recompute": 6}
    for row, why in zip(rows[1:], whys[1:]):  # the columns named are the ones that differ from the best
        named = set(why.partition(": ")[2].split(", ")) - {"m", "k"}
        assert named == {name for name, column in columns.items() if row[column] != rows[0][column]}, why
    assert main(args + ["--wide"]) == 0
    wide = capsys.readouterr().out.splitlines()
    assert "best; beyond compute: bubble" in wide[3] and all("; " in line and " s" in line for line in wide[4:8])
    assert main(args + ["--json"]) == 0
    best = json.loads(capsys.readouterr().out)[0]
    assert best["why"].startswith("best; beyond compute: bubble") and best["reshard"] == (rows[0][5] == "yes")
    assert main(["plan", "deepseek-llm-67b", "--gpus", "8", "--gpu-memory", "80GiB", "--global-batch-size", "512"]) == 1
    assert "no layout fits" in capsys.readouterr().out
    assert main(["plan", "deepseek-llm-67b", "--gpus", "8"]) == 2
    assert "the advisor needs --global-batch-size B" in capsys.readouterr().err


def test_slower_links_make_the_tensor_parallel_layouts_pay_their_all_reduces():
    config = MODEL_PRESETS["deepseek-llm-7b"]
    fast = advise(config, Cluster(16, 80 * GIB, group_gbps={"tp": 400.0}), 64, 4096)
    slow = advise(config, Cluster(16, 80 * GIB, group_gbps={"tp": 20.0}), 64, 4096)

    def tp_cost(candidates, tp):
        return min(c.exposed_seconds["tp"] for c in candidates if c.tensor_parallel_size == tp)

    assert tp_cost(fast, 1) == tp_cost(slow, 1) == 0.0
    assert tp_cost(slow, 8) == pytest.approx(tp_cost(fast, 8) * 20, rel=1e-12)


def test_latency_per_call_and_a_cluster_without_overlap():
    """alpha-beta: each call adds the group's latency; without overlap (CPU processes sharing cores) the
    FSDP and pipeline transfers are exposed in full."""
    from lightning_tp3d.plan.advisor import evaluate_layout
    from lightning_tp3d.plan.communication import communication_ledger, group_bandwidths

    config = MODEL_PRESETS["deepseek-llm-7b"]
    layout = ParallelLayout(tensor_parallel_size=8, data_parallel_size=2, gradient_accumulation_steps=4)
    options = TrainingOptions(seq_len=4096, data_parallel_mode="fsdp")
    plain = evaluate_layout(config, Cluster(16, 80 * GIB), layout, options, 8)
    slow_calls = evaluate_layout(config, Cluster(16, 80 * GIB, latency_seconds={"tp": 1e-3}), layout, options, 8)
    calls = sum(transfer.count for transfer in communication_ledger(config, layout, options).stages[0]
                if transfer.group == "tp")
    assert slow_calls.exposed_seconds["tp"] == pytest.approx(plain.exposed_seconds["tp"] + calls * 1e-3, rel=1e-12)
    exposed = evaluate_layout(config, Cluster(16, 80 * GIB, overlap=False), layout, options, 8)
    ledger = communication_ledger(config, layout, options)
    bandwidth = group_bandwidths(layout, 8)
    whole_dp = ledger.seconds(0, bandwidth)["dp"]
    assert plain.exposed_seconds["dp"] == pytest.approx(whole_dp["seconds"] - min(whole_dp["hideable_seconds"],
                                                                                  plain.compute_seconds))
    assert exposed.exposed_seconds["dp"] == pytest.approx(whole_dp["seconds"])
    assert exposed.exposed_seconds["dp"] > plain.exposed_seconds["dp"]
    assert exposed.exposed_seconds["tp"] == plain.exposed_seconds["tp"]  # tp was never hidden
