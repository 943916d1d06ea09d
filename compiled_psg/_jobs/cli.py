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
    noise, a delta outside (0, 1)) is a usage error too."""
    from .._errors import DPConfigError

    args = parser.parse_args(argv)
    try:
        job(args)
    except DPConfigError as e:
        parser.error(str(e))
    return 0
