"""``python -m benchmarks.call_overhead``: what a cached call costs on top of running its graph.

A call of a per-sample function finds its cached graph (a key from the parameters' and arguments' signatures),
checks the capture's Dynamo guards (module structure, hooks, Python attributes the loss read), then runs the
graph. On a tiny model, where the graph itself costs little, this prints, side by side in one process (medians of
``--repeats`` timed calls after warm-up, microseconds):

- ``call``: the whole public call, ``loss(x, y)``;
- ``lookup``: finding the entry, guards included (``compiled_for``);
- ``guards``: the guard check alone;
- ``graph``: running the cached entry (``entry(params, args, B)``).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import compiled_psg as psg

from .timing import median_seconds


def measure(repeats: int = 15, batch: int = 8, backend: str = "eager") -> dict[str, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    @psg.per_sample(model, reduce=psg.norms(), backend=backend)
    def loss(x, y):
        return F.cross_entropy(model(x), y)

    x, y = torch.randn(batch, 8), torch.randint(0, 3, (batch,))
    loss(x, y)
    entry, params, args, size = loss.compiled_for(x, y)
    guards = entry.rewritten.captured.guards
    tensors = list(params.values())
    return {
        "call": median_seconds(lambda: loss(x, y), repeats, 20, 20) * 1e6,
        "lookup": median_seconds(lambda: loss.compiled_for(x, y), repeats, 20, 20) * 1e6,
        "guards": median_seconds(lambda: guards.check(loss.fn, tensors, args), repeats, 20, 20) * 1e6,
        "graph": median_seconds(lambda: entry(params, args, size), repeats, 20, 20) * 1e6,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.call_overhead", description=__doc__.split("\n\n")[1])
    p.add_argument("--repeats", type=int, default=15, help="timed calls per measure (median reported; >= 7)")
    p.add_argument("--backend", choices=["eager", "inductor"], default="eager")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    args = p.parse_args(argv)
    if args.repeats < 7:
        p.error("--repeats must be at least 7")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, backend {args.backend}, "
          f"median of {args.repeats} x 20 calls, microseconds per call")
    for name, us in measure(args.repeats, backend=args.backend).items():
        print(f"{name:>7}: {us:8.1f}")


if __name__ == "__main__":
    main()
