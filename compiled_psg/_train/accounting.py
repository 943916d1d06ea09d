"""Privacy accounting, delegated to existing libraries: nothing here computes a privacy bound itself.

``"rdp"`` (default) and ``"pld"`` use Google's dp-accounting (``RdpAccountant``, ``PLDAccountant``);
``"prv"`` and ``"opacus-rdp"`` use ``opacus.accountants`` (installed with the ``peers`` extra). A DP-SGD
step is the Poisson-subsampled Gaussian mechanism with sampling rate ``q`` and noise multiplier
``sigma``, under the add-or-remove-one neighbouring relation.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import warnings

from .._errors import DPConfigError, is_int, is_number
from .config import check_noise_multiplier

MECHANISMS = ("rdp", "pld", "prv", "opacus-rdp")
_OPACUS = {"prv": "prv", "opacus-rdp": "rdp"}


def _check(mechanism: str) -> None:
    if mechanism not in MECHANISMS:
        raise DPConfigError(f"accountant must be one of {MECHANISMS}, got {mechanism!r}")


def check_delta(delta: float) -> float:
    """``delta`` as a Python float (the checks return what the caller keeps: no numpy scalar reaches a saved
    state, which ``torch.load(weights_only=True)`` would refuse)."""
    if not (is_number(delta) and 0 < delta < 1):
        raise DPConfigError(f"delta must be a number in (0, 1), got {delta!r}: epsilon is undefined at delta <= 0 (no "
                            "finite noise reaches it) and meaningless at delta >= 1")
    return float(delta)


def check_sample_rate(sample_rate: float) -> float:
    if not (is_number(sample_rate) and 0 < sample_rate <= 1):
        raise DPConfigError(f"sample_rate must be a number in (0, 1], got {sample_rate!r}: it is the probability "
                            "that a sample joins a batch. Fix: batch size / dataset size (make_private's default "
                            "when sample_rate=None)")
    if not sample_rate >= MIN_SAMPLE_RATE:  # an epoch is round(1 / q) steps, a length the loader must report
        raise DPConfigError(f"sample_rate={sample_rate!r} is below {MIN_SAMPLE_RATE:.3g} (2**-53): an epoch of 1 / "
                            "sample_rate steps is past what a loader can count (an expected batch of 1 sample "
                            "needs a dataset of 1 / sample_rate). Fix: batch size / dataset size")
    return float(sample_rate)


#: the smallest sampling rate taken: 1 / q steps per epoch stays an integer a float holds exactly
MIN_SAMPLE_RATE = 2.0 ** -53


def check_steps(steps: int, name: str = "steps") -> int:
    if not (is_int(steps) and steps >= 1):
        raise DPConfigError(f"{name} must be a positive int, got {steps!r}: the noise is calibrated for that many "
                            f"passes or steps. Fix: {name}=1 or more")
    return int(steps)


#: Below this noise multiplier dp-accounting's RDP overflows (it reports epsilon 0 at 1e-154 and divides by zero at
#: 1e-200); epsilon there is above 1e199 (5.5e19 for one step already at 1e-10), infinite in all but name.
MIN_ACCOUNTED_NOISE = 1e-100


def dp_event(history: list[tuple[float, float, int]]):
    """The dp-accounting event of a history of ``(noise_multiplier, sample_rate, steps)`` entries."""
    import dp_accounting

    events = [dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
        for sigma, q, steps in history]
    return events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events)


@contextlib.contextmanager
def _quiet_absl():
    """dp-accounting's RDP logs (through absl) every fractional order it drops; the bound is still valid."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _dp_accounting_accountant(mechanism: str):
    from dp_accounting import pld, rdp

    return rdp.RdpAccountant() if mechanism == "rdp" else pld.PLDAccountant()


#: the accountants that discretize the privacy loss on a grid, and the noise below which they are refused
_GRIDDED = ("pld", "prv")
MIN_GRIDDED_NOISE = 0.01


