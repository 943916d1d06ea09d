"""``python -m benchmarks.probes.cost_model [--quick] [--backend eager|inductor] [--quantity sq_norm|clip_sq_norm]
[--model NAME --batch B [--set seq=32] [--step]]``: does the cost model pick the faster way?

For each shape of a Linear layer over a sequence (``x [n, t, i] -> [n, t, o]``, index letters n batch, t tokens,
i in, o out), the per-sample squared norms (``psg.norms()``) can come from the ``ghost`` strategy
(``<A A^T, X X^T>`` per sample, never forming a gradient) or from ``materialize`` (form ``g[n] [o, i]`` and
reduce). This times both, side by side in one process (medians of ``--repeats`` calls after warm-up), and reports
which one the cost model in ``compiled_psg/_reduce/strategies.py`` picks, its estimated costs, and how often that
pick was the faster one (within ``--tie`` of each other counts as right either way). ``--quantity clip_sq_norm``
does the same for ``psg.clip_sum``, where each norm is priced with the sum it bounds. ``--model`` times a whole
benchmark model's ``clip_sum`` under each plan, with its peak memory; ``--model M --step`` its DP step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import resource
import statistics

import torch
import torch.nn as nn

import compiled_psg as psg
from compiled_psg._reduce import strategies

from .. import keep_freed_memory
from ..timing import median_seconds

SHAPES = [(n, t, i, o) for n, t, (i, o) in itertools.product((16, 64), (1, 16, 128), ((64, 64), (256, 1024)))]
TRANSFORMER_SHAPES = [(64, 64, 128, 384), (64, 64, 128, 512), (64, 64, 512, 128)]  # the benchmark transformer's
QUICK_SHAPES = [(16, 1, 32, 32), (16, 64, 32, 32), (16, 8, 256, 256)]


@contextlib.contextmanager
def only(quantity: str, name: str):
    """Let the cost model see one strategy for ``quantity`` (the benchmark's way to force a choice)."""
    saved = strategies.STRATEGIES[quantity]
    strategies.STRATEGIES[quantity] = [s for s in saved if s.name == name]
    try:
        yield
    finally:
        strategies.STRATEGIES[quantity] = saved


def measure_model(model_name: str, batch: int, repeats: int, overrides: dict | None = None, step: bool = False) -> None:
    """The whole benchmark model's clipped sum (``psg.clip_sum``, Inductor) under each ``clip_sq_norm`` plan and
    under the cost model's own choice: what a per-layer timing cannot see is the per-sample gradients a plan holds
    across the program (fresh pages every call, and the peak memory). ``step``: the page's DP step
    (``compile_step``) under each plan instead, against the plain SGD steps (eager and compiled), with the ratios
    of the page's targets (time against the faster plain step, peak against the lower one)."""
    from .. import models
    from ..measure import Device
    from ..models import build_workload

    spec = models.MODELS[model_name]
    if overrides:  # the same model with some sizes changed (``--set seq=32``)
        models.MODELS[model_name] = dataclasses.replace(spec, config={**spec.config, **overrides})
    try:
        wl = build_workload(model_name, False, torch.device("cpu"))
    finally:
        models.MODELS[model_name] = spec
    args = wl.batch(batch)
    plans = {"cost model": contextlib.nullcontext()}
    plans.update({name: strategies.preferred("clip_sq_norm", name) for name in
                  [s.name for s in strategies.STRATEGIES["clip_sq_norm"]]})
    calls, peaks, faults = {}, {}, {}
    dev = Device(torch.device("cpu"))
    model = wl.model

    def loss(x, y):
        return wl.criterion(model(x), y)

    if step:
        from ..methods import METHODS, dp_compile_step

        plains = {key: METHODS[key].setup(wl).run for key in ("sgd_step", "sgd_step_compile")}
        plans = {**{key: contextlib.nullcontext() for key in plains}, **plans}
    for plan, ctx in plans.items():
        with ctx:
            if step:
                fn = plains[plan] if plan in plains else dp_compile_step(wl)
                fn(*args)
                fn(*args)  # the first step runs eagerly; the plan's program compiles at its end
            else:
                fn = psg.per_sample(model, reduce=psg.clip_sum(1.0))(loss)
                fn(*args)
        calls[plan] = lambda fn=fn: fn(*args)
        peaks[plan] = dev.peak_bytes(calls[plan], ()) / 2**20
        calls[plan]()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        calls[plan]()
        faults[plan] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    times = _interleaved_ms(calls, repeats)
    what = "compile_step's DP step (Inductor; sgd_step eager)" if step else "psg.clip_sum, Inductor"
    print(f"{model_name} {overrides or ''}, B={batch}: {what}, median of {repeats} interleaved calls")
    ratios = " x plain (time, memory)" if step else ""
    print(f"{'plan':>22} {'ms':>9} {'peak MiB':>9} {'page faults/call':>17}{ratios}")
    for plan in plans:
        line = f"{plan:>22} {times[plan]:9.1f} {peaks[plan]:9.1f} {faults[plan]:17d}"
        if step and plan not in plains:
            line += (f" {times[plan] / min(times[k] for k in plains):8.2f} "
                     f"{peaks[plan] / max(min(peaks[k] for k in plains), 1e-9):6.2f}")
        print(line)


def _norms_fn(shape, backend: str, quantity: str = "sq_norm"):
    """``psg.norms()`` of one Linear layer (``sq_norm``), or ``psg.clip_sum`` (``clip_sq_norm``: the norm and the
    clipped sum it bounds)."""
    n, t, i, o = shape
    torch.manual_seed(0)
    lin = nn.Linear(i, o, bias=False)
    reduce = psg.norms() if quantity == "sq_norm" else psg.clip_sum(1.0)

    @psg.per_sample(lin, reduce=reduce, backend=backend)
    def loss(x):
        return lin(x).square().sum()

    return loss, torch.randn(n, t, i) if t > 1 else torch.randn(n, i)


def _interleaved_ms(calls: dict, repeats: int) -> dict:
    """Median ms per callable, timed round by round in rotated order (a slow phase falls on all alike)."""
    keys, times = list(calls), {k: [] for k in calls}
    for k in keys:
        for _ in range(2):
            calls[k]()
    for r in range(repeats):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[k].append(median_seconds(calls[k], 1, warm_up=1))
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def measure_shape(shape, backend: str, repeats: int, quantity: str = "sq_norm") -> dict:
    row: dict = {"shape": shape}
    calls = {}
    for name in [s.name for s in strategies.STRATEGIES[quantity]]:
        with only(quantity, name):
            fn, x = _norms_fn(shape, backend, quantity)
            try:
                fn(x)  # capture and compile under the forced choice
            except Exception:  # noqa: BLE001 - this strategy does not apply to the shape
                continue
        calls[name] = lambda fn=fn, x=x: fn(x)
    row["times"] = _interleaved_ms(calls, repeats)
    fn, x = _norms_fn(shape, backend, quantity)
    fn(x)
    choice = fn.compiled_for(x)[0].rewritten.choices["weight"][0]
    row["picked"], row["estimates"] = choice.method, choice.cost
    return row


def main(argv: list[str] | None = None) -> None:
    keep_freed_memory()
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.cost_model", description=__doc__.split("\n\n")[1])
    p.add_argument("--quick", action="store_true", help="three small shapes, eager backend: checks the harness")
    p.add_argument("--backend", choices=["eager", "inductor"], default="inductor")
    p.add_argument("--repeats", type=int, default=9, help="timed calls per strategy (median; >= 7)")
    p.add_argument("--quantity", choices=["sq_norm", "clip_sq_norm"], default="sq_norm",
                   help="sq_norm: psg.norms(); clip_sq_norm: psg.clip_sum (each norm with the sum it bounds)")
    p.add_argument("--model", help="a benchmark model (benchmarks/models.py): time its whole clip_sum per plan")
    p.add_argument("--batch", type=int, default=64, help="the batch size for --model")
    p.add_argument("--step", action="store_true",
                   help="with --model: the DP step (compile_step) under each plan, against the plain SGD steps")
    p.add_argument("--set", action="append", default=[], metavar="KEY=INT",
                   help="change an integer size of the --model's config (e.g. seq=32)")
    p.add_argument("--tie", type=float, default=0.05, help="relative difference counted as a tie (default 0.05)")
    args = p.parse_args(argv)
    if args.repeats < 7:
        p.error("--repeats must be at least 7")
    if args.model:
        overrides = dict(kv.split("=", 1) for kv in args.set)
        measure_model(args.model, args.batch, args.repeats, {k: int(v) for k, v in overrides.items()}, args.step)
        return
    shapes, backend = (QUICK_SHAPES, "eager") if args.quick else (SHAPES, args.backend)
    if args.quantity == "clip_sq_norm" and not args.quick:
        shapes = shapes + TRANSFORMER_SHAPES
    names = [s.name for s in strategies.STRATEGIES[args.quantity]]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, backend {backend}, {args.quantity}, "
          f"median of {args.repeats} interleaved calls; times in ms")
    print(f"{'n':>4} {'t':>4} {'i':>5} {'o':>5} | " + " ".join(f"{n:>20}" for n in names) + f" | {'picked':>20} right")
    right = 0
    for shape in shapes:
        row = measure_shape(shape, backend, args.repeats, args.quantity)
        times = row["times"]
        fastest = min(times.values())
        ok = times.get(row["picked"], float("inf")) <= (1 + args.tie) * fastest
        right += ok
        n, t, i, o = shape
        cells = " ".join(f"{times[name]:20.3f}" if name in times else f"{'-':>20}" for name in names)
        print(f"{n:>4} {t:>4} {i:>5} {o:>5} | {cells} | {row['picked']:>20} {'yes' if ok else 'NO':>5}", flush=True)
    print(f"the cost model picked the faster strategy (or one within {args.tie:.0%} of it) for {right} of "
          f"{len(shapes)} shapes")


if __name__ == "__main__":
    main()
