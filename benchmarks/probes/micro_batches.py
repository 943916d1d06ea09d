"""``python -m benchmarks.probes.micro_batches --models transformer resnet --sizes 16 64 256 --splits 2 4``: the DP
step's time and peak memory when ``compile_step(..., max_physical_batch_size=N)`` splits each batch.

A one-pass DP step holds more per sample than the plain step: every clip factor must be known before any
clipped sum, so each layer's input and output gradient (book-keeping) or its per-sample gradients (materialized)
are kept until the last per-sample norm is known, where the plain step frees a layer's input at its weight
gradient. That extra scales with the samples in one program call. ``max_physical_batch_size`` runs the per-sample
graph on micro-batches and accumulates their clipped sums (the same step: noise once, one update), so the
extra scales with the micro-batch instead. This measures what that costs in time and saves in memory, against
the plain step.

Per model and batch size, in one process, interleaved (``measure.interleaved_times``, medians of ``--repeats``):
the plain SGD step eager and ``torch.compile``'d (static shapes), and ``compile_step``'s DP step on the whole
batch and split into ``k`` micro-batches of ``ceil(B / k)`` samples for each ``k`` in ``--splits``. Peak extra
memory as on the page (``Device.peak_bytes``: the resident set's high-water mark during one call), the median of
three calls. Ratios: time against the faster plain step, memory against the lower plain peak (the issue's
targets, <= 1.25 each).
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from .. import keep_freed_memory, methods
from ..measure import Device, Plan, interleaved_times
from ..models import build_workload

TARGET = 1.25


def measure(model: str, size: int, splits: list[int], repeats: int) -> list[dict]:
    torch._dynamo.reset()
    dev = Device(torch.device("cpu"))
    wl = build_workload(model, False, torch.device("cpu"))
    batch = wl.batch(size)
    steps = {"plain": methods.sgd_step(wl).run, "plain compiled": methods.sgd_step_compile(wl).run,
             "DP, whole batch": methods.dp_compile_step(wl)}
    for k in splits:
        physical = math.ceil(size / k)
        if 1 < k and physical < size:
            steps[f"DP, {k} x {physical}"] = methods.dp_compile_step(wl, max_physical_batch_size=physical)
    for step in steps.values():  # first calls (capture, compile) and warm-up
        for _ in range(3):
            step(*batch)
    peaks = {k: statistics.median(dev.peak_bytes(step, batch) / 2**20 for _ in range(3)) for k, step in steps.items()}
    plan = Plan(sizes=(size,), sequence=(), check_size=size, warmup=0, reps=repeats, min_seconds=0.0,
                max_reps=repeats)
    times, errors = interleaved_times({k: (lambda s=s: s(*batch)) for k, s in steps.items()}, plan, dev)
    if errors:
        raise next(iter(errors.values()))
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    plain_ms, plain_mib = min(ms["plain"], ms["plain compiled"]), min(peaks["plain"], peaks["plain compiled"])
    return [{"model": model, "B": size, "step": k, "ms": ms[k], "time": ms[k] / plain_ms, "MiB": peaks[k],
             "memory": peaks[k] / plain_mib} for k in steps]


def main(argv: list[str] | None = None) -> None:
    keep_freed_memory()
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.micro_batches", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["mlp", "cnn", "transformer", "resnet", "gpt2"])
    p.add_argument("--sizes", nargs="+", type=int, default=[16, 64, 256])
    p.add_argument("--splits", nargs="+", type=int, default=[2, 4], help="micro-batches per batch (k)")
    p.add_argument("--repeats", type=int, default=9, help="timed calls of each (median; >= 7)")
    args = p.parse_args(argv)
    if args.repeats < 7:
        p.error("--repeats must be at least 7")
    print(f"ms: medians of {args.repeats} interleaved calls; MiB: peak extra memory, median of 3 calls; "
          f"x plain: against the faster plain step's time and the lower plain peak; 'both' = both <= {TARGET}")
    print(f"{'model':>12} {'B':>4} {'step':>18} {'ms':>9} {'x plain':>8} {'MiB':>8} {'x plain':>8} {'both':>5}")
    for model in args.models:
        for size in args.sizes:
            for r in measure(model, size, args.splits, args.repeats):
                both = "DP" in r["step"] and r["time"] <= TARGET and r["memory"] <= TARGET
                print(f"{model:>12} {size:4d} {r['step']:>18} {r['ms']:9.2f} {r['time']:8.2f} {r['MiB']:8.1f} "
                      f"{r['memory']:8.2f} {'yes' if both else '':>5}", flush=True)


if __name__ == "__main__":
    main()
