"""Errors raised by compiled_psg. Each names the culprit and the fix."""

from __future__ import annotations

import numbers
from typing import Any


class PerSampleError(Exception):
    """Base class of every error compiled_psg raises on purpose."""

    #: The inspection report of the refused graph (see ``compiled_psg.explain``), when one exists.
    report: Any = None


class SampleMixingError(PerSampleError):
    """The loss lets one sample's output depend on another sample: per-sample gradients are undefined."""


class BatchInputError(PerSampleError, ValueError):
    """The arguments, ``in_dims`` or the loss do not fit the per-sample contract."""


class CaptureError(PerSampleError):
    """The loss function could not be captured as one graph (a graph break, or a fixed batch size)."""


class UnsupportedError(PerSampleError):
    """A graph node has no rule and the generic fallback cannot handle it either."""


class CompileError(PerSampleError):
    """The compiler (Inductor) failed on a rewritten graph; ``backend="eager"`` gives the same numbers."""


class InternalError(PerSampleError, AssertionError):
    """A check inside compiled_psg failed: a bug in compiled_psg, not in the user's code. Please report it."""

    def __init__(self, message: str):
        super().__init__(f"{message}\nThis is a bug in compiled_psg; please report it with this message.")


class DPConfigError(PerSampleError, ValueError):
    """A training or DP-SGD setting is invalid or contradicts another (``compile_step``, ``make_private``, the
    accountant, the Poisson sampler, a noise scheduler)."""


def require_flag(name: str, value: object, error: type[PerSampleError]) -> bool:
    """``value`` if it is True or False, else ``error`` naming the setting: Python reads any non-empty string as
    true, so ``secure_rng="no"`` or ``return_norms="false"`` would turn the setting on unasked."""
    if not isinstance(value, bool):
        raise error(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def is_number(value) -> bool:
    """A real number of any type ``numbers.Real`` covers (Python's, numpy's scalars), not a bool: ``True`` is an
    int to Python, and a slip for a setting (numpy's ``bool_`` is no ``numbers.Real``)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value) -> bool:
    """An integer of any type ``numbers.Integral`` covers (Python's int, numpy's integers), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_python(value: numbers.Real) -> int | float:
    """A real number as Python's int (an integer type) or float: a numpy scalar kept as a setting would reach the
    step's program, the accountant's history and the saved state."""
    return int(value) if isinstance(value, numbers.Integral) else float(value)
