"""``python -m benchmarks.probes.fresh_pages``: what a buffer costs when it is not recycled between calls.

A buffer the allocator cannot recycle (kept alive across the program, or above glibc's 32 MiB mmap threshold) is
faulted in as fresh zeroed pages on every call. This times writing a fresh buffer against writing a reused one
of the same size, medians of ``--repeats`` interleaved calls; the ratio minus one is ``FRESH_PAGE_FACTOR`` in
``compiled_psg/_reduce/strategies.py`` (the extra cost of a fresh byte, in written bytes).
"""

from __future__ import annotations

import argparse

import torch

from ..timing import interleaved_medians


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.fresh_pages", description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, nargs="+", default=[16, 64, 256], help="buffer sizes in MiB")
    p.add_argument("--repeats", type=int, default=15, help="timed calls of each (median; >= 7)")
    args = p.parse_args(argv)
    if args.repeats < 7:
        p.error("--repeats must be at least 7")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.repeats} calls, ms")
    print(f"{'MiB':>6} {'fresh':>8} {'reused':>8} {'ratio':>6}")
    for mib in args.mib:
        n = mib * 2**20 // 4
        kept = torch.empty(n)
        calls = {"fresh": lambda n=n: torch.empty(n).fill_(1.0), "reused": lambda kept=kept: kept.fill_(1.0)}
        medians = interleaved_medians(calls, args.repeats, warm_up=1)
        fresh, reused = (medians[k] * 1e3 for k in ("fresh", "reused"))
        print(f"{mib:>6} {fresh:8.2f} {reused:8.2f} {fresh / reused:6.2f}", flush=True)


if __name__ == "__main__":
    main()
