"""Noise schedules: change the noise multiplier between steps, as Opacus's ``ExponentialNoise``/``StepNoise``.

A scheduler holds the training it drives (a ``PrivateTraining`` or a ``DPStep``, anything with an assignable
``noise_multiplier``) and sets ``noise_multiplier`` on each ``step()``, like ``torch.optim.lr_scheduler`` sets
the learning rate: call ``scheduler.step()`` once per epoch (or per step, as you choose). The accountant of a
``PrivateTraining`` records the noise multiplier each DP-SGD step actually used, so a schedule is accounted
exactly (dp-accounting composes the per-step mechanisms).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from .._errors import DPConfigError
from .config import check_noise_multiplier, check_number, is_int, is_number, not_a_number


class HasNoise(Protocol):
    noise_multiplier: float


#: the keys of ``NoiseScheduler.state_dict()``
_STATE_KEYS = ("base_noise_multiplier", "last_epoch")


class NoiseScheduler:
    """Base class: ``noise_at(epoch)`` is the noise multiplier for ``epoch`` (0 is the one the training had
    when the scheduler was built). ``step()`` advances the epoch and sets it on the training. A refused
    ``step()`` or ``load_state_dict`` changes neither the scheduler nor the training."""

    def __init__(self, training: HasNoise, last_epoch: int = -1):
        if not hasattr(training, "noise_multiplier"):
            raise DPConfigError(f"{type(self).__name__}: training must be what make_private or compile_step "
                                f"returned (anything with an assignable noise_multiplier), got "
                                f"{type(training).__name__}")
        self.training = training
        self.base_noise_multiplier = float(training.noise_multiplier)
        self.last_epoch = self._check_epoch("last_epoch", last_epoch, -1)
        self.step()

    def noise_at(self, epoch: int) -> float:
        raise NotImplementedError

    def _check_epoch(self, name: str, value: object, least: int) -> int:
        if not (is_int(value) and value >= least):
            raise DPConfigError(f"{type(self).__name__}: {name} must be an int >= {least}, got "
                                f"{type(value).__name__} {value!r}")
        return int(value)

    def _check_gamma(self, gamma: object) -> float:
        try:
            gamma = check_number("gamma", gamma)
        except DPConfigError as error:
            raise DPConfigError(f"{type(self).__name__}: {error}") from None
        if not 0 < gamma < math.inf:
            raise DPConfigError(f"{type(self).__name__}: gamma must be a positive finite number, got {gamma}")
        return float(gamma)

    def _set_noise(self, epoch: int) -> None:
        """Set the noise multiplier of ``epoch`` on the training, or raise before anything is set."""
        try:
            sigma = self.noise_at(epoch)
        except OverflowError:  # gamma ** epoch past float's range
            raise DPConfigError(f"{type(self).__name__}: the noise multiplier at epoch {epoch} is past float's "
                                "range") from None
        if not sigma >= 0:
            raise DPConfigError(f"{type(self).__name__} gave noise_multiplier={sigma} at epoch {epoch}")
        try:
            self.training.noise_multiplier = float(sigma)  # validated by the training, which raises before setting
        except DPConfigError as error:
            raise DPConfigError(f"{type(self).__name__} at epoch {epoch}: {error}") from None

    def step(self) -> None:
        """Move to the next epoch and set its noise multiplier; a refused one leaves the epoch as it was."""
        epoch = self.last_epoch + 1
        self._set_noise(epoch)
        self.last_epoch = epoch

    def get_noise_multiplier(self) -> float:
        """The noise multiplier of the current epoch (Opacus's name)."""
        return float(self.noise_at(self.last_epoch))

    def state_dict(self) -> dict:
        return {"base_noise_multiplier": self.base_noise_multiplier, "last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict) -> None:
        """Restore the schedule's position and set the noise multiplier of that epoch on the training; a refused
        state (not ``state_dict()``'s keys and values, or a noise the training refuses) changes nothing."""
        name = f"{type(self).__name__}.load_state_dict"
        fix = f"Nothing was loaded. Fix: load what {type(self).__name__}.state_dict() returned"
        if not isinstance(state, dict):
            raise DPConfigError(f"{name}: the state must be a dict with keys {list(_STATE_KEYS)}, got "
                                f"{type(state).__name__}. {fix}")
        missing = [k for k in _STATE_KEYS if k not in state]
        unknown = sorted((k for k in state if k not in _STATE_KEYS), key=repr)
        if missing or unknown:
            found = "; ".join(f"{what} {keys}" for what, keys in (("missing", missing), ("unknown", unknown)) if keys)
            raise DPConfigError(f"{name}: the state must have the keys {list(_STATE_KEYS)}, {found}. {fix}")
        try:
            base = check_noise_multiplier(state["base_noise_multiplier"], "base_noise_multiplier")
        except DPConfigError as error:
            raise DPConfigError(f"{name}: {error}. {fix}") from None
        epoch = state["last_epoch"]
        if not (is_int(epoch) and epoch >= 0):
            raise DPConfigError(f"{name}: last_epoch must be an int >= 0, got {type(epoch).__name__} {epoch!r}. "
                                f"{fix}")
        epoch = int(epoch)
        kept = self.base_noise_multiplier
        self.base_noise_multiplier = base  # noise_at reads it: put back if the training refuses the noise
        try:
            self._set_noise(epoch)
        except BaseException:
            self.base_noise_multiplier = kept
            raise
        self.last_epoch = epoch


class ExponentialNoise(NoiseScheduler):
    """``sigma_0 * gamma ** epoch``."""

    def __init__(self, training: HasNoise, gamma: float, last_epoch: int = -1):
        self.gamma = self._check_gamma(gamma)
        super().__init__(training, last_epoch)

    def noise_at(self, epoch: int) -> float:
        return self.base_noise_multiplier * self.gamma ** epoch


class StepNoise(NoiseScheduler):
    """``sigma_0 * gamma ** (epoch // step_size)``: multiplied by ``gamma`` every ``step_size`` epochs."""

    def __init__(self, training: HasNoise, step_size: int, gamma: float = 0.1, last_epoch: int = -1):
        if not (is_int(step_size) and step_size >= 1):
            raise DPConfigError(f"StepNoise: step_size must be a positive int, got {type(step_size).__name__} "
                                f"{step_size!r}")
        self.step_size, self.gamma = int(step_size), self._check_gamma(gamma)
        super().__init__(training, last_epoch)

    def noise_at(self, epoch: int) -> float:
        return self.base_noise_multiplier * self.gamma ** (epoch // self.step_size)


class LambdaNoise(NoiseScheduler):
    """``sigma_0 * noise_lambda(epoch)``; ``noise_lambda`` returns a real number."""

    def __init__(self, training: HasNoise, noise_lambda: Callable[[int], float], last_epoch: int = -1):
        if not callable(noise_lambda):
            raise DPConfigError(f"LambdaNoise: noise_lambda must be a function of the epoch, got "
                                f"{type(noise_lambda).__name__} {noise_lambda!r}")
        self.noise_lambda = noise_lambda
        super().__init__(training, last_epoch)

    def noise_at(self, epoch: int) -> float:
        factor = self.noise_lambda(epoch)
        if not is_number(factor):
            raise not_a_number(f"LambdaNoise: noise_lambda({epoch})", factor, "return a number")
        return self.base_noise_multiplier * float(factor)
