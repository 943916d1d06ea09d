"""Native Gaussian noise: AES-128 in counter mode and Box-Muller, vectorized, on torch's OpenMP threads.

torch's CPU generator is one Mersenne Twister behind a lock; it was most of a DP step on models whose per-sample
work is small (docs/benchmarks-probes.md, "Noise drawn outside the program"). ``aes_normal.cpp`` draws from a
counter-based stream instead, so every thread computes its own slice, and any slice of the stream can be drawn
alone: number e depends on the key and e only. Timings: ``python -m benchmarks.probes.noise``.

The key is drawn for each draw from the user's ``torch.Generator`` (or torch's global one): a seeded run is
reproducible and a saved generator state resumes it, and the stream is exactly as predictable as that
generator (mt19937, whose seed has 32 bits). With ``secure_rng`` the key is 128 bits of ``os.urandom`` instead:
AES-128 in counter mode under a fresh secret key, the keystream generator at the core of NIST SP 800-90A's CTR_DRBG
(without its per-request limit and its key update; each draw has its own key).

The library is compiled by Inductor's C++ toolchain once per Inductor cache directory and CPU type, and used
only on x86-64 CPUs with AES-NI, AVX2 and FMA where torch runs its AVX2 (or AVX-512) kernels. Elsewhere
``available()`` is False (a failed build is logged once) and the caller keeps torch's generator
(``dp.gaussian_many``): other numbers, and in float32 a shorter tail (5.77 std, against the stream's 9.42).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import threading
from pathlib import Path

import torch

log = logging.getLogger("compiled_psg")

_SOURCE = Path(__file__).with_name("aes_normal.cpp")
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None
_SERIAL_BELOW = 1 << 15  # numbers: below this one thread is faster than waking the others
_U64 = ctypes.c_uint64


def _new_lock_in_child() -> None:  # a fork while the build held the lock would leave the child waiting forever
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)


def _build() -> ctypes.CDLL:
    from torch._inductor.codecache import CppCodeCache

    # the CPU in the source: Inductor's cache key holds its flags' text (-march=native), not the CPU's features
    source = f"// built for: {_cpu_tag()}\n" + _SOURCE.read_text()
    lib = CppCodeCache.load(source, extra_flags=("-mavx2", "-mfma", "-maes"))
    lib.cpu_supported.restype = ctypes.c_int
    if not lib.cpu_supported():
        raise RuntimeError("this CPU lacks AES-NI, AVX2 or FMA")
    lib.has_vaes.restype = lib.normal_fill.restype = ctypes.c_int
    lib.normal_fill.argtypes = [ctypes.c_void_p, _U64, ctypes.c_int64, _U64, _U64, ctypes.c_float, ctypes.c_int,
                                ctypes.c_int]
    for name, args in [("keystream_words", [ctypes.c_void_p, ctypes.c_int64, _U64, _U64, _U64]),
                       ("box_muller_words", [ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p]),
                       ("encrypt_block", [_U64] * 4 + [ctypes.c_void_p])]:
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = None
    return lib


def _cpu_tag() -> str:
    """The CPU's model and a digest of its feature flags (Linux), else the platform's name for it."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or platform.machine()
    model = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
    flags = re.search(r"^flags\s*:\s*(.*)$", info, re.M)
    digest = hashlib.sha256((flags.group(1) if flags else "").encode()).hexdigest()[:16]
    return f"{model.group(1) if model else platform.machine()}, flags {digest}"


def library() -> ctypes.CDLL | None:
    """The built library, building it on first use (a second caller waits for the first); None where it cannot
    run here (``failure()`` says why)."""
    global _library, _failure
    with _lock:
        if _library is None and _failure is None:
            capability = torch.backends.cpu.get_cpu_capability()
            if platform.machine().lower() not in ("x86_64", "amd64"):
                _failure = f"not an x86-64 CPU ({platform.machine()})"
            elif capability not in ("AVX2", "AVX512"):
                _failure = f"torch's CPU capability is {capability}, not AVX2"
            else:
                try:
                    _library = _build()
                except Exception as e:  # no compiler, no AES-NI: torch's generators serve instead
                    _failure = f"{type(e).__name__}: {e}"
                    log.warning("compiled_psg: the native noise generator could not be built (%s); the noise comes "
                                "from torch's generators, so a seed gives other numbers than where it runs",
                                _failure)
        return _library


