"""DeepSeek-V3 from `transformers` (`models.deepseek`): multi-head latent attention and mixture-of-experts
blocks (a dense first block, then MoE blocks of 4 routed experts, 2 per token, and a shared expert) through
tp, pp and dp.

The module is what a Lightning project holds (`self.model = DeepseekV3ForCausalLM(config)`, the loss
`self.model(input_ids=..., labels=input_ids).loss`). Each run is compared with the same module trained by a
plain single-process loop on the same samples: the losses of 5 steps and every gradient each rank holds
after step 1, per tensor (rtol 1e-5, atol 1e-7, fp32: tp reorders the heads' and the MLP's partial sums,
~1e-7 relative; a gradient summed over the wrong ranks, as the shared rotary key's was before
`SharedAcrossHeads`, is off by 1e-3 and more). The (2, 2, 1) run also exports its weights, which
transformers loads with the live model's logits, and saves a checkpoint that resumes exactly at (1, 2, 2).

Expert parallelism (`expert_parallel_size=2`, `parallel.experts`) runs the same comparison at (2, 1, 2),
(1, 2, 2) 1F1B, (1, 1, 4) (two replicas of each expert group), in a world of 2 at (1, 1, 2), in a world of
8 at (2, 2, 2) 1F1B, at (1, 2, 2) under each other pipeline schedule (GPipe, interleaved 1F1B, looped BFS,
interleaved zero bubble, ZBV, DualPipeV, across the three data-parallel modes), with full recompute
(E = 1 and E = 2: the experts' forward all-to-alls replayed in the backward, counted) and selective, and
with FSDP2 at (1, 2, 2) 1F1B (one replica: the experts outside the units) and (1, 1, 4) (each expert
group's experts sharded over its two replicas), and with ZeRO-1 at (1, 1, 4); its (1, 2, 2) checkpoint
resumes exactly without it at (2, 1, 2) and exports whole experts, the (1, 1, 4) FSDP2 one with the
experts over 4 ranks, the (1, 1, 4) ZeRO-1 one at (1, 2, 2) with FSDP2; a Fabric loop at (1, 2, 2)
1F1B with E = 2 equals one process as the Trainer does; one step's
all-to-all payloads equal the ledger's (`plan.moe`) at two layouts, and at every layout above each rank's
collectives and sends over tp, pp, dp and edp equal `plan.moe_communication`'s call by call (over ep in
calls); and the experts module alone, with every token routed to one rank's experts, equals transformers'
(outputs and gradients).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader

from lightning_tp3d import TP3DFabricStrategy, TP3DStrategy
from lightning_tp3d.callbacks import ConsistencyCheck
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.diagnostics.traffic import TrafficRecorder
from lightning_tp3d.io.checkpoint_format import load_model_tensors
from lightning_tp3d.io.export import export_checkpoint
from lightning_tp3d.models.deepseek import DeepseekV3Adapter, deepseek_v3_tp_plan
from lightning_tp3d.models.families import resolve_model_adapter
from lightning_tp3d.parallel.experts import is_expert_parameter
from lightning_tp3d.parallel.tensor import SharedAcrossHeads, local_part
from lightning_tp3d.plan.layout import ParallelLayout
from lightning_tp3d.plan.ledger import TrainingOptions
from lightning_tp3d.plan.moe import MoEModelConfig, expert_ledger
from lightning_tp3d.plan.moe_communication import moe_communication_ledger
from tests.distributed import released_process_groups, results_by_name
from tests.helpers import (
    BF16_MIXED_GRADIENT_TOLERANCE,
    LEARNING_RATE,
    SEQ_LEN,
    CaptureGradients,
    MemoryLogger,
    assert_bf16_mixed_gradients,
    assert_ranks_match,
    named_full,
    reference_run,
    trainer_kwargs,
    world_size,
)

transformers = pytest.importorskip("transformers")

RTOL, ATOL = 1e-5, 1e-7
STEPS = 5
GLOBAL_BATCH = 8
SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
             num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=16,
             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64,
             tie_word_embeddings=False)


def deepseek_network() -> nn.Module:
    """A tiny DeepSeek-V3, identical on every rank (seeded), attention by SDPA."""
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SHAPE, attn_implementation="sdpa"))


class DeepseekModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = deepseek_network()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.0)


class RecordStepTraffic(Callback):
    """What this rank hands to the collectives and sends of every group during the second step: the mesh's
    tp, pp and dp, and with expert parallelism the expert mesh's ep and edp."""

    def __init__(self) -> None:
        self.recorder: TrafficRecorder | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
                             ) -> None:
        if batch_idx == 1:
            experts = [parameter.device_mesh for parameter in pl_module.parameters() if is_expert_parameter(parameter)]
            self.recorder = TrafficRecorder(trainer.strategy.device_mesh, *experts[:1]).__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if batch_idx == 1:
            self.recorder.__exit__(None, None, None)

    def transfers(self) -> dict[tuple[str, str, int, int], int]:
        return dict(self.recorder.transfers) if self.recorder is not None else {}


