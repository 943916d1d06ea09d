"""``python -m benchmarks.probes.breakdown``: where a method's time goes, against the baseline it is judged by.

Issue 12 asks for the measured cause of every missed target. For each model and batch size this runs, in one
process with an empty Inductor cache (one subprocess per model), the methods of the targets side by side:

- the first call of each method, cold, split into Inductor's code generation (Dynamo's ``compile_fx_inner``
  timer, the same for ``torch.compile`` and for compiled_psg), AOT autograd's tracing
  (``create_aot_dispatcher_function``) and the rest (Dynamo's bytecode tracing; for compiled_psg also the
  analysis and rewrite);
- the median of ``--repeats`` warm calls;
- ``torch.profiler`` over ``--profiled`` warm calls (Inductor's C++ kernels recorded:
  ``TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1``), each op's exclusive CPU time summed into categories:
  library matmuls and convolutions, Inductor's fused kernels, noise, other ATen ops, and the time outside every
  op (Python, guards, argument handling, the wrappers of compiled graphs and of the optimizer step);
- the ops that allocate the most memory (``profile_memory``: bytes the op allocated and kept past its return).

Writes ``OUT/breakdown.json`` and ``OUT/breakdown.md`` (one table per model and batch size, ms per call); the
tables of each model and batch size already in ``OUT/breakdown.json`` from an earlier command and not measured
again are kept, and the page names both commands.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import keep_freed_memory
from ..timing import first_call_seconds, median_seconds

PAIRS = {  # method -> the baselines a target compares it with
    "dp_psg_compile_step": ("sgd_step", "sgd_step_compile", "dp_func_compile"),
    "psg_norms": ("backward", "backward_compile"),
    "psg_grads": ("func_compile",),
}
LIBRARY_CALLS = {  # ATen ops that call a BLAS, oneDNN or another library kernel (Inductor's extern calls)
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::convolution",
    "aten::_convolution", "aten::convolution_backward", "aten::mkldnn_convolution", "aten::_mkl_linear",
    "aten::mkldnn_convolution_backward", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::_native_multi_head_attention",
    "mkldnn::_convolution_pointwise", "mkldnn::_linear_pointwise", "mkl::_mkl_linear",
    "aten::slow_conv2d_forward", "aten::_slow_conv2d_backward", "aten::thnn_conv2d",
}
NOISE = {"aten::randn", "aten::normal_", "aten::randn_like", "aten::normal", "compiled_psg.noise"}
WRAPPERS = ("## Call CompiledFxGraph", "TorchDynamo Cache Lookup", "CompiledFunction", "Optimizer.", "Torch-Compiled")
STEP = "one call"  # a record_function around each call: its own time is the time outside every op
CATEGORIES = ("library matmul/conv", "Inductor fused kernels", "noise", "other ATen ops", "outside ops")


def category(name: str) -> str:
    if name in LIBRARY_CALLS:
        return "library matmul/conv"
    if "cpp_fused" in name or name.startswith(("graph_", "kernel_")):
        return "Inductor fused kernels"
    if name in NOISE:
        return "noise"
    if name.startswith(WRAPPERS) or name == STEP:
        return "outside ops"
    return "other ATen ops"


def _profile(run, batch, calls: int) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    # acc_events: one cycle either way; without it torch 2.11 warns that a cycle's events are cleared
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, acc_events=True) as prof:
        for _ in range(calls):
            with record_function(STEP):
                run(*batch)
    totals = dict.fromkeys(CATEGORIES, 0.0)
    ops, memory = [], []
    for ev in prof.key_averages():
        us = ev.self_cpu_time_total / calls
        totals[category(ev.key)] += us
        if ev.key == STEP:
            continue
        ops.append((ev.key, us, ev.count // calls))
        if ev.self_cpu_memory_usage > 0:
            memory.append((ev.key, ev.self_cpu_memory_usage / calls))
    ops.sort(key=lambda o: -o[1])
    memory.sort(key=lambda m: -m[1])
    return {"categories_ms": {k: v / 1e3 for k, v in totals.items()},
            "top_ops": [{"op": k, "ms": us / 1e3, "calls": n} for k, us, n in ops[:8]],
            "top_memory": [{"op": k, "MiB": b / 2**20} for k, b in memory[:5]]}


def _compile_timers() -> dict:
    """Seconds under each of Dynamo's compile timers so far, and ``KEY#`` the number of times each ran."""
    from torch._dynamo.utils import compilation_time_metrics

    return {k: sum(v) for k, v in compilation_time_metrics.items()} | {
        f"{k}#": len(v) for k, v in compilation_time_metrics.items()}


