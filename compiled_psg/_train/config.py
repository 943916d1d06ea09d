"""``DPConfig``: the settings of one DP-SGD step, as a frozen value.

A step reads its config once at the start of every call and runs the whole step (clipping, noise, scaling) with
that snapshot, so a setting changed between steps takes effect at the next step, and ``step.last_config`` says
exactly what the last step used (the accountant records its noise multiplier).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .._errors import DPConfigError

LOSS_REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True)
class DPConfig:
    """``max_grad_norm``: the per-sample clipping bound ``C`` (None: no clipping, or a custom reduction);
    ``noise_multiplier``: ``sigma``, the noise std is ``sigma * C``; ``expected_batch_size``: the divisor of
    the noisy sum under ``loss_reduction="mean"`` (None: the actual batch size); ``clipping``: ``"flat"`` (one
    bound over all parameters; unclipped when ``max_grad_norm`` is None) or ``"custom"`` (a user reduction
    replaces the clipped sum)."""

    max_grad_norm: float | None = None
    noise_multiplier: float = 0.0
    expected_batch_size: float | None = None
    loss_reduction: str = "mean"
    clipping: str = "flat"

    def __post_init__(self) -> None:
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise DPConfigError(f"loss_reduction must be 'mean' or 'sum', got {self.loss_reduction!r}")
        if self.clipping not in ("flat", "custom"):
            raise DPConfigError(f"clipping must be 'flat' or 'custom', got {self.clipping!r}")
        if not (isinstance(self.noise_multiplier, int | float) and self.noise_multiplier >= 0):
            raise DPConfigError(f"noise_multiplier must be a number >= 0, got {self.noise_multiplier!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise DPConfigError(f"max_grad_norm must be positive, got {self.max_grad_norm}")
        if self.clipping == "custom" and self.max_grad_norm is not None:
            raise DPConfigError("max_grad_norm applies to the default clip_sum reduction; with a custom reduce, "
                                "clip inside it")
        if self.noise_multiplier > 0 and (self.max_grad_norm is None or math.isinf(self.max_grad_norm)):
            raise DPConfigError("noise needs a clipping bound: pass max_grad_norm or reduce=psg.clip_sum(C) (the "
                                "noise std is noise_multiplier * C)")
        if self.expected_batch_size is not None and not self.expected_batch_size > 0:
            raise DPConfigError(f"expected_batch_size must be positive, got {self.expected_batch_size}")
        object.__setattr__(self, "noise_multiplier", float(self.noise_multiplier))
        if self.max_grad_norm is not None:
            object.__setattr__(self, "max_grad_norm", float(self.max_grad_norm))

    @property
    def noise_std(self) -> float:
        return self.noise_multiplier * (self.max_grad_norm or 0.0)

    @property
    def bound(self) -> float:
        """The bound the clip_sum reduction runs with (infinite: no clipping)."""
        return math.inf if self.max_grad_norm is None else self.max_grad_norm

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

    def replace(self, **changes) -> DPConfig:
        """A validated copy with ``changes``."""
        return replace(self, **changes)
