"""argparse types shared by the jobs: a bad value is a one-line usage error (exit code 2) before anything runs,
not a traceback in the middle (or at the end) of a run."""

from __future__ import annotations

import argparse
from pathlib import Path


def _number(kind: type, text: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an int' if kind is int else 'a number'}") from None


def positive_int(text: str) -> int:
    value = _number(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    value = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = _number(float, text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {value}")
    return value


def int_at_least(minimum: int):
    """An int of at least ``minimum`` (``--seq-len``: a window needs a byte to predict from and one to predict)."""

    def parse(text: str) -> int:
        value = _number(int, text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}, got {value}")
        return value

    return parse


def positive_multiple_of(factor: int):
    """A positive multiple of ``factor`` (the model's width: 4 attention heads with an even rotary dimension)."""

    def parse(text: str) -> int:
        value = _number(int, text)
        if value < 1 or value % factor:
            raise argparse.ArgumentTypeError(f"must be a positive multiple of {factor}, got {value}")
        return value

    return parse


def momentum(text: str) -> float:
    value = _number(float, text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {value}")
    return value


def delta(text: str) -> float:
    value = _number(float, text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1), got {value}")
    return value


def seed(text: str) -> int:
    """A seed every generator the jobs seed takes (scikit-learn's split takes 0 to 2**32 - 1)."""
    value = _number(int, text)
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be an int in [0, 2**32 - 1], got {value}")
    return value


class FlagError(Exception):
    """A flag's value that only the run can find wrong (``--seq-len`` longer than the text it cuts into
    windows): ``run`` reports it as a usage error. The message starts with the flag."""


def output_folder(text: str) -> Path:
    """A folder the job can write to, created now: a path that cannot be written fails before the run (which
    writes its results at the end), not after it."""
    path = Path(text)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot create the folder {text}: {e.strerror}") from None
    return path


def run(parser: argparse.ArgumentParser, job, argv: list[str] | None) -> int:
    """``job(args)``; a setting the flags gave that DP-SGD refuses (``DPConfigError``: an epsilon reached without
    noise) or that the run finds wrong (``FlagError``) is a usage error too."""
    from .._errors import DPConfigError

    args = parser.parse_args(argv)
    try:
        job(args)
    except (DPConfigError, FlagError) as e:
        parser.error(str(e))
    return 0
