"""Free what torch's shape environments keep alive after a capture or a compile.

Without this, RSS grows by about 1 MB per capture for the life of the process. Two things keep each capture's
``ShapeEnv`` (with its fake tensors and fake-tensor dispatch cache) alive:

- Class-level ``functools.lru_cache``s on ``ShapeEnv`` methods (``get_implications``, ``_maybe_evaluate_static``,
  ``simplify``, ...) keyed by ``self``: strong references from a module global. Pure memoization.
- A reference cycle the garbage collector cannot see: ShapeEnv -> ``fake_tensor_cache`` / ``tracked_fakes`` ->
  FakeTensor -> its C++ sizes -> SymInt -> SymNode -> ShapeEnv. The C++ edge is invisible to ``gc``, so the cycle
  is never collected. The dispatch cache is memoization too, and ``tracked_fakes`` is only read while Dynamo
  produces its guards, which it has done once the capture returns.

So, under the capture lock, after each capture and each compile: clear the memo caches, and cut the cycle in the
shape environments our captures used (``track``).
"""

from __future__ import annotations

import weakref

from torch.fx.experimental.symbolic_shapes import ShapeEnv

_used: weakref.WeakSet[ShapeEnv] = weakref.WeakSet()


def track(shape_env: ShapeEnv | None) -> None:
    """Remember a shape environment a capture used, to cut its cycle at the next ``release``."""
    if shape_env is not None:
        _used.add(shape_env)


def release() -> None:
    """Drop the memoized ``ShapeEnv`` method entries and cut the tracked environments' cycles.

    Pre: called under ``CAPTURE_LOCK``, after the capture or compile that used the environments returned.
    Post: each tracked environment is freed as soon as nothing else (a live capture's fake inputs) holds it; one
    still in use keeps working (its dispatch cache refills on demand)."""
    for method in vars(ShapeEnv).values():
        if callable(getattr(method, "cache_clear", None)):
            method.cache_clear()
    for env in list(_used):
        env.fake_tensor_cache.clear()
        env.tracked_fakes = None
    _used.clear()