def _loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, labels=input_ids).loss


RUNS = {
    "tp2-pp1-dp2-replicate": dict(tp=2, pp=1, mode="replicate"),
    "tp2-pp2-dp1-1f1b-replicate": dict(tp=2, pp=2, mode="replicate", export=True, save=True),
    "tp1-pp2-dp2-1f1b-fsdp": dict(tp=1, pp=2, mode="fsdp"),
    "tp2-pp1-dp2-zero1": dict(tp=2, pp=1, mode="zero1"),
    "tp2-pp1-dp2-ep2-replicate": dict(tp=2, pp=1, mode="replicate", experts=2),
    "tp1-pp2-dp2-ep2-1f1b-replicate": dict(tp=1, pp=2, mode="replicate", experts=2, save=True),
    "tp1-pp1-dp4-ep2-replicate": dict(tp=1, pp=1, mode="replicate", experts=2),
    "tp2-pp2-dp2-ep2-1f1b-replicate": dict(tp=2, pp=2, mode="replicate", experts=2, world=8),
    "tp1-pp2-dp2-ep2-1f1b-fsdp": dict(tp=1, pp=2, mode="fsdp", experts=2),
    "tp1-pp1-dp4-ep2-fsdp": dict(tp=1, pp=1, mode="fsdp", experts=2, save=True),
    "tp1-pp1-dp4-ep2-zero1": dict(tp=1, pp=1, mode="zero1", experts=2, save=True),
    "tp1-pp1-dp2-ep2-replicate": dict(tp=1, pp=1, mode="replicate", experts=2, world=2),
    # every other pipeline schedule with the experts split, each in one data-parallel mode
    "tp1-pp2-dp2-ep2-gpipe-replicate": dict(tp=1, pp=2, mode="replicate", experts=2, schedule="gpipe"),
    "tp1-pp2-dp2-ep2-interleaved_1f1b-fsdp": dict(tp=1, pp=2, mode="fsdp", experts=2, schedule="interleaved_1f1b"),
    "tp1-pp2-dp2-ep2-looped_bfs-zero1": dict(tp=1, pp=2, mode="zero1", experts=2, schedule="looped_bfs"),
    "tp1-pp2-dp2-ep2-interleaved_zero_bubble-replicate": dict(tp=1, pp=2, mode="replicate", experts=2,
                                                              schedule="interleaved_zero_bubble"),
    "tp1-pp2-dp2-ep2-zbv_zero_bubble-fsdp": dict(tp=1, pp=2, mode="fsdp", experts=2, schedule="zbv_zero_bubble"),
    "tp1-pp2-dp2-ep2-dualpipev-zero1": dict(tp=1, pp=2, mode="zero1", experts=2, schedule="dualpipev",
                                            microbatches=4),
    # recompute: transformers' experts (E = 1) and the split ones replayed with their all-to-alls (E = 2)
    "tp2-pp1-dp2-fsdp-full-recompute": dict(tp=2, pp=1, mode="fsdp", recompute="full"),
    "tp2-pp1-dp2-ep2-replicate-full-recompute": dict(tp=2, pp=1, mode="replicate", experts=2, recompute="full"),
    "tp1-pp2-dp2-ep2-1f1b-fsdp-selective-recompute": dict(tp=1, pp=2, mode="fsdp", experts=2, recompute="selective"),
}
EXPERT_RUNS = [name for name, run in RUNS.items() if run.get("experts", 1) > 1]
# bf16-mixed with the experts split, against the one-process bf16 autocast run (`BF16_MIXED_GRADIENT_TOLERANCE`):
# the experts compute as the model's own do (transformers' default grouped_mm experts in the fp32 of the master
# weights, outside autocast; computing them in bf16 instead moves the MoE blocks' gradients by 6-9 %). Without
# pipelining (its micro-batches round DeepSeek's latent projections' gradients by 5e-3, one process's bf16 to
# the bound, with or without experts split). Not under tp (there each rank's row-parallel partial
# sums are rounded to bf16 before the all-reduce: another rounding pattern, see tests/models/test_lora.py).
BF16_RUNS = {"tp1-pp1-dp4-ep2-replicate-bf16-mixed": dict(tp=1, pp=1, mode="replicate", experts=2,
                                                          precision="bf16-mixed")}
