"""One timer for the benchmark commands and probes: a first call timed alone (its compile included), then medians
over timed calls after warm-up, several callables interleaved in rounds whose order rotates (a slow phase of the
machine then falls on all of them alike). ``measure.interleaved_times`` is the same rotation for the main
harness, with its device's memory bookkeeping."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def first_call_seconds(fn: Callable[[], object], sync: Callable[[], object] | None = None) -> float:
    """Seconds of one call of ``fn`` (a first call: its compile included), between two ``sync`` calls."""
    if sync is not None:
        sync()
    start = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - start


def interleaved_medians(calls: dict[str, Callable[[], object]], repeats: int, warm_up: int = 3, inner: int = 1,
                        before: Callable[[], object] | None = None,
                        sync: Callable[[], object] | None = None) -> dict[str, float]:
    """Median seconds per call of each of ``calls``, over ``repeats`` rounds after ``warm_up`` calls of each.
    Each round times ``inner`` calls of every callable in turn, the order rotated every round. ``before`` runs
    untimed before each timing (e.g. a parallel region whose aftermath the call must meet), ``sync`` on both
    sides of it (a device synchronization)."""
    names = list(calls)
    for name in names:
        for _ in range(warm_up):
            calls[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if before is not None:
                before()
            if sync is not None:
                sync()
            start = time.perf_counter()
            for _ in range(inner):
                calls[name]()
            if sync is not None:
                sync()
            samples[name].append((time.perf_counter() - start) / inner)
    return {name: statistics.median(s) for name, s in samples.items()}


def median_seconds(fn: Callable[[], object], repeats: int, warm_up: int = 3, inner: int = 1,
                   sync: Callable[[], object] | None = None) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` timings of ``inner`` calls each, after ``warm_up`` calls."""
    return interleaved_medians({"fn": fn}, repeats, warm_up, inner, sync=sync)["fn"]
