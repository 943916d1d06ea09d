"""``make_private``: the model, optimizer and loader of a training loop, turned into DP-SGD (like Opacus's
``PrivacyEngine.make_private``), with the step compiled by ``compile_step`` and the accounting delegated to
dp-accounting or opacus (``accounting.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from . import distributed as dist_utils
from .accounting import Accountant, calibrate_noise
from .sampling import poisson_loader
from .step import DPStep, compile_step


class PrivateTraining:
    """What ``make_private`` returns: ``step(*batch) -> loss`` (one DP-SGD step, counted by the accountant),
    ``data_loader`` (Poisson-sampled), ``epsilon(delta)`` and the parameters of the mechanism."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                 dp_step: DPStep, accountant: Accountant, sample_rate: float, target_delta: float):
        self.model = model
        self.optimizer = optimizer
        self.data_loader = data_loader
        self.dp_step = dp_step
        self.accountant = accountant
        self.sample_rate = sample_rate
        self.target_delta = target_delta

    @property
    def noise_multiplier(self) -> float:
        return self.dp_step.noise_multiplier

    @property
    def max_grad_norm(self) -> float:
        return self.dp_step.max_grad_norm

    @property
    def expected_batch_size(self) -> float:
        return self.dp_step.expected_batch_size

    @property
    def compile_seconds(self) -> float:
        return self.dp_step.compile_seconds

    def step(self, *batch) -> torch.Tensor:
        loss = self.dp_step(*batch)
        self.accountant.step(self.noise_multiplier, self.sample_rate)
        return loss

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (default: ``target_delta``)."""
        return self.accountant.epsilon(self.target_delta if delta is None else delta)


def make_private(model: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                 loss_fn: Callable, *, noise_multiplier: float | None = None,
                 target_epsilon: float | None = None,
                 target_delta: float = 1e-5, epochs: int | None = None, max_grad_norm: float = 1.0,
                 accountant: str = "rdp", secure_rng: bool = False, poisson_sampling: bool = True,
                 loss_reduction: str = "mean", backend: str = "inductor",
                 generator: torch.Generator | None = None,
                 sample_rate: float | None = None) -> PrivateTraining:
    """Make a training loop differentially private (DP-SGD, Abadi et al. 2016).

    ``loss_fn(*batch)`` is the batched loss of ``model`` on one batch as ``data_loader`` yields it. Give
    either ``noise_multiplier`` or ``target_epsilon`` (with ``epochs``: sigma is then calibrated by the
    accountant library for ``epochs * len(data_loader)`` steps at ``target_delta``). The sampling rate is
    ``1 / len(data_loader)`` (batch size over dataset size); the returned ``data_loader`` Poisson-samples the
    same dataset at that rate (``poisson_sampling=False`` keeps the loader as it is, which the accountant's
    analysis does not cover). The gradient is divided by the expected batch size ``q * N`` (``N`` summed over
    the ranks under ``torch.distributed``, where every rank passes a loader over its own shard).

    The per-sample graph is captured on the loader's first batch, so a model that mixes samples (BatchNorm in
    training mode, ...) is refused here with ``compiled_psg.SampleMixingError``.
    """
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ValueError("give exactly one of noise_multiplier and target_epsilon")
    if target_epsilon is not None and epochs is None:
        raise ValueError("target_epsilon needs epochs (the number of passes the noise is calibrated for)")
    if sample_rate is None:
        sample_rate = 1 / len(data_loader)
    if dist_utils.is_distributed():
        low = -dist_utils.all_reduce_scalar(-sample_rate, op=torch.distributed.ReduceOp.MAX)
        high = dist_utils.all_reduce_scalar(sample_rate, op=torch.distributed.ReduceOp.MAX)
        if abs(high - low) > 1e-12:
            raise ValueError(f"ranks disagree on the sampling rate ({low} .. {high}): give every rank a "
                             "shard of the same size and the same batch size, or pass sample_rate=")
    steps_per_epoch = max(1, round(1 / sample_rate))
    if target_epsilon is not None:
        noise_multiplier = calibrate_noise(target_epsilon, target_delta, sample_rate,
                                           epochs * steps_per_epoch, accountant)
    global_size = dist_utils.all_reduce_scalar(float(len(data_loader.dataset)))
    expected_batch_size = sample_rate * global_size

    # capture on a real batch first: a model that mixes samples is refused before any training
    first = next(iter(data_loader))
    first = tuple(first) if isinstance(first, list | tuple) else (first,)
    device = next(p.device for p in model.parameters())
    first = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in first)
    dp_step = compile_step(loss_fn, model, optimizer, max_grad_norm=max_grad_norm,
                           noise_multiplier=noise_multiplier, expected_batch_size=expected_batch_size,
                           loss_reduction=loss_reduction, secure_rng=secure_rng, backend=backend,
                           generator=generator)
    start = time.perf_counter()
    dp_step.per_sample.compiled_for(*first)
    dp_step.compile_seconds += time.perf_counter() - start

    loader = data_loader
    if poisson_sampling:
        loader = poisson_loader(data_loader, sample_rate, steps=steps_per_epoch, generator=generator,
                                secure=secure_rng)
    return PrivateTraining(model, optimizer, loader, dp_step, Accountant(accountant), sample_rate,
                           target_delta)