# The (2, 2, 1) run saves after STEPS steps and resumes at (1, 2, 2) with FSDP2 for RESUMED_STEPS more; the
# (1, 2, 2) run with its experts over 2 ranks resumes at (2, 1, 2) without expert parallelism, and the
# (1, 1, 4) FSDP2 run with its experts over 2 ranks (each rank 1 of 4) resumes with them over 4, the
# (1, 1, 4) ZeRO-1 one (the experts' optimizer state in parts over their replicas) at (1, 2, 2) with FSDP2.
RESUMED_STEPS = 3
RESUME = {"resume": dict(tp=1, pp=2, mode="fsdp", resume="tp2-pp2-dp1-1f1b-replicate"),
          "resume-experts": dict(tp=2, pp=1, mode="replicate", resume="tp1-pp2-dp2-ep2-1f1b-replicate"),
          "resume-experts-4": dict(tp=1, pp=1, mode="replicate", experts=4, resume="tp1-pp1-dp4-ep2-fsdp"),
          "resume-experts-zero1": dict(tp=1, pp=2, mode="fsdp", experts=2, resume="tp1-pp1-dp4-ep2-zero1")}


@released_process_groups()
def _fit(directory: Path, name: str, tp: int, pp: int, mode: str, export: bool = False, save: bool = False,
         resume: str | None = None, experts: int = 1, world: int = 4, schedule: str = "1f1b",
         microbatches: int = 2, recompute: str = "none", precision: str = "32-true") -> dict[str, Any]:
    dp = world_size() // (tp * pp)
    logger, capture = MemoryLogger(), CaptureGradients()
    consistency = ConsistencyCheck(directory / f"{name}-export") if export else None
    strategy = TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, num_microbatches=microbatches,
                            data_parallel_mode=mode, expert_parallel_size=experts, pipeline_schedule=schedule,
                            recompute=recompute, recompute_target="self_attn")
    traffic = RecordStepTraffic()
    callbacks = [capture, traffic] + ([consistency] if export else [])
    if save:  # inside fit, at the last step
        callbacks.append(ModelCheckpoint(dirpath=directory, filename=name, every_n_train_steps=STEPS))
    trainer = L.Trainer(**trainer_kwargs(devices=world_size(), strategy=strategy, logger=logger, callbacks=callbacks,
                                         enable_checkpointing=save, precision=precision,
                                         max_steps=STEPS + RESUMED_STEPS if resume else STEPS))
    trainer.fit(DeepseekModule(), TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp,
                                                  val_fraction=0.2),
                ckpt_path=str(directory / f"{resume}.ckpt") if resume else None)
    report = consistency.report.to_dict() if consistency is not None and consistency.report is not None else None
    held = {key: tuple(local_part(parameter).shape) for key, parameter in trainer.lightning_module.named_parameters()
            if key.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    return {"losses": logger.values("train_loss"), "first_grads": capture.first_grads, "consistency": report,
            "experts_held": held, "traffic": traffic.transfers()}


FABRIC_RUN = "fabric-tp1-pp2-dp2-ep2-1f1b-replicate"


@released_process_groups()
def _fabric_fit(tp: int, pp: int, experts: int) -> dict[str, Any]:
    """The module's model and optimizer in a Fabric loop (`TP3DFabricStrategy(expert_parallel_size=...)`):
    the loss is the model's own, the logged loss its mean over the dp ranks."""
    dp = world_size() // (tp * pp)
    strategy = TP3DFabricStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, num_microbatches=2,
                                  expert_parallel_size=experts)
    fabric = L.Fabric(accelerator="cpu", devices=world_size(), strategy=strategy)
    fabric.launch()
    model = fabric.setup(deepseek_network())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95),
                                                          weight_decay=0.0))
    data = TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp, val_fraction=0.2)
    data.setup()
    loader = fabric.setup_dataloaders(DataLoader(data.train_dataset, batch_size=GLOBAL_BATCH // dp, shuffle=True))
    losses, first_grads = [], None
    for _, batch in zip(range(STEPS), loader):
        loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        fabric.backward(loss)
        first_grads = first_grads or named_full(model, "grad", prefix="_forward_module.")
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach()).item())
    return {"losses": losses, "first_grads": first_grads}


