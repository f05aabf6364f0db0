"""Mixed precision under tensor and pipeline parallelism, against single-process runs in the same
precision, with tolerances shown to reject the wrong precision.

* bf16-mixed at (tp, pp, dp) = (2, 2, 1) with 1F1B, (1, 2, 2) with ZBVZeroBubble + FSDP2 and (1, 1, 4)
  replicate (the dp reduction overlapped with backward): losses of
  10 steps against the single-process bf16 autocast run (mean |difference| <= 6e-4, a sanity check: an
  fp32 run's losses can be as close), and at (1, 2, 2) every first-step gradient (relative norm of the
  difference <= 5e-3, which the fp32 run's gradients exceed: asserted). The fp32 parity tolerance
  (rtol 1e-5) is shown to reject the bf16 run.
* bf16-true at (2, 2, 1): bf16 weights and optimizer against single-process bf16-true (mean |difference|
  <= 2e-3, which the fp32 and bf16-mixed references exceed: asserted).
* `data_parallel_mode="zero1"` at (1, 1, 4): bf16-mixed, bf16-true and 16-mixed (the scaler unscales and checks each
  dp rank's parts of the gradients) against the same single-process runs.
* 16-mixed at (2, 2, 1) with `TP3DPrecision`: linear layers run in fp16; an inf written into one tp rank's
  gradient makes every rank skip that step (weights unchanged everywhere) and halve the scale together;
  the losses follow a single-process fp16 autocast + `torch.amp.GradScaler` run with the same skipped
  step (a reference without the skip is rejected); the scale survives a checkpoint and the resumed run
  continues exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.tensor import DTensor

from lightning_tp3d import TP3DPrecision, TP3DStrategy
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.strategies.precision import ModelParallelGradScaler
from tests.distributed import run_distributed
from tests.helpers import (
    BF16_MIXED_GRADIENT_TOLERANCE,
    LEARNING_RATE,
    SEQ_LEN,
    CaptureGradients,
    MemoryLogger,
    reference_run,
    trainer_kwargs,
    world_size,
    worst_relative_difference,
)

pytestmark = pytest.mark.distributed  # starts processes: deselect with -m 'not distributed'

GLOBAL_BATCH = 8
STEPS = 10
INF_STEP = 3  # the optimizer step (1-based) whose gradients get an inf on one tp rank


class WatchScaler(Callback):
    """Per step: the loss scale after it, and whether this rank's weights changed in it. At `inf_step` it
    writes an inf into one gradient element on the rank at tp coordinate 1 (after backward, before the
    scaler unscales)."""

    def __init__(self, inf_step: int | None) -> None:
        self.inf_step = inf_step
        self.scales: list[float] = []
        self.changed: list[bool] = []
        self._before: list[torch.Tensor] = []

    @staticmethod
    def _local(tensor: torch.Tensor) -> torch.Tensor:
        return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().clone()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._before = [self._local(parameter) for parameter in pl_module.parameters()]

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tp_rank = trainer.strategy.layout.coordinates(trainer.global_rank).tp
        if trainer.global_step + 1 == self.inf_step and tp_rank == 1:
            grad = next(parameter.grad for parameter in pl_module.parameters() if parameter.grad is not None)
            (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = float("inf")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.scales.append(trainer.precision_plugin.scaler.get_scale())
        after = [self._local(parameter) for parameter in pl_module.parameters()]
        self.changed.append(any(not torch.equal(a, b) for a, b in zip(self._before, after)))


def _fit(tp: int, pp: int, steps: int, precision: Any, callbacks: list[Callback] = (), ckpt_path: Path | None = None,
         directory: Path | None = None, schedule: str = "1f1b", mode: str = "replicate") -> list[float]:
    dp = world_size() // (tp * pp)
    logger = MemoryLogger()
    options = {"plugins": [precision]} if isinstance(precision, TP3DPrecision) else {"precision": precision}
    trainer = L.Trainer(**trainer_kwargs(
        devices=world_size(), max_steps=steps, logger=logger, callbacks=list(callbacks),
        enable_checkpointing=any(isinstance(callback, ModelCheckpoint) for callback in callbacks),
        default_root_dir=directory,
        strategy=TP3DStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, num_microbatches=2,
                              pipeline_schedule=schedule, data_parallel_mode=mode), **options))
    trainer.fit(CausalLMModule("tiny", learning_rate=LEARNING_RATE),
                TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp,
                                val_fraction=0.2), ckpt_path=ckpt_path)
    return logger.values("train_loss")


def run_precision_world(directory: str) -> dict[str, Any]:
    directory = Path(directory)
    watch, fp16_dtypes = WatchScaler(INF_STEP), LinearOutputDtypes()
    saver = ModelCheckpoint(dirpath=directory, filename="step4", every_n_train_steps=4)
    straight = _fit(2, 2, 6, TP3DPrecision("16-mixed"), [watch, saver, fp16_dtypes], directory=directory)
    resumed_watch = WatchScaler(None)
    resumed = _fit(2, 2, 6, TP3DPrecision("16-mixed"), [resumed_watch], ckpt_path=directory / "step4.ckpt")
    dtypes, zero_fp16_dtypes = LinearOutputDtypes(), LinearOutputDtypes()
    bf16_true = _fit(2, 2, STEPS, "bf16-true", [dtypes])
    # (1, 1, 4) in data_parallel_mode="zero1": the scaler unscales and checks each dp rank's parts.
    zero1 = {"fp16": _fit(1, 1, 6, TP3DPrecision("16-mixed"), [zero_fp16_dtypes], mode="zero1"),
             "fp16_dtypes": zero_fp16_dtypes.dtypes, "bf16_true": _fit(1, 1, STEPS, "bf16-true", mode="zero1")}
    bf16_dtypes, capture = LinearOutputDtypes(), CaptureGradients()
    bf16_mixed = {"losses": _fit(2, 2, STEPS, "bf16-mixed", [bf16_dtypes]), "dtypes": bf16_dtypes.dtypes,
                  "no_tp_losses": _fit(1, 2, STEPS, "bf16-mixed", [capture], schedule="zbv_zero_bubble", mode="fsdp"),
                  "no_tp_first_grads": capture.first_grads,
                  # (1, 1, 4) replicate: the dp reduction overlapped with backward, on bf16-autocast gradients.
                  "data_parallel_losses": _fit(1, 1, STEPS, "bf16-mixed"),
                  "zero1_losses": _fit(1, 1, STEPS, "bf16-mixed", mode="zero1")}
    return {"straight": straight, "scales": watch.scales, "changed": watch.changed, "resumed": resumed,
            "resumed_scales": resumed_watch.scales, "fp16_dtypes": fp16_dtypes.dtypes, "bf16_true": bf16_true,
            "bf16_true_dtypes": dtypes.dtypes, "bf16_mixed": bf16_mixed, "zero1": zero1}


class LinearOutputDtypes(Callback):
    """The dtypes the linear layers of this rank produced during training (autocast makes them bf16)."""

    def __init__(self) -> None:
        self.dtypes: set[str] = set()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for module in pl_module.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(lambda _, __, output: self.dtypes.add(str(output.dtype)))


@pytest.fixture(scope="module")
def fp16(tmp_path_factory) -> list[dict[str, Any]]:
    """Every run of 4 processes: fp16 with a skipped step and a resume, bf16-true, bf16-mixed at 2 layouts."""
    return run_distributed(4, "tests.strategies.test_precision:run_precision_world",
                           str(tmp_path_factory.mktemp("fp16")))


def _mean_difference(losses: list[float], reference: list[float]) -> float:
    assert len(losses) == len(reference)
    return sum(abs(a - b) for a, b in zip(losses, reference)) / len(losses)


BF16_MIXED_LOSS_TOLERANCE = 6e-4  # mean |loss difference| over the steps
BF16_TRUE_LOSS_TOLERANCE = 2e-3
FP16_LOSS_TOLERANCE = 3e-4


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    return {"fp32": reference_run(STEPS, GLOBAL_BATCH),
            "bf16-mixed": reference_run(STEPS, GLOBAL_BATCH, autocast_dtype=torch.bfloat16),
            "bf16-true": reference_run(STEPS, GLOBAL_BATCH, parameter_dtype=torch.bfloat16),
            "16-mixed": reference_run(STEPS, GLOBAL_BATCH, autocast_dtype=torch.float16, scaler_inf_step=INF_STEP),
            "16-mixed-no-skip": reference_run(STEPS, GLOBAL_BATCH, autocast_dtype=torch.float16)}


def test_bf16_mixed_matches_single_process_bf16_and_fp32_is_rejected(fp16, references):
    bf16, fp32 = references["bf16-mixed"], references["fp32"]
    # The gradient tolerance rejects a run that silently trained in fp32 (the losses of fp32 and bf16-mixed
    # runs differ by only ~2e-4 on average over these steps, so the loss agreement is a sanity check) ...
    assert worst_relative_difference(fp32["first_grads"], bf16["first_grads"]) > BF16_MIXED_GRADIENT_TOLERANCE
    ranks = [rank["bf16_mixed"] for rank in fp16]
    gradients: dict[str, torch.Tensor] = {}
    for rank in ranks:
        assert rank["dtypes"] == {"torch.bfloat16"}
        assert _mean_difference(rank["losses"], bf16["losses"]) <= BF16_MIXED_LOSS_TOLERANCE
        assert _mean_difference(rank["no_tp_losses"], bf16["losses"]) <= BF16_MIXED_LOSS_TOLERANCE
        assert _mean_difference(rank["data_parallel_losses"], bf16["losses"]) <= BF16_MIXED_LOSS_TOLERANCE
        assert _mean_difference(rank["zero1_losses"], bf16["losses"]) <= BF16_MIXED_LOSS_TOLERANCE
        gradients.update(rank["no_tp_first_grads"])
    assert gradients.keys() == bf16["first_grads"].keys()
    assert worst_relative_difference(gradients, bf16["first_grads"]) <= BF16_MIXED_GRADIENT_TOLERANCE
    # ... and the fp32 parity check (rtol 1e-5) rejects this bf16 run, so fp32 parity means fp32 ran.
    with pytest.raises(AssertionError):
        torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(fp32["losses"]), rtol=1e-5, atol=0)


def test_bf16_true_matches_single_process_bf16_true(fp16, references):
    """bf16 weights and optimizer state on both sides; fp32 and bf16-mixed references are rejected."""
    expected = references["bf16-true"]["losses"]
    for other in ("fp32", "bf16-mixed"):
        assert _mean_difference(references[other]["losses"], expected) > BF16_TRUE_LOSS_TOLERANCE
    for rank in fp16:
        assert rank["bf16_true_dtypes"] == {"torch.bfloat16"}
        assert _mean_difference(rank["bf16_true"], expected) <= BF16_TRUE_LOSS_TOLERANCE
        assert _mean_difference(rank["zero1"]["bf16_true"], expected) <= BF16_TRUE_LOSS_TOLERANCE


def test_fp16_matches_single_process_fp16_with_grad_scaler(fp16, references):
    """The same step is skipped on one process (torch.amp.GradScaler) and at (2, 2, 1); a reference that
    skips nothing is rejected by the tolerance."""
    expected = references["16-mixed"]["losses"][:6]
    assert _mean_difference(references["16-mixed-no-skip"]["losses"][:6], expected) > FP16_LOSS_TOLERANCE
    for rank in fp16:
        assert rank["fp16_dtypes"] == {"torch.float16"}
        assert _mean_difference(rank["straight"], expected) <= FP16_LOSS_TOLERANCE
        # zero1 at (1, 1, 4), no inf injected: the scaler's unscaling of the parts follows the plain fp16 run.
        assert rank["zero1"]["fp16_dtypes"] == {"torch.float16"}
        no_skip = references["16-mixed-no-skip"]["losses"][:6]
        assert _mean_difference(rank["zero1"]["fp16"], no_skip) <= FP16_LOSS_TOLERANCE


def test_inf_on_one_tp_rank_makes_every_rank_skip_and_halve_the_scale(fp16):
    initial = 2.0**16
    for rank in fp16:
        assert rank["scales"][: INF_STEP + 1] == [initial, initial, initial / 2, initial / 2]
        assert rank["changed"] == [True, True, False, True, True, True]


def test_scaler_state_survives_resume(fp16):
    for rank in fp16:
        assert rank["resumed_scales"] == rank["scales"][4:]
        assert rank["resumed"] == rank["straight"][4:]


def test_precision_plugin_autocasts_on_the_strategy_device():
    plugin = TP3DPrecision("16-mixed")
    plugin.bind_device("cuda")
    assert plugin.device == "cuda" and plugin.scaler._device == "cuda"
    chosen = TP3DPrecision("bf16-mixed", device="cpu")
    chosen.bind_device("cuda")
    assert chosen.device == "cpu"


def test_precision_plugin_choices():
    assert isinstance(TP3DPrecision("16-mixed").scaler, ModelParallelGradScaler)
    assert TP3DPrecision("bf16-mixed").scaler is None
    with pytest.raises(ValueError, match=r"TP3DPrecision\(precision='32-true'\): use '16-mixed' or 'bf16-mixed'"):
        TP3DPrecision("32-true")


def run_sixteen_true() -> list[str]:
    """`16-true` through the Trainer and through Fabric: both refuse it before training."""
    from lightning_tp3d import TP3DFabricStrategy
    from tests.helpers import reference_network

    messages = []
    trainer = L.Trainer(**trainer_kwargs(devices=1, max_steps=1, precision="16-true", strategy=TP3DStrategy()))
    try:
        trainer.fit(CausalLMModule("tiny"), TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=2))
    except ValueError as error:
        messages.append(str(error))
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="16-true", strategy=TP3DFabricStrategy())
    fabric.launch()
    try:
        fabric.setup(reference_network())
    except ValueError as error:
        messages.append(str(error))
    return messages


def test_sixteen_true_is_refused_with_the_alternatives():
    (messages,) = run_distributed(1, "tests.strategies.test_precision:run_sixteen_true")
    assert len(messages) == 2
    for message in messages:
        assert "precision='16-true' (fp16 weights, no loss scaling) is not supported" in message
        assert "TP3DPrecision('16-mixed')" in message


def test_the_loss_scale_is_read_as_a_tensor_without_a_host_synchronisation():
    from lightning_tp3d.strategies.precision import ModelParallelGradScaler, current_loss_scale

    assert current_loss_scale(None) == 1.0
    scaler = ModelParallelGradScaler(device="cpu", init_scale=1024.0)
    assert current_loss_scale(scaler) == 1024.0  # before the first step: the initial scale
    scaler.scale(torch.ones(()))
    scale = current_loss_scale(scaler)
    assert isinstance(scale, torch.Tensor) and scale.item() == 1024.0
