"""``python -m benchmarks.probes.cold_compile --models mlp cnn --batch 16``: where a first call's time goes.

The page's cold-compile target compares the first call of ``compile_step``'s DP step with that of
``torch.compile(vmap(grad))``. This splits each first call into phases, by timers around the functions that do
the work, each phase counting its own time only (a phase called inside another is taken out of the outer one):

- ``capture``: compiled_psg's capture and rewrite of the loss (Dynamo, AOT autograd's joint trace, the rewrite,
  the reductions), all of it;
- ``update capture``: the trace of the optimizer's step (``capture_update``), all of it;
- ``program``: the DP step's construction of its program from those two graphs, less the update capture;
- ``dynamo``: Dynamo's trace of the user's function (``torch.compile``'s methods), less what it calls below;
- ``aot trace``: AOT autograd's metadata pass and graph trace of the graph handed to Inductor (``compile_fx``
  re-traces compiled_psg's rewritten program with Inductor's decompositions; Dynamo's graph for ``vmap``);
- ``lowering``: Inductor's lowering of the graph to its IR;
- ``codegen``: Inductor's scheduling, fusion and code generation (``GraphLowering.codegen``);
- ``c++ wait``: waiting for the C++ compiler (the kernels compile on Inductor's worker processes);
- ``inductor other``: the rest of ``_compile_fx_inner`` (post-grad passes, its cache, loading the module);
- ``compile_fx other``: the rest of ``compile_fx`` (AOT autograd's wrappers and cache, Inductor's joint-graph
  passes);
- ``eager step``: the DP step's first step, which runs the rewritten graph op by op and the optimizer eagerly
  (the optimizer's state must exist before the program that updates it is traced);
- ``noise wait``: the DP step's first noise draw waiting for the native generator's build (a C++ compile on a
  background thread, started when the step is built);
- ``rest``: the first call's remainder (Python around the phases, running the program once).

``kernels`` counts the C++ kernels the call's generated code loads (Inductor's wrapper creates one per distinct
kernel source; one that an earlier method of the process compiled comes from the cache). One process per model
with an empty Inductor cache (``--scratch``); in it ``backward_compile``'s first call runs first, untimed, so that
the compiler's one-time work (its check of the CPU's vector instructions, its worker pool, imports) is not
charged to the first measured method. The page's first calls follow all the other methods of their model, so
their seconds differ from these.

``--warm`` runs each model's worker a second time on the cache the first filled: a new process whose Inductor
(and AOT autograd) caches are warm, the case of a user's second run of the same script (rows ``cache: warm``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .. import keep_freed_memory
from ..timing import first_call_seconds

PHASES = ("capture", "update capture", "program", "dynamo", "aot trace", "lowering", "codegen", "c++ wait",
          "inductor other", "compile_fx other", "eager step", "noise wait", "rest")
DEFAULT_METHODS = ("func_compile", "dp_psg_compile_step")


class PhaseTimer:
    """Exclusive time per phase: a timed function's time less that of the timed functions it calls.
    ``inclusive`` phases keep all of their time (nothing inside them is timed apart)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._stack: list[list[float]] = []  # per open phase: [seconds of timed calls inside it]
        self._inclusive_depth = 0
        self.kernels = 0
        self._originals: list[tuple[object, str, object]] = []

    def restore(self) -> None:
        """Put every wrapped function back."""
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()

    def wrap(self, owner, name: str, phase: str, inclusive: bool = False) -> None:
        original = getattr(owner, name)
        self._originals.append((owner, name, original))

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if self._inclusive_depth or threading.current_thread() is not threading.main_thread():
                return original(*args, **kwargs)
            self._stack.append([0.0])
            self._inclusive_depth += inclusive
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self._inclusive_depth -= inclusive
                inner = self._stack.pop()[0]
                self.seconds[phase] = self.seconds.get(phase, 0.0) + elapsed - inner
                self.calls[phase] = self.calls.get(phase, 0) + 1
                if self._stack:
                    self._stack[-1][0] += elapsed

        setattr(owner, name, timed)

    def count_kernels(self, owner, name: str) -> None:
        original = getattr(owner, name)
        self._originals.append((owner, name, original))

        @functools.wraps(original)
        def counted(*args, **kwargs):
            self.kernels += 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)