def run_world(size: int, directory: str) -> dict[str, Any]:
    """The runs of this world size (4; 2 for the (1, 1, 2) one, 8 for the (2, 2, 2) one); at 4 also the Fabric
    loop with expert parallelism and the skewed routing check."""
    results = {name: _fit(Path(directory), name, **configuration)
               for name, configuration in (RUNS | RESUME | BF16_RUNS).items() if configuration.get("world", 4) == size}
    if size != 4:
        return results
    return results | {FABRIC_RUN: _fabric_fit(tp=1, pp=2, experts=2), "skewed-routing": _skewed_routing()}


@released_process_groups()
def _skewed_routing() -> dict[str, Any]:
    """`ExpertParallelExperts` over a (2, 2) ("edp", "ep") mesh against transformers' experts module when
    every token of every rank chooses experts 0 and 1, both on ep rank 0: rank 1 of each ep group receives
    no rows, yet takes part in every all-to-all of the forward and the backward (no hang). Returns the
    outputs, the input gradients and this rank's experts' gradients beside their references (the experts'
    reference gradient is summed over the ep group's tokens, as the all-to-all's backward sums them)."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_tp3d.parallel.experts import ExpertParallelExperts

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    torch.manual_seed(0)
    reference = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Experts(
        transformers.DeepseekV3Config(**SHAPE))
    for parameter in reference.parameters():
        nn.init.normal_(parameter, std=0.1)
    split = ExpertParallelExperts(reference, mesh)
    group_ranks = [mesh.mesh[mesh.get_local_rank("edp"), ep].item() for ep in range(2)]

    def tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(10 + rank)
        hidden = torch.randn(6, SHAPE["hidden_size"], generator=generator)
        return hidden, torch.tensor([[0, 1], [1, 0]] * 3), torch.rand(6, 2, generator=generator)

    hidden, index, weights = tokens(torch.distributed.get_rank())
    hidden.requires_grad_(True)
    output = split(hidden, index, weights)
    output.sum().backward()
    inputs = [tokens(rank) for rank in group_ranks]
    whole = torch.cat([item[0] for item in inputs]).requires_grad_(True)
    expected = reference(whole, torch.cat([item[1] for item in inputs]), torch.cat([item[2] for item in inputs]))
    expected.sum().backward()
    mine = slice(6 * group_ranks.index(torch.distributed.get_rank()), None)
    held = slice(split.first_local, split.first_local + split.num_local)
    return {"output": (output.detach(), expected[mine][:6].detach()),
            "input_grad": (hidden.grad, whole.grad[mine][:6]),
            "gate_up_grad": (split.gate_up_proj.grad.to_local(), reference.gate_up_proj.grad[held]),
            "down_grad": (split.down_proj.grad.to_local(), reference.down_proj.grad[held])}


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("deepseek")


@pytest.fixture(scope="module")
def world_results(directory) -> dict[str, list[dict[str, Any]]]:
    return results_by_name([2, 4, 8], "tests.models.test_deepseek:run_world", str(directory))


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(RUNS))
def test_deepseek_v3_matches_single_process_at_every_layout(world_results, name):
    reference = reference_run(STEPS, GLOBAL_BATCH, build_network=deepseek_network, loss_of=_loss)
    covered = assert_ranks_match(name, world_results[name], reference, RTOL, ATOL)
    assert covered == reference["first_grads"].keys(), f"{name}: the ranks' stages do not cover the model"
    assert reference["losses"][-1] < reference["losses"][0], "the reference itself must learn"


@pytest.mark.distributed
def test_a_fabric_loop_with_expert_parallelism_matches_single_process(world_results):
    """Fabric at (1, 2, 2) 1F1B with the experts over 2 ranks: 5 steps' losses and every gradient of the
    first, on every rank, equal one process's (the strategy core is the Trainer's; this is its Fabric path)."""
    reference = reference_run(STEPS, GLOBAL_BATCH, build_network=deepseek_network, loss_of=_loss)
    covered = assert_ranks_match(FABRIC_RUN, world_results[FABRIC_RUN], reference, RTOL, ATOL)
    assert covered == reference["first_grads"].keys()


@pytest.mark.distributed
def test_the_export_loads_in_transformers_with_the_live_logits(world_results, directory):
    """ConsistencyCheck on rank 0 of the (2, 2, 1) run: the live model against its export loaded by
    transformers (fp32, 1e-5), every block compared; the export is a DeepseekV3ForCausalLM with the model's
    own names and shapes (experts fused as transformers holds them)."""
    name = "tp2-pp2-dp1-1f1b-replicate"
    report = world_results[name][0]["consistency"]
    assert report["max_abs_diff"] <= 1e-5 and report["passed"], report
    assert len(report["layer_max_abs_diff"]) == SHAPE["num_hidden_layers"]
    export = directory / f"{name}-export"
    assert json.loads((export / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    exported = transformers.AutoModelForCausalLM.from_pretrained(export)
    assert {key: tuple(value.shape) for key, value in exported.named_parameters()} == {
        key: tuple(value.shape) for key, value in deepseek_network().named_parameters()}


@pytest.mark.distributed
def test_a_checkpoint_resumes_exactly_at_another_layout(world_results):
    """Saved at (2, 2, 1) after 5 steps, resumed at (1, 2, 2) with FSDP2, and saved at (1, 2, 2) with the
    experts over 2 ranks, resumed at (2, 1, 2) without expert parallelism: the next steps' losses are the
    uninterrupted single-process run's (experts, router, MLA and optimizer state resharded by DCP, the data
    position kept)."""
    reference = reference_run(STEPS + RESUMED_STEPS, GLOBAL_BATCH, build_network=deepseek_network, loss_of=_loss)
    for name in RESUME:
        for rank, rank_result in enumerate(world_results[name]):
            assert len(rank_result["losses"]) == RESUMED_STEPS
            torch.testing.assert_close(
                torch.tensor(rank_result["losses"]), torch.tensor(reference["losses"][STEPS:]), rtol=RTOL, atol=0.0,
                msg=lambda message, rank=rank, name=name: f"{name} rank {rank}: {message}")


@pytest.mark.distributed
def test_expert_parallel_runs_match_single_process_and_hold_only_their_experts(world_results):
    """Each rank of an expert-parallel run holds 2 of each MoE block's 4 experts, and under FSDP2 with two
    replicas of each expert group (1, 1, 4) 1 of them (the parity is in
    `test_deepseek_v3_matches_single_process_at_every_layout`, gradients gathered whole)."""
    for name in EXPERT_RUNS:
        run = RUNS[name]
        replicas = run.get("world", 4) // (run["tp"] * run["pp"] * run["experts"])
        expected = SHAPE["n_routed_experts"] // run["experts"] // (replicas if run["mode"] == "fsdp" else 1)
        for rank_result in world_results[name]:
            held = rank_result["experts_held"]
            assert held and all(shape[0] == expected for shape in held.values()), (name, expected, held)


@pytest.mark.distributed
def test_an_expert_parallel_checkpoint_exports_whole_experts(world_results, directory, tmp_path):
    """The checkpoint of the (1, 2, 2) run with its experts over 2 ranks exports what `save_pretrained` of
    the model with its values writes (the Hub's names: each block's 4 experts as 4 x 3 tensors, which vLLM
    reads), bitwise (deploy shards, whose split table is Llama's, refused before anything is written), and
    transformers loads it with the model's own names and shapes (the experts fused again), every tensor the
    checkpoint's own. (That the checkpoint holds the trained values is
    `test_a_checkpoint_resumes_exactly_at_another_layout`.)"""
    checkpoint, exported = directory / "tp1-pp2-dp2-ep2-1f1b-replicate.ckpt", tmp_path / "export"
    with pytest.raises(ValueError, match=r"deploy shards follow Llama's split table, not deepseek_v3's.*"
                                         r"--enable-expert-parallel"):
        export_checkpoint(checkpoint, exported, deploy_tp=2)
    assert not exported.exists()  # refused before anything is written
    export_checkpoint(checkpoint, exported)
    saved = load_model_tensors(checkpoint)
    network = deepseek_network()
    network.load_state_dict({name.removeprefix("model."): value for name, value in saved.items()})
    network.save_pretrained(tmp_path / "save_pretrained")
    written, expected = (load_file(folder / "model.safetensors") for folder in (exported, tmp_path / "save_pretrained"))
    assert written.keys() == expected.keys() and "model.layers.1.mlp.experts.3.gate_proj.weight" in written
    assert all(torch.equal(written[name], expected[name]) for name in expected)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(exported).state_dict()
    assert {name: tuple(value.shape) for name, value in loaded.items()} == {
        name: tuple(value.shape) for name, value in deepseek_network().state_dict().items()}
    for name, value in loaded.items():
        assert torch.equal(value, saved[f"model.{name}"]), name


@pytest.mark.parametrize("name", ["tp1-pp1-dp4-ep2-replicate", "tp2-pp1-dp2-ep2-replicate"])
@pytest.mark.distributed
def test_the_all_to_all_traffic_is_the_ledgers(world_results, name):
    """One step's all-to-alls over "ep" against `MoEModelConfig.expert_exchange` at two layouts, exactly:
    per MoE block on every rank one exchange of the 4 expert counts (int64) and two of its T K h choices
    (the dispatch, the combine's backward); the rest, what the routing sent each rank (twice: the combine,
    the dispatch's backward), sums to E T K h per block over each ep group; and the step's calls and bytes
    equal `expert_ledger`'s (`tp3d plan`), per rank and summed over each group."""
    run = RUNS[name]
    tp, experts = run["tp"], run["experts"]
    dp = len(world_results[name]) // tp
    config = MoEModelConfig.from_dict(SHAPE)
    exchange = config.expert_exchange(tokens=GLOBAL_BATCH // dp * SEQ_LEN, expert_parallel_size=experts)
    blocks = config.moe_layers
    returned: dict[tuple[int, int], int] = {}
    step_bytes: dict[tuple[int, int], int] = {}
    for rank, result in enumerate(world_results[name]):
        ep_traffic = {key: calls for key, calls in result["traffic"].items() if key[0] == "ep"}
        assert ep_traffic.pop(("ep", "all_to_all", exchange.counts, 8), 0) == blocks, (rank, ep_traffic)
        float_payloads = [(elements, calls) for (_, _, elements, size), calls in ep_traffic.items() if size == 4]
        assert len(ep_traffic) == len(float_payloads) and float_payloads, (rank, ep_traffic)
        assert dict(float_payloads).get(exchange.dispatch, 0) >= 2 * blocks, (rank, float_payloads)
        group = (rank % tp, rank // tp // experts)  # (tp, edp): the ranks of one ep group
        total = sum(elements * calls for elements, calls in float_payloads)
        returned[group] = returned.get(group, 0) + total - 2 * blocks * exchange.dispatch
        step_bytes[group] = step_bytes.get(group, 0) + 8 * blocks * exchange.counts + 4 * total
    assert set(returned.values()) == {2 * blocks * exchange.returned_in_group}, returned
    # the step's ledger (`tp3d plan`'s "ep" rows): 5 calls per block on every rank, and its uniform-routing
    # payload times E is each group's measured sum, exactly (the routing only moves rows within a group)
    layout = ParallelLayout(tensor_parallel_size=tp, data_parallel_size=dp, micro_batch_size=GLOBAL_BATCH // dp,
                            expert_parallel_size=experts)
    ledger = expert_ledger(config, layout, SEQ_LEN, "32-true").totals(0)["ep"]
    assert ledger["calls"] == 5 * blocks
    assert all(_expert_calls(result) == ledger["calls"] for result in world_results[name])
    assert set(step_bytes.values()) == {experts * ledger["payload_bytes"]}, (step_bytes, ledger)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(RUNS))
def test_every_groups_traffic_is_the_moe_communication_ledgers(world_results, name):
    """One step's collectives and sends of every rank, per group, against `plan.moe_communication`
    (`tp3d plan` and the layout advisor for MoE models): over tp, pp, dp and edp each (operation, payload,
    dtype) with exactly the ledger's calls; over ep the ledger's calls (the payloads follow the routing,
    `test_the_all_to_all_traffic_is_the_ledgers`)."""
    run = RUNS[name]
    tp, pp, experts = run["tp"], run["pp"], run.get("experts", 1)
    dp = len(world_results[name]) // (tp * pp)
    m = run.get("microbatches", 2) if pp > 1 else 1
    layout = ParallelLayout(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                            micro_batch_size=GLOBAL_BATCH // dp // m, num_microbatches=m, expert_parallel_size=experts)
    options = TrainingOptions(seq_len=SEQ_LEN, precision="32-true", data_parallel_mode=run["mode"],
                              schedule=run.get("schedule", "1f1b"), recompute=run.get("recompute", "none"))
    ledger = moe_communication_ledger(MoEModelConfig.from_dict(SHAPE), layout, options, backend="gloo")
    for rank, result in enumerate(world_results[name]):
        stage = rank // (tp * dp)
        measured = {key: calls for key, calls in result["traffic"].items() if key[0] != "ep"}
        predicted = {key: calls for key, calls in ledger.calls_by_transfer(stage).items() if key[0] != "ep"}
        assert measured == predicted, (rank, measured, predicted)
        assert _expert_calls(result) == ledger.totals(stage).get("ep", {"calls": 0})["calls"], rank


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(BF16_RUNS))
def test_expert_parallel_in_bf16_mixed_matches_the_single_process_bf16_run(world_results, name):
    """Every gradient of the first step within `BF16_MIXED_GRADIENT_TOLERANCE` of the one-process bf16
    autocast run's, a bound the fp32 run's gradients exceed (asserted: the run did train in bf16)."""
    gradients = {key: value for rank_result in world_results[name] for key, value in rank_result["first_grads"].items()}
    assert_bf16_mixed_gradients(gradients, GLOBAL_BATCH, deepseek_network, _loss, BF16_MIXED_GRADIENT_TOLERANCE)


def _expert_calls(result: dict[str, Any]) -> int:
    return sum(calls for key, calls in result["traffic"].items() if key[0] == "ep")


@pytest.mark.distributed
def test_full_recompute_replays_the_experts_forward_all_to_alls(world_results):
    """Full recompute runs each MoE block's forward again in the backward, its three forward all-to-alls
    (counts, dispatch, combine) with it: 8 per block and step instead of 5 on every rank (the parity is in
    `test_deepseek_v3_matches_single_process_at_every_layout`); selective recompute (the attention) leaves
    the experts' exchanges as they are, rank by rank."""
    blocks = MoEModelConfig.from_dict(SHAPE).moe_layers
    assert [_expert_calls(result) for result in world_results["tp2-pp1-dp2-ep2-replicate-full-recompute"]] == [
        8 * blocks] * 4
    assert [_expert_calls(result) for result in world_results["tp1-pp2-dp2-ep2-1f1b-fsdp-selective-recompute"]] == [
        _expert_calls(result) for result in world_results["tp1-pp2-dp2-ep2-1f1b-fsdp"]]


@pytest.mark.distributed
def test_expert_parallel_with_every_token_on_one_rank(world_results):
    for rank, result in enumerate(world_results["skewed-routing"]):
        for key, (found, expected) in result.items():
            torch.testing.assert_close(found, expected, rtol=RTOL, atol=ATOL,
                                       msg=lambda message, rank=rank, key=key: f"rank {rank} {key}: {message}")


def test_the_adapter_reads_the_plan_from_the_config():
    """Chosen for DeepseekV3ForCausalLM; per block a dense MLP or shared experts, the shared rotary key's
    columns from the config; without a query latent, `q_proj` is the column-parallel query."""
    network = deepseek_network()
    adapter = resolve_model_adapter(network)
    assert isinstance(adapter, DeepseekV3Adapter) and adapter.name == "Hugging Face DeepSeek-V3"
    plan = adapter.tp_plan()
    assert "model.layers.0.mlp.gate_proj" in plan and "model.layers.0.mlp.shared_experts.gate_proj" not in plan
    assert "model.layers.3.mlp.shared_experts.down_proj" in plan and "model.layers.3.mlp.gate_proj" not in plan
    assert plan["model.layers.*.self_attn.kv_a_proj_with_mqa"].columns == SHAPE["qk_rope_head_dim"]
    assert not any("experts.gate_up_proj" in pattern or "mlp.gate" == pattern[-8:] for pattern in plan)
    without_latent = deepseek_v3_tp_plan(8, 2, 1, query_latent=False)
    assert "model.layers.*.self_attn.q_proj" in without_latent
    assert isinstance(without_latent["model.layers.*.self_attn.kv_a_proj_with_mqa"], SharedAcrossHeads)


@pytest.mark.parametrize(("features", "named"), [(dict(compiled=True), "compile"),
                                                  (dict(float8="tensorwise"), "float8")])
def test_features_not_yet_tested_with_mla_and_moe_are_refused(features, named):
    with pytest.raises(ValueError, match=f"{named}.*DeepSeek-V3.*not supported yet; train it with compile=None"):
        DeepseekV3Adapter.for_network(deepseek_network()).check_features(**features)
    DeepseekV3Adapter().check_features(recompute="full", peft=True)  # the defaults, recompute and PEFT pass


def test_the_adapter_named_as_the_option_is_built_for_the_network():
    """`model_adapter=DeepseekV3Adapter` (the class, or its import path) reads the network's config as the
    automatic choice does, not DeepSeek-V3's 61-block defaults."""
    network = deepseek_network()
    for given in (DeepseekV3Adapter, "lightning_tp3d.models.deepseek:DeepseekV3Adapter"):
        assert resolve_model_adapter(network, given) == resolve_model_adapter(network)
    assert resolve_model_adapter(network).num_layers == SHAPE["num_hidden_layers"]
