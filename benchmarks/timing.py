"""One timer for the small benchmark commands: the median over timed calls after warm-up."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], repeats: int, warm_up: int = 3, inner: int = 1) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` timings of ``inner`` calls each, after ``warm_up`` calls."""
    for _ in range(warm_up):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)
