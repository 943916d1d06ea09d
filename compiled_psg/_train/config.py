"""``DPConfig``: the settings of one DP-SGD step, as a frozen value.

A step reads its config once at the start of every call and runs the whole step (clipping, noise, scaling) with
that snapshot, so a setting changed between steps takes effect at the next step, and ``step.last_config`` says
exactly what the last step used (the accountant records its noise multiplier).

Sensitivity (add or remove one sample) of the clipped sum, which the noise std is proportional to:

- ``"flat"``: ``C``; ``"automatic"``: ``C`` (each contribution is ``C g / (||g|| + gamma)``, of norm < ``C``);
- ``"per_layer"``: ``sqrt(sum_k C_k^2)`` (the joint bound: group ``k``'s part of a contribution has norm <= C_k);
- ``"adaptive"`` (flat clipping, ``C`` updated every step from a noisy count of unclipped samples, Andrew et al.
  2021): the gradient gets noise multiplier ``sigma_g = (sigma^-2 - (2 sigma_b)^-2)^-1/2`` and the centred count
  noise std ``sigma_b``, so that the two releases together are one Gaussian mechanism of noise multiplier
  ``sigma`` (``noise_multiplier``), which is what the accountant records.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from .._errors import DPConfigError, as_python, is_int, is_number  # noqa: F401 (the settings' checks)
from .._reduce.reductions import check_memory_budget

LOSS_REDUCTIONS = ("mean", "sum")
CLIPPING = ("flat", "per_layer", "automatic", "adaptive", "custom")


def not_a_number(name: str, value: object, expected: str = "be a number") -> DPConfigError:
    """The refusal of ``value`` for the setting ``name`` ("{name} must {expected}"), naming its type; a
    one-element tensor names the fix."""
    fix = ": pass float(t)" if isinstance(value, torch.Tensor) and value.numel() == 1 else ""
    return DPConfigError(f"{name} must {expected}, got {type(value).__name__} {value!r}{fix}")


def check_number(name: str, value, *, optional: bool = False) -> int | float | None:
    """``value`` as a Python number (``as_python``), or None where ``optional``; else a DPConfigError naming the
    setting, before a comparison with it raises a raw TypeError."""
    if optional and value is None:
        return None
    if not is_number(value):
        raise not_a_number(name, value, "be a number or None" if optional else "be a number")
    return as_python(value)


def check_noise_multiplier(value, name: str = "noise_multiplier") -> float:
    """``value`` as a Python float if it is a finite number >= 0: NaN, infinite or negative noise has no privacy
    meaning (infinite noise turns every parameter into inf/NaN, and an accountant would report epsilon 0)."""
    sigma = check_number(name, value)
    if not 0 <= sigma < math.inf:
        raise DPConfigError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(sigma)


def _as_bound(value):
    """A float, or a tuple of floats for per-group bounds (lists are accepted and frozen)."""
    if value is None or is_number(value):
        return None if value is None else float(value)
    if isinstance(value, Sequence) and not isinstance(value, str) and all(is_number(v) for v in value):
        return tuple(float(v) for v in value)
    raise not_a_number("max_grad_norm", value, "be a number, a list of numbers (clipping='per_layer') or None")


_LOG_FLOAT_MAX = math.log(sys.float_info.max)

#: How many stds the range checks leave room for in one noise draw. A standard normal passes 40 with probability
#: erfc(40 / sqrt 2) = 7.3e-350 per draw: 1.3e-329 for 2^64 draws, more than any training makes.
NOISE_TAIL_STDS = 40.0

#: The settings that define the mechanism: what is clipped, how, and what the noise is added to. They are fixed
#: when a step is built; a saved state is loaded only into a step built with the same ones.
MECHANISM = ("clipping", "loss_reduction", "clip_groups")


def _largest(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def draw_overflows(std: float, dtype: torch.dtype, offset: float = 0.0, factor: float = 1.0) -> bool:
    """Whether ``(offset + 40 std) * factor``, the largest plausible draw of N(0, std^2) moved by ``offset`` and
    scaled by ``factor``, is past ``dtype``'s range. In Python floats (float64): a product past float64's range is
    inf, which fails the comparison as it should."""
    return not (offset + NOISE_TAIL_STDS * std) * factor < _largest(dtype)


@dataclass(frozen=True)
class DPConfig:
    """``max_grad_norm``: the per-sample clipping bound ``C`` (None: no clipping, or a custom reduction; a list
    of per-group bounds ``C_k`` with ``clipping="per_layer"``); ``noise_multiplier``: ``sigma``, the accounted
    noise multiplier (noise std ``sigma * sensitivity``); ``expected_batch_size``: the divisor of the noisy sum
    under ``loss_reduction="mean"`` (None: the actual batch size); ``clipping``: ``"flat"`` (one bound over all
    parameters; unclipped when ``max_grad_norm`` is None), ``"per_layer"`` (one bound per group of parameters,
    ``clip_groups``: lists of parameter names, None: one group per trained parameter), ``"automatic"``
    (``C g / (||g|| + automatic_gamma)``, Bu et al. 2022), ``"adaptive"`` (flat, ``C`` follows the
    ``target_unclipped_quantile`` of the norms, Andrew et al. 2021, with ``clipbound_learning_rate``,
    ``unclipped_num_std`` (sigma_b), ``min_clipbound``, ``max_clipbound``: Opacus's names) or ``"custom"``
    (a user reduction replaces the clipped sum); ``memory_budget``: the bytes of per-sample values the plan may
    have at its peak (None: the fastest plan; ``DPClip``)."""

    max_grad_norm: float | tuple[float, ...] | None = None
    noise_multiplier: float = 0.0
    expected_batch_size: float | None = None
    loss_reduction: str = "mean"
    clipping: str = "flat"
    clip_groups: tuple[tuple[str, ...], ...] | None = None
    automatic_gamma: float = 0.01
    target_unclipped_quantile: float = 0.5
    clipbound_learning_rate: float = 0.2
    unclipped_num_std: float | None = None
    min_clipbound: float = 0.0
    max_clipbound: float = math.inf
    memory_budget: float | None = None

    def __post_init__(self) -> None:
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise DPConfigError(f"loss_reduction must be 'mean' or 'sum', got {self.loss_reduction!r}")
        if self.clipping not in CLIPPING:
            raise DPConfigError(f"clipping must be one of {CLIPPING}, got {self.clipping!r}")
        for name in ("automatic_gamma", "target_unclipped_quantile", "clipbound_learning_rate", "min_clipbound",
                     "max_clipbound"):
            object.__setattr__(self, name, check_number(name, getattr(self, name)))
        for name in ("expected_batch_size", "unclipped_num_std"):
            object.__setattr__(self, name, check_number(name, getattr(self, name), optional=True))
        for name in ("automatic_gamma", "target_unclipped_quantile", "clipbound_learning_rate", "min_clipbound",
                     "max_clipbound", "unclipped_num_std"):  # floats: an int past int64 (2**70) fits no tensor op
            value = getattr(self, name)
            if isinstance(value, int):
                try:
                    object.__setattr__(self, name, float(value))
                except OverflowError:
                    raise DPConfigError(f"{name}={value} is past the float range") from None
        object.__setattr__(self, "noise_multiplier", check_noise_multiplier(self.noise_multiplier))
        bound = _as_bound(self.max_grad_norm)
        object.__setattr__(self, "max_grad_norm", bound)
        bounds = bound if isinstance(bound, tuple) else (bound,)
        if bound is not None and not all(b > 0 for b in bounds):
            raise DPConfigError(f"max_grad_norm must be positive, got {self.max_grad_norm}")
        if isinstance(bound, tuple) and self.clipping != "per_layer":
            raise DPConfigError("a list of bounds needs clipping='per_layer' (one bound per group of parameters)")
        if self.clipping == "custom" and bound is not None:
            raise DPConfigError("max_grad_norm applies to the default clip_sum reduction; with a custom reduce, "
                                "clip inside it")
        if self.clipping in ("per_layer", "automatic", "adaptive") and bound is None:
            raise DPConfigError(f"clipping={self.clipping!r} needs max_grad_norm")
        if self.noise_multiplier > 0 and (bound is None or any(math.isinf(b) for b in bounds)):
            raise DPConfigError("noise needs a clipping bound: pass max_grad_norm or reduce=psg.clip_sum(C) (the "
                                "noise std is noise_multiplier * C)")
        if self.expected_batch_size is not None and not (0 < self.expected_batch_size < math.inf
                                                          and 1 / self.expected_batch_size < math.inf):
            # inf scales every update to zero; 1e-320 makes the scale 1/m infinite and every parameter inf
            raise DPConfigError(f"expected_batch_size must be a positive finite number whose inverse is finite, "
                                f"got {self.expected_batch_size}: it divides the noisy sum")
        if self.clip_groups is not None:
            if self.clipping != "per_layer":
                raise DPConfigError("clip_groups applies to clipping='per_layer'")
            groups = tuple(tuple(g) for g in self.clip_groups)
            if not groups or any(not g or not all(isinstance(n, str) for n in g) for g in groups):
                raise DPConfigError("clip_groups must be a non-empty list of non-empty lists of parameter names")
            names = [n for g in groups for n in g]
            if len(set(names)) != len(names):
                raise DPConfigError("clip_groups: a parameter may belong to one group only")
            object.__setattr__(self, "clip_groups", groups)
        if not 0 < self.automatic_gamma < math.inf:  # inf makes every contribution C g / (||g|| + inf) zero
            raise DPConfigError(f"automatic_gamma must be a positive finite number, got {self.automatic_gamma}")
        object.__setattr__(self, "memory_budget", check_memory_budget(self.memory_budget, DPConfigError))
        self._refuse_options_of_other_modes()
        self._check_adaptive()

    def _refuse_options_of_other_modes(self) -> None:
        """An option of another clipping mode, set off its default, would do nothing: refused, naming the mode it
        belongs to (``automatic_gamma=0.5`` with ``clipping="flat"`` clips flat, which the user did not ask)."""
        for mode, names in MODE_OPTIONS.items():
            given = [n for n in names if getattr(self, n) != _DEFAULTS[n]]
            if given and self.clipping != mode:
                values = ", ".join(f"{n}={getattr(self, n)!r}" for n in given)
                raise DPConfigError(f"{values} applies to clipping={mode!r}, and this step clips with "
                                    f"clipping={self.clipping!r}, where it would do nothing. Fix: pass "
                                    f"clipping={mode!r}, or leave {' and '.join(given)} out")

    def _check_adaptive(self) -> None:
        if not 0 <= self.target_unclipped_quantile <= 1:
            raise DPConfigError(f"target_unclipped_quantile must be in [0, 1], got {self.target_unclipped_quantile}")
        if not 0 <= self.clipbound_learning_rate < math.inf:
            # inf times an unclipped fraction exactly on the target is NaN
            raise DPConfigError(f"clipbound_learning_rate must be a finite number >= 0, got "
                                f"{self.clipbound_learning_rate}")
        if not 0 <= self.min_clipbound < self.max_clipbound:
            raise DPConfigError(f"need 0 <= min_clipbound < max_clipbound, got {self.min_clipbound}, "
                                f"{self.max_clipbound}")
        if self.clipping != "adaptive":
            return
        sigma_b = self.unclipped_num_std
        if self.noise_multiplier > 0:
            if sigma_b is None:
                raise DPConfigError("clipping='adaptive' with noise needs unclipped_num_std (sigma_b, the std of "
                                    "the noise on the count of unclipped samples; Andrew et al. suggest about "
                                    "expected_batch_size / 20)")
            if not 2 * sigma_b > self.noise_multiplier:
                raise DPConfigError(f"unclipped_num_std={sigma_b} must exceed noise_multiplier / 2 = "
                                    f"{self.noise_multiplier / 2}: the gradient's noise multiplier is "
                                    "(sigma^-2 - (2 sigma_b)^-2)^-1/2, which needs sigma < 2 sigma_b")
        elif sigma_b is not None and not sigma_b >= 0:
            raise DPConfigError(f"unclipped_num_std must be >= 0, got {sigma_b}")
        if sigma_b is not None and not sigma_b < math.inf:
            raise DPConfigError(f"unclipped_num_std must be finite, got {sigma_b}: infinite noise on the count of "
                                "unclipped samples moves the clip bound to its limits and stalls the training")
        if sigma_b is not None and draw_overflows(sigma_b, torch.float64):
            raise DPConfigError(f"unclipped_num_std={sigma_b:.3g} is past the range of the count's noise: its largest "
                                f"plausible draw ({NOISE_TAIL_STDS:g} std) is past torch.float64's "
                                f"{_largest(torch.float64):.3g}, the dtype it is drawn in. Fix: about "
                                "expected_batch_size / 20 (Andrew et al.)")

    # --- the mechanism --------------------------------------------------------------------------------------
    @property
    def bounds(self) -> tuple[float, ...]:
        """The bounds ``C_k`` (one for every mode but per_layer; infinite: no clipping)."""
        if self.max_grad_norm is None:
            return (math.inf,)
        return self.max_grad_norm if isinstance(self.max_grad_norm, tuple) else (self.max_grad_norm,)

    def group_bounds(self, groups: int) -> tuple[float, ...]:
        """The bound of each of ``groups`` groups: a single ``C`` under per_layer is split evenly,
        ``C / sqrt(K)`` each, so that the joint bound stays ``C``."""
        if self.clipping != "per_layer" or isinstance(self.max_grad_norm, tuple):
            return self.bounds
        return (self.max_grad_norm / math.sqrt(groups),) * groups

    @property
    def sensitivity(self) -> float:
        """The L2 sensitivity of the clipped sum to adding or removing one sample (see the module docstring)."""
        return math.hypot(*self.bounds)  # scaled inside: C * C overflows Python's float from C = 1.4e154

    @property
    def bound(self) -> float:
        """The flat bound (infinite: no clipping); per_layer: the joint bound ``sqrt(sum C_k^2)``."""
        return self.sensitivity

    @property
    def gradient_noise_multiplier(self) -> float:
        """The noise multiplier of the gradient's noise: ``noise_multiplier``, or with adaptive clipping what
        is left after the count's share, ``(sigma^-2 - (2 sigma_b)^-2)^-1/2``."""
        sigma = self.noise_multiplier
        if self.clipping != "adaptive" or sigma == 0:
            return sigma
        # sigma / sqrt(1 - (sigma / 2 sigma_b)^2): the powers -2 overflow Python's float for sigma below 1e-154
        return sigma / math.sqrt(1 - (sigma / (2 * self.unclipped_num_std)) ** 2)

    @property
    def accounted_noise_multiplier(self) -> float:
        """The noise multiplier of the whole step as one Gaussian mechanism, computed from the noise actually
        added (the gradient's, and the count's with adaptive clipping): what the accountant composes."""
        sigma_g = self.gradient_noise_multiplier
        if self.clipping != "adaptive" or sigma_g == 0:
            return sigma_g
        if not self.unclipped_num_std:
            return 0.0  # an exact count releases it without noise: no privacy
        # min: the recomposition equals noise_multiplier up to rounding; never report less noise than was set
        return min(sigma_g / math.hypot(1.0, sigma_g / (2 * self.unclipped_num_std)), self.noise_multiplier)

    @property
    def noise_std(self) -> float:
        """The std of the noise added to the clipped sum: 0 without noise (also for an infinite bound, where
        0 * inf would be NaN)."""
        if self.max_grad_norm is None or self.gradient_noise_multiplier == 0:
            return 0.0
        return self.gradient_noise_multiplier * self.sensitivity

    @property
    def largest_scale(self) -> float:
        """The largest factor ``scale`` can give: ``1 / expected_batch_size``, or 1 (a sum, or a divisor that is
        the actual batch size, at least 1)."""
        if self.loss_reduction == "mean" and self.expected_batch_size is not None:
            return 1.0 / self.expected_batch_size
        return 1.0

    def range_problem(self, dtype: torch.dtype, grad_dtype: torch.dtype | None = None) -> str | None:
        """Why (a sentence) this config's noisy sum could leave the range of ``dtype`` (the dtype the clipped sum
        is computed and the noise drawn and added in) or, once multiplied by ``scale``, of ``grad_dtype`` (the
        parameters' dtype of least range, which ``.grad`` holds): every parameter would become inf/NaN. None if
        it cannot.

        Bound: one sample's clipped contribution (its norm is at most the sensitivity) plus the largest plausible
        draw of the noise, ``NOISE_TAIL_STDS`` stds. The clipped sum of B samples is not bounded by B times the
        sensitivity here: its entries are at most the samples' own gradient norms summed, which overflow where
        the model's own gradient would, whatever the settings. Checked with noise, and under adaptive clipping,
        where ``C`` itself is a tensor of ``dtype`` (the learning rate is the optimizer's: its update is the
        optimizer's arithmetic)."""
        if not (self.noise_multiplier > 0 or self.clipping == "adaptive") or self.max_grad_norm is None:
            return None
        sigma, sensitivity, scale = self.gradient_noise_multiplier, self.sensitivity, self.largest_scale
        checks = [(dtype, max(scale, 1.0), "the dtype the noise is drawn and added in")]
        if grad_dtype is not None and _largest(grad_dtype) < _largest(dtype):
            checks.append((grad_dtype, scale, "the dtype of the parameters' .grad, which the scaled noisy sum is "
                                              "written into"))
        for target, factor, role in checks:
            if draw_overflows(sigma * sensitivity, target, offset=sensitivity, factor=factor):
                scaled = f", times 1/expected_batch_size = {factor:.3g}," if factor != 1 else ""
                return (f"the noise std noise_multiplier * max_grad_norm = {sigma:.3g} * {sensitivity:.3g}: its "
                        f"largest plausible draw ({NOISE_TAIL_STDS:g} std; a normal draw passes it with "
                        f"probability 7e-350) plus one sample's clipped contribution ({sensitivity:.3g})"
                        f"{scaled} is past the range of {target} (largest {_largest(target):.3g}), {role}: every "
                        "parameter would become inf/NaN")
        return None

    def check_noise_range(self, dtype: torch.dtype, grad_dtype: torch.dtype | None = None) -> None:
        """Refuse a config whose noisy sum could leave the range of ``dtype`` or ``grad_dtype``
        (``range_problem``)."""
        problem = self.range_problem(dtype, grad_dtype)
        if problem is not None:
            raise DPConfigError(f"{problem}. Fix: a smaller max_grad_norm (per-sample gradient norms are rarely "
                                "above 1e3) or noise_multiplier")

    def scale(self, batch_size: int) -> float:
        """The factor the noisy sum is multiplied by."""
        if self.loss_reduction == "sum":
            return 1.0
        if self.expected_batch_size is not None:
            return 1.0 / self.expected_batch_size
        return 1.0 / max(batch_size, 1)

    @property
    def divide_by_count(self) -> bool:
        """True when the divisor is the (global) actual batch size, computed inside the program."""
        return self.loss_reduction == "mean" and self.expected_batch_size is None

    def next_bound(self, unclipped: float, batch_size: int, count_noise: float) -> float:
        """Adaptive clipping's next ``C`` (Andrew et al. 2021, geometric update): ``unclipped`` samples of
        ``batch_size`` had norm <= C; ``count_noise`` ~ N(0, sigma_b^2) is added to the centred count
        ``sum_i (b_i - 1/2)``, whose sensitivity is 1/2. The unclipped fraction's estimate divides by the
        expected batch size (the actual one without it)."""
        m = self.expected_batch_size if self.expected_batch_size is not None else max(batch_size, 1)
        fraction = (unclipped - batch_size / 2 + count_noise) / m + 0.5
        # checked in logarithms: a large learning rate makes the factor overflow (math.exp raises past e^709);
        # the bound then saturates at max_clipbound, or is infinite, which DPStep refuses to step with
        lr = self.clipbound_learning_rate  # finite: a fraction past float64's range (m tiny) makes inf, not NaN
        exponent = -lr * (fraction - self.target_unclipped_quantile) if lr else 0.0
        overflows = math.log(self.max_grad_norm) + exponent >= _LOG_FLOAT_MAX
        bound = math.inf if overflows else self.max_grad_norm * math.exp(exponent)
        return min(max(bound, self.min_clipbound, 1e-12), self.max_clipbound)

    def replace(self, **changes) -> DPConfig:
        """A validated copy with ``changes``."""
        return replace(self, **changes)


#: the options only one clipping mode reads (``clip_groups``, per_layer's, is checked on its own)
MODE_OPTIONS = {"automatic": ("automatic_gamma",),
                "adaptive": ("target_unclipped_quantile", "clipbound_learning_rate", "unclipped_num_std",
                             "min_clipbound", "max_clipbound")}
_DEFAULTS = {f.name: f.default for f in fields(DPConfig)}
