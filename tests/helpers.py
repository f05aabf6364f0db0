"""Shared pieces of the training tests: the single-process reference and what a parallel run records."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_tp3d.callbacks.monitor import local_storage_bytes
from lightning_tp3d.data import TokenDataModule
from lightning_tp3d.models import CausalLMModule
from lightning_tp3d.parallel.nf4 import dequantized

SEQ_LEN = 16
LEARNING_RATE = 3e-3


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective over its mesh when it is a DTensor), detached on the CPU; an NF4 weight
    (QLoRA) as the values it stands for."""
    tensor = dequantized(tensor)
    tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return tensor.detach().cpu().clone()


def named_full(module: nn.Module, attribute: str = "data", prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Whole parameters (or gradients: of the parameters that have one) by name, with the LightningModule's
    `prefix` removed."""
    values = {}
    for name, parameter in module.named_parameters():
        value = parameter if attribute == "data" else parameter.grad
        if value is not None:
            values[name.removeprefix(prefix)] = full_tensor(value)
    return values


class MemoryLogger(Logger):
    """Keeps every logged metric: (step, name, value)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.extend((step, key, float(value)) for key, value in metrics.items())

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def values(self, key: str) -> list[float]:
        return [value for _, name, value in self.records if name == key]


class CaptureGradients(Callback):
    """Whole gradients before the first optimizer update, and whole parameters at the end of fit."""

    def __init__(self, prefix: str = "model.") -> None:
        self.prefix = prefix
        self.first_grads: dict[str, torch.Tensor] | None = None
        self.final_params: dict[str, torch.Tensor] | None = None
        self.misplaced_gradients: list[str] = []  # gradients placed unlike their parameter
        self.gradient_bytes = self.parameter_bytes = 0  # this rank's storage, before the first update

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.first_grads is None:
            # the optimizer's parameters hold the reduced gradients (in "zero1" mode: each dp rank's parts)
            core = getattr(trainer.strategy, "core", None)
            owner = core.data_parallel.optimizer_owner(pl_module) if core is not None else pl_module
            self.first_grads = named_full(owner, "grad", self.prefix)
            parameters = dict(pl_module.named_parameters())
            self.misplaced_gradients = [
                name for name, parameter in parameters.items()
                if getattr(parameter, "placements", None) != getattr(parameter.grad, "placements", None)
            ]
            self.parameter_bytes = local_storage_bytes(parameters.values())
            self.gradient_bytes = local_storage_bytes(parameter.grad for parameter in parameters.values())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.final_params = named_full(pl_module, "data", self.prefix)


# bf16-mixed parity, per gradient tensor: ||g - g_ref|| / ||g_ref|| against the single-process bf16 autocast
# run. bf16 rounds each matmul output to 2^-9 relative; a layout changes which sums are rounded where (micro-
# batches, dp halves reduced in fp32), so a gradient moves by a few of those roundings, ~1e-3 in norm. The
# fp32 run's gradients differ from the bf16 run's by more than 5e-3 (each parity test asserts it), so the
# bound rejects a run that silently trained in fp32.
BF16_MIXED_GRADIENT_TOLERANCE = 5e-3
# LoRA factors' gradients are products through the small factors (A x, then B^T g): each carries the
# roundings of two more bf16 matmuls, and the factors of r = 4 sum few terms, so the same few re-roundings
# weigh about twice as much. The fp32 run's factor gradients differ from the bf16 run's by 2-3% at the
# median and 7-10% at the worst tensor on the tiny model (asserted > the bound in each test).
BF16_MIXED_LORA_GRADIENT_TOLERANCE = 1e-2


def worst_relative_difference(tensors: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """max over `tensors` of ||t - t_ref|| / ||t_ref||."""
    return max(((tensors[name] - reference[name]).norm() / reference[name].norm()).item() for name in tensors)


def assert_adam_weights_close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Weights after several AdamW steps from the same start, parallel against single-process.

    AdamW moves an entry by lr x m / (sqrt(v) + eps) a step, at most about lr. The two runs' gradients
    agree to fp32 rounding of their different summation orders, so almost every entry differs by rounding
    alone (~1e-9). An entry whose gradient comes out of cancellation near eps's scale (1e-8) is the
    exception: its step depends on g / eps, and a rounding difference in g can move it by a good fraction
    of lr, or flip its sign in the sign-like first step (measured: 1.29e-4 on 1 of 8,192 entries after 2
    steps at (2, 2, 1); up to 1.3e-5 on a few dozen after 8 at (2, 2, 2)). So what separates a right run
    from a wrong one is how many entries differ, not by how much the worst one does:

    * at most 1% of the entries differ by more than 1e-5 (a 300th of a step at lr 3e-3; measured: at
      most 0.02%);
    * the mean |difference| is at most 1e-6: the rounding of the rest (1e-9) plus at most 1% of the entries
      at a thirtieth of a step, 1e-4 (measured: 2e-8 and, on an AMD EPYC, 1.006e-7, above an earlier
      bound of 1e-7 set at one machine's value);
    * no entry differs by more than 1e-2, three whole steps (a blow-up).

    A lost, stale or misplaced optimizer state, or a wrong gradient, moves most entries by ~lr: over half
    of them beyond 1e-5 and a mean of ~1e-3."""
    difference = (actual - expected).abs()
    assert difference.max().item() <= 1e-2, (name, "max", difference.max().item())
    assert (difference > 1e-5).float().mean().item() <= 0.01, (name, "share > 1e-5",
                                                              (difference > 1e-5).float().mean().item())
    assert difference.mean().item() <= 1e-6, (name, "mean", difference.mean().item())


def world_size() -> int:
    """Lightning's environment removes WORLD_SIZE at teardown; later Trainers in the process read the group."""
    if torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ["WORLD_SIZE"])


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs = dict(
        accelerator="cpu", max_steps=10, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=1, num_sanity_val_steps=0, limit_val_batches=0,
    )
    kwargs.update(overrides)
    return kwargs


def _training_sample_order(num_samples: int, seed: int = 0) -> torch.Tensor:
    """Lightning shuffles training data with `DistributedSampler(seed=PL_GLOBAL_SEED or 0)`: epoch 0 is
    `randperm(n)` from a generator seeded with `seed`, and rank r takes every dp-th index from r on."""
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))


