"""Gaussian noise for DP-SGD: the default source and a cryptographically secure one.

Float32 noise on CPU comes from the native AES-CTR stream (``native_noise``) where this CPU and compiler can
build it: keyed from torch's generator by default, from ``os.urandom`` with ``secure``.

Otherwise the default source is torch's generator, tensor by tensor, and the secure one reads ``os.urandom``
(the operating system's CSPRNG, what ``secrets`` uses), turns 53 random bits into a uniform in (0, 1) in
float64 and applies Box-Muller in float64, then casts to the parameter dtype. Any floating-point sampler is only
an approximation of the continuous Gaussian the analysis assumes (Mironov 2012; Holohan & Braghin 2021): its
largest value is finite (5.77 std for torch's float32 ``randn``, 8.65 for the float64 path, 9.42 for the native
stream), and an output past it is one the mechanism cannot produce without the sample that moved the sum.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import numpy as np
import torch

from . import native_noise


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
    return _torch_gaussian(t.shape, t.dtype, t.device, std, secure, generator)


def _torch_gaussian(shape, dtype: torch.dtype, device: torch.device, std: float, secure: bool,
                    generator: torch.Generator | None) -> torch.Tensor:
    if secure:
        return secure_gaussian(tuple(shape), std, dtype=dtype, device=device)
    noise = torch.randn(shape, dtype=dtype, device=device if generator is None else generator.device,
                        generator=generator)
    return noise.mul_(std).to(device)


def _native(likes: list[torch.Tensor], generator: torch.Generator | None) -> bool:
    """Whether the noise for ``likes`` comes from the native stream: float32 on CPU, where it runs."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 for t in likes)
            and (generator is None or generator.device.type == "cpu") and native_noise.available())


def _one_accelerator(likes: list[torch.Tensor], generator: torch.Generator | None) -> bool:
    """Whether ``likes`` share one dtype and one device other than the CPU, the generator's (if any)."""
    device, dtype = likes[0].device, likes[0].dtype
    return (device.type != "cpu" and (generator is None or generator.device == device)
            and all(t.device == device and t.dtype == dtype for t in likes))


def _flat_buffer(likes: list[torch.Tensor], dtype: torch.dtype, device: torch.device,
                 reuse: dict | None) -> torch.Tensor:
    """One buffer for the noise of every tensor of ``likes``: ``reuse``'s when it is of that size, dtype and
    device, else a new one (kept in ``reuse``)."""
    total = sum(t.numel() for t in likes)
    flat = None if reuse is None else reuse.get("flat")
    if flat is None or flat.numel() != total or flat.dtype != dtype or flat.device != device:
        flat = torch.empty(total, dtype=dtype, device=device)
        if reuse is not None:
            reuse["flat"] = flat
    return flat


def gaussian_many(likes: list[torch.Tensor], std: float, *, secure: bool = False,
                  generator: torch.Generator | None = None, reuse: dict | None = None) -> list[torch.Tensor]:
    """N(0, std^2) noise shaped like each of ``likes``: from the native stream where it serves them (one key for
    the whole draw, the tensors as consecutive slices of one flat buffer); on one accelerator from torch's
    generator in one draw over one flat buffer; else tensor by tensor (``gaussian_like``). ``gaussian_stream``
    gives the same numbers one tensor at a time, except on an accelerator (the same distribution, drawn tensor by
    tensor: one flat draw would hold every tensor's noise at once, which the stream exists to avoid).

    ``reuse``: a dict the caller keeps from draw to draw, once it no longer reads the previous draw: the flat
    buffer is filled again in place (same size) instead of allocated. A fresh buffer of many MB costs its page
    faults on every step (glibc maps allocations over 32 MB anew each time); the numbers are the same."""
    if not likes:
        return []
    with torch.profiler.record_function("compiled_psg.noise"):  # drawn on worker threads: named for profiles
        if _native(likes, generator):
            flat = _flat_buffer(likes, torch.float32, torch.device("cpu"), reuse)
            native_noise.normal_(flat, float(std), native_noise.draw_key(generator, secure))
        elif not secure and _one_accelerator(likes, generator):
            # One normal_ over one buffer: a draw per tensor costs a launch or two each and the host time between
            # them, a measured share of the DP step on a GPU (benchmarks/scale_notes.md, llama_lora).
            flat = _flat_buffer(likes, likes[0].dtype, likes[0].device, reuse)
            flat.normal_(0.0, float(std), generator=generator)
        else:
            return [gaussian_like(t, std, secure=secure, generator=generator) for t in likes]
    out, offset = [], 0
    for t in likes:
        out.append(flat[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


def gaussian_stream(likes: list[torch.Tensor], std: float, *, secure: bool = False,
                    generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
    """The numbers ``gaussian_many`` draws, one tensor at a time, in order (the sharded step adds each
    parameter's noise and releases it before the next): the key is drawn now, each tensor is its slice of the
    stream. Only the shapes of ``likes`` are kept, not the tensors."""
    metas = [(t.shape, t.dtype, t.device) for t in likes]
    if not likes or not _native(likes, generator):
        return (_torch_gaussian(*meta, std, secure, generator) for meta in metas)
    key = native_noise.draw_key(generator, secure)
    firsts = [0]
    for shape, _, _ in metas[:-1]:
        firsts.append(firsts[-1] + math.prod(shape))
    return (native_noise.normal_(torch.empty(shape, dtype=torch.float32, device="cpu"), float(std), key, first)
            for (shape, _, _), first in zip(metas, firsts, strict=True))
