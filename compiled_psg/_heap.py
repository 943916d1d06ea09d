"""Keep what a compiled CPU program frees in the process heap, so its buffers are recycled between calls.

Inductor allocates a program's buffers on every call. glibc serves an allocation above its mmap threshold (at most
32 MiB) with fresh pages from the kernel and unmaps it on free, and gives freed memory at the top of the heap back
to the kernel; either way the next call faults in zeroed pages again, which costs several times writing warm ones.
A per-sample program's ``[B, ...]`` buffers are such allocations (measured: docs/benchmarks-probes.md, "The heap
keeps freed memory" and "Fresh pages cost more than warm ones"). PyTorch's CUDA caching allocator keeps freed blocks
for reuse; ``compiled_psg.retain_freed_memory()`` does the same for the CPU heap, once per process, when the user
asks for it (it changes the whole process's heap, so it is never on by default): no mmap for large
blocks (``M_MMAP_MAX = 0``) and no trimming (``M_TRIM_THRESHOLD = -1``). A finite threshold is not enough: with
2 GiB (the largest value mallopt's int takes), a freed buffer that leaves more than 2 GiB free at the top of the heap
(materialized per-sample gradients: 1.2 GB per call for the benchmark CNN at B = 256, beside the program's other
buffers) is given back, and the next call faults all of it in again
(``tests/test_clip_plans.py::test_the_heap_keeps_freed_memory_only_when_asked`` checks the setting and the faults).
As with the CUDA cache, the process keeps that memory (its peak heap, or more where small cached blocks keep a freed
buffer from being reused) after the program's last call. The settings hold for the main thread's heap: glibc maps a
large request from another thread directly and may unmap a free per-thread heap. Only on glibc; also set by
``COMPILED_PSG_RETAIN_FREED_MEMORY=1`` in the environment, read when the first CPU program runs. The cost model
prices held per-sample buffers by whether the heap keeps freed memory (``retains``).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading

from ._capture import patches

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
NEVER_TRIM = -1  # "Setting M_TRIM_THRESHOLD to -1 disables trimming completely" (man mallopt)
ENV = "COMPILED_PSG_RETAIN_FREED_MEMORY"

_lock = threading.Lock()
_state: dict[str, bool] = {}


def retains() -> bool:
    """Whether freed memory is (or will be, from the first program on) kept: glibc, and opted in. The cost
    model prices held buffers by it; once the heap is set, the setting made."""
    if "set" in _state:
        return _state["set"]
    return opted_in_by_environment() and _mallopt() is not None


def opted_in_by_environment() -> bool:
    return os.environ.get(ENV, "0") == "1"


def retain_freed_memory() -> bool:
    """Keep what compiled CPU programs free in the process heap, so their large buffers are recycled between
    calls instead of faulted in fresh (glibc: ``mallopt(M_TRIM_THRESHOLD, -1)`` and ``mallopt(M_MMAP_MAX, 0)``,
    once per process, for the whole process, never undone). Returns True when the heap is set; False where the C
    library is not glibc. The process keeps its peak heap afterwards, as PyTorch's CUDA caching allocator does on
    the GPU. Its effect on page faults: docs/benchmarks-probes.md, "The heap keeps freed memory"."""
    if "set" in _state:
        return _state["set"]
    with _lock:
        if "set" not in _state:
            mallopt = _mallopt()
            _state["set"] = mallopt is not None and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)) and bool(
                mallopt(M_MMAP_MAX, 0))
        return _state["set"]


@functools.cache
def _mallopt():
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: other C libraries have other parameters
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


patches.register(patches.Patch(
    "heap keeps freed memory", "glibc's mallopt(M_TRIM_THRESHOLD, -1) and mallopt(M_MMAP_MAX, 0)",
    "a CPU program's large buffers are then recycled between calls instead of faulted in fresh (this module)",
    ("process",), "the whole process's heap; only when the user calls compiled_psg.retain_freed_memory() or sets "
    "COMPILED_PSG_RETAIN_FREED_MEMORY=1", "permanent once asked for: glibc's settings are not read back"))
