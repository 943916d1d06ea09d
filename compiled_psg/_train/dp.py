"""Gaussian noise for DP-SGD: the default source (torch's generators) and a cryptographically secure one.

The secure source reads ``os.urandom`` (the operating system's CSPRNG, what ``secrets`` uses), turns 53 random
bits into a uniform in (0, 1) in float64 and applies Box-Muller in float64, then casts to the parameter
dtype. Float64 leaves far fewer gaps in the noise than float32, but any floating-point sampler is only an
approximation of the continuous Gaussian the analysis assumes (Mironov 2012; Holohan & Braghin 2021).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch


def secure_uniform(n: int) -> torch.Tensor:
    """``n`` float64 uniforms in the open interval (0, 1) from ``os.urandom``: ``(k + 0.5) / 2**53``."""
    if n <= 0:
        return torch.zeros(0, dtype=torch.float64)
    words = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(11)
    return (torch.from_numpy(words.astype(np.float64)) + 0.5) * (2.0 ** -53)


def secure_gaussian(shape, std: float = 1.0, *, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """Gaussian noise N(0, std^2) of ``shape`` from ``os.urandom`` via Box-Muller in float64."""
    n = math.prod(shape)
    pairs = (n + 1) // 2
    u = secure_uniform(2 * pairs)
    radius = torch.sqrt(-2.0 * torch.log(u[:pairs]))
    angle = (2.0 * math.pi) * u[pairs:]
    z = torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:n]
    return (z * float(std)).reshape(shape).to(dtype=dtype, device=device)


def gaussian_like(t: torch.Tensor, std: float, *, secure: bool = False,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """N(0, std^2) noise shaped like ``t``: secure (os.urandom), or from torch's ``generator`` (default:
    the global one)."""
    if secure:
        return secure_gaussian(tuple(t.shape), std, dtype=t.dtype, device=t.device)
    noise = torch.randn(t.shape, dtype=t.dtype, device=t.device if generator is None else generator.device,
                        generator=generator)
    return noise.mul_(std).to(t.device)


# torch.randn on CPU runs on one thread (mt19937 behind a lock). A large draw is split into chunks of _CHUNK
# numbers, each from its own mt19937 seeded from the user's generator, filled on torch's intra-op threads: the
# numbers depend on the generator's state only, not on the thread count.
_CHUNK = 1 << 16
_PARALLEL_MIN = 1 << 17
_pool: ThreadPoolExecutor | None = None


def _fill_normal(flat: torch.Tensor, std: float, generator: torch.Generator | None) -> None:
    """``flat`` (CPU, contiguous, 1-d) filled with N(0, std^2), chunk by chunk."""
    global _pool
    chunks = -(-flat.numel() // _CHUNK)
    seeds = torch.randint(0, 2 ** 62, (chunks,), generator=generator).tolist()

    def fill(i: int) -> None:
        flat[i * _CHUNK:(i + 1) * _CHUNK].normal_(0.0, std, generator=torch.Generator().manual_seed(seeds[i]))

    threads = min(torch.get_num_threads(), chunks)
    if threads <= 1:
        for i in range(chunks):
            fill(i)
        return
    if _pool is None or _pool._max_workers < threads:
        _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="compiled_psg-noise")
    list(_pool.map(fill, range(chunks)))


def gaussian_many(likes: list[torch.Tensor], std: float, *, secure: bool = False,
                  generator: torch.Generator | None = None, reuse: dict | None = None) -> list[torch.Tensor]:
    """N(0, std^2) noise shaped like each of ``likes``. A large CPU draw from torch's generators fills one flat
    buffer in parallel chunks (``_fill_normal``); anything else draws tensor by tensor (``gaussian_like``).

    ``reuse``: a dict the caller keeps from draw to draw, once it no longer reads the previous draw: the flat
    buffer is filled again in place (same size and dtype) instead of allocated. A fresh buffer of many MB costs
    its page faults on every step (glibc maps allocations over 32 MB anew each time); the numbers are the same."""
    total = sum(t.numel() for t in likes)
    on_cpu = all(t.device.type == "cpu" for t in likes) and (generator is None or generator.device.type == "cpu")
    if secure or not on_cpu or total < _PARALLEL_MIN or len({t.dtype for t in likes}) != 1:
        return [gaussian_like(t, std, secure=secure, generator=generator) for t in likes]
    flat = None if reuse is None else reuse.get("flat")
    if flat is None or flat.numel() != total or flat.dtype != likes[0].dtype:
        flat = torch.empty(total, dtype=likes[0].dtype)
        if reuse is not None:
            reuse["flat"] = flat
    with torch.profiler.record_function("compiled_psg.noise"):  # drawn on worker threads: named for profiles
        _fill_normal(flat, float(std), generator)
    out, offset = [], 0
    for t in likes:
        out.append(flat[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out
