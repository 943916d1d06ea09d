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


_NOT_GIVEN = object()


def parse_with_given(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with ``args.given``: the destinations of the flags on the command line (a flag
    given with its default value counts; argparse alone cannot tell it from one left out)."""
    actions = [a for a in parser._actions if a.dest != argparse.SUPPRESS and a.default != argparse.SUPPRESS]
    args = parser.parse_args(argv, argparse.Namespace(**{a.dest: _NOT_GIVEN for a in actions}))
    given = set()
    for action in actions:
        if getattr(args, action.dest) is _NOT_GIVEN:
            default = action.default
            if isinstance(default, str) and action.type is not None:
                default = action.type(default)
            setattr(args, action.dest, default)
        else:
            given.add(action.dest)
    args.given = frozenset(given)
    return args


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def unused_flags(args: argparse.Namespace, dp_flags: tuple[str, ...]) -> dict[str, str]:
    """The flags the others make do nothing in this run, each with why: ``dp_flags`` with ``--no-dp``,
    ``--epsilon`` beside ``--sigma``, ``--momentum`` with Adam."""
    unused = {}
    if args.no_dp:
        unused.update(dict.fromkeys(dp_flags, "--no-dp (a non-private run has no clipping, noise or accounting)"))
    elif args.sigma is not None:
        unused["epsilon"] = "--sigma (the noise multiplier is given, not calibrated to a target epsilon)"
    if args.optimizer != "sgd":
        unused["momentum"] = (f"--optimizer {args.optimizer} (only SGD takes a momentum; Adam's moments use torch's "
                              "default betas)")
    return unused


def flags_without_effect(args: argparse.Namespace, dp_flags: tuple[str, ...]) -> str | None:
    """The usage error for a flag given that the other flags make do nothing (it would be silently ignored, and
    the run's record would show a setting that never applied), else None."""
    for dest, why in unused_flags(args, dp_flags).items():
        if dest in args.given:
            return f"argument {flag(dest)}: has no effect with {why}: drop one of them"
    return None


def config_record(args: argparse.Namespace, dp_flags: tuple[str, ...]) -> dict:
    """The flags' values as JSON takes them (``metrics.json``'s ``config``); null for a default that did nothing
    in this run (``unused_flags``)."""
    unused = unused_flags(args, dp_flags)
    return {k: None if k in unused else str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items() if k != "given"}


def epsilon_text(epsilon: float | None, private: bool) -> str:
    """How the jobs print a run's epsilon (``metrics.json`` stores an infinite one as null)."""
    if not private:
        return "inf (non-private)"
    if epsilon is None or epsilon == float("inf"):
        return "inf (the noise is too small for a finite bound)"
    return f"{epsilon:.3f}"


def run(parser: argparse.ArgumentParser, job, argv: list[str] | None, check=None) -> int:
    """``job(args)``, after ``check(args)`` (a usage error it returns ends the run before anything runs); a
    setting the flags gave that DP-SGD refuses (``DPConfigError``: an epsilon reached without noise) or that the
    run finds wrong (``FlagError``) is a usage error too."""
    from .._errors import DPConfigError

    args = parse_with_given(parser, argv)
    problem = check(args) if check is not None else None
    if problem is not None:
        parser.error(problem)
    try:
        job(args)
    except (DPConfigError, FlagError) as e:
        parser.error(str(e))
    return 0
