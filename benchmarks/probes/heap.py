"""``python -m benchmarks.probes.heap --model transformer --batch 256``: the DP step with and without the kept heap.

``compiled_psg.retain_freed_memory()`` keeps freed memory in glibc's heap (``compiled_psg/_heap.py``), so a
program's buffers are recycled between calls instead of faulted in fresh. This runs one worker process per setting
(the setting is per process: ``COMPILED_PSG_RETAIN_FREED_MEMORY=1`` asks for it, ``0`` leaves the heap as it is),
and in each the plain SGD step (eager and ``torch.compile``) and ``compile_step``'s DP step, timed in interleaved
rounds (medians of ``--repeats``), with the minor page faults of one call and its peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

METHODS = ("sgd_step", "sgd_step_compile", "dp_psg_compile_step")


def worker(model: str, batch: int, repeats: int) -> dict:
    import torch

    from ..measure import Device
    from ..methods import METHODS as ALL
    from ..models import build_workload

    wl = build_workload(model, False, torch.device("cpu"))
    args = wl.batch(batch)
    runs = {key: ALL[key].setup(wl).run for key in METHODS}
    for run in runs.values():
        for _ in range(3):
            run(*args)
    dev = Device(torch.device("cpu"))
    result = {key: {"peak_mib": dev.peak_bytes(run, args) / 2**20} for key, run in runs.items()}
    for key, run in runs.items():
        run(*args)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        run(*args)
        result[key]["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    times: dict[str, list[float]] = {k: [] for k in runs}
    keys = list(runs)
    for r in range(repeats):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            runs[key](*args)  # untimed: its data back in the caches
            times[key].append(dev.timed(runs[key], args)[0])
    for key in runs:
        result[key]["ms"] = statistics.median(times[key]) * 1e3
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.heap", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="transformer")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=9, help="timed calls of each method (median; >= 7)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats < 7:
        p.error("--repeats must be at least 7")
    if args.worker:
        print(json.dumps(worker(args.model, args.batch, args.repeats)))
        return
    print(f"{args.model}, B={args.batch}: medians of {args.repeats} interleaved calls, one process per setting")
    print(f"{'heap':>9} {'method':>20} {'ms':>9} {'page faults/call':>17} {'peak MiB':>9}")
    for setting, env_value in (("kept", "1"), ("released", "0")):
        env = {**os.environ, "COMPILED_PSG_RETAIN_FREED_MEMORY": env_value}
        out = subprocess.run([sys.executable, "-m", "benchmarks.probes.heap", "--worker", "--model", args.model,
                              "--batch", str(args.batch), "--repeats", str(args.repeats)],
                             env=env, capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        for key in METHODS:
            r = result[key]
            print(f"{setting:>9} {key:>20} {r['ms']:9.1f} {r['faults']:17d} {r['peak_mib']:9.1f}", flush=True)
        plain = min(result["sgd_step"]["ms"], result["sgd_step_compile"]["ms"])
        print(f"{setting:>9} {'DP / plain':>20} {result['dp_psg_compile_step']['ms'] / plain:9.2f}")


if __name__ == "__main__":
    main()
