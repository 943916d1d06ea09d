"""``python -m benchmarks.probes.call_overhead``: what a cached call, and a DP step, cost on top of running their graph.

A call of a per-sample function finds its cached graph (a key from the parameters' and arguments' signatures),
checks the capture's Dynamo guards (module structure, hooks, Python attributes the loss read), then runs the
graph. On a small model, where the graph itself costs little, this prints, side by side in one process and
interleaved (every round times each variant in turn; medians of ``--repeats`` rounds of ``--inner`` calls after
warm-up, microseconds per call):

- ``call``: the whole public call, ``loss(x, y)``;
- ``lookup``: finding the entry, guards included (``compiled_for``);
- ``guards``: the guard check alone;
- ``graph``: running the cached entry (``entry(params, args, B)``: inputs assembled, outputs unflattened);
- ``kernel``: the compiled graph alone, on inputs assembled once.

With ``--step``, a ``compile_step`` DP step (clipping and noise, ``torch.optim.SGD``) against the plain
training step of the same model (``zero_grad``, forward, ``backward``, ``optimizer.step()``), eager and with
``torch.compile(model)``:

- ``dp_step``: ``step(x, y)``;
- ``program``: the step's compiled program alone, on inputs assembled once (its noise drawn once);
- ``plain_eager``, ``plain_compiled``: the plain step; ratios are against the faster of the two.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import compiled_psg as psg

from .. import keep_freed_memory
from ..models import MODELS, build_workload
from ..timing import interleaved_medians


def interleaved(variants: dict[str, Callable[[], object]], repeats: int, inner: int,
                warm_up: int = 20) -> dict[str, float]:
    """Median microseconds per call of each variant (``timing.interleaved_medians``: a load spike on the shared
    machine then hits all of them, not one)."""
    return {name: s * 1e6 for name, s in interleaved_medians(variants, repeats, warm_up, inner).items()}


#: ``--model deep``: as many parameter tensors as ResNet-50 (161; GPT-2 small has 148) and almost no arithmetic,
#: so that a step's time is its host time, which a GPU step of those models spends beside its kernels
DEEP_LAYERS = 80


def _workload(model_name: str, batch: int, full: bool = False):
    """``(model, (x, y), loss_of(model))``: the tiny MLP (8-16-3, tanh), the deep one (``DEEP_LAYERS`` tanh layers
    of width 8) or a benchmark model (its ``--quick`` sizes unless ``full``)."""
    torch.manual_seed(0)
    if model_name in ("tiny", "deep"):
        hidden = [nn.Linear(8, 16), nn.Tanh()] if model_name == "tiny" else [
            layer for _ in range(DEEP_LAYERS) for layer in (nn.Linear(8, 8), nn.Tanh())]
        model = nn.Sequential(*hidden, nn.Linear(16 if model_name == "tiny" else 8, 3))
        data = (torch.randn(batch, 8), torch.randint(0, 3, (batch,)))
        return model, data, lambda m: (lambda x, y: F.cross_entropy(m(x), y))
    work = build_workload(model_name, quick=not full, device=torch.device("cpu"))
    criterion = work.criterion
    return work.model, work.batch(batch), lambda m: (lambda x, y: criterion(m(x), y))


def _kernel(entry, params: dict, args: tuple, batch: int, extra: tuple = ()) -> Callable[[], object]:
    """The compiled graph of ``entry`` alone, its inputs assembled once (what a call cannot go below)."""
    inputs = entry._inputs(params, args, batch) + list(extra)
    fn = entry._callable(batch, inputs)

    def run():
        with torch.no_grad():
            return fn(*inputs)

    return run


def measure(repeats: int = 15, batch: int = 8, backend: str = "eager", model_name: str = "tiny",
            inner: int = 20, full: bool = False) -> dict[str, float]:
    model, (x, y), loss_of = _workload(model_name, batch, full)
    loss = psg.per_sample(model, reduce=psg.norms(), backend=backend)(loss_of(model))
    loss(x, y)
    entry, params, args, size = loss.compiled_for(x, y)
    guards = entry.rewritten.captured.guards
    tensors = list(params.values())
    return interleaved({
        "call": lambda: loss(x, y),
        "lookup": lambda: loss.compiled_for(x, y),
        "guards": lambda: guards.check(loss.fn, tensors, args),
        "graph": lambda: entry(params, args, size),
        "kernel": _kernel(entry, params, args, size),
    }, repeats, inner)


def measure_step(repeats: int = 15, batch: int = 16, backend: str = "inductor", model_name: str = "tiny",
                 inner: int = 20, full: bool = False) -> dict[str, float]:
    model, (x, y), loss_of = _workload(model_name, batch, full)
    variants: dict[str, Callable[[], object]] = {}

    dp_model = copy.deepcopy(model)
    step = psg.compile_step(loss_of(dp_model), dp_model, torch.optim.SGD(dp_model.parameters(), lr=1e-3),
                            max_grad_norm=1.0, noise_multiplier=1.0, backend=backend)
    step(x, y)  # eager: creates the optimizer state, then builds and compiles the program
    step(x, y)
    variants["dp_step"] = lambda: step(x, y)
    call = step.per_sample.prepare_call(x, y)
    program, compiled = step.program_cache.get(call.entry, step.config, False)
    extra = step.inputs.for_program(step.config, program.inputs, batch)
    variants["program"] = _kernel(compiled, call.params, call.args, batch, tuple(extra))

    for name, wrap in (("plain_eager", lambda m: m), ("plain_compiled", torch.compile)):
        plain = copy.deepcopy(model)
        opt = torch.optim.SGD(plain.parameters(), lr=1e-3)
        loss_fn = loss_of(wrap(plain))

        def plain_step(opt=opt, loss_fn=loss_fn):
            opt.zero_grad()
            loss_fn(x, y).backward()
            opt.step()

        variants[name] = plain_step
    return interleaved(variants, repeats, inner)


def breakdown(steps: int = 1000, batch: int = 16, backend: str = "inductor", model_name: str = "tiny",
              full: bool = False) -> dict[str, tuple[float, float]]:
    """Where a DP step's time goes: each listed method is wrapped with a timer for ``steps`` steps (after
    warm-up); ``{method: (median microseconds per call, calls per step)}``. The timers add their own cost."""
    import functools

    from compiled_psg import _api
    from compiled_psg._compile import run
    from compiled_psg._train import binding, eager, paths, transaction, update_graph
    from compiled_psg._train import inputs as inputs_module
    from compiled_psg._train import step as step_module

    model, (x, y), loss_of = _workload(model_name, batch, full)
    step = psg.compile_step(loss_of(model), model, torch.optim.SGD(model.parameters(), lr=1e-3),
                            max_grad_norm=1.0, noise_multiplier=1.0, backend=backend)
    for _ in range(20):
        step(x, y)
    timed: dict[str, list[int]] = {}
    targets = [(step_module.DPStep, "__call__", "step"), (step_module.DPStep, "_per_sample_for", "per-sample function"),
               (_api.PerSampleFunction, "prepare_call", "prepare_call (walk, key, guards)"),
               (_api.PerSampleFunction, "_valid", "  guard check"),
               (step_module.DPStep, "program_for", "program lookup"),
               (update_graph, "signature", "  optimizer signature"),
               (inputs_module.StepInputs, "for_program", "extra inputs"),
               (eager.NoiseSource, "draw_many", "  noise draw"),
               (run.CompiledGraph, "run", "run the program"), (run.CompiledGraph, "_inputs", "  inputs"),
               (binding.OptimizerBinding, "refresh", "optimizer binding"),
               (step_module.DPStep, "_reduction_for", "clip reduction"),
               (step_module, "refuse_gradient_hooks", "gradient hooks check"),
               (transaction.Snapshot, "take", "transaction snapshot"), (paths, "commit", "commit")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]

    def timer(fn, label):
        @functools.wraps(fn)
        def timed_fn(*a, **k):
            start = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                timed.setdefault(label, []).append(time.perf_counter_ns() - start)
        return timed_fn

    try:
        for (owner, name, label), (_, _, fn) in zip(targets, saved, strict=True):
            setattr(owner, name, timer(fn, label))
        for _ in range(steps):
            step(x, y)
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return {label: (statistics.median(timed[label]) / 1e3, len(timed[label]) / steps)
            for _, _, label in targets if label in timed}


def main(argv: list[str] | None = None) -> None:
    keep_freed_memory()
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.call_overhead", description=__doc__.split("\n\n")[1])
    p.add_argument("--repeats", type=int, default=15, help="timed rounds per variant (median reported; >= 7)")
    p.add_argument("--inner", type=int, default=20, help="calls per timed round")
    p.add_argument("--backend", choices=["eager", "inductor"], default=None,
                   help="default: eager for a call, inductor for --step")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes (default: 8; --step: 16)")
    p.add_argument("--model", choices=["tiny", "deep", *MODELS], default="tiny",
                   help="tiny: MLP 8-16-3 (tanh); deep: 80 tanh layers of width 8 (161 parameter tensors, host time "
                        "alone); else a benchmark model (benchmarks/models.py) at its --quick sizes")
    p.add_argument("--full", action="store_true", help="the benchmark model at its full size")
    p.add_argument("--step", action="store_true", help="time a compile_step DP step against the plain step")
    p.add_argument("--breakdown", action="store_true",
                   help="with --step: where the step's time goes (timers around its methods; medians)")
    args = p.parse_args(argv)
    if args.repeats < 7:
        p.error("--repeats must be at least 7")
    if args.threads:
        torch.set_num_threads(args.threads)
    backend = args.backend or ("inductor" if args.step else "eager")
    batches = args.batch or [16 if args.step else 8]
    model = args.model + (" (full size)" if args.full else "")
    how = ("timers around the step's methods, median of 1000 steps" if args.step and args.breakdown else
           f"median of {args.repeats} interleaved rounds x {args.inner} calls, microseconds per call")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, backend {backend}, model {model}, {how}")
    for batch in batches:
        if args.step and args.breakdown:
            print(f"B={batch}:")
            for label, (us, calls) in breakdown(batch=batch, backend=backend, model_name=args.model,
                                                full=args.full).items():
                print(f"  {label:<34} {us:8.1f} us x {calls:.0f} per step")
        elif args.step:
            t = measure_step(args.repeats, batch, backend, args.model, args.inner, args.full)
            plain = min(t["plain_eager"], t["plain_compiled"])
            print(f"B={batch}: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items())
                  + f"; dp_step / plain {t['dp_step'] / plain:.2f}, dp_step / program {t['dp_step'] / t['program']:.2f}"
                  f", program / plain {t['program'] / plain:.2f}")
        else:
            t = measure(args.repeats, batch, backend, args.model, args.inner, args.full)
            print(f"B={batch}: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items())
                  + f"; call / kernel {t['call'] / t['kernel']:.2f}, call - kernel {t['call'] - t['kernel']:.1f}")


if __name__ == "__main__":
    main()