def _memory_refused(accounting):
    """A ``MemoryError`` of the accounting library (PLD and PRV discretize the privacy loss on a grid whose size
    grows as the noise shrinks: 38 GiB at sigma 0.001, q 0.2) as a ``DPConfigError`` naming the fix; so is numpy's
    refusal of a grid past its largest array (``ValueError: Maximum allowed size exceeded``, sigma 1e-8 to
    1e-99, red team P)."""
    @functools.wraps(accounting)
    def refusing(*args, **kwargs):
        try:
            return accounting(*args, **kwargs)
        except (MemoryError, ValueError) as e:
            if isinstance(e, ValueError) and "Maximum allowed size exceeded" not in str(e):
                raise
            raise DPConfigError(
                f"the accountant ran out of memory ({e}): the pld and prv accountants discretize the privacy loss on "
                "a grid that grows as the noise multiplier shrinks. Fix: accountant='rdp' (an upper bound, "
                "computed in closed form), or a larger noise multiplier") from None
    return refusing


def check_accountable(noise_multiplier: float, mechanism: str) -> None:
    """Refuse a noise multiplier the ``pld`` and ``prv`` accountants cannot account for on this machine."""
    if mechanism in _GRIDDED and MIN_ACCOUNTED_NOISE <= noise_multiplier < MIN_GRIDDED_NOISE:
        # the grid would be allocated whole and then written: past the machine's memory the kernel kills the
        # process, with no MemoryError to turn into this refusal (red team Q: prv at sigma 0.001 took 21 GB)
        raise DPConfigError(
            f"the {mechanism} accountant discretizes the privacy loss on a grid that grows as 1 / sigma**2: at "
            f"noise_multiplier={noise_multiplier:g}, below {MIN_GRIDDED_NOISE}, it needs gigabytes (19 GiB at "
            "0.002), and epsilon there is in the hundreds or more. Fix: accountant='rdp' (an upper bound, computed "
            "in closed form)")


@_memory_refused
def epsilon_of(history: list[tuple[float, float, int]], delta: float, mechanism: str = "rdp") -> float:
    """Epsilon at ``delta`` after the steps in ``history`` (``(noise_multiplier, sample_rate, steps)``)."""
    _check(mechanism)
    check_delta(delta)
    history = [(float(s), float(q), int(n)) for s, q, n in history if n > 0 and q > 0]
    if not history:
        return 0.0
    if any(s < MIN_ACCOUNTED_NOISE for s, _, _ in history):
        return math.inf
    check_accountable(min(s for s, _, _ in history), mechanism)
    if mechanism in _OPACUS:
        from opacus.accountants import create_accountant

        accountant = create_accountant(mechanism=_OPACUS[mechanism])
        accountant.history = list(history)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
            return float(accountant.get_epsilon(delta=delta))
    accountant = _dp_accounting_accountant(mechanism)
    with _quiet_absl():
        accountant.compose(dp_event(history))
        return float(accountant.get_epsilon(delta))


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float,
            mechanism: str = "rdp") -> float:
    """Epsilon at ``delta`` of ``steps`` DP-SGD steps with the given noise multiplier and sampling rate."""
    return epsilon_of([(noise_multiplier, sample_rate, steps)], delta, mechanism)


