"""``python -m benchmarks.probes.materialized_floor --models mlp transformer --sizes 16 256``: how close any program
returning per-sample gradients can come to ``torch.compile(vmap(grad))``.

Whatever computes them, a program that returns per-sample gradients runs the forward pass before any of them
exists (the loss is its end), and writes B x P floats. On this CPU its kernels run one after another (Inductor's
C++ and ATen's kernels each use every core), so the two costs add up, and the backward's input-gradient chain
comes on top. Per model and batch size, in one process, interleaved (``measure.interleaved_times``):

- ``write``: B x P floats written into newly allocated tensors of the per-sample gradients' shapes (the faster of
  ``zero_`` and ``fill_``; their pages come from the heap compiled_psg keeps, as the programs' do);
- ``forward``: the loss without gradients, the faster of eager and ``torch.compile``;
- ``floor``: write + forward, against compiled_psg's materialized per-sample gradients and
  ``torch.compile(vmap(grad))``; the ordinary backward (forward included; the faster of eager and compiled) for
  scale.

Where ``floor / vmap`` exceeds 0.9, a program with these kernels (stores through the cache, as ``fill_`` makes)
cannot get the per-sample gradients in 0.9 times vmap's time on this machine, within its noise; where it is far
below, the gap is in the backward, not in the writes.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

from .. import keep_freed_memory
from ..measure import Device, Plan, interleaved_times
from ..methods import METHODS
from ..models import build_workload

TIMED = ("psg_grads", "func_compile", "backward", "backward_compile")


def _writer(shapes: list[tuple[int, ...]], how: str):
    if how == "zero_":
        return lambda: [torch.empty(s).zero_() for s in shapes]
    return lambda: [torch.empty(s).fill_(1.0) for s in shapes]


def _forward(wl):
    model = copy.deepcopy(wl.model).requires_grad_(False)

    def forward(x, *rest):
        with torch.no_grad():
            return wl.criterion(model(x), *rest)
    return forward


def measure(model: str, size: int, repeats: int) -> dict[str, float]:
    torch._dynamo.reset()  # vmap's program recompiles at every batch size: start each size below Dynamo's limit
    wl = build_workload(model, False, torch.device("cpu"))
    batch = wl.batch(size)
    shapes = [(size, *p.shape) for p in wl.model.parameters() if p.requires_grad]
    forward = _forward(wl)
    prepared = {key: METHODS[key].setup(wl).run for key in TIMED}
    runs = {key: (lambda run=run: run(*batch)) for key, run in prepared.items()}
    runs["write zero_"] = _writer(shapes, "zero_")
    runs["write fill_"] = _writer(shapes, "fill_")
    runs["forward"] = lambda: forward(*batch)
    compiled_forward = torch.compile(forward)
    runs["forward compiled"] = lambda: compiled_forward(*batch)
    for run in runs.values():  # first calls (compiles) and warm-up
        for _ in range(3):
            run()
    plan = Plan(sizes=(size,), sequence=(), check_size=size, warmup=0, reps=repeats, min_seconds=0.0,
                max_reps=repeats)
    times, errors = interleaved_times(runs, plan, Device(torch.device("cpu")))
    if errors:
        raise next(iter(errors.values()))
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    write = min(ms["write zero_"], ms["write fill_"])
    forward_ms = min(ms["forward"], ms["forward compiled"])
    return {"B x P": size * sum(p.numel() for p in wl.model.parameters() if p.requires_grad),
            "backward": min(ms["backward"], ms["backward_compile"]), "write": write, "forward": forward_ms,
            "floor": write + forward_ms, "compiled_psg": ms["psg_grads"], "vmap": ms["func_compile"]}


def main(argv: list[str] | None = None) -> None:
    keep_freed_memory()
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.materialized_floor",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["mlp", "cnn", "transformer", "gpt2"])
    p.add_argument("--sizes", nargs="+", type=int, default=[16, 64, 256])
    p.add_argument("--repeats", type=int, default=9, help="timed calls of each (median; >= 7)")
    args = p.parse_args(argv)
    if args.repeats < 7:
        p.error("--repeats must be at least 7")
    print(f"ms, medians of {args.repeats} interleaved calls; floor = write + forward")
    print(f"{'model':>12} {'B':>4} {'B x P':>11} {'backward':>9} {'write':>8} {'forward':>8} {'floor':>8} "
          f"{'compiled_psg':>13} {'vmap':>8} {'floor/vmap':>11} {'psg/vmap':>9}")
    for model in args.models:
        for size in args.sizes:
            r = measure(model, size, args.repeats)
            print(f"{model:>12} {size:4d} {r['B x P']:11,d} {r['backward']:9.2f} {r['write']:8.2f} "
                  f"{r['forward']:8.2f} {r['floor']:8.2f} {r['compiled_psg']:13.2f} {r['vmap']:8.2f} "
                  f"{r['floor'] / r['vmap']:11.2f} {r['compiled_psg'] / r['vmap']:9.2f}", flush=True)


if __name__ == "__main__":
    main()
