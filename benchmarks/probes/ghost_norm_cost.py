"""What the certified ghost norm costs: per-sample squared norms of a Linear layer over a sequence
(``x [n, t, i] -> [n, t, o]``; index letters n batch, t tokens, i in, o out) from its factors, in float64 with a
rounding bound (``compiled_psg._rewrite.contraction.factored_sq_norms``, what ``norms`` and ``clip_sum`` use),
against the float32 ghost norm it replaced (which adversarial tokens can make cancel to 0 or NaN) and against
materializing ``g[n]`` and reducing it. Eager torch ops, side by side in one process, medians of 9 calls.

    python -m benchmarks.probes.ghost_norm_cost
"""

from __future__ import annotations

import argparse

import torch

from compiled_psg._rewrite.contraction import factored_sq_norms

from .. import keep_freed_memory
from ..timing import median_seconds

SHAPES = [(64, 32, 256, 256), (32, 128, 256, 256), (16, 64, 768, 768)]  # (n, t, o, i)


def float32_ghost(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(x, x.transpose(1, 2))).sum((1, 2))


def materialized(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.bmm(a.transpose(1, 2), x).pow(2).sum((1, 2))


def main() -> None:
    keep_freed_memory()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads; median of {args.repeats} calls, ms")
    print(f"{'n':>4} {'t':>4} {'o':>4} {'i':>4} | {'float32 ghost':>13} {'certified':>10} {'materialized':>12}")
    for n, t, o, i in SHAPES:
        g = torch.Generator().manual_seed(0)
        a, x = torch.randn(n, t, o, generator=g), torch.randn(n, t, i, generator=g)
        times = [median_seconds(lambda f=f, a=a, x=x: f(a, x), args.repeats) * 1e3
                 for f in (float32_ghost, factored_sq_norms, materialized)]
        print(f"{n:>4} {t:>4} {o:>4} {i:>4} | {times[0]:>13.2f} {times[1]:>10.2f} {times[2]:>12.2f}")


if __name__ == "__main__":
    main()
