"""``python -m benchmarks.gpu_diag MODEL B``: the full error of ``compile_step`` on MODEL (the tables keep its
first line only), which attention kernel the default ``scaled_dot_product_attention`` picks there, and the
same step with SDPA limited to the math backend (decomposed into matmuls and softmax), timed against the
plain SGD steps under the same setting."""

from __future__ import annotations

import statistics
import sys
import time
import traceback

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import keep_freed_memory
from .methods import METHODS
from .models import build_workload


def _time(run, batch, reps=15) -> float:
    for _ in range(3):
        run(*batch)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        run(*batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(model: str, size: int) -> None:
    keep_freed_memory()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {model} B={size}", flush=True)
    wl = build_workload(model, False, torch.device("cuda"))
    batch = wl.batch(size)
    try:
        step = METHODS["dp_psg_compile_step"].setup(wl)
        step.run(*batch)
        print("default SDPA: compile_step ran", flush=True)
    except Exception:
        print("default SDPA: compile_step failed:\n" + traceback.format_exc()[-6000:], flush=True)
    with sdpa_kernel([SDPBackend.MATH]):
        rows = []
        for key in ("sgd_step", "sgd_step_compile", "dp_psg_compile_step"):
            try:
                prepared = METHODS[key].setup(wl)
                t0 = time.perf_counter()
                prepared.run(*batch)
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                rows.append(f"SDPA math backend: {key}: {_time(prepared.run, batch) * 1e3:.2f} ms "
                            f"(first call {first:.1f} s)")
            except Exception:
                rows.append(f"SDPA math backend: {key} failed: {traceback.format_exc()[-1500:]}")
            print(rows[-1], flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
