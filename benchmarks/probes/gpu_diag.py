"""``python -m benchmarks.probes.gpu_diag MODEL B``: the full error of ``compile_step`` on MODEL (the tables keep its
first line only), which attention kernel the default ``scaled_dot_product_attention`` picks there, and the
same step with SDPA limited to the math backend (decomposed into matmuls and softmax), timed against the
plain SGD steps under the same setting."""

from __future__ import annotations

import sys
import traceback

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import keep_freed_memory
from ..methods import METHODS
from ..models import build_workload
from ..timing import first_call_seconds, median_seconds


def _time(run, batch, reps=15) -> float:
    return median_seconds(lambda: run(*batch), reps, sync=torch.cuda.synchronize)


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
                first = first_call_seconds(lambda run=prepared.run: run(*batch), sync=torch.cuda.synchronize)
                rows.append(f"SDPA math backend: {key}: {_time(prepared.run, batch) * 1e3:.2f} ms "
                            f"(first call {first:.1f} s)")
            except Exception:
                rows.append(f"SDPA math backend: {key} failed: {traceback.format_exc()[-1500:]}")
            print(rows[-1], flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
