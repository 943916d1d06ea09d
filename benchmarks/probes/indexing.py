"""``python -m benchmarks.probes.indexing --model transformer --batch 64``: compiled_psg's programs with and without its
index rules for Inductor.

compiled_psg compiles with the batch symbolic and adds two rules to Inductor's simplification of index
expressions (``compiled_psg/_compile/indexing.py``), so that a view merging the batch with another dimension does
not leave a modulus by the batch in the C++ kernels. This runs one worker process per setting, each with its own
empty Inductor cache (so the kernels are generated, not loaded): compiled_psg's methods, and the eager plain step
and ``torch.compile(vmap(grad))`` DP step as references the rules do not touch. Per method: the first call
(capture and compile), the median of ``--repeats`` interleaved calls, and the slowest Inductor kernel (profiled;
its time per call of the method, all its calls summed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile

from .. import keep_freed_memory
from ..timing import first_call_seconds

METHODS = ("sgd_step", "dp_func_compile", "psg_grads", "psg_norms", "dp_psg_compile_step")


def _slowest_kernel(run, args) -> tuple[str, float]:
    from torch.profiler import profile

    with profile() as prof:
        for _ in range(3):
            run(*args)
    kernels = [(e.key, e.self_cpu_time_total / 3e3) for e in prof.key_averages() if "cpp_fused" in e.key]
    return max(kernels, key=lambda k: k[1], default=("", 0.0))


def worker(model: str, batch: int, repeats: int, rules: bool) -> dict:
    import torch

    import compiled_psg._compile.run as compile_run

    from ..measure import Device, Plan, interleaved_times
    from ..methods import METHODS as ALL
    from ..models import build_workload

    if not rules:
        compile_run.simplified_indexing = contextlib.nullcontext
    wl = build_workload(model, False, torch.device("cpu"))
    args = wl.batch(batch)
    runs, result = {}, {}
    for key in METHODS:
        run = ALL[key].setup(wl).run
        result[key] = {"first_s": first_call_seconds(lambda run=run: run(*args))}
        for _ in range(3):
            run(*args)
        runs[key] = lambda run=run: run(*args)
    plan = Plan(sizes=(batch,), sequence=(), check_size=batch, warmup=0, reps=repeats, min_seconds=0.0,
                max_reps=repeats)
    times, errors = interleaved_times(runs, plan, Device(torch.device("cpu")))
    if errors:
        raise next(iter(errors.values()))
    for key in METHODS:
        name, ms = _slowest_kernel(runs[key], ())
        result[key].update(ms=statistics.median(times[key]) * 1e3, kernel=name, kernel_ms=ms)
    return result


def main(argv: list[str] | None = None) -> None:
    keep_freed_memory()
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.indexing", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="transformer")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=9, help="timed calls of each method (median; >= 7)")
    p.add_argument("--worker", choices=("on", "off"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats < 7:
        p.error("--repeats must be at least 7")
    if args.worker:
        print(json.dumps(worker(args.model, args.batch, args.repeats, args.worker == "on")))
        return
    print(f"{args.model}, B={args.batch}: medians of {args.repeats} interleaved calls, one process per setting, "
          "each with an empty Inductor cache")
    print(f"{'rules':>5} {'method':>20} {'first call s':>13} {'ms':>8}  "
          "slowest Inductor kernel (ms per method call, all its calls)")
    for setting in ("on", "off"):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE": "1"}
            out = subprocess.run([sys.executable, "-m", "benchmarks.probes.indexing", "--worker", setting, "--model",
                                  args.model, "--batch", str(args.batch), "--repeats", str(args.repeats)],
                                 env=env, capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        for key in METHODS:
            r = result[key]
            print(f"{setting:>5} {key:>20} {r['first_s']:13.1f} {r['ms']:8.1f}  {r['kernel'][:60]} "
                  f"({r['kernel_ms']:.2f})", flush=True)
        print(f"{setting:>5} {'DP / eager plain':>20} {'':>13} "
              f"{result['dp_psg_compile_step']['ms'] / result['sgd_step']['ms']:8.2f}")
        print(f"{setting:>5} {'DP / vmap DP':>20} {'':>13} "
              f"{result['dp_psg_compile_step']['ms'] / result['dp_func_compile']['ms']:8.2f}")


if __name__ == "__main__":
    main()
