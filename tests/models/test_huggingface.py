"""Hugging Face `transformers` causal LMs, written the usual way, through every layout, pipeline included.

The module below is what a Lightning project holds (`self.model = LlamaForCausalLM(config)`, the loss
`self.model(input_ids=..., labels=input_ids).loss`); nothing in it knows about this package. Each run is
compared with the same module trained by a plain single-process PyTorch loop on the same samples: the
losses of 5 steps and every gradient each rank holds after step 1, per tensor (rtol 1e-5, atol 1e-7, fp32).
Two mixture-of-experts families run as they are (`models.moe`): Qwen3-MoE (a dense first block, then MoE
blocks of 4 routed experts, 2 per token) at (2, 1, 2) with its experts over 2 ranks, replicated (exported
and loaded by transformers with the live logits) and with FSDP2 (its per-head q / k norms' gradients summed
over tp either way), and Mixtral; both built on the meta device and filled by `pretrained=` from a folder
transformers wrote (per-expert tensors): Qwen3-MoE at (1, 1, 4) with FSDP2 and E = 2, Mixtral (whose block the
Hub names `block_sparse_moe`) at (2, 1, 2) E = 2 and at (1, 2, 2) 1F1B with FSDP2 and E = 2 (each stage reads
its own blocks' experts). With the auxiliary load-balancing loss on (`output_router_logits=True`, coefficient
0.1), Mixtral at (1, 1, 4) E = 2 and Qwen3-MoE at (2, 1, 2) FSDP2 equal one process on the whole batch
(`models.router_loss`: each rank's share of the whole batch's loss; a per-rank loss fails by far).
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
pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

RTOL, ATOL = 1e-5, 1e-7
STEPS = 5
GLOBAL_BATCH = 8
SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


EXPERTS = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[0]),
           "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}


# the auxiliary load-balancing loss, its coefficient large enough that a per-rank loss fails the comparison
ROUTER_LOSS = dict(output_router_logits=True, router_aux_loss_coef=0.1)


def hf_network(architecture: str, router_loss: bool = False) -> nn.Module:
    """A tiny `transformers` model, identical on every rank (seeded), computing attention with SDPA; with
    `router_loss` a mixture of experts adds its balancing loss (`ROUTER_LOSS`)."""
    torch.manual_seed(0)
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "mistral": transformers.MistralConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
                    "mixtral": transformers.MixtralConfig}[architecture]
    config = config_class(**SHAPE, **EXPERTS.get(architecture, {}), **(ROUTER_LOSS if router_loss else {}),
                          attn_implementation="sdpa")
    model_class = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                   "mistral": transformers.MistralForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
                   "mixtral": transformers.MixtralForCausalLM}[architecture]
    return model_class(config)


class HFModule(L.LightningModule):
    """A LightningModule holding a Hugging Face model, written the Hugging Face way: built from its config,
    `from_pretrained` from a folder written by transformers, or (`on_meta`) built on the meta device in
    `configure_model` from the folder's config, for `TP3DStrategy(pretrained=folder)` to fill shard by shard."""

    def __init__(self, architecture: str = "llama", pretrained: str | None = None, on_meta: bool = False,
                 router_loss: bool = False) -> None:
        super().__init__()
        self.folder, self.on_meta = pretrained, on_meta
        self.model = None
        if pretrained is None:
            self.model = hf_network(architecture, router_loss)
        elif not on_meta:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(pretrained, attn_implementation="sdpa")

    def configure_model(self) -> None:
        if self.model is None:
            config = transformers.AutoConfig.from_pretrained(self.folder, attn_implementation="sdpa")
            with torch.device("meta"):
                self.model = transformers.AutoModelForCausalLM.from_config(config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        self.log("train_loss", loss, sync_dist=True)  # the mean over dp replicas: the global batch loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.0)


def hf_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, labels=input_ids).loss


