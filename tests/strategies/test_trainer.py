"""TP3DStrategy inside `lightning.Trainer`: parity with a single-process reference at every (tp, dp).

Each world size (1, 2, 4 processes) is spawned once and runs several layouts; the test process computes
the plain-PyTorch reference and compares: losses of 10 steps and every parameter's gradient after step 1
within 1e-5 (fp32).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_tp3d import LayoutError, ModelConfig, TP3DStrategy
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from tests.distributed import run_distributed
from tests.helpers import (
    LEARNING_RATE,
    SEQ_LEN,
    CaptureGradients,
    MemoryLogger,
    reference_run,
    trainer_kwargs,
    world_size,
)

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

TOLERANCE = 1e-5
GLOBAL_BATCH = 8
STEPS = 10


# ---------------------------------------------------------------------- a user's own model and plan
class UserBlock(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc_in = nn.Linear(width, hidden)
        self.fc_out = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(F.gelu(self.fc_in(self.norm(x))))


class UserNet(nn.Module):
    """Not the reference model: other names, biases, LayerNorm, no attention."""

    def __init__(self, vocab: int = 256, width: int = 32, hidden: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(UserBlock(width, hidden) for _ in range(depth))
        self.out = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tok(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.out(x)
        return logits if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def user_network() -> UserNet:
    with torch.random.fork_rng():
        torch.manual_seed(1)
        return UserNet()


def user_tp_plan() -> dict:
    return {
        "blocks.*.fc_in": ColwiseParallel(),
        "blocks.*.fc_out": RowwiseParallel(),
        "out": ColwiseParallel(output_layouts=Replicate()),
    }


class UserModule(CausalLMModule):
    """Same steps and optimizer as the reference module; the network lives in `self.net`."""

    def __init__(self) -> None:
        super().__init__(learning_rate=LEARNING_RATE)
        self.net = user_network()

    def configure_model(self) -> None:
        pass

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.net(batch["input_ids"], labels=batch["labels"])
        self.log("train_loss", loss, sync_dist=True)
        return loss


# ---------------------------------------------------------------------- what each rank runs
SCENARIOS: dict[int, list[dict[str, Any]]] = {
    1: [dict(name="tp1-dp1-replicate", tp=1, mode="replicate", batch=8),
        dict(name="tp1-dp1-fsdp", tp=1, mode="fsdp", batch=8)],
    2: [dict(name="tp2-dp1-replicate", tp=2, mode="replicate", batch=8),
        dict(name="tp2-dp1-fsdp", tp=2, mode="fsdp", batch=8),
        dict(name="tp1-dp2-replicate", tp=1, mode="replicate", batch=4),
        dict(name="tp1-dp2-fsdp", tp=1, mode="fsdp", batch=4),
        dict(name="user-tp2", tp=2, mode="replicate", batch=8, user_model=True)],
    4: [dict(name="tp2-dp2-replicate", tp=2, mode="replicate", batch=4, validate=True),
        dict(name="tp2-dp2-fsdp", tp=2, mode="fsdp", batch=4, validate=True),
        dict(name="tp2-dp2-accumulate-clip-replicate", tp=2, mode="replicate", batch=2, accumulate=2, clip=0.05),
        dict(name="tp2-dp2-accumulate-clip-fsdp", tp=2, mode="fsdp", batch=2, accumulate=2, clip=0.05)],
}


def _fit(name: str, tp: int, mode: str, batch: int, accumulate: int = 1, clip: float | None = None,
         validate: bool = False, user_model: bool = False) -> dict[str, Any]:
    world = world_size()
    if user_model:
        module, prefix = UserModule(), "net."
        strategy = TP3DStrategy(tensor_parallel_size=tp, data_parallel_mode=mode, tp_plan=user_tp_plan,
                                model_attribute="net", layers_attribute="blocks")
    else:
        module, prefix = CausalLMModule("tiny", learning_rate=LEARNING_RATE), "model."
        strategy = TP3DStrategy(tensor_parallel_size=tp, data_parallel_mode=mode)
    logger, capture = MemoryLogger(), CaptureGradients(prefix)
    extra: dict[str, Any] = {"accumulate_grad_batches": accumulate, "gradient_clip_val": clip}
    if validate:
        extra.update(limit_val_batches=None, val_check_interval=STEPS, check_val_every_n_epoch=None)
    trainer = L.Trainer(**trainer_kwargs(devices=world, strategy=strategy, logger=logger, callbacks=[capture],
                                         **extra))
    assert trainer.strategy.layout.tensor_parallel_size == tp
    trainer.fit(module, TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=batch, val_fraction=0.2))
    return {"losses": logger.values("train_loss"), "val_loss": logger.values("val_loss"),
            "first_grads": capture.first_grads, "final_params": capture.final_params,
            "mesh_shape": tuple(module.device_mesh.shape), "misplaced_gradients": capture.misplaced_gradients,
            "gradient_bytes": capture.gradient_bytes, "parameter_bytes": capture.parameter_bytes}


def run_world() -> dict[str, Any]:
    world = world_size()
    return {scenario["name"]: _fit(**scenario) for scenario in SCENARIOS[world]}


# ---------------------------------------------------------------------- fixtures and checks
@pytest.fixture(scope="module")
def world_results() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for world in SCENARIOS:
        per_rank = run_distributed(world, "tests.strategies.test_trainer:run_world")
        results.update(per_rank[0])
    return results


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return reference_run(STEPS, GLOBAL_BATCH, validate_batch_size=4)


def _assert_close_dicts(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert found.keys() == expected.keys(), f"{what}: parameter names differ"
    for name, value in expected.items():
        difference = (found[name] - value).abs().max().item()
        assert difference <= TOLERANCE, f"{what}: {name} differs by {difference:.3e} > {TOLERANCE}"


LAYOUTS = [scenario["name"] for world in (1, 2, 4) for scenario in SCENARIOS[world]
           if "accumulate" not in scenario and not scenario.get("user_model")]


@pytest.mark.parametrize("name", [scenario["name"] for world in (1, 2, 4) for scenario in SCENARIOS[world]])
def test_gradients_are_sharded_like_their_parameters(world_results, name):
    """DTensor's embedding backward returns the vocab-parallel embedding's gradient replicated (V x h on
    every tp rank); the strategy cuts it to the rank's rows before the all-reduce and the update."""
    result = world_results[name]
    assert result["misplaced_gradients"] == []
    assert result["gradient_bytes"] == result["parameter_bytes"] > 0


