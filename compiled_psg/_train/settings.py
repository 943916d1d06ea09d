"""A DP step's settings: validated on assignment, used from the next step on (``DPStep`` inherits them)."""

from __future__ import annotations

from .._errors import DPConfigError, is_int
from .config import MECHANISM, DPConfig


class StepSettings:
    """``config`` (a frozen ``DPConfig``) and its fields that may be assigned between steps, the micro-batch size,
    and what the last step used. Reads ``_config``, ``_stalled_bound``, ``_custom_reduce`` and ``last_config``
    of the step, and calls its ``_acc_dtype`` and ``_grad_dtype`` (the noise's dtype and the parameters' of least
    range, whose ranges the noisy sum must fit). ``clipping``, ``loss_reduction`` and ``clip_groups`` define the
    mechanism: fixed when the step is built."""

    _config: DPConfig
    _stalled_bound: str | None
    last_config: DPConfig | None

    @property
    def config(self) -> DPConfig:
        return self._config

    @config.setter
    def config(self, value: DPConfig) -> None:
        self.check_config(value)
        self._config = value
        self._stalled_bound = None  # a new bound (or max_clipbound) from the user: adaptive clipping goes on

    def check_config(self, value: DPConfig) -> None:
        """What assigning ``config = value`` checks, without assigning (a checkpoint's load checks it before it
        loads anything)."""
        if not isinstance(value, DPConfig):
            raise DPConfigError(f"config must be a DPConfig, got {type(value).__name__}")
        for name in MECHANISM:
            if getattr(value, name) != getattr(self._config, name):
                what = "the clipping mode" if name == "clipping" else name
                raise DPConfigError(f"{what} is fixed when the step is built ({getattr(self._config, name)!r}), got "
                                    f"{getattr(value, name)!r}: it defines the mechanism. Fix: build a step with "
                                    f"{name}={getattr(value, name)!r}")
        value.check_noise_range(self._acc_dtype(), self._grad_dtype())
        self._check_owner_rules(value)
        self._reduction_for(value)  # per_layer: as many bounds as groups, refused now rather than at every step

    def _check_owner_rules(self, value: DPConfig) -> None:
        """A step that a ``PrivateTraining`` accounts for keeps what its accountant's analysis assumes, however its
        settings are assigned (``private.noise_multiplier`` or ``private.dp_step.noise_multiplier``): noise, a
        bound, and a fixed divisor (dividing by the actual Poisson batch size reveals it through the update)."""
        owner, now = getattr(self, "accounted_by", None), self._config
        if owner is None:
            return
        # the assigned fields only: make_private may build a step without noise (a clipped baseline)
        if value.noise_multiplier != now.noise_multiplier and not value.noise_multiplier > 0:
            raise DPConfigError(f"a {owner} needs noise_multiplier > 0, got {value.noise_multiplier}")
        if value.max_grad_norm is None and now.max_grad_norm is not None:
            raise DPConfigError(f"a {owner} needs a clipping bound, got max_grad_norm=None")
        if value.expected_batch_size is None and now.expected_batch_size is not None \
                and value.loss_reduction == "mean":
            raise DPConfigError(
                f"a {owner} divides the clipped sum by the expected batch size q * N "
                f"({self._config.expected_batch_size}); expected_batch_size=None divides by the actual size of "
                "the Poisson batch, which the update's norm would reveal. Fix: keep a fixed expected_batch_size")

    @property
    def max_grad_norm(self) -> float | None:
        return self._config.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        self.config = self._config.replace(max_grad_norm=value)

    @property
    def noise_multiplier(self) -> float:
        return self._config.noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        self.config = self._config.replace(noise_multiplier=value)

    @property
    def expected_batch_size(self) -> float | None:
        return self._config.expected_batch_size

    @expected_batch_size.setter
    def expected_batch_size(self, value: float | None) -> None:
        self.config = self._config.replace(expected_batch_size=value)

    @property
    def loss_reduction(self) -> str:
        return self._config.loss_reduction

    @property
    def noise_std(self) -> float:
        """The noise std the next step adds to the clipped sum: the gradient's noise multiplier times the
        sensitivity (``noise_multiplier * max_grad_norm`` for flat clipping; see ``DPConfig``)."""
        return self._config.noise_std

    @property
    def clipping(self) -> str:
        """The clipping mode, fixed when the step is built."""
        return self._config.clipping

    @property
    def last_noise_multiplier(self) -> float | None:
        """The noise multiplier the last step used as one Gaussian mechanism (None before the first step), from
        the noise actually added (with adaptive clipping: the gradient's and the count's): what the accountant
        records."""
        return None if self.last_config is None else self.last_config.accounted_noise_multiplier

    @property
    def max_physical_batch_size(self) -> int | None:
        """Micro-batch size: a larger (logical) batch is processed in pieces of at most this many samples."""
        return self._max_physical_batch_size

    @max_physical_batch_size.setter
    def max_physical_batch_size(self, value: int | None) -> None:
        if value is not None and not (is_int(value) and value >= 1):
            raise DPConfigError(f"max_physical_batch_size must be a positive int or None, got {value!r}")
        if value is not None and getattr(self, "_custom_reduce", None) is not None:
            # micro-batches' results are summed: right for a sum over samples only (not a mean, max, median)
            raise DPConfigError("max_physical_batch_size with a custom reduce=: the micro-batches' results would be "
                                "summed, which equals the whole batch's result only if the reduction is a sum over "
                                "samples. Fix: max_physical_batch_size=None, or reduce=psg.clip_sum(C) / "
                                "max_grad_norm=C")
        from .buckets import check_fits

        check_fits(getattr(self, "batch_buckets", None), value)
        self._max_physical_batch_size = None if value is None else int(value)