def reference_network() -> nn.Module:
    module = CausalLMModule("tiny", learning_rate=LEARNING_RATE)
    module.configure_model()
    return module.model


def reference_run(
    steps: int,
    global_batch_size: int,
    clip_norm: float | None = None,
    validate_batch_size: int | None = None,
    build_network: Callable[[], nn.Module] = reference_network,
    autocast_dtype: torch.dtype | None = None,
    accumulate: int = 1,
    parameter_dtype: torch.dtype | None = None,
    scaler_inf_step: int | None = None,
    loss_of: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    skip_steps: Collection[int] = (),
    warmup_steps: int = 0,
) -> dict[str, Any]:
    """Plain single-process PyTorch: the same network, data order and AdamW as the module, no Lightning.

    Each step takes the next `global_batch_size` windows of the epoch's permutation, which is exactly the
    union of what the dp ranks' DistributedSamplers hand out in that step. With `autocast_dtype` the
    forward runs under `torch.autocast("cpu", dtype=autocast_dtype)` (fp32 weights and optimizer); with
    `parameter_dtype` the weights and AdamW's state are of that dtype (Lightning's `bf16-true`).

    With `scaler_inf_step` the loss goes through `torch.amp.GradScaler` (fp16 training), and at that step
    (1-based) an inf written into one gradient makes the scaler skip the update and halve its scale.

    With `accumulate` = k, `last_batch_losses` holds what a run accumulating k batches per step logs: the
    loss of the last k-th of each step's samples (its dp ranks' last batches), before the update.

    At `skip_steps` (1-based) the loss is computed but nothing is updated: no optimizer step, no scheduler
    step. `warmup_steps` adds the module's linear warm-up (`LambdaLR`, stepped after every update).

    `loss_of(model, input_ids, labels)` computes a batch's loss (default: `model(input_ids, labels=labels)`,
    this package's contract; a Hugging Face model's is `model(input_ids=..., labels=input_ids).loss`)."""
    loss_of = loss_of or (lambda network, input_ids, labels: network(input_ids, labels=labels))
    model = build_network()
    if parameter_dtype is not None:
        model = model.to(parameter_dtype)
    scaler = torch.amp.GradScaler("cpu", enabled=scaler_inf_step is not None)
    data = TokenDataModule(source="tiny", seq_len=SEQ_LEN, batch_size=global_batch_size, val_fraction=0.2)
    data.setup()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup_steps)
                                                  if warmup_steps else 1.0)
    losses, last_batch_losses, first_grads = [], [], None
    order = _training_sample_order(len(data.train_dataset))
    for step in range(steps):
        samples = [data.train_dataset[int(i)] for i in order[step * global_batch_size : (step + 1) * global_batch_size]]
        input_ids = torch.stack([sample["input_ids"] for sample in samples])
        labels = torch.stack([sample["labels"] for sample in samples])
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            loss = loss_of(model, input_ids, labels)
            if accumulate > 1:
                with torch.no_grad():
                    last = global_batch_size - global_batch_size // accumulate
                    last_batch_losses.append(loss_of(model, input_ids[last:], labels[last:]).item())
        scaler.scale(loss).backward()
        if step + 1 == scaler_inf_step:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.unscale_(optimizer)
        if first_grads is None:
            first_grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        losses.append(loss.item())
        if step + 1 in skip_steps:
            continue
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
    result = {"losses": losses, "last_batch_losses": last_batch_losses, "first_grads": first_grads,
              "final_params": {name: full_tensor(p) for name, p in model.named_parameters()}}
    if validate_batch_size is not None:
        result["val_loss"] = reference_validation_loss(model, data, batch_size=validate_batch_size)
    return result