RUNS: dict[int, dict[str, dict[str, Any]]] = {
    8: {"llama-tp2-pp2-dp2-1f1b-replicate": dict(architecture="llama", tp=2, pp=2, mode="replicate",
                                                 export=True)},
    4: {"llama-tp1-pp2-dp2-1f1b-fsdp": dict(architecture="llama", tp=1, pp=2, mode="fsdp", save=True),
        "qwen2-tp2-pp2-dp1-1f1b-replicate": dict(architecture="qwen2", tp=2, pp=2, mode="replicate", export=True),
        "mistral-tp2-pp2-dp1-interleaved-fsdp": dict(architecture="mistral", tp=2, pp=2, mode="fsdp",
                                                     schedule="interleaved_1f1b"),
        "llama-tp2-pp2-dp1-zbv-fsdp-full-recompute": dict(architecture="llama", tp=2, pp=2, mode="fsdp",
                                                          schedule="zbv_zero_bubble", recompute="full"),
        "llama-from-pretrained-tp1-pp2-dp2-gpipe-replicate": dict(architecture="llama", tp=1, pp=2,
                                                                  mode="replicate", schedule="gpipe",
                                                                  from_pretrained="transformers"),
        "llama-meta-pretrained-option-tp2-pp2-dp1-1f1b-fsdp": dict(architecture="llama", tp=2, pp=2, mode="fsdp",
                                                                   from_pretrained="shards"),
        "qwen3moe-tp2-pp1-dp2-ep2-replicate": dict(architecture="qwen3_moe", tp=2, pp=1, mode="replicate", experts=2,
                                                   export=True),
        "qwen3moe-tp2-pp1-dp2-ep2-fsdp": dict(architecture="qwen3_moe", tp=2, pp=1, mode="fsdp", experts=2),
        # built on the meta device, `pretrained=` a folder transformers wrote (the Hub's per-expert tensors):
        # each rank reads only its experts (of its stage's blocks under pipelining; 1 of 4 per block with E = 2
        # and FSDP2 over the 2 replicas)
        "mixtral-meta-pretrained-option-tp1-pp2-dp2-ep2-1f1b-fsdp": dict(architecture="mixtral", tp=1, pp=2,
                                                                         mode="fsdp", experts=2,
                                                                         from_pretrained="shards"),
        "qwen3moe-meta-pretrained-option-tp1-pp1-dp4-ep2-fsdp": dict(architecture="qwen3_moe", tp=1, pp=1,
                                                                     mode="fsdp", experts=2, from_pretrained="shards"),
        "mixtral-meta-pretrained-option-tp2-pp1-dp2-ep2-replicate": dict(architecture="mixtral", tp=2, pp=1,
                                                                         mode="replicate", experts=2,
                                                                         from_pretrained="shards"),
        # the balancing loss over the whole batch (`models.router_loss`), with the experts split and under tp
        "mixtral-router-loss-tp1-pp1-dp4-ep2-replicate": dict(architecture="mixtral", tp=1, pp=1, mode="replicate",
                                                              experts=2, router_loss=True),
        "qwen3moe-router-loss-tp2-pp1-dp2-fsdp": dict(architecture="qwen3_moe", tp=2, pp=1, mode="fsdp",
                                                      router_loss=True)},
}
# The (1, 2, 2) FSDP run saves after STEPS steps; this run resumes it at (2, 1, 2) for RESUMED_STEPS more.
RESUMED_STEPS = 3
RESUME = {"resume": dict(architecture="llama", tp=2, pp=1, mode="replicate", resume=True)}
CONFIGURATIONS = {name: configuration for runs in RUNS.values() for name, configuration in runs.items()}


def _fit(directory: Path, name: str, architecture: str, tp: int, pp: int, mode: str, schedule: str = "1f1b",
         export: bool = False, from_pretrained: str | None = None, save: bool = False, resume: bool = False,
         recompute: str = "none", experts: int = 1, router_loss: bool = False) -> dict[str, Any]:
    """`from_pretrained`: "transformers" (the module calls `from_pretrained`) or "shards" (the module builds
    on the meta device and the strategy's `pretrained=` reads each rank's slices)."""
    dp = world_size() // (tp * pp)
    logger, capture = MemoryLogger(), CaptureGradients()
    consistency = ConsistencyCheck(directory / f"{name}-export") if export else None
    folder = directory / f"pretrained-{architecture}"
    strategy = TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_schedule=schedule,
                            num_microbatches=2, data_parallel_mode=mode, recompute=recompute,
                            expert_parallel_size=experts,
                            pretrained=folder if from_pretrained == "shards" else None)
    callbacks = [capture] + ([consistency] if export else [])
    if save:  # inside fit, at the last step: mid-epoch, as a run that goes on would save
        callbacks.append(ModelCheckpoint(dirpath=directory, filename="hf", every_n_train_steps=STEPS))
    trainer = L.Trainer(**trainer_kwargs(devices=world_size(), strategy=strategy, logger=logger, callbacks=callbacks,
                                         enable_checkpointing=save,
                                         max_steps=STEPS + RESUMED_STEPS if resume else STEPS))
    module = HFModule(architecture, str(folder) if from_pretrained else None, on_meta=from_pretrained == "shards",
                      router_loss=router_loss)
    trainer.fit(module, TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp,
                                        val_fraction=0.2),
                ckpt_path=str(directory / "hf.ckpt") if resume else None)
    report = consistency.report.to_dict() if consistency is not None and consistency.report is not None else None
    return {"losses": logger.values("train_loss"), "first_grads": capture.first_grads, "consistency": report}


