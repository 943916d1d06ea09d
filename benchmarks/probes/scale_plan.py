"""``python -m benchmarks.probes.scale_plan MODEL [--memory-budget BYTES] [--batch B] [--scaled]``: what a DP step's
plan holds on one of ``benchmarks/scale_models.py``'s models, full config by default (the GPU's), planned on the CPU.

``psg.explain`` plans a step without running it: this prints its memory line (the per-sample values at the peak
and held across the program, against the fastest plan's) and the bytes each kind of layer holds across the
program under each strategy (kernel size of a convolution, "other" for the rest), largest first. The plan on the
CPU is the GPU's except where a rule picks another form on CUDA (a Conv2d's GEMM form; ``explain`` on the GPU shows
that one). Nothing is timed.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

import torch

import compiled_psg as psg

from ..scale_models import SCALE_MODELS, build_scale_model

_ROW = re.compile(r"^(\S+)\s+\((.*?)\)\s+\S+\s+sq_norm: ([a-z, -]+?) \(flops=[^,]+, bytes=[^,]+, held=(\d+)")
_WEIGHTED = re.compile(r"weighted_sum: ([a-z -]+?) \(")


def held_by_kind(report_text: str, batch: int) -> Counter:
    """Bytes held across the program per (layer kind, norm strategy, sum strategy): ``held`` of the norm's
    choice (bytes per sample, as ``explain`` prints them) times the batch size."""
    held: Counter = Counter()
    for line in report_text.splitlines():
        row = _ROW.match(line)
        if row is None:
            continue
        _, shape, strategy, per_sample = row.groups()
        kernel = re.search(r", (\d+), (\d+)$", shape)
        kind = f"{kernel.group(1)}x{kernel.group(2)} conv" if kernel and shape.count(",") == 3 else "other"
        weighted = _WEIGHTED.search(line)
        held[(kind, strategy.strip(), weighted.group(1) if weighted else "?")] += int(per_sample) * batch
    return held


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.scale_plan", description=__doc__.split("\n\n")[0])
    p.add_argument("model", choices=sorted(SCALE_MODELS))
    p.add_argument("--memory-budget", type=float, default=None, help="bytes (default: None, the fastest plan)")
    p.add_argument("--batch", type=int, default=None, help="default: the model's GPU (or --scaled: CPU) batch size")
    p.add_argument("--scaled", action="store_true", help="the scaled (CPU) config instead of the full one")
    args = p.parse_args(argv)
    spec = SCALE_MODELS[args.model]
    batch = args.batch or (spec.cpu_batch if args.scaled else spec.gpu_batch)
    model, make_batch, criterion = build_scale_model(args.model, args.scaled, torch.device("cpu"))
    step = psg.compile_step(lambda x, y: criterion(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.1),
                            max_grad_norm=1.0, noise_multiplier=1.0, backend="eager",
                            memory_budget=args.memory_budget)
    text = str(psg.explain(step, *make_batch(batch, torch.Generator().manual_seed(0))))
    print(f"{args.model}, {'scaled' if args.scaled else 'full'} config, B = {batch}, "
          f"memory_budget={args.memory_budget}")
    print(next((line for line in text.splitlines() if line.startswith("memory budget")), "(no memory line)"))
    for (kind, strategy, weighted), size in held_by_kind(text, batch).most_common():
        print(f"  {size / 2**20:9.1f} MiB held: {kind}, norm {strategy}, sum {weighted}")


if __name__ == "__main__":
    main()
