"""The step breakdown's arithmetic on hand-built timelines: each moment goes to the innermost named range,
the components add up to the step, the advisor's parts land on their components, the rules of thumb fire
where the design documents put them, and the report's table and pictures are written."""

from __future__ import annotations

import pytest

from lightning_tp3d.diagnostics.breakdown import (
    COMPONENTS,
    TimedRange,
    component_of,
    exclusive_segments,
    predicted_components,
    rules_of_thumb,
    step_components,
)
from lightning_tp3d.diagnostics.profile_report import build_report, report_table
from lightning_tp3d.parallel.labels import PIPELINE_COMPUTE, PIPELINE_SCHEDULE, STEP
from lightning_tp3d.plan.advisor import Cluster, evaluate_layout
from lightning_tp3d.plan.config import resolve_model_config
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.ledger import TrainingOptions
from lightning_tp3d.plan.moe import MoEModelConfig
from lightning_tp3d.plan.moe_communication import moe_communication_ledger

DATA = "[_TrainingEpochLoop].train_dataloader_next"
TRAINING_STEP = "[Strategy]TP3DStrategy.training_step"
OPTIMIZER = "[LightningModule]CausalLMModule.optimizer_step"


def _step() -> list[TimedRange]:
    """One 10 s step: data 0-1, the optimizer step 1-9 holding training_step 1-7 (the schedule 1.5-6.5 with
    two chunks 2-3 and 4-5, a tp wait 2.2-2.6 inside the first, a send 3.2-3.4 between them; the loss
    broadcast 6.6-6.9), the dp reduction 7-8 (its all-reduce 7.1-7.9), a world flag 8.5-8.6; the rest of
    9-10 is Lightning's."""
    return [TimedRange(STEP, 0.0, 10.0), TimedRange(DATA, 0.0, 1.0), TimedRange(OPTIMIZER, 1.0, 9.0),
            TimedRange(TRAINING_STEP, 1.0, 7.0), TimedRange(PIPELINE_SCHEDULE, 1.5, 6.5),
            TimedRange(PIPELINE_COMPUTE, 2.0, 3.0), TimedRange("tp3d::comm::tp::wait", 2.2, 2.6),
            TimedRange("c10d::send", 3.2, 3.4), TimedRange(PIPELINE_COMPUTE, 4.0, 5.0),
            TimedRange("tp3d::comm::pp::broadcast", 6.6, 6.9),
            TimedRange("tp3d::dp::reduce_gradients", 7.0, 8.0), TimedRange("tp3d::comm::dp::all_reduce", 7.1, 7.9),
            TimedRange("tp3d::comm::world::all_reduce", 8.5, 8.6)]


def test_each_moment_goes_to_the_innermost_range_and_the_components_add_up():
    # the profiler keeps the ranges the breakdown names; the send's time stays the schedule's
    segments = exclusive_segments([timed for timed in _step() if component_of(timed.name) is not None])
    assert sum(end - start for start, end, _ in segments) == pytest.approx(10.0)
    components = step_components(segments, 0.0, 10.0)
    assert list(components) == list(COMPONENTS)
    expected = {"data loading": 1.0, "tp collectives": 0.4, "pipeline send/recv": 0.3, "dp communication": 1.0,
                "compute": 0.6 + 1.0 + 0.5 + 0.2,  # the chunks without the wait, training_step outside the schedule
                "pipeline idle": 5.0 - 2.0,  # the schedule without its chunks (its send included)
                "optimizer": 8.0 - 6.0 - 1.0 - 0.1,  # optimizer_step without training_step, dp and the flag
                "rest": 1.0 + 0.1}  # the step's own last second and the world flag
    assert components == pytest.approx(expected)
    # a window cuts the timeline where it starts and ends
    assert sum(step_components(segments, 2.5, 4.5).values()) == pytest.approx(2.0)


def test_a_range_that_outlives_its_parent_is_cut_at_the_parent_end():
    segments = exclusive_segments([TimedRange(STEP, 0.0, 2.0), TimedRange(PIPELINE_COMPUTE, 1.0, 3.0)])
    assert segments == [(0.0, 1.0, STEP), (1.0, 2.0, PIPELINE_COMPUTE)]


def test_names_map_to_components():
    assert component_of("tp3d::comm::pp::broadcast") == "pipeline send/recv"
    assert component_of("tp3d::comm::other::wait") == "rest"
    assert component_of("tp3d::dp::all_gather_parameters") == "dp communication"
    assert component_of("[Strategy]TP3DStrategy.backward") == "compute"
    assert component_of("[Strategy]TP3DStrategy.batch_to_device") == "data loading"
    assert component_of("Optimizer.step#AdamW.step") == "optimizer"
    assert component_of("[Callback]PrintLosses.on_train_batch_end") is None  # its time goes to the step
    assert component_of("aten::mm") is None and component_of("c10d::send") is None  # the schedule's time


def _candidate():
    layout = ParallelLayout(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2,
                            micro_batch_size=2, num_microbatches=4)
    options = TrainingOptions(seq_len=64, precision="32-true")
    return evaluate_layout(resolve_model_config("tiny"), Cluster(gpus=8, gpu_memory_bytes=1 << 40, overlap=False),
                           layout, options, global_batch_size=16)


def test_the_advisor_parts_land_on_their_components():
    candidate = _candidate()
    predicted = predicted_components(candidate)
    assert predicted["compute"] == candidate.compute_seconds and predicted["pipeline idle"] == candidate.bubble_seconds
    assert [predicted[name] for name in ("tp collectives", "pipeline send/recv", "dp communication")] == [
        candidate.exposed_seconds[group] for group in ("tp", "pp", "dp")]
    assert sum(predicted.values()) == pytest.approx(candidate.step_seconds)


