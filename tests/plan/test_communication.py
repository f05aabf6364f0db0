"""The communication ledger's formulas, on figures derived by hand (docs/communication.md), and `tp3d plan`'s
communication section. The ledger against measured traffic: tests/diagnostics/test_traffic.py."""

from __future__ import annotations

import json

import pytest

from lightning_tp3d.cli import main
from lightning_tp3d.plan.communication import communication_ledger, group_bandwidths, groups_inside_a_node
from lightning_tp3d.plan.config import MODEL_PRESETS
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.ledger import TrainingOptions

SEVEN_B = MODEL_PRESETS["deepseek-llm-7b"]
LAYOUT = ParallelLayout(tensor_parallel_size=8, pipeline_parallel_size=4, data_parallel_size=2, num_microbatches=8)
TOKENS = 4096 * 4096  # b s h of one micro-batch: 1 x 4096 tokens x hidden 4096


def test_deepseek_7b_tp_traffic_of_a_middle_stage_by_hand():
    """Stage 1 holds layers 7-14 (8 layers); 8 micro-batches; bf16-mixed: the row-parallel outputs are bf16
    (2 per layer and micro-batch), the input gradients fp32 (2 per layer and micro-batch)."""
    stage = communication_ledger(SEVEN_B, LAYOUT, TrainingOptions(seq_len=4096)).totals(1)
    forward, backward = 2 * 8 * 8 * TOKENS * 2, 2 * 8 * 8 * TOKENS * 4
    assert stage["tp"]["calls"] == 256
    assert stage["tp"]["payload_bytes"] == forward + backward == 12_884_901_888
    assert stage["tp"]["sent_bytes"] == pytest.approx(2 * 7 / 8 * 12_884_901_888)
    # pp: a middle stage sends 8 activations forward and 8 gradients back, fp32 residual stream.
    assert stage["pp"] == {"calls": 16, "payload_bytes": 16 * TOKENS * 4, "sent_bytes": 16 * TOKENS * 4}
    # dp replicate: one all-reduce of the stage's 202,440,704 fp32 gradients.
    assert stage["dp"]["payload_bytes"] == 202_440_704 * 4


def test_recompute_repeats_the_attention_all_reduce_and_fsdp_gathers_once_under_pipelining():
    base = communication_ledger(SEVEN_B, LAYOUT, TrainingOptions(seq_len=4096)).totals(1)["tp"]
    full = communication_ledger(SEVEN_B, LAYOUT, TrainingOptions(seq_len=4096, recompute="full")).totals(1)["tp"]
    assert full["calls"] - base["calls"] == 8 * 8  # the attention output's all-reduce of 8 layers x 8 micro-batches
    fsdp = communication_ledger(SEVEN_B, LAYOUT, TrainingOptions(seq_len=4096, data_parallel_mode="fsdp"))
    operations = [(transfer.operation, transfer.count) for transfer in fsdp.stages[1] if transfer.group == "dp"]
    assert operations == [("all_gather", 1), ("reduce_scatter", 1)] * 8
    no_pp = ParallelLayout(tensor_parallel_size=8, data_parallel_size=8)
    unpipelined = communication_ledger(SEVEN_B, no_pp, TrainingOptions(seq_len=4096, data_parallel_mode="fsdp"))
    assert {transfer.count for transfer in unpipelined.stages[0]
            if (transfer.group, transfer.operation) == ("dp", "all_gather")} == {2}


def test_groups_inside_a_node_and_their_bandwidths():
    assert groups_inside_a_node(LAYOUT, 8) == {"tp": True, "dp": False, "pp": False}
    assert groups_inside_a_node(ParallelLayout(tensor_parallel_size=4, data_parallel_size=2), 8) == {
        "tp": True, "dp": True, "pp": True}
    assert group_bandwidths(LAYOUT, 8, given_gbps={"dp": 40.0}) == {"tp": 100e9, "pp": 10e9, "dp": 40e9}
    experts = ParallelLayout(tensor_parallel_size=2, data_parallel_size=8, expert_parallel_size=4)
    assert groups_inside_a_node(experts, 8) == {"tp": True, "dp": False, "pp": False, "ep": True, "edp": False}
    assert groups_inside_a_node(experts, 4)["ep"] is False  # an ep group spans tp x E = 8 ranks


