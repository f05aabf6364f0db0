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
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_tp3d import TP3DStrategy
from lightning_tp3d.callbacks import ConsistencyCheck
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models.deepseek import DeepseekV3Adapter, deepseek_v3_tp_plan
from lightning_tp3d.models.families import resolve_model_adapter
from lightning_tp3d.parallel.tensor import SharedAcrossHeads
from tests.distributed import results_by_name
from tests.helpers import (
    LEARNING_RATE,
    SEQ_LEN,
    CaptureGradients,
    MemoryLogger,
    assert_ranks_match,
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


def _loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, labels=input_ids).loss


RUNS = {
    "tp2-pp1-dp2-replicate": dict(tp=2, pp=1, mode="replicate"),
    "tp2-pp2-dp1-1f1b-replicate": dict(tp=2, pp=2, mode="replicate", export=True, save=True),
    "tp1-pp2-dp2-1f1b-fsdp": dict(tp=1, pp=2, mode="fsdp"),
    "tp2-pp1-dp2-zero1": dict(tp=2, pp=1, mode="zero1"),
}
# The (2, 2, 1) run saves after STEPS steps; this run resumes it at (1, 2, 2) with FSDP2 for RESUMED_STEPS more.
RESUMED_STEPS = 3
RESUME = {"resume": dict(tp=1, pp=2, mode="fsdp", resume=True)}


def _fit(directory: Path, name: str, tp: int, pp: int, mode: str, export: bool = False, save: bool = False,
         resume: bool = False) -> dict[str, Any]:
    dp = world_size() // (tp * pp)
    logger, capture = MemoryLogger(), CaptureGradients()
    consistency = ConsistencyCheck(directory / f"{name}-export") if export else None
    strategy = TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, num_microbatches=2,
                            data_parallel_mode=mode)
    callbacks = [capture] + ([consistency] if export else [])
    if save:  # inside fit, at the last step
        callbacks.append(ModelCheckpoint(dirpath=directory, filename="deepseek", every_n_train_steps=STEPS))
    trainer = L.Trainer(**trainer_kwargs(devices=world_size(), strategy=strategy, logger=logger, callbacks=callbacks,
                                         enable_checkpointing=save,
                                         max_steps=STEPS + RESUMED_STEPS if resume else STEPS))
    trainer.fit(DeepseekModule(), TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp,
                                                  val_fraction=0.2),
                ckpt_path=str(directory / "deepseek.ckpt") if resume else None)
    report = consistency.report.to_dict() if consistency is not None and consistency.report is not None else None
    return {"losses": logger.values("train_loss"), "first_grads": capture.first_grads, "consistency": report}


def run_world(directory: str) -> dict[str, Any]:
    return {name: _fit(Path(directory), name, **configuration) for name, configuration in (RUNS | RESUME).items()}


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("deepseek")


@pytest.fixture(scope="module")
def world_results(directory) -> dict[str, list[dict[str, Any]]]:
    return results_by_name([4], "tests.models.test_deepseek:run_world", str(directory), with_world=False)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(RUNS))
def test_deepseek_v3_matches_single_process_at_every_layout(world_results, name):
    reference = reference_run(STEPS, GLOBAL_BATCH, build_network=deepseek_network, loss_of=_loss)
    covered = assert_ranks_match(name, world_results[name], reference, RTOL, ATOL)
    assert covered == reference["first_grads"].keys(), f"{name}: the ranks' stages do not cover the model"
    assert reference["losses"][-1] < reference["losses"][0], "the reference itself must learn"


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
    """Saved at (2, 2, 1) after 5 steps, resumed at (1, 2, 2) with FSDP2: the next steps' losses are the
    uninterrupted single-process run's (experts, router, MLA and optimizer state resharded by DCP, the data
    position kept)."""
    reference = reference_run(STEPS + RESUMED_STEPS, GLOBAL_BATCH, build_network=deepseek_network, loss_of=_loss)
    for rank, rank_result in enumerate(world_results["resume"]):
        assert len(rank_result["losses"]) == RESUMED_STEPS
        torch.testing.assert_close(torch.tensor(rank_result["losses"]), torch.tensor(reference["losses"][STEPS:]),
                                   rtol=RTOL, atol=0.0, msg=lambda message, rank=rank: f"rank {rank}: {message}")


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


@pytest.mark.parametrize(("features", "named"), [(dict(recompute="full"), "recompute"),
                                                  (dict(compiled=True), "compile"),
                                                  (dict(float8="tensorwise"), "float8"), (dict(peft=True), "PEFT")])
def test_features_not_yet_tested_with_mla_and_moe_are_refused(features, named):
    with pytest.raises(ValueError, match=f"{named}.*DeepSeek-V3.*not supported yet; train it with recompute='none'"):
        DeepseekV3Adapter.for_network(deepseek_network()).check_features(**features)
    DeepseekV3Adapter().check_features()  # the defaults pass


def test_the_adapter_named_as_the_option_is_built_for_the_network():
    """`model_adapter=DeepseekV3Adapter` (the class, or its import path) reads the network's config as the
    automatic choice does, not DeepSeek-V3's 61-block defaults."""
    network = deepseek_network()
    for given in (DeepseekV3Adapter, "lightning_tp3d.models.deepseek:DeepseekV3Adapter"):
        assert resolve_model_adapter(network, given) == resolve_model_adapter(network)
    assert resolve_model_adapter(network).num_layers == SHAPE["num_hidden_layers"]