def _components(**shares: float) -> dict[str, float]:
    components = dict.fromkeys(COMPONENTS, 0.0)
    components.update(shares)
    components["rest"] += 1.0 - sum(components.values())
    return components


def test_the_rules_of_thumb_name_the_cause():
    low = rules_of_thumb(_components(compute=0.5, **{"data loading": 0.3}), 1.0, None, None)
    assert [cause for cause, _ in low] == ["low compute: data loading"] and "num_workers" in low[0][1]
    assert [cause for cause, _ in rules_of_thumb(_components(compute=0.95), 1.0, None, None)] == ["high compute"]
    assert rules_of_thumb(_components(compute=0.75), 1.0, None, None) == []
    idle = rules_of_thumb(_components(compute=0.7, **{"pipeline idle": 0.2}), 1.0, 0.1, None)
    assert [cause for cause, _ in idle] == ["pipeline idle"]  # 20% against 1.25 x 10%
    assert rules_of_thumb(_components(compute=0.7, **{"pipeline idle": 0.12}), 1.0, 0.1, None) == []
    off = rules_of_thumb(_components(compute=0.7, **{"tp collectives": 0.2}), 1.0, None,
                         {"compute": 0.7, "tp collectives": 0.05})
    assert [cause for cause, _ in off] == ["prediction: tp collectives"] and "--link-gbps" in off[0][1]


def _rank(rank: int, compute: float) -> dict:
    components = _components(compute=compute, **{"tp collectives": 0.05, "pipeline idle": 0.3})
    return {"rank": rank, "host": "h", "coordinates": {"pp": rank // 4, "dp": rank // 2 % 2, "tp": rank % 2},
            "step_seconds": 1.0, "components": components, "steps": [], "pipeline_timing": None,
            "dp_bytes_per_step": 10.0, "timeline": [[0.0, compute, "compute"], [compute, 1.0, "rest"]]}


def test_the_report_predicts_warns_once_per_cause_and_draws(tmp_path):
    pytest.importorskip("matplotlib")
    from lightning_tp3d.diagnostics.profile_plots import plot_breakdown, plot_timeline

    ranks = [_rank(rank, 0.5 if rank == 3 else 0.62) for rank in range(8)]
    layout = ParallelLayout(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2,
                            micro_batch_size=2, num_microbatches=4)
    report = build_report(ranks, config=resolve_model_config("tiny"), layout=layout,
                          options=TrainingOptions(seq_len=64, precision="32-true"), global_batch=16,
                          schedule="1f1b", device_type="cpu", backend="gloo", gpus_per_node=8,
                          cluster_options={"link_gbps": {"tp": 5.0}}, warmup_steps=2, steps=3, command=["tp3d"])
    # on a CPU the compute rate is calibrated: the predicted compute is the ranks' mean
    mean_compute = (7 * 0.62 + 0.5) / 8
    assert report["prediction"]["components"]["compute"] == pytest.approx(mean_compute)
    assert report["prediction"]["cluster"]["group_gbps"] == {"tp": 5.0}
    assert all("timeline" not in rank and rank["ledger_dp_bytes"] > 0 for rank in report["ranks"])
    low = [warning for warning in report["warnings"] if "under 60%" in warning]
    assert len(low) == 1 and low[0].startswith("rank 3:") and "pipeline idle (30%)" in low[0]
    # 30% idle against 1 / (4 + 1) = 20% in theory at pp 2, m 4: one warning naming every rank
    idle = [warning for warning in report["warnings"] if "against 20% in theory" in warning]
    assert len(idle) == 1 and idle[0].startswith("ranks 0, 1, 2, 3, 4, 5, 6, 7 ")
    table = report_table(report)
    assert table.splitlines()[2].split()[:3] == ["compute", f"{mean_compute:.4f}", f"{mean_compute:.1%}"]
    timelines = [(rank["rank"], rank["coordinates"], rank["timeline"]) for rank in ranks]
    for path in (plot_timeline(timelines, tmp_path / "timeline.png"), plot_breakdown(report, tmp_path / "b.png")):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_report_of_a_mixture_of_experts_run_predicts_with_its_ledgers():
    """A DeepSeek run's prediction comes from the MoE ledgers (`plan.advisor.plan_ledgers`): each rank's dp
    bytes are `plan.moe_communication`'s, and the experts' reduction over "edp" counts as dp communication."""
    config = MoEModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1,
                            num_experts_per_tok=2, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=16,
                            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    layout = ParallelLayout(pipeline_parallel_size=2, data_parallel_size=4, micro_batch_size=1, num_microbatches=4,
                            expert_parallel_size=2)  # pp rank = rank // 4, as `_rank` places them
    options = TrainingOptions(seq_len=64, precision="32-true")
    report = build_report([_rank(rank, 0.62) for rank in range(8)], config=config, layout=layout, options=options,
                          global_batch=16, schedule="1f1b", device_type="cpu", backend="gloo", gpus_per_node=8,
                          cluster_options={}, warmup_steps=2, steps=3, command=["tp3d"])
    ledger = moe_communication_ledger(config, layout, options, backend="gloo")
    assert [rank["ledger_dp_bytes"] for rank in report["ranks"]] == [
        ledger.totals(rank // 4)["dp"]["payload_bytes"] for rank in range(8)]
    candidate = evaluate_layout(config, Cluster(gpus=8, gpu_memory_bytes=1 << 40, overlap=False), layout, options, 16)
    assert candidate.exposed_seconds["edp"] > 0
    assert predicted_components(candidate)["dp communication"] == pytest.approx(
        candidate.exposed_seconds["dp"] + candidate.exposed_seconds["edp"])