def run_world(world: int, directory: str) -> dict[str, Any]:
    runs = RUNS[world] | (RESUME if world == 4 else {})
    return {name: _fit(Path(directory), name, **configuration) for name, configuration in runs.items()}


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> Path:
    """Holds the folder a `from_pretrained` run loads (written by transformers) and the exports."""
    directory = tmp_path_factory.mktemp("hf")
    for architecture in ("llama", "qwen3_moe", "mixtral"):
        hf_network(architecture).save_pretrained(directory / f"pretrained-{architecture}")
    return directory


@pytest.fixture(scope="module")
def world_results(directory) -> dict[str, list[dict[str, Any]]]:
    return results_by_name(RUNS, "tests.models.test_huggingface:run_world", str(directory))


@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_hf_module_matches_single_process_at_every_layout(world_results, directory, name):
    configuration = CONFIGURATIONS[name]
    if configuration.get("from_pretrained"):  # the folder's own model, loaded by transformers
        def build() -> nn.Module:
            return transformers.AutoModelForCausalLM.from_pretrained(
                directory / f"pretrained-{configuration['architecture']}", attn_implementation="sdpa")
    else:
        def build() -> nn.Module:
            return hf_network(configuration["architecture"], configuration.get("router_loss", False))
    reference = reference_run(STEPS, GLOBAL_BATCH, build_network=build, loss_of=hf_loss)
    covered = assert_ranks_match(name, world_results[name], reference, RTOL, ATOL)
    assert covered == reference["first_grads"].keys(), f"{name}: the ranks' stages do not cover the model"
    assert reference["losses"][-1] < reference["losses"][0], "the reference itself must learn"


EXPORTED = [name for name, configuration in CONFIGURATIONS.items() if configuration.get("export")]


@pytest.mark.parametrize("name", EXPORTED)
def test_export_of_hf_model_loads_in_transformers_with_the_live_logits(world_results, directory, name):
    """ConsistencyCheck on rank 0: the live (tp, pp, dp) model against its export loaded by transformers."""
    report = world_results[name][0]["consistency"]
    assert report["max_abs_diff"] <= 1e-5 and report["passed"], report
    assert len(report["layer_max_abs_diff"]) == SHAPE["num_hidden_layers"]  # every stage's layers compared
    config = json.loads((directory / f"{name}-export" / "config.json").read_text())
    architecture = CONFIGURATIONS[name]["architecture"]
    assert config["model_type"] == architecture
    assert config["architectures"] == [type(hf_network(architecture)).__name__]
    exported = transformers.AutoModelForCausalLM.from_pretrained(directory / f"{name}-export")
    expected = dict(hf_network(architecture).named_parameters())
    assert {key: tuple(value.shape) for key, value in exported.named_parameters()} == {
        key: tuple(value.shape) for key, value in expected.items()}


def test_hf_checkpoint_resumes_exactly_at_another_layout(world_results):
    """Saved at (1, 2, 2) with FSDP after 5 steps, resumed at (2, 1, 2): the next steps' losses are the
    uninterrupted single-process run's (model, optimizer state and data position restored)."""
    reference = reference_run(STEPS + RESUMED_STEPS, GLOBAL_BATCH, build_network=lambda: hf_network("llama"),
                              loss_of=hf_loss)
    for rank, rank_result in enumerate(world_results["resume"]):
        torch.testing.assert_close(torch.tensor(rank_result["losses"]), torch.tensor(reference["losses"][STEPS:]),
                                   rtol=RTOL, atol=0.0, msg=lambda message, rank=rank: f"rank {rank}: {message}")