def assert_bf16_mixed_gradients(gradients: dict[str, torch.Tensor], global_batch_size: int,
                                build_network: Callable[[], nn.Module],
                                loss_of: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
                                tolerance: float) -> None:
    """`gradients` (name -> first-step gradient, gathered whole) within `tolerance` (worst ||g - g_ref|| /
    ||g_ref||) of the one-process bf16 autocast run of `build_network`'s, a bound the one-process fp32 run's
    gradients must exceed (so the check tells a run that trained in bf16 from one that did not)."""
    bf16 = reference_run(1, global_batch_size, build_network=build_network, loss_of=loss_of,
                         autocast_dtype=torch.bfloat16)["first_grads"]
    fp32 = reference_run(1, global_batch_size, build_network=build_network, loss_of=loss_of)["first_grads"]
    assert worst_relative_difference(fp32, bf16) > tolerance
    assert gradients.keys() == bf16.keys()
    assert worst_relative_difference(gradients, bf16) <= tolerance


@torch.no_grad()
def reference_validation_loss(model: nn.Module, data: TokenDataModule, batch_size: int, dp: int = 2) -> float:
    """Lightning's distributed validation, replayed: per dp rank a DistributedSampler shard, the mean of its
    batch losses, then the mean over dp ranks."""
    model.eval()
    rank_means = []
    for rank in range(dp):
        sampler = torch.utils.data.DistributedSampler(data.val_dataset, num_replicas=dp, rank=rank, shuffle=False)
        loader = torch.utils.data.DataLoader(data.val_dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
        batch_losses = [model(batch["input_ids"], labels=batch["labels"]).item() for batch in loader]
        rank_means.append(sum(batch_losses) / len(batch_losses))
    model.train()
    return sum(rank_means) / dp


def assert_ranks_match(name: str, rank_results: list[dict[str, Any]], reference: dict[str, Any], rtol: float,
                       atol: float) -> set[str]:
    """Every rank's losses (rtol) and first gradients (per tensor, rtol and atol) equal the reference run's;
    returns the names of the gradients the ranks held together (their stages' parameters)."""
    covered: set[str] = set()
    for rank, rank_result in enumerate(rank_results):
        torch.testing.assert_close(torch.tensor(rank_result["losses"]), torch.tensor(reference["losses"]),
                                   rtol=rtol, atol=0.0, msg=lambda message, rank=rank: f"{name} rank {rank}: {message}")
        for key, gradient in rank_result["first_grads"].items():
            torch.testing.assert_close(gradient, reference["first_grads"][key], rtol=rtol, atol=atol,
                                       msg=lambda message, rank=rank, key=key: f"{name} rank {rank} {key}: {message}")
        covered.update(rank_result["first_grads"])
    return covered
