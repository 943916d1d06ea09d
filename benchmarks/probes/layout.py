"""``python -m benchmarks.probes.layout``: per-sample convolutions with and without Inductor's layout optimization.

``compiled_psg`` turns Inductor's ``layout_optimization`` (channels-last buffers for graphs with convolutions) off
for graphs that call its per-sample convolution ops, which read the batch as the groups of one NCHW convolution
(``_rewrite/rules/conv.py``, ``BATCH_AS_GROUPS``). This times both settings: each (model, setting, pair) in its own
process with an empty Inductor cache, the settings alternated, medians of ``--repeats`` calls after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from .. import keep_freed_memory

# the two methods this compares, by their names in the benchmark's method table
METHOD_NAMES = {"norms": "psg_norms", "dp_step": "dp_psg_compile_step"}


def _one(model: str, batch: int, method: str, layout_on: bool, repeats: int) -> float:
    import torch

    from compiled_psg._compile import run

    from ..methods import METHODS
    from ..models import build_workload
    from ..timing import median_seconds

    if layout_on:  # what Inductor would do without compiled_psg's setting
        run.calls_batch_as_groups = lambda graph: False
    wl = build_workload(model, False, torch.device("cpu"))
    x, y = wl.batch(batch)
    f = METHODS[METHOD_NAMES[method]].setup(wl).run
    f(x, y)
    return median_seconds(lambda: f(x, y), repeats) * 1e3


def main(argv: list[str] | None = None) -> None:
    keep_freed_memory()
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.layout", description=__doc__.split("\n\n")[1])
    p.add_argument("--models", nargs="+", default=["cnn", "resnet"])
    p.add_argument("--methods", nargs="+", default=["norms", "dp_step"], choices=list(METHOD_NAMES))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # model method on|off, in a child process
    args = p.parse_args(argv)
    if args.repeats < 7:
        p.error("--repeats must be at least 7")
    if args.one:
        model, method, setting = args.one
        print("RESULT", json.dumps(_one(model, args.batch, method, setting == "on", args.repeats)))
        return
    print(f"B={args.batch}, median of {args.repeats} calls, ms; each pair: layout optimization on, then off")
    for model in args.models:
        for method in args.methods:
            cells = []
            for _ in range(args.pairs):
                for setting in ("on", "off"):
                    with tempfile.TemporaryDirectory() as cache:
                        cmd = [sys.executable, "-m", "benchmarks.probes.layout", "--one", model, method, setting,
                               "--batch", str(args.batch), "--repeats", str(args.repeats)]
                        out = subprocess.run(cmd, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache},
                                             capture_output=True, text=True)
                        found = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
                        cells.append(f"{setting} {json.loads(found[-1][7:]):.1f}" if found else f"{setting} failed")
            print(f"{model:>8} {method:>8}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
