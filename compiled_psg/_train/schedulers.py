"""Noise schedules: change the noise multiplier between steps, as Opacus's ``ExponentialNoise``/``StepNoise``.

A scheduler holds the training it drives (a ``PrivateTraining`` or a ``DPStep``, anything with an assignable
``noise_multiplier``) and sets ``noise_multiplier`` on each ``step()``, like ``torch.optim.lr_scheduler`` sets
the learning rate: call ``scheduler.step()`` once per epoch (or per step, as you choose). The accountant of a
``PrivateTraining`` records the noise multiplier each DP-SGD step actually used, so a schedule is accounted
exactly (dp-accounting composes the per-step mechanisms).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .._errors import DPConfigError


class HasNoise(Protocol):
    noise_multiplier: float


class NoiseScheduler:
    """Base class: ``noise_at(epoch)`` is the noise multiplier for ``epoch`` (0 is the one the training had
    when the scheduler was built). ``step()`` advances the epoch and sets it on the training."""

    def __init__(self, training: HasNoise, last_epoch: int = -1):
        if not hasattr(training, "noise_multiplier"):
            raise DPConfigError(f"{type(self).__name__}: training must be what make_private or compile_step "
                                f"returned (anything with an assignable noise_multiplier), got "
                                f"{type(training).__name__}")
        self.training = training
        self.base_noise_multiplier = float(training.noise_multiplier)
        self.last_epoch = last_epoch
        self.step()

    def noise_at(self, epoch: int) -> float:
        raise NotImplementedError

    def step(self) -> None:
        """Move to the next epoch and set its noise multiplier; a refused one leaves the epoch as it was."""
        epoch = self.last_epoch + 1
        sigma = float(self.noise_at(epoch))
        if not sigma >= 0:
            raise DPConfigError(f"{type(self).__name__} gave noise_multiplier={sigma} at epoch {epoch}")
        self.training.noise_multiplier = sigma  # validated by the training: raises before the epoch moves
        self.last_epoch = epoch

    def get_noise_multiplier(self) -> float:
        """The noise multiplier of the current epoch (Opacus's name)."""
        return float(self.noise_at(self.last_epoch))

    def state_dict(self) -> dict:
        return {"base_noise_multiplier": self.base_noise_multiplier, "last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict) -> None:
        """Restore the schedule's position and set the noise multiplier of that epoch on the training."""
        self.base_noise_multiplier = float(state["base_noise_multiplier"])
        self.last_epoch = int(state["last_epoch"])
        self.training.noise_multiplier = self.get_noise_multiplier()


class ExponentialNoise(NoiseScheduler):
    """``sigma_0 * gamma ** epoch``."""

    def __init__(self, training: HasNoise, gamma: float, last_epoch: int = -1):
        if not gamma > 0:
            raise DPConfigError(f"gamma must be positive, got {gamma}")
        self.gamma = gamma
        super().__init__(training, last_epoch)

    def noise_at(self, epoch: int) -> float:
        return self.base_noise_multiplier * self.gamma ** epoch


class StepNoise(NoiseScheduler):
    """``sigma_0 * gamma ** (epoch // step_size)``: multiplied by ``gamma`` every ``step_size`` epochs."""

    def __init__(self, training: HasNoise, step_size: int, gamma: float = 0.1, last_epoch: int = -1):
        if not (isinstance(step_size, int) and step_size >= 1):
            raise DPConfigError(f"step_size must be a positive int, got {step_size!r}")
        if not gamma > 0:
            raise DPConfigError(f"gamma must be positive, got {gamma}")
        self.step_size, self.gamma = step_size, gamma
        super().__init__(training, last_epoch)

    def noise_at(self, epoch: int) -> float:
        return self.base_noise_multiplier * self.gamma ** (epoch // self.step_size)


class LambdaNoise(NoiseScheduler):
    """``sigma_0 * noise_lambda(epoch)``."""

    def __init__(self, training: HasNoise, noise_lambda: Callable[[int], float], last_epoch: int = -1):
        self.noise_lambda = noise_lambda
        super().__init__(training, last_epoch)

    def noise_at(self, epoch: int) -> float:
        return self.base_noise_multiplier * float(self.noise_lambda(epoch))