@pytest.mark.parametrize("name", LAYOUTS)
def test_losses_and_first_gradients_match_single_process(world_results, reference, name):
    result = world_results[name]
    assert len(result["losses"]) == STEPS
    assert max(abs(a - b) for a, b in zip(result["losses"], reference["losses"])) <= TOLERANCE
    _assert_close_dicts(result["first_grads"], reference["first_grads"], name)
    assert reference["losses"][-1] < reference["losses"][0] - 0.5, "the reference itself must learn"


def test_mesh_shape_follows_layout(world_results):
    assert world_results["tp2-dp2-replicate"]["mesh_shape"] == (1, 2, 2)
    assert world_results["tp1-dp2-fsdp"]["mesh_shape"] == (1, 2, 1)


@pytest.mark.parametrize("name", ["tp2-dp2-replicate", "tp2-dp2-fsdp"])
def test_validation_loss_matches_single_process(world_results, reference, name):
    (val_loss,) = world_results[name]["val_loss"]
    assert abs(val_loss - reference["val_loss"]) <= TOLERANCE


@pytest.mark.parametrize("name", ["tp2-dp2-accumulate-clip-replicate", "tp2-dp2-accumulate-clip-fsdp"])
def test_accumulation_and_global_norm_clipping(world_results, name):
    """2 accumulated batches of 2 per dp rank x dp 2 = the reference's batch of 8; clip at 0.05 bites."""
    expected = reference_run(STEPS, GLOBAL_BATCH, clip_norm=0.05)
    unclipped = reference_run(1, GLOBAL_BATCH)
    first_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in unclipped["first_grads"].values()]))
    assert first_norm > 0.05, "the clip value must be below the gradient norm to test anything"
    _assert_close_dicts(world_results[name]["first_grads"], expected["first_grads"], name)
    _assert_close_dicts(world_results[name]["final_params"], expected["final_params"], name)


def test_user_model_with_own_plan_matches_single_process(world_results):
    expected = reference_run(STEPS, GLOBAL_BATCH, build_network=user_network)
    result = world_results["user-tp2"]
    assert max(abs(a - b) for a, b in zip(result["losses"], expected["losses"])) <= TOLERANCE
    _assert_close_dicts(result["first_grads"], expected["first_grads"], "user-tp2")
    _assert_close_dicts(result["final_params"], expected["final_params"], "user-tp2")


# ---------------------------------------------------------------------- errors before any process starts
def test_world_size_mismatch_is_refused_at_trainer_construction():
    with pytest.raises(LayoutError, match=r"world size 3 is not divisible by tensor_parallel_size x"):
        L.Trainer(accelerator="cpu", devices=3, strategy=TP3DStrategy(tensor_parallel_size=2))
    with pytest.raises(LayoutError, match=r"= 4, but the world size is 2; launch 4 processes"):
        L.Trainer(accelerator="cpu", devices=2, strategy=TP3DStrategy(tensor_parallel_size=2, data_parallel_size=2))


def test_model_that_tp_cannot_split_is_refused_before_process_groups():
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=TP3DStrategy(tensor_parallel_size=4))
    module = CausalLMModule(ModelConfig(num_attention_heads=8, num_key_value_heads=2))
    with pytest.raises(LayoutError, match=r"tensor_parallel_size=4 does not divide num_key_value_heads=2"):
        trainer.strategy.connect(module)
    assert not torch.distributed.is_initialized()


def test_strategy_argument_errors():
    with pytest.raises(ValueError, match=r"data_parallel_mode='zero' is not one of \['replicate', 'fsdp', 'zero1'\]"):
        TP3DStrategy(data_parallel_mode="zero")
    with pytest.raises(LayoutError, match=r"tensor_parallel_size must be a positive integer, got 0"):
        TP3DStrategy(tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"tp_plan='no_colon' must look like 'package.module:name'"):
        TP3DStrategy(tp_plan="no_colon")


def test_registered_by_name():
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="tp3d")
    assert isinstance(trainer.strategy, TP3DStrategy)