def install(timer: PhaseTimer) -> None:
    """Wrap the functions of the phases where their callers look them up (``timer.restore()`` undoes it)."""
    import torch._dynamo.convert_frame as convert_frame
    import torch._functorch.aot_autograd as aot_autograd
    import torch._inductor.async_compile as async_compile
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.graph as inductor_graph

    import compiled_psg._api as api
    import compiled_psg._train.native_noise as native_noise
    import compiled_psg._train.paths as paths
    import compiled_psg._train.step as step
    import compiled_psg._train.update_graph as update_graph

    timer.wrap(api, "build", "capture", inclusive=True)  # _api calls build through its module global
    timer.wrap(update_graph, "capture_update", "update capture", inclusive=True)
    timer.wrap(step.DPStep, "program_for", "program")
    timer.wrap(paths, "run_per_sample", "eager step")  # the first step's, and micro-batches' (none here)
    timer.wrap(paths, "eager_update_of", "eager step")
    timer.wrap(convert_frame, "_compile", "dynamo")
    timer.wrap(compile_fx, "compile_fx", "compile_fx other")  # the run-time imports of compile_fx find this one
    timer.wrap(aot_autograd, "create_aot_state", "aot trace")
    timer.wrap(aot_autograd, "aot_stage1_graph_capture", "aot trace")  # imported by name into aot_autograd
    timer.wrap(compile_fx, "_compile_fx_inner", "inductor other")  # compile_fx_inner is bound as a default
    timer.wrap(native_noise, "available", "noise wait")
    timer.wrap(inductor_graph.GraphLowering, "run", "lowering")
    timer.wrap(inductor_graph.GraphLowering, "codegen", "codegen")
    timer.wrap(async_compile.AsyncCompile, "wait", "c++ wait")
    timer.count_kernels(async_compile.AsyncCompile, "cpp_pybinding")


def worker(model: str, batch: int, methods: list[str]) -> list[dict]:
    import torch

    from ..methods import METHODS
    from ..models import build_workload

    wl = build_workload(model, False, torch.device("cpu"))
    args = wl.batch(batch)
    METHODS["backward_compile"].setup(wl).run(*args)  # the compiler's one-time work, untimed
    timer = PhaseTimer()
    install(timer)  # the worker process ends after its rows
    rows = []
    for key in methods:
        timer.seconds.clear()
        timer.kernels = 0
        total = first_call_seconds(lambda key=key: METHODS[key].setup(wl).run(*args))
        phases = {p: round(timer.seconds.get(p, 0.0), 2) for p in PHASES[:-1]}
        phases["rest"] = round(total - sum(timer.seconds.values()), 2)
        rows.append({"model": model, "batch": batch, "method": key, "first_call_s": round(total, 2),
                     "kernels": timer.kernels, "phases": phases})
    return rows


def table(rows: list[dict]) -> str:
    head = ["model", "method", "cache", "first call (s)", "kernels", *PHASES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], r["method"], r["cache"], f"{r['first_call_s']:.2f}", str(r["kernels"]),
                 *(f"{r['phases'][p]:.2f}" for p in PHASES)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    keep_freed_memory()
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.cold_compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS))
    p.add_argument("--scratch", default=None, help="folder for the empty Inductor caches (default: a temporary one)")
    p.add_argument("--warm", action="store_true", help="also a second process per model on the filled cache")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.models[0], args.batch, args.methods)))
        return
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="cold-compile-"))
    rows = []
    for model in args.models:
        cache = scratch / f"inductor-{model}"
        if cache.exists():
            raise SystemExit(f"{cache} exists: the first calls would not be cold. Pass an empty --scratch folder.")
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
        cmd = [sys.executable, "-m", "benchmarks.probes.cold_compile", "--worker", "--models", model,
               "--batch", str(args.batch), "--methods", *args.methods]
        for cache_state in ("cold", "warm") if args.warm else ("cold",):
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            rows += [dict(row, cache=cache_state) for row in json.loads(out.strip().splitlines()[-1])]
    print(table(rows))


if __name__ == "__main__":
    main()
