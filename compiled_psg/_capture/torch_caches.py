"""Free what torch keeps for the life of the process after each capture or compile.

Without this, the process's memory grows with every capture, forever (``tests/test_capture_threads_leaks.py``):

- **Shape environments.** Class-level ``functools.lru_cache``s on ``ShapeEnv`` methods (``get_implications``,
  ``_maybe_evaluate_static``, ``simplify``, ...) are keyed by ``self``: strong references from a module global.
  And a reference cycle the garbage collector cannot see: ShapeEnv -> ``fake_tensor_cache`` / ``tracked_fakes`` ->
  FakeTensor -> its C++ sizes -> SymInt -> SymNode -> ShapeEnv (the C++ edge is invisible to ``gc``). The caches
  are memoization, and ``tracked_fakes`` is only read while Dynamo produces guards, which it has done once the
  capture returns. So: clear the memo caches, and cut the cycle in the environments our captures used (``track``).
- **Generated source.** torch.fx keeps the source of every generated ``forward`` (and a copy of its globals) in
  ``linecache`` for tracebacks, about 50 KB per capture. Entries whose GraphModule is gone are dropped.

Dynamo's guard trees, the third thing, are handled where the guards are kept (``identity_guards.py``).
"""

from __future__ import annotations

import linecache
import re
import weakref

import torch.fx as fx
from torch.fx import graph_module as _fx_graph_module
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from . import patches

_used: weakref.WeakSet[ShapeEnv] = weakref.WeakSet()
_KEY = re.compile(r"<eval_with_key>\.(\d+)")
_sources_seen = 0  # generated-source keys below this number were looked at by an earlier release
_sources_pending: set[str] = set()  # keys seen whose GraphModule was still alive then


def track(shape_env: ShapeEnv | None) -> None:
    """Remember a shape environment a capture used, to cut its cycle at the next ``release``."""
    if shape_env is not None:
        _used.add(shape_env)


def release() -> None:
    """Drop memoized ``ShapeEnv`` entries, cut the tracked environments' cycles, drop dead generated source.

    Pre: called under ``CAPTURE_LOCK``, after the capture or compile that used the environments returned.
    Post: each tracked environment is freed as soon as nothing else (a live capture's fake inputs) holds it; one
    still in use keeps working (its dispatch cache refills on demand). Live GraphModules keep their source."""
    for method in vars(ShapeEnv).values():
        if callable(getattr(method, "cache_clear", None)):
            method.cache_clear()
    for env in list(_used):
        env.fake_tensor_cache.clear()
        env.tracked_fakes = None
    _used.clear()
    _release_dead_sources()


def _live_source_files() -> set[str]:
    """The file names of every live GraphModule's generated ``forward`` (each instance has its own class)."""
    files, stack = set(), [fx.GraphModule]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        forward = cls.__dict__.get("forward")
        code = getattr(forward, "__code__", None)
        if code is not None:
            files.add(code.co_filename)
    return files


def _release_dead_sources() -> None:
    global _sources_seen
    loader = getattr(_fx_graph_module, "_loader", None)
    cache = getattr(loader, "eval_cache", None)
    if not isinstance(cache, dict):
        return
    for key in cache:
        m = _KEY.match(key)
        if m and int(m.group(1)) >= _sources_seen:
            _sources_pending.add(key)
    _sources_seen = loader.next_id
    dead = _sources_pending - _live_source_files()
    for key in dead:
        cache.pop(key, None)
        linecache.cache.pop(key, None)
    _sources_pending.difference_update(dead)


patches.register(patches.Patch(
    "memo caches released", "ShapeEnv's class-level lru_caches, tracked_fakes and fake_tensor_cache of the "
    "environments our captures used; linecache entries of dead GraphModules",
    "they hold every capture's shape environment for the life of the process (about 1 MB a capture)",
    ("process",), "the memo caches are shared by all threads; they refill on demand",
    "nothing to undo: caches only, refilled on demand; an environment still in use keeps working"))
