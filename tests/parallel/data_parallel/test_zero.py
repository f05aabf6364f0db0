"""`data_parallel_mode="zero1"` (`parallel.data_parallel.zero`): the optimizer's state and update split over dp.

One 4-process world. Parity with one process (losses of 5 steps and every gradient each rank holds
after step 1, rtol 1e-5, plus the final weights) at (1, 1, 4) with global-norm clipping, (2, 1, 2)
(column-parallel weights cut along dim 1 over dp, row-parallel along dim 0) and (1, 2, 2) under 1F1B
with 2 accumulated batches; each rank's AdamW state covers 1/4 of every parameter and the ranks'
parts tile it exactly; a checkpoint saved in `zero1` at (2, 1, 2) resumes in `zero1` at (1, 1, 4) and in
`replicate` at (1, 2, 2) on the reference's losses; every dp collective of a step = the communication
ledger (in `tests/diagnostics/test_traffic.py`); Fabric in `zero1` gives the `replicate` losses; a
non-elementwise optimizer is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

from lightning_tp3d import TP3DFabricStrategy, TP3DStrategy
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.plan.optimizer_sharding import chunk_sizes, pack_buckets, part_sizes
from tests.distributed import run_distributed
from tests.helpers import (
    LEARNING_RATE,
    SEQ_LEN,
    CaptureGradients,
    MemoryLogger,
    assert_adam_weights_close,
    named_full,
    reference_network,
    reference_run,
    trainer_kwargs,
)

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

RTOL, ATOL = 1e-5, 1e-7
STEPS = 5
SAVED_AT = 3
GLOBAL_BATCH = 8
CLIP = 0.5
WORLD = 4

PARITY = {
    "1-1-4-clip": dict(tp=1, pp=1, clip=CLIP),
    "2-1-2": dict(tp=2, pp=1),
    "1-2-2-1f1b-accumulate-2": dict(tp=1, pp=2, accumulate=2),
}


class _OptimizerState(L.Callback):
    """Each AdamW state tensor's local elements on this rank, by parameter name, at the end of fit."""

    def __init__(self) -> None:
        self.local_elements: dict[str, int] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state = trainer.strategy.core.optimizer_state(trainer.strategy.model, trainer.optimizers[0])
        self.local_elements = {key.removeprefix("state.model.").removesuffix(".exp_avg"): _local(value).numel()
                               for key, value in state.items()
                               if key.endswith(".exp_avg")}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _fit(tp: int, pp: int, clip: float | None = None, accumulate: int = 1, mode: str = "zero1",
         steps: int = STEPS, directory: Path | None = None, ckpt_path: Path | None = None,
         callbacks: list[L.Callback] | None = None) -> dict[str, Any]:
    dp = WORLD // (tp * pp)
    logger, capture, state = MemoryLogger(), CaptureGradients(), _OptimizerState()
    strategy = TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, num_microbatches=2,
                            data_parallel_mode=mode)
    trainer = L.Trainer(**trainer_kwargs(
        devices=WORLD, strategy=strategy, max_steps=steps, logger=logger, gradient_clip_val=clip,
        accumulate_grad_batches=accumulate, callbacks=[capture, state, *(callbacks or [])],
        enable_checkpointing=bool(callbacks), default_root_dir=directory))
    module = CausalLMModule("tiny", learning_rate=LEARNING_RATE)
    trainer.fit(module, TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp // accumulate,
                                        val_fraction=0.2), ckpt_path=ckpt_path)
    return {"losses": logger.values("train_loss"), "first_grads": capture.first_grads,
            "weights": named_full(module), "state_elements": state.local_elements}


def _fabric(mode: str) -> dict[str, Any]:
    """3 steps of a Fabric loop with weight decay; the network has a parameter no loss uses (no gradient:
    AdamW must skip it, as in `replicate`, rather than decay it)."""
    strategy = TP3DFabricStrategy(data_parallel_mode=mode)
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    network = reference_network()
    network.unused = torch.nn.Parameter(torch.ones(3))
    model = fabric.setup(network)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.1))
    generator = torch.Generator().manual_seed(fabric.global_rank)  # each dp rank its own batches
    losses = []
    for _ in range(3):
        input_ids = torch.randint(0, 256, (2, SEQ_LEN), generator=generator)
        loss = model(input_ids, labels=input_ids)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach()).item())
    return {"losses": losses, "unused": network.unused.detach().clone()}


def _refused() -> str:
    class Factored(CausalLMModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adafactor(self.parameters(), lr=LEARNING_RATE)

    strategy = TP3DStrategy(data_parallel_mode="zero1")
    trainer = L.Trainer(**trainer_kwargs(devices=WORLD, strategy=strategy, max_steps=1, logger=False))
    try:
        trainer.fit(Factored("tiny"), TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=2))
    except TypeError as error:
        return str(error)
    return "not refused"