@_memory_refused
def calibrate_noise(target_epsilon: float, target_delta: float, sample_rate: float, steps: int,
                    mechanism: str = "rdp", epsilon_tolerance: float = 0.01) -> float:
    """The smallest noise multiplier whose ``steps`` steps at ``sample_rate`` stay within ``target_epsilon``.

    dp-accounting's ``calibrate_dp_mechanism`` for ``"rdp"``/``"pld"``; opacus's ``get_noise_multiplier``
    for the opacus accountants.
    """
    _check(mechanism)
    if not (is_number(target_epsilon) and 0 < target_epsilon < math.inf):
        raise DPConfigError(f"target_epsilon must be a positive finite number, got {target_epsilon!r}. Fix: "
                            "a target such as 1 to 10; for no privacy, train without compiled_psg's DP step")
    target_delta, sample_rate, steps = check_delta(target_delta), check_sample_rate(sample_rate), check_steps(steps)
    def out_of_reach(cause: str) -> DPConfigError:
        return DPConfigError(
            f"target_epsilon={target_epsilon} cannot be calibrated with accountant={mechanism!r} for {steps} steps at "
            f"sample_rate={sample_rate}, delta={target_delta}: {cause}. Fix: a larger target_epsilon (1 to 10 is "
            "usual), fewer epochs, or pass noise_multiplier= yourself")

    if mechanism in _OPACUS:
        from opacus.accountants.utils import get_noise_multiplier

        with warnings.catch_warnings():  # PRV's search probes RDP bounds at extreme sigmas
            warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
            try:
                return float(get_noise_multiplier(
                    target_epsilon=target_epsilon, target_delta=target_delta, sample_rate=sample_rate,
                    steps=steps, accountant=_OPACUS[mechanism], epsilon_tolerance=epsilon_tolerance))
            except ValueError as e:  # opacus: "The privacy budget is too low." past its largest sigma
                raise out_of_reach(f"opacus's search stopped ({e})") from None
    import dp_accounting

    def calibrate(kind, bracket, tol):
        with _quiet_absl():
            return float(dp_accounting.calibrate_dp_mechanism(
                lambda: _dp_accounting_accountant(kind),
                lambda sigma: dp_event([(sigma, sample_rate, steps)]),
                target_epsilon, target_delta, bracket_interval=bracket, tol=tol))

    lowest = 1e-2
    try:
        sigma_rdp = calibrate("rdp", dp_accounting.LowerEndpointAndGuess(lowest, 1.0), 1e-4)
    except dp_accounting.mechanism_calibration.NoBracketIntervalFoundError:  # epsilon(lowest) <= target already
        raise DPConfigError(
            f"target_epsilon={target_epsilon} is met even with noise_multiplier={lowest} (epsilon "
            f"{epsilon(lowest, sample_rate, steps, target_delta):.3g} for {steps} steps at sample_rate={sample_rate}), "
            "the smallest the calibration tries: such an epsilon guarantees nothing. Fix: a smaller target_epsilon, "
            "or pass noise_multiplier= yourself") from None
    if mechanism == "rdp":
        return sigma_rdp
    # PLD is tighter than RDP: the RDP answer bounds it from above (and PLD is slow at small sigma)
    try:
        return calibrate("pld", dp_accounting.ExplicitBracketInterval(0.25 * sigma_rdp, sigma_rdp), 1e-3)
    except DPConfigError:
        raise
    except ValueError as e:  # dp-accounting's PLD at noise multipliers of thousands: its root search fails
        raise out_of_reach(f"RDP asks for noise_multiplier {sigma_rdp:.4g}, where dp-accounting's PLD search fails "
                           f"({str(e).splitlines()[0][:120]})") from None


class Accountant:
    """Records the steps taken (``step``) and reports ``epsilon(delta)`` through the chosen library."""

    def __init__(self, mechanism: str = "rdp"):
        self.mechanism = mechanism
        self._history: list[tuple[float, float, int]] = []

    @property
    def mechanism(self) -> str:
        """The analysis ``epsilon`` runs (any of them bounds the same history)."""
        return self._mechanism

    @mechanism.setter
    def mechanism(self, value: str) -> None:
        _check(value)
        self._mechanism = value

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """What it counted: ``(noise_multiplier, sample_rate, steps)`` per run of equal steps (a copy: only
        ``step`` adds to it, so that epsilon always covers every step counted)."""
        return list(self._history)

    @history.setter
    def history(self, value) -> None:
        raise DPConfigError("an Accountant's history is what it counted: only step() adds to it, so that epsilon "
                            "covers every step taken. Fix: count another training with a new Accountant")

    def step(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        sample_rate = check_sample_rate(sample_rate)  # dp-accounting would refuse it only at epsilon(), each call
        noise_multiplier = check_noise_multiplier(noise_multiplier)  # Python numbers in the history
        steps = check_steps(steps)
        if self._history and self._history[-1][:2] == (noise_multiplier, sample_rate):
            sigma, q, n = self._history[-1]
            self._history[-1] = (sigma, q, n + steps)
        else:
            self._history.append((noise_multiplier, sample_rate, steps))

    def load_history(self, history: list[tuple[float, float, int]]) -> None:
        """Take a saved training's history in place of this one's (``PrivateTraining.load_state_dict``, which
        checks it against the saved step)."""
        self._history = [(float(s), float(q), int(n)) for s, q, n in history]

    @property
    def steps(self) -> int:
        return sum(n for _, _, n in self._history)

    def epsilon(self, delta: float) -> float:
        return epsilon_of(self._history, delta, self.mechanism)
