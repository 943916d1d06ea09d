"""``python -m benchmarks [--quick] [--models ...] [--methods ...] [--device cpu|cuda] [--out docs]``

Runs every method side by side on each model, one subprocess per model, and writes ``OUT/benchmarks.md``,
``OUT/benchmarks.json`` (the raw results) and the plots under ``OUT/img/``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import keep_freed_memory, report
from .measure import run_worker
from .methods import MAX_NORM, METHODS, NOISE_MULTIPLIER
from .models import MODELS

# --quick checks the harness within minutes on 2 cores: every method, on one model every method supports and
# on the GPT-2-style decoder (tied weights, LayerNorm, attention: where the peers fail).
QUICK_MODELS = ("mlp", "gpt2")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[1])
    add = p.add_argument
    add("--quick", action="store_true", help="tiny models and batches, 3 timed calls: checks the harness")
    add("--models", nargs="+", choices=list(MODELS), metavar="MODEL",
        help=f"of {', '.join(MODELS)} (default: all; with --quick: {', '.join(QUICK_MODELS)})")  # fmt: skip
    add("--methods", nargs="+", choices=list(METHODS), default=list(METHODS), metavar="METHOD",
        help=f"of {', '.join(METHODS)} (default: all)")  # fmt: skip
    add("--device", choices=["cpu", "cuda"], default="cpu")
    add("--out", default="docs", help="folder for benchmarks.md, benchmarks.json and img/ (default: docs)")
    add("--threads", type=int, help="torch.set_num_threads per worker (default: torch's; cores / jobs)")
    add("--jobs", type=int,
        help="models measured at once (default: 1, so that they do not disturb each other's timings; "
             "with --quick: one per core)")  # fmt: skip
    add("--headline-only", action="store_true",
        help="time each model at its headline batch size only (plus the changing-size sequence)")
    add("--sizes", nargs="+", type=int, metavar="B",
        help="batch sizes to time (default: 16, 64, 256 and the model's headline size; with --quick: tiny)")
    add("--no-sequence", action="store_true",
        help="skip the changing batch-size sequence (its recompiles cost minutes per model on a GPU)")
    add("--scratch", help="keep each model's raw results in this folder and reuse those already there "
                          "(resume a long run; default: a temporary folder)")
    add("--command-note", help="record this as the command (a page assembled with --scratch from the raw "
                                "results of earlier runs, e.g. on a lent GPU, names the commands that measured)")
    add("--worker", choices=list(MODELS), help=argparse.SUPPRESS)  # internal: measure this model here
    add("--results", help=argparse.SUPPRESS)  # internal: the worker's JSON-lines file
    args = p.parse_args(argv)
    if args.models is None:
        args.models = list(QUICK_MODELS) if args.quick else list(MODELS)
    if args.jobs is None:
        args.jobs = min(len(args.models), os.cpu_count() or 1) if args.quick else 1
    if args.threads is None and args.jobs > 1:  # workers side by side share the cores, not oversubscribe them
        args.threads = max(1, (os.cpu_count() or 1) // args.jobs)
    return args


def run_model(model: str, args: argparse.Namespace, scratch: Path) -> dict:
    """Measure one model in a fresh process; methods it never reached are recorded as failures."""
    path = scratch / f"{model}.jsonl"
    if args.scratch and path.exists():  # measured by an earlier run into the same scratch folder
        return _collect(model, args, path, rc=0)
    env = dict(os.environ)
    if not args.quick:  # first calls compile cold, as on a user's first run: an empty compiler cache per model
        env["TORCHINDUCTOR_CACHE_DIR"] = str(scratch / f"inductor-{model}")
        env["TRITON_CACHE_DIR"] = str(scratch / f"inductor-{model}" / "triton")
    remaining = list(args.methods)
    rc = 0
    while remaining:
        cmd = [sys.executable, "-m", "benchmarks", "--worker", model, "--results", str(path)]
        cmd += ["--headline-only"] if args.headline_only else []
        cmd += ["--sizes", *map(str, args.sizes)] if args.sizes else []
        cmd += ["--no-sequence"] if args.no_sequence else []
        cmd += ["--device", args.device, "--methods", *remaining]
        cmd += ["--quick"] if args.quick else []
        cmd += ["--threads", str(args.threads)] if args.threads else []
        rc = subprocess.run(cmd, env=env).returncode
        done = {r["method"] for r in _lines(path) if "method" in r}
        remaining = [m for m in remaining if m not in done]
        if rc == 0 or not remaining:
            break
        # the worker died (typically the out-of-memory killer) in the method it was running last: record that
        # method's finished sizes and the fatal one, and go on with the rest in a fresh worker
        killed = _killed_method(path, remaining)
        _record_killed(model, killed, path, rc)
        remaining = [m for m in remaining if m != killed]
    return _collect(model, args, path, rc)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _killed_method(path: Path, remaining: list[str]) -> str:
    """The method whose first calls a dead worker was making last; during the interleaved timed calls (which
    follow every method's peak-memory call) the last method whose first calls ran."""
    running = [r["running"] for r in _lines(path) if r.get("running") in remaining]
    return running[-1] if running else remaining[0]


def _record_killed(model: str, method: str, path: Path, rc: int) -> None:
    lines = _lines(path)
    sizes = {str(r["size"]): r["entry"] for r in lines if r.get("partial") == method}
    running = [r["size"] for r in lines if r.get("running") == method]
    cause = "signal 9, most likely the out-of-memory killer" if rc == -9 else f"exit code {rc}"
    if running and str(running[-1]) not in sizes:
        sizes[str(running[-1])] = {"error": f"unsupported: the process was killed ({cause})"}
    record = {"model": model, "method": method, "label": METHODS[method].label, "sizes": sizes,
              "sequence": None, "check": None}
    if not sizes:
        record["error"] = f"unsupported: the process was killed ({cause})"
    with path.open("a") as out:
        out.write(json.dumps(record) + "\n")


def _collect(model: str, args: argparse.Namespace, path: Path, rc: int) -> dict:
    lines = _lines(path)
    header = lines[0] if lines and "environment" in lines[0] else {}
    records = {r["method"]: r for r in lines if "method" in r}
    for key in args.methods:
        error = f"unsupported: the worker process exited with code {rc} before this method"
        records.setdefault(key, {"model": model, "method": key, "label": METHODS[key].label, "error": error})
    return {**header, "methods": {key: records[key] for key in args.methods}}


def main(argv: list[str] | None = None) -> None:
    keep_freed_memory()
    args = parse(argv)
    if args.worker:
        run_worker(args.worker, args.methods, args.quick, args.device, args.results, args.threads,
                   headline_only=args.headline_only, sizes=tuple(args.sizes or ()) or None,
                   sequence=not args.no_sequence)
        return
    argv = sys.argv[1:] if argv is None else argv
    start = time.perf_counter()
    if args.scratch:
        Path(args.scratch).mkdir(parents=True, exist_ok=True)
    with (contextlib.nullcontext(args.scratch) if args.scratch else tempfile.TemporaryDirectory(prefix="benchmarks-")
          ) as scratch, ThreadPoolExecutor(args.jobs) as pool:
        measured = pool.map(lambda m: run_model(m, args, Path(scratch)), args.models)
        models = dict(zip(args.models, measured, strict=True))
    environment = next((m["environment"] for m in models.values() if "environment" in m), None)
    if environment is None:
        sys.exit("every worker failed before measuring anything")
    results = {
        "command": args.command_note or shlex.join(["python", "-m", "benchmarks", *argv]),
        "assembled": bool(args.command_note),
        "quick": args.quick,
        "jobs": args.jobs,
        "date": datetime.date.today().isoformat(),
        "wall_s": time.perf_counter() - start,
        "environment": environment,
        "methods": args.methods,
        "dp": {"max_norm": MAX_NORM, "noise_multiplier": NOISE_MULTIPLIER},
        "models": models,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / f"{report.page_stem(results)}.json"
    raw.write_text(json.dumps(results, indent=1))
    written = [raw, *report.write(results, out)]
    print(f"wrote {', '.join(map(str, written))} in {results['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
