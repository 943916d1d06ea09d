"""Gaussian noise for DP-SGD: the default source (torch's generators) and a cryptographically secure one.

The secure source reads ``os.urandom`` (the operating system's CSPRNG, what ``secrets`` uses), turns 53 random
bits into a uniform in (0, 1) in float64 and applies Box-Muller in float64, then casts to the parameter
dtype. Float64 leaves far fewer gaps in the noise than float32, but any floating-point sampler is only an
approximation of the continuous Gaussian the analysis assumes (Mironov 2012; Holohan & Braghin 2021).
"""

from __future__ import annotations

import math
import os

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
