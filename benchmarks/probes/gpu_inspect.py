"""``python -m benchmarks.probes.gpu_inspect MODEL B OUTDIR``: what the GPU runs in one DP step of ``compile_step``.

Run it with ``TORCH_LOGS=output_code`` (and an empty ``TORCHINDUCTOR_CACHE_DIR``) to get Inductor's generated
code on stderr. Here: three steps (the first runs eagerly and compiles), then ``torch.profiler`` over ten steps
of ``compile_step`` and ten of the compiled plain SGD step; writes ``OUTDIR/profile_MODEL_B.txt`` (the
profiler's tables: kernels by GPU time, with call counts) and ``OUTDIR/kernels_MODEL_B.json`` (per step:
every GPU kernel's name, launches and microseconds).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from .. import keep_freed_memory
from ..methods import METHODS
from ..models import build_workload

STEPS = 10


def _kernels(prof) -> list[dict]:
    rows = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(ev, "self_cuda_time_total", 0)
        if dev_us and ev.device_type == torch.autograd.DeviceType.CUDA:
            rows.append({"name": ev.key, "launches_per_step": ev.count / STEPS, "us_per_step": dev_us / STEPS})
    return sorted(rows, key=lambda r: -r["us_per_step"])


def main(model: str, size: int, out: Path) -> None:
    keep_freed_memory()
    out.mkdir(parents=True, exist_ok=True)
    wl = build_workload(model, False, torch.device("cuda"))
    batch = wl.batch(size)
    report, found = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {model} B={size}"], {}
    for key in ("dp_psg_compile_step", "sgd_step_compile", "sgd_step"):
        prepared = METHODS[key].setup(wl)
        print(f"=== {key}: warm-up (compiles) ===", file=sys.stderr, flush=True)
        for _ in range(3):
            prepared.run(*batch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True) as prof:
            for _ in range(STEPS):
                prepared.run(*batch)
            torch.cuda.synchronize()
        try:
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=90)
        except Exception as e:  # the sort key's name changed between torch versions
            table = f"(table: {e})\n" + prof.key_averages().table(row_limit=60, max_name_column_width=90)
        report += [f"\n===== {key} ({STEPS} steps) =====", table]
        found[key] = _kernels(prof)
        del prepared
    (out / f"profile_{model}_{size}.txt").write_text("\n".join(report))
    (out / f"kernels_{model}_{size}.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                                  "torch": torch.__version__, "steps": found},
                                                                 indent=1))
    for key, rows in found.items():
        total = sum(r["us_per_step"] for r in rows)
        launches = sum(r["launches_per_step"] for r in rows)
        print(f"{key}: {launches:.0f} kernel launches, {total:.0f} us of GPU time per step", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