def test_plan_json_and_table_carry_the_communication_ledger(tmp_path, capsys):
    arguments = ["plan", "deepseek-llm-7b", "--tp", "8", "--pp", "4", "--dp", "2", "--num-microbatches", "8",
                 "--seq-len", "4096", "--precision", "bf16-mixed"]
    assert main([*arguments, "--bandwidth", "tp=200", "--json"]) == 0
    communication = json.loads(capsys.readouterr().out)["communication"]
    stage = communication["stages"][1]["per_group"]
    assert stage["tp"]["payload_bytes"] == 12_884_901_888
    assert communication["bandwidth_bytes_per_second"] == {"tp": 200e9, "pp": 10e9, "dp": 10e9}
    assert communication["seconds"][1]["tp"]["seconds"] == pytest.approx(stage["tp"]["sent_bytes"] / 200e9)
    report = tmp_path / "doctor.json"
    report.write_text(json.dumps({"measurements": [
        {"dimension": "dp", "bytes": 4096, "bandwidth_gbps": 1.0},
        {"dimension": "dp", "bytes": 16 * 2**20, "bandwidth_gbps": 25.0}]}))
    assert main([*arguments, "--doctor-report", str(report)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "    1    tp     256    12,884.9   22,548.6   100.0     225.5         0.0" in lines
    assert "    1    dp       1       809.8      809.8    25.0      32.4         0.0" in lines
    assert main([*arguments, "--bandwidth", "tx=3"]) == 2
    assert "--bandwidth 'tx=3': write GROUP=GB/s" in capsys.readouterr().err


def test_the_fsdp_gather_trade_off_is_in_both_ledgers_and_refused_where_it_breaks_gradients():
    """Kept gathered (default under pp): the stage's parameters whole, 1 all-gather per unit and step;
    resharded after forward: 2 layers' worth, m + 1 all-gathers."""
    from lightning_tp3d import TP3DStrategy
    from lightning_tp3d.plan.ledger import training_ledger
    from lightning_tp3d.plan.sharding import layer_parameters_per_rank

    for reshard, gathered, gathers in ((None, 202_440_704 * 4, 1),
                                       (True, 2 * layer_parameters_per_rank(SEVEN_B, 8) * 4, 8 + 1)):
        options = TrainingOptions(seq_len=4096, data_parallel_mode="fsdp", fsdp_reshard_after_forward=reshard)
        assert training_ledger(SEVEN_B, LAYOUT, options).stages[1].gathered_weight_bytes == gathered
        counts = {transfer.count for transfer in communication_ledger(SEVEN_B, LAYOUT, options).stages[1]
                  if transfer.operation == "all_gather"}
        assert counts == {gathers}
    with pytest.raises(ValueError, match=r"fsdp_reshard_after_forward=True cannot run pipeline_schedule='zbv_zero_bu"):
        TP3DStrategy(pipeline_parallel_size=2, pipeline_schedule="zbv_zero_bubble", data_parallel_mode="fsdp",
                     fsdp_reshard_after_forward=True)


def test_replicate_without_pipelining_reduces_in_buckets_during_backward():
    """tp 8, dp 8: the rank's 958M gradients (fp32) go in buckets of <= 25 MiB (a larger parameter, like the
    vocab-parallel embedding, fills one alone); all but the last launched can hide behind backward."""
    from lightning_tp3d.plan.ledger import training_ledger

    layout = ParallelLayout(tensor_parallel_size=8, data_parallel_size=8)
    options = TrainingOptions(seq_len=4096)
    buckets = [transfer for transfer in communication_ledger(SEVEN_B, layout, options).stages[0]
               if transfer.group == "dp"]
    assert sum(bucket.elements for bucket in buckets) == training_ledger(SEVEN_B, layout, options).stages[0].parameters
    assert len(buckets) > 30 and [bucket.hideable for bucket in buckets] == [True] * (len(buckets) - 1) + [False]
    after_backward = communication_ledger(SEVEN_B, layout, TrainingOptions(seq_len=4096,
                                                                           overlap_gradient_reduction=False))
    assert [transfer.count for transfer in after_backward.stages[0] if transfer.group == "dp"] == [1]


def test_zero1_sends_what_replicate_sends_as_reduce_scatters_and_all_gathers():
    """tp 8, dp 8, pp 1: the rank's gradients reduce-scattered and its parts all-gathered, bucket by bucket;
    the bytes on the wire equal the all-reduce's (the parts tile every parameter: d S = P, no padding here)."""
    from lightning_tp3d.plan.ledger import training_ledger

    layout = ParallelLayout(tensor_parallel_size=8, data_parallel_size=8)
    replicate = communication_ledger(SEVEN_B, layout, TrainingOptions(seq_len=4096))
    zero1 = communication_ledger(SEVEN_B, layout, TrainingOptions(seq_len=4096, data_parallel_mode="zero1"))
    transfers = [transfer for transfer in zero1.stages[0] if transfer.group == "dp"]
    scatters = [transfer for transfer in transfers if transfer.operation == "reduce_scatter"]
    gathers = [transfer for transfer in transfers if transfer.operation == "all_gather"]
    assert len(scatters) == len(gathers) == len(transfers) // 2 > 1
    assert [gather.elements * 8 for gather in gathers] == [scatter.elements for scatter in scatters]
    assert sum(scatter.elements for scatter in scatters) == training_ledger(SEVEN_B, layout,
                                                                            TrainingOptions()).stages[0].parameters
    assert zero1.totals(0)["dp"]["sent_bytes"] == pytest.approx(replicate.totals(0)["dp"]["sent_bytes"], rel=1e-12)
    assert not any(transfer.hideable for transfer in transfers)
    gloo = communication_ledger(SEVEN_B, layout, TrainingOptions(seq_len=4096, data_parallel_mode="zero1"),
                                backend="gloo")
    assert {transfer.operation for transfer in gloo.stages[0] if transfer.group == "dp"} == {"all_reduce", "all_gather"}