def run_world(directory: str) -> dict[str, Any]:
    directory = Path(directory)
    results: dict[str, Any] = {name: _fit(**configuration) for name, configuration in PARITY.items()}
    saver = ModelCheckpoint(dirpath=directory, filename="step3", every_n_train_steps=SAVED_AT)
    results["saved"] = _fit(2, 1, steps=SAVED_AT, directory=directory, callbacks=[saver])
    results["resumed-zero1-1-1-4"] = _fit(1, 1, directory=directory, ckpt_path=directory / "step3.ckpt")
    results["resumed-replicate-1-2-2"] = _fit(1, 2, mode="replicate", directory=directory,
                                              ckpt_path=directory / "step3.ckpt")
    results["fabric"] = {mode: _fabric(mode) for mode in ("replicate", "zero1")}
    results["refused"] = _refused()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict[str, Any]]:
    return run_distributed(WORLD, "tests.parallel.data_parallel.test_zero:run_world",
                           str(tmp_path_factory.mktemp("zero")))


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    return {"plain": reference_run(STEPS, GLOBAL_BATCH), "clip": reference_run(STEPS, GLOBAL_BATCH, clip_norm=CLIP),
            "accumulate-2": reference_run(STEPS, GLOBAL_BATCH, accumulate=2)}


@pytest.mark.parametrize("name", list(PARITY))
def test_losses_gradients_and_weights_match_single_process(runs, references, name):
    configuration = PARITY[name]
    accumulate = configuration.get("accumulate", 1)
    reference = references["clip" if configuration.get("clip") else "accumulate-2" if accumulate > 1 else "plain"]
    expected_losses = torch.tensor(reference["losses" if accumulate == 1 else "last_batch_losses"])
    covered: set[str] = set()
    for rank, result in enumerate(runs):
        run = result[name]
        torch.testing.assert_close(torch.tensor(run["losses"]), expected_losses, rtol=RTOL, atol=0.0,
                                   msg=lambda message, rank=rank: f"{name} rank {rank} losses: {message}")
        for key, gradient in run["first_grads"].items():
            torch.testing.assert_close(gradient, reference["first_grads"][key], rtol=RTOL, atol=ATOL,
                                       msg=lambda message, rank=rank, key=key: f"{name} rank {rank} {key}: {message}")
        covered.update(run["first_grads"])
        for key, weight in run["weights"].items():
            assert_adam_weights_close(weight, reference["final_params"][key], f"{name} rank {rank} {key}")
    assert covered == reference["first_grads"].keys()


def test_each_rank_keeps_state_for_its_part_and_the_parts_tile_every_parameter(runs, references):
    """At (1, 1, 4) AdamW's exp_avg of W holds chunk r of W's dim 0 on dp rank r (dim 1 for nothing: tp 1)."""
    shapes = {name: tuple(value.shape) for name, value in references["plain"]["final_params"].items()}
    for name, shape in shapes.items():
        elements = [result["1-1-4-clip"]["state_elements"][name] for result in runs]
        assert tuple(elements) == part_sizes(shape, None, WORLD), name
        assert sum(elements) == torch.Size(shape).numel(), name
    total = sum(torch.Size(shape).numel() for shape in shapes.values())
    assert sum(runs[0]["1-1-4-clip"]["state_elements"].values()) <= total / WORLD + 2 * len(shapes) * 64


def test_torch_chunk_sizes_are_the_parts():
    for length, parts in ((10, 4), (5, 2), (1, 2), (7, 3), (0, 2), (16, 4)):
        expected = [len(piece) for piece in torch.arange(length).chunk(parts)] if length else []
        sizes = chunk_sizes(length, parts)
        assert sizes[:len(expected)] == expected and not any(sizes[len(expected):]), (length, parts)
    assert part_sizes((8, 6), 0, 2) == (24, 24)  # column-parallel: dp cuts dim 1
    assert part_sizes((6,), 0, 4) == (6, 6, 6, 6)  # a tp-split bias is not cut
    buckets = pack_buckets([[3, 3], [2, 1], [10, 10]], dp=2, element_bytes=4, bucket_bytes=4 * 2 * 5)
    assert [(bucket.indices, bucket.segment) for bucket in buckets] == [((0, 1), 5), ((2,), 10)]


@pytest.mark.parametrize("resumed", ["resumed-zero1-1-1-4", "resumed-replicate-1-2-2"])
def test_checkpoint_resumes_at_another_layout_and_mode(runs, references, resumed):
    reference = references["plain"]
    for rank, result in enumerate(runs):
        torch.testing.assert_close(torch.tensor(result["saved"]["losses"]),
                                   torch.tensor(reference["losses"][:SAVED_AT]), rtol=RTOL, atol=0.0)
        torch.testing.assert_close(torch.tensor(result[resumed]["losses"]),
                                   torch.tensor(reference["losses"][SAVED_AT:]), rtol=RTOL, atol=0.0,
                                   msg=lambda message, rank=rank: f"{resumed} rank {rank}: {message}")
        for key, weight in result[resumed]["weights"].items():
            assert_adam_weights_close(weight, reference["final_params"][key], f"{resumed} rank {rank} {key}")


def test_fabric_zero1_gives_the_replicate_losses_and_skips_a_parameter_without_gradient(runs):
    for result in runs:
        zero1, replicate = result["fabric"]["zero1"], result["fabric"]["replicate"]
        torch.testing.assert_close(torch.tensor(zero1["losses"]), torch.tensor(replicate["losses"]), rtol=RTOL, atol=0)
        assert torch.equal(zero1["unused"], torch.ones(3)) and torch.equal(replicate["unused"], torch.ones(3))


def test_non_elementwise_optimizer_is_refused(runs):
    for result in runs:
        assert "data_parallel_mode='zero1'" in result["refused"] and "Adafactor" in result["refused"]
        assert "data_parallel_mode='replicate'" in result["refused"]
