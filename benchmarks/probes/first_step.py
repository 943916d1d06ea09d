"""``python -m benchmarks.probes.first_step --models gpt2``: a user's process, from its start to its first step.

The scale page's compile targets, measured as whole processes on the scaled CPU models of
``benchmarks/scale_models.py``: cold compile of ``compile_step``'s DP step at most that of
``torch.compile(vmap(grad))`` + clip-and-sum at one batch size, and a second process with warm caches done with its
first DP step within 3 s. Each (model, method) runs in processes of its own that do what a user's script does:
import torch and the library, build the model from its config (random weights), set up the method, take one
step. The first process has an empty Inductor cache of its own (``TORCHINDUCTOR_CACHE_DIR``, which also holds
AOT autograd's cache); ``--warm N`` processes follow on the cache it filled.

Per process: ``process_s``, from the parent's launch of the process to the end of its first step (Python's
start, the imports and the model's build included); ``first_step_s``, the first step alone (capture and
compile included); and that step's phases, as ``cold_compile`` splits them (``PHASES`` there: each phase its own
time, the rest of the step in ``rest``). The machine is shared: one figure per process, warm processes as the
median of ``--warm`` runs (their phases are the median process's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..first_step_report import table, targets
from .cold_compile import PHASES, PhaseTimer, install

_LAUNCHED = "PSG_FIRST_STEP_LAUNCHED"  # the parent's time.time() at the launch, for process_s


def worker(model_name: str, method: str, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from ..scale import _setup
    from ..scale_models import SCALE_MODELS, build_scale_model

    model, make_batch, criterion = build_scale_model(model_name, True, torch.device("cpu"))
    batch_size = SCALE_MODELS[model_name].cpu_batch
    batch = make_batch(batch_size, torch.Generator().manual_seed(0))
    timer = PhaseTimer()
    install(timer)  # the process ends after its row
    start = time.perf_counter()
    step = _setup(method, model, criterion, batch)
    step(*batch)
    first = time.perf_counter() - start
    process = time.time() - float(os.environ[_LAUNCHED])
    phases = {p: round(timer.seconds.get(p, 0.0), 2) for p in PHASES[:-1]}
    phases["rest"] = round(first - sum(timer.seconds.values()), 2)
    return {"model": model_name, "method": method, "batch": batch_size, "process_s": round(process, 2),
            "first_step_s": round(first, 2), "kernels": timer.kernels, "phases": phases}


def run_process(model: str, method: str, cache: Path, threads: int) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), **{_LAUNCHED: repr(time.time())})
    cmd = [sys.executable, "-m", "benchmarks.probes.first_step", "--worker", "--models", model, "--methods", method,
           "--threads", str(threads)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.first_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["gpt2"])
    p.add_argument("--methods", nargs="+", default=["psg", "vmap_dp"])
    p.add_argument("--warm", type=int, default=3, help="warm processes per model and method (median)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--scratch", default=None, help="folder for the empty Inductor caches (default: a temporary one)")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.models[0], args.methods[0], args.threads)))
        return
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="first-step-"))
    rows = []
    for model in args.models:
        for method in args.methods:
            cache = scratch / f"inductor-{model}-{method}"
            if cache.exists():
                raise SystemExit(f"{cache} exists: the first process would not be cold. Pass an empty --scratch.")
            rows.append(dict(run_process(model, method, cache, args.threads), cache="cold"))
            warm = [run_process(model, method, cache, args.threads) for _ in range(args.warm)]
            if warm:
                middle = sorted(warm, key=lambda r: r["process_s"])[len(warm) // 2]
                rows.append(dict(middle, cache="warm", warm_runs=[(r["process_s"], r["first_step_s"]) for r in warm],
                                 process_s=statistics.median(r["process_s"] for r in warm),
                                 first_step_s=statistics.median(r["first_step_s"] for r in warm)))
    print(table(rows))
    print()
    print(targets(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