def measure_model(model: str, sizes: list[int], methods: list[str], repeats: int, profiled: int) -> dict:
    """In this process (its Inductor cache empty): every method at every size."""
    import torch

    from ..methods import METHODS
    from ..models import build_workload

    wl = build_workload(model, False, torch.device("cpu"))
    out = {}
    for size in sizes:
        batch = wl.batch(size)
        rows = {}
        for key in methods:
            try:
                before = _compile_timers()
                made = {}  # the set-up is timed with the first call
                first = first_call_seconds(
                    lambda key=key, batch=batch, made=made: made.setdefault("it", METHODS[key].setup(wl)).run(*batch))
                prepared = made["it"]
                after = _compile_timers()
                spent = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                median = median_seconds(lambda run=prepared.run, batch=batch: run(*batch), repeats)
                inductor = spent.get("compile_fx_inner", 0.0)  # nested in AOT autograd's timer
                rows[key] = {"median_ms": median * 1e3, "first_call_s": first,
                             "inductor_s": inductor, "inductor_graphs": int(spent.get("compile_fx_inner#", 0)),
                             "aot_trace_s": max(spent.get("create_aot_dispatcher_function", 0.0) - inductor, 0.0),
                             **_profile(prepared.run, batch, profiled)}
            except Exception as e:  # recorded, as in the main harness
                rows[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
            print(f"[{model}] B={size} {key}: {rows[key].get('median_ms', rows[key].get('error'))}", flush=True)
        out[str(size)] = rows
    return out


def _md_model(model: str, size: str, rows: dict) -> list[str]:
    keys = [k for k in rows if "error" not in rows[k]]
    lines = [f"### {model}, B={size}", "", "| ms per call | " + " | ".join(keys) + " |",
             "|---" * (len(keys) + 1) + "|"]
    lines.append("| median (not profiled) | " + " | ".join(f"{rows[k]['median_ms']:.2f}" for k in keys) + " |")
    for cat in CATEGORIES:
        lines.append(f"| {cat} | " + " | ".join(f"{rows[k]['categories_ms'][cat]:.2f}" for k in keys) + " |")
    lines.append("| first call (s): Inductor (graphs) / AOT trace / rest | " + " | ".join(
        f"{rows[k]['inductor_s']:.1f} ({rows[k].get('inductor_graphs', '?')}) / {rows[k]['aot_trace_s']:.1f} / "
        f"{rows[k]['first_call_s'] - rows[k]['inductor_s'] - rows[k]['aot_trace_s']:.1f}" for k in keys) + " |")
    lines.append("")
    for k in keys:
        top = ", ".join(f"{o['op']} {o['ms']:.2f} ms ×{o['calls']}" for o in rows[k]["top_ops"][:6])
        mem = ", ".join(f"{m['op']} {m['MiB']:.0f} MiB" for m in rows[k]["top_memory"][:3])
        lines.append(f"- {k}: {top}. Memory kept: {mem or 'none'}")
    lines += [f"- {k}: {rows[k]['error']}" for k in rows if "error" in rows[k]]
    return lines + [""]


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = ["# Where the time goes", "", f"- Command: `{meta['command']}`", f"- {meta['machine']}", ""]
    for model, sizes in results["models"].items():
        for size, rows in sizes.items():
            lines += _md_model(model, size, rows)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    keep_freed_memory()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.breakdown", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "mlp", "transformer", "resnet", "gpt2"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[64])
    parser.add_argument("--methods", nargs="+",
                        default=[m for pair in PAIRS.items() for m in (pair[0], *pair[1])])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profiled", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/breakdown"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the worker: measure this model, print JSON
    args = parser.parse_args(argv)
    methods = list(dict.fromkeys(args.methods))
    if args.one:
        print("RESULT " + json.dumps(measure_model(args.one, args.sizes, methods, args.repeats, args.profiled)))
        return
    import platform

    import torch

    results = {"meta": {"command": "python -m benchmarks.probes.breakdown " + " ".join(argv or sys.argv[1:]),
                        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                                   f"torch {torch.__version__}"}, "models": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    earlier = args.out / "breakdown.json"
    if earlier.exists():  # the (model, size) tables of earlier commands into the same folder stay unless measured again
        old = json.loads(earlier.read_text())
        results["models"] = {m: {b: rows for b, rows in sizes.items()
                                 if m not in args.models or int(b) not in args.sizes}
                             for m, sizes in old["models"].items()}
        results["meta"]["command"] = "; ".join([old["meta"]["command"], results["meta"]["command"]])
    for model in args.models:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE": "1"}
            cmd = [sys.executable, "-m", "benchmarks.probes.breakdown", "--one", model, "--sizes",
                   *map(str, args.sizes), "--methods", *methods, "--repeats", str(args.repeats),
                   "--profiled", str(args.profiled)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            sys.stderr.write(proc.stdout.rsplit("RESULT ", 1)[0])
            if "RESULT " not in proc.stdout:
                sys.stderr.write(proc.stderr[-3000:])
                continue
            results["models"].setdefault(model, {}).update(json.loads(proc.stdout.rsplit("RESULT ", 1)[1]))
        (args.out / "breakdown.json").write_text(json.dumps(results, indent=1))
        (args.out / "breakdown.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
