"""The communication ledger of a DeepSeek mixture-of-experts model (`plan.moe_communication`) by hand for
DeepSeek-V2-Lite (h 2048, no query latent, kv latent 512, rotary 64, 27 blocks of which 1 dense, 64 routed
experts of 1408); measured call by call on every rank of 21 layouts in tests/models/test_deepseek.py."""

from __future__ import annotations

import math

from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.ledger import TrainingOptions
from lightning_tp3d.plan.moe import MOE_PRESETS, expert_ledger, expert_model_memory
from lightning_tp3d.plan.moe_communication import moe_communication_ledger

LITE = MOE_PRESETS["deepseek-v2-lite"]
EXPERT = 3 * 2048 * 1408  # one routed expert's parameters


def _calls(ledger, stage: int, group: str) -> dict[tuple[str, int, int], int]:
    return {(operation, elements, size): calls for (name, operation, elements, size), calls
            in ledger.calls_by_transfer(stage).items() if name == group}


def test_tensor_parallel_rows_without_pipelining():
    """(2, 1, 2) E 2, one micro-batch of 4096 tokens, bf16-mixed: per block 2 forward all-reduces of T h in
    bf16 (o, down), 2 backward of T h in fp32 (gate, up), one each of T h (q_proj's input: no query latent),
    T r_kv and T d_r; the embedding's and the head's; the logits all-gathered for the model's own loss."""
    layout = ParallelLayout(tensor_parallel_size=2, data_parallel_size=2, expert_parallel_size=2)
    ledger = moe_communication_ledger(LITE, layout, TrainingOptions(seq_len=4096, precision="bf16-mixed"))
    tokens = 4096
    assert _calls(ledger, 0, "tp") == {("all_reduce", tokens * 2048, 2): 2 * 27,
                                       ("all_reduce", tokens * 2048, 4): 2 * 27 + 1 + 27 + 1,
                                       ("all_reduce", tokens * 512, 4): 27, ("all_reduce", tokens * 64, 4): 27,
                                       ("all_gather", tokens * 102400 // 2, 2): 1}
    assert [transfer for transfer in ledger.stages[0] if transfer.group == "ep"] == expert_ledger(
        LITE, layout, 4096, "bf16-mixed").stages[0]


def test_data_parallel_rows_cover_each_ranks_parameters_once():
    """Over dp the rank's parameters but the routed experts, over edp its experts (26 blocks x 16 of them),
    whatever the mode: the replicate buckets' payloads sum to them, ZeRO-1's reduce-scatters cover them (cut
    into d segments, then gathered back), FSDP2 gathers each unit's shard, experts' over their 2 replicas."""
    layout = ParallelLayout(tensor_parallel_size=2, data_parallel_size=8, expert_parallel_size=4)
    dense = expert_model_memory(LITE, layout, "bf16-mixed", "replicate")[0].parameters
    experts = 26 * 16 * EXPERT
    rows = {}
    for mode in ("replicate", "zero1", "fsdp"):
        options = TrainingOptions(seq_len=4096, precision="bf16-mixed", data_parallel_mode=mode)
        rows[mode] = moe_communication_ledger(LITE, layout, options).stages[0]
    replicate = [transfer for transfer in rows["replicate"] if transfer.group == "dp"]
    assert sum(transfer.elements for transfer in replicate) == dense
    assert [transfer.hideable for transfer in replicate] == [True] * (len(replicate) - 1) + [False]
    assert {(transfer.group, transfer.elements) for transfer in rows["replicate"] if transfer.group == "edp"} == {
        ("edp", experts)}
    for group, total in (("dp", dense), ("edp", experts)):
        reduced = [transfer for transfer in rows["zero1"] if transfer.group == group and transfer.operation
                   == "reduce_scatter"]
        gathered = [transfer for transfer in rows["zero1"] if transfer.group == group and transfer.operation
                    == "all_gather"]
        shards = 8 if group == "dp" else 2
        assert total <= sum(transfer.elements for transfer in reduced) < total + 64 * shards
        assert [transfer.elements * shards for transfer in gathered] == [transfer.elements for transfer in reduced]
    fsdp = rows["fsdp"]
    assert sum(transfer.elements for transfer in fsdp if transfer.group == "dp"
               and transfer.operation == "all_gather") == math.ceil(dense / 8)
    expert_gathers = [transfer for transfer in fsdp if transfer.group == "edp" and transfer.operation == "all_gather"]
    assert [transfer.elements for transfer in expert_gathers] == [16 * EXPERT // 2] * 26
    assert all(transfer.count == 2 for transfer in expert_gathers)  # forward, then backward (resharded)


def test_full_recompute_replays_attention_and_the_experts_forward():
    """Per recomputed block one more tp all-reduce (o_proj) and its three forward all-to-alls over ep."""
    layout = ParallelLayout(tensor_parallel_size=2, data_parallel_size=2, expert_parallel_size=2)
    plain, full = (moe_communication_ledger(LITE, layout, TrainingOptions(seq_len=4096, recompute=recompute))
                   for recompute in ("none", "full"))
    assert full.totals(0)["tp"]["calls"] == plain.totals(0)["tp"]["calls"] + 27
    assert full.totals(0)["ep"]["calls"] == plain.totals(0)["ep"]["calls"] + 3 * 26
    selective = moe_communication_ledger(LITE, layout, TrainingOptions(seq_len=4096, recompute="selective"))
    assert selective.totals(0)["tp"]["calls"] == full.totals(0)["tp"]["calls"]
    assert selective.totals(0)["ep"] == plain.totals(0)["ep"]
