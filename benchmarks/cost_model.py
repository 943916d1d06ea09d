"""``python -m benchmarks.cost_model [--quick] [--backend eager|inductor]``: does the cost model pick the faster way?

For each shape of a Linear layer over a sequence (``x [n, t, i] -> [n, t, o]``, index letters n batch, t tokens,
i in, o out), the per-sample squared norms (``psg.norms()``) can come from the ``ghost`` strategy
(``<A A^T, X X^T>`` per sample, never forming a gradient) or from ``materialize`` (form ``g[n] [o, i]`` and
reduce). This times both, side by side in one process (medians of ``--repeats`` calls after warm-up), and reports
which one the cost model in ``compiled_psg/_reduce/strategies.py`` picks, its estimated costs, and how often that
pick was the faster one (within ``--tie`` of each other counts as right either way).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools

import torch
import torch.nn as nn

import compiled_psg as psg
from compiled_psg._reduce import strategies

from .timing import median_seconds

SHAPES = [(n, t, i, o) for n, t, (i, o) in itertools.product((16, 64), (1, 16, 128), ((64, 64), (256, 1024)))]
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


def _norms_fn(shape, backend: str):
    n, t, i, o = shape
    torch.manual_seed(0)
    lin = nn.Linear(i, o, bias=False)

    @psg.per_sample(lin, reduce=psg.norms(), backend=backend)
    def loss(x):
        return lin(x).square().sum()

    return loss, torch.randn(n, t, i) if t > 1 else torch.randn(n, i)


def measure_shape(shape, backend: str, repeats: int) -> dict:
    row: dict = {"shape": shape}
    for name in ("ghost", "materialize"):
        with only("sq_norm", name):
            fn, x = _norms_fn(shape, backend)
            fn(x)  # capture and compile under the forced choice
        row[name] = median_seconds(lambda fn=fn, x=x: fn(x), repeats) * 1e3
    fn, x = _norms_fn(shape, backend)
    fn(x)
    choice = fn.compiled_for(x)[0].rewritten.choices["weight"][0]
    row["picked"], row["estimates"] = choice.method, choice.cost
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cost_model", description=__doc__.split("\n\n")[1])
    p.add_argument("--quick", action="store_true", help="three small shapes, eager backend: checks the harness")
    p.add_argument("--backend", choices=["eager", "inductor"], default="inductor")
    p.add_argument("--repeats", type=int, default=9, help="timed calls per strategy (median; >= 7)")
    p.add_argument("--tie", type=float, default=0.05, help="relative difference counted as a tie (default 0.05)")
    args = p.parse_args(argv)
    if args.repeats < 7:
        p.error("--repeats must be at least 7")
    shapes, backend = (QUICK_SHAPES, "eager") if args.quick else (SHAPES, args.backend)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, backend {backend}, median of "
          f"{args.repeats} calls; times in ms")
    print(f"{'n':>4} {'t':>4} {'i':>5} {'o':>5} | {'ghost':>9} {'materialize':>11} | {'picked':>11} {'right':>5}")
    right = 0
    for shape in shapes:
        row = measure_shape(shape, backend, args.repeats)
        faster = "ghost" if row["ghost"] < row["materialize"] else "materialize"
        tie = abs(row["ghost"] - row["materialize"]) <= args.tie * min(row["ghost"], row["materialize"])
        ok = tie or row["picked"] == faster
        right += ok
        n, t, i, o = shape
        print(f"{n:>4} {t:>4} {i:>5} {o:>5} | {row['ghost']:9.3f} {row['materialize']:11.3f} | "
              f"{row['picked']:>11} {'yes' if ok else 'NO':>5}", flush=True)
    print(f"the cost model picked the faster strategy (or a tie within {args.tie:.0%}) for {right} of "
          f"{len(shapes)} shapes")


if __name__ == "__main__":
    main()