def available() -> bool:
    return library() is not None


def failure() -> str | None:
    """Why the native generator is not used here, once ``library()`` has been tried; None when it is."""
    library()
    return _failure


def prepare() -> None:
    """Start building the library on a background thread (a step's constructor calls this, so that the build
    overlaps the capture and compile of the program instead of delaying the first draw)."""
    if _library is None and _failure is None:
        threading.Thread(target=library, name="compiled_psg-noise-build", daemon=True).start()


def draw_key(generator: torch.Generator | None, secure: bool = False) -> tuple[int, int]:
    """A fresh AES key as two 64-bit words: 128 bits of ``os.urandom`` when ``secure``, else two 63-bit words
    from ``generator`` (default: torch's global CPU generator)."""
    if secure:
        bits = int.from_bytes(os.urandom(16), "little")
        return bits & (2 ** 64 - 1), bits >> 64
    device = "cpu" if generator is None else generator.device
    k0, k1 = torch.randint(0, 2 ** 63 - 1, (2,), dtype=torch.int64, generator=generator, device=device).tolist()
    return k0, k1


def _loaded() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"the native noise generator is not available here: {_failure}")
    return lib


def normal_(out: torch.Tensor, std: float, key: tuple[int, int], first: int = 0, *,
            wide_aes: bool = True) -> torch.Tensor:
    """Fill ``out`` (CPU float32, contiguous) in place with the stream's numbers ``[first, first + out.numel())``
    for ``key``, scaled to N(0, std^2). ``wide_aes=False`` keeps 128-bit AES-NI on a CPU with VAES (the same
    numbers; for tests)."""
    fill(out, std, key, first, wide_aes=wide_aes)
    return out


def fill(out: torch.Tensor, std: float, key: tuple[int, int], first: int = 0, *, wide_aes: bool = True) -> bool:
    """``normal_``, returning whether the VAES keystream ran (for tests)."""
    lib = _loaded()
    if out.device.type != "cpu" or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"normal_ fills a contiguous CPU float32 tensor, got {out.dtype} on {out.device}")
    n = out.numel()
    if not 0 <= first <= 2 ** 64 - 64 - n:
        raise ValueError(f"the stream's numbers [{first}, {first} + {n}) are not in [0, 2^64 - 64)")
    threads = 1 if n < _SERIAL_BELOW else torch.get_num_threads()
    return bool(lib.normal_fill(out.data_ptr(), first, n, key[0], key[1], float(std), threads, int(wide_aes)))


def has_vaes() -> bool:
    """Whether this CPU has VAES (the keystream then takes two blocks per instruction)."""
    return bool(_loaded().has_vaes())


def keystream_words(key: tuple[int, int], groups: int, first_group: int = 0) -> torch.Tensor:
    """The stream's 32-bit words ``[48 first_group, 48 (first_group + groups))`` as int64 (for tests)."""
    words = torch.empty(48 * groups, dtype=torch.int32)
    _loaded().keystream_words(words.data_ptr(), groups, first_group, key[0], key[1])
    return words.to(torch.int64) & 0xFFFFFFFF


def box_muller_words(words: torch.Tensor, std: float) -> torch.Tensor:
    """The 32 numbers the kernel makes of 48 given 32-bit words (int64 tensor; for the limit-case tests)."""
    packed = (words.to(torch.int64) & 0xFFFFFFFF).to(torch.uint32).contiguous()
    if packed.shape != (48,):
        raise ValueError(f"box_muller_words takes 48 words, got shape {tuple(words.shape)}")
    out = torch.empty(32)
    _loaded().box_muller_words(packed.data_ptr(), float(std), out.data_ptr())
    return out


def encrypt_block(key: bytes, plaintext: bytes) -> bytes:
    """AES-128 of one 16-byte block (for the known-answer tests)."""
    out = (ctypes.c_uint64 * 2)()
    k, p = int.from_bytes(key, "little"), int.from_bytes(plaintext, "little")
    _loaded().encrypt_block(k & (2 ** 64 - 1), k >> 64, p & (2 ** 64 - 1), p >> 64, out)
    return out[0].to_bytes(8, "little") + out[1].to_bytes(8, "little")
