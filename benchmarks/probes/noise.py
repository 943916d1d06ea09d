"""``python -m benchmarks.probes.noise``: Gaussian noise drawn outside the compiled step (as ``compile_step``
does) against noise drawn inside it.

For each number of parameters P, side by side in one process (medians of ``--repeats`` calls after warm-up):

- ``outside``: ``torch.randn(P)`` eagerly, then a compiled ``g + sigma * noise`` (sigma folded into the program);
- ``scaled``: ``torch.randn(P).mul_(sigma)`` eagerly, then a compiled ``g + noise`` (``compile_step``'s layout:
  the scaled noise is an input of the program);
- ``inside``: one compiled function ``g + sigma * torch.randn_like(g)`` (Inductor's own random generator);
- ``chunked``: ``compile_step``'s draw today (``dp.gaussian_many``: on CPU in float32 the native AES-CTR stream,
  ``native_noise``, on torch's threads, where it runs; else ``torch.randn`` tensor by tensor; sigma applied in
  the draw), then a compiled ``g + noise``;
- ``draw``: that draw into a fresh buffer alone, what a DP step paid before its program ran (the add is fused
  into the program);
- ``reused``: the same draw into the previous draw's buffer (``reuse=``), what a DP step pays now;
- ``after_parallel``: the reused draw timed right after an op that ATen runs on its OpenMP threads, as in a
  training loop where the draw follows the previous step's program: the OpenMP workers spin-wait for a while
  after a parallel region, on the cores the draw's threads need (CPU only).
- ``mt19937``: as ``after_parallel``, torch's generator filling the buffer (``normal_``: the draw where the
  native generator cannot run; one thread, mt19937 behind a lock).
- ``threefry``: a candidate, not what compiled_psg does: one compiled ``g + sigma * z`` with ``z`` from the
  counter-based Threefry-2x32-20 (Random123's; JAX's default generator) and Box-Muller, in integer and float ops
  Inductor fuses and runs on its OpenMP threads (``threefry_normal`` below), timed in a loop after a parallel op
  as ``after_parallel``.

Outside is also the only way to keep seeded runs resumable (the noise comes from a ``torch.Generator`` whose state
is saved) and to use ``secure_rng`` (``os.urandom``), which cannot run inside a graph.
"""

from __future__ import annotations

import argparse
import math

import torch

from compiled_psg._train.dp import gaussian_many

from .. import keep_freed_memory
from ..timing import interleaved_medians, median_seconds

_M32 = 0xFFFFFFFF
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def threefry2x32(k0, k1, c0, c1):
    """Threefry-2x32 with 20 rounds (Salmon et al. 2011) on int64 tensors holding uint32 words: the block
    cipher of counter ``(c0, c1)`` under key ``(k0, k1)``, as two words."""
    ks = (k0, k1, k0 ^ k1 ^ 0x1BD11BDA)
    x0, x1 = (c0 + k0) & _M32, (c1 + k1) & _M32
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = (x0 + x1) & _M32
            x1 = (((x1 << r) & _M32) | (x1 >> (32 - r))) ^ x0
        x0 = (x0 + ks[(i + 1) % 3]) & _M32
        x1 = (x1 + ks[(i + 2) % 3] + (i + 1)) & _M32
    return x0, x1


def threefry_normal(key: torch.Tensor, n: int, device: str = "cpu") -> torch.Tensor:
    """``n`` N(0, 1) float32 numbers, number ``e`` from the cipher of counter ``(e, 0)`` under ``key`` (two
    uint32 words in an int64 tensor): Box-Muller on its two words."""
    w0, w1 = threefry2x32(key[0], key[1], torch.arange(n, device=device), 0)
    u1 = (w0.to(torch.float32) + 0.5) * 2.0 ** -32
    u2 = w1.to(torch.float32) * 2.0 ** -32
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2 * math.pi) * u2)


def measure(size: int, repeats: int, device: str = "cpu") -> dict[str, float]:
    g = torch.randn(size, device=device)
    sigma = 1.3
    add = torch.compile(lambda g, noise: g + sigma * noise, dynamic=False)
    add_scaled = torch.compile(lambda g, noise: g + noise, dynamic=False)
    draw_inside = torch.compile(lambda g: g + sigma * torch.randn_like(g), dynamic=False)
    generator = torch.Generator(device=device).manual_seed(0)
    reuse: dict = {}

    def outside():
        return add(g, torch.randn(size, device=device, generator=generator))

    def scaled():
        return add_scaled(g, torch.randn(size, device=device, generator=generator).mul_(sigma))

    def chunked():
        return add_scaled(g, gaussian_many([g], sigma, generator=generator)[0])

    big = torch.randn(1 << 22, device=device)
    mt_buffer = torch.empty(size, device=device)

    def after_parallel(draw) -> float:
        """Median ms of ``draw`` timed right after an OpenMP parallel region, after 3 warm-up calls."""
        return interleaved_medians({"draw": draw}, repeats,
                                   before=lambda: big.mul_(1.0))["draw"] * 1e3  # over ATen's grain size: parallel

    key = torch.tensor([0x13198A2E, 0x03707344], device=device)
    add_threefry = torch.compile(lambda g, key: g + sigma * threefry_normal(key, g.numel(), device), dynamic=False)

    def sync(fn):
        def run():
            out = fn()
            if device == "cuda":
                torch.cuda.synchronize()
            return out
        return run

    return {"outside": median_seconds(sync(outside), repeats) * 1e3,
            "scaled": median_seconds(sync(scaled), repeats) * 1e3,
            "inside": median_seconds(sync(lambda: draw_inside(g)), repeats) * 1e3,
            "chunked": median_seconds(sync(chunked), repeats) * 1e3,
            "draw": median_seconds(sync(lambda: gaussian_many([g], sigma, generator=generator)), repeats) * 1e3,
            "reused": median_seconds(sync(lambda: gaussian_many([g], sigma, generator=generator, reuse=reuse)),
                                     repeats) * 1e3,
            "after_parallel": after_parallel(lambda: gaussian_many([g], sigma, generator=generator, reuse=reuse)),
            "mt19937": after_parallel(lambda: mt_buffer.normal_(0.0, sigma, generator=generator)),
            "threefry": after_parallel(lambda: add_threefry(g, key))}


def main(argv: list[str] | None = None) -> None:
    keep_freed_memory()
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.noise", description=__doc__.split("\n\n")[1])
    p.add_argument("--sizes", nargs="+", type=int, default=[100_000, 1_000_000, 10_000_000])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args(argv)
    if args.repeats < 7:
        p.error("--repeats must be at least 7")
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, median of {args.repeats} "
          "calls; ms")
    print(f"{'P':>10} | {'outside':>8} {'scaled':>8} {'inside':>8} {'chunked':>8} {'draw':>8} {'reused':>8} "
          f"{'after_parallel':>14} {'mt19937':>8} {'threefry':>8} | scaled/outside inside/outside chunked/scaled "
          "reused/draw mt19937/after_parallel")
    for size in args.sizes:
        r = measure(size, args.repeats, args.device)
        times = " ".join(f"{r[k]:8.3f}" for k in ("outside", "scaled", "inside", "chunked", "draw", "reused"))
        times += f" {r['after_parallel']:14.3f} {r['mt19937']:8.3f} {r['threefry']:8.3f}"
        print(f"{size:>10} | {times} | "
              f"{r['scaled'] / r['outside']:14.2f} {r['inside'] / r['outside']:14.2f} "
              f"{r['chunked'] / r['scaled']:14.2f} {r['reused'] / r['draw']:11.2f} "
              f"{r['mt19937'] / r['after_parallel']:22.2f}", flush=True)


if __name__ == "__main__":
    main()
