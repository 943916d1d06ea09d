"""Dynamo's identity guards, without Dynamo's leak.

For each object a guard matches by identity (the model's classes, modules, builtins, code objects), Dynamo
registers ``weakref.finalize(obj, check_fn_manager.invalidate)``, so that the cache entry dies if the object dies
and another one reuses its ``id``. Most such objects are classes and modules that live for the whole process, and
each finalizer holds its ``CheckFunctionManager`` (with the guard tree) for that long: every capture's guard tree.

``adopt`` moves those finalizers onto our ``Guards``: one finalizer per watched object for the whole process,
which marks every live ``Guards`` that matched it as stale when it dies (the next call then recaptures). The
``CheckFunctionManager`` is freed with its capture.
"""

from __future__ import annotations

import gc
import weakref

from . import patches

# id(watched object) -> (a weak reference to it, the Guards that matched it by identity)
_watched: dict[int, tuple[weakref.ref, weakref.WeakSet]] = {}


def adopt(manager, guards) -> int:
    """Re-home the invalidation finalizers of the ``CheckFunctionManager`` owning ``manager`` (a frame's guard
    manager) onto ``guards``, which must have a ``stale(reason)`` method. Returns how many were moved.

    Post: no finalizer refers to that ``CheckFunctionManager``; when a watched object dies, ``guards.stale`` is
    called, as Dynamo's own ``invalidate`` would have dropped the cache entry."""
    registry = getattr(weakref.finalize, "_registry", None)  # CPython's registry of live finalizers
    if registry is None:
        return 0
    moved = 0
    enabled = gc.isenabled()
    gc.disable()  # a collection while listing could run a finalizer, which changes the registry under us
    try:
        entries = list(registry.items())
    finally:
        if enabled:
            gc.enable()
    for finalizer, info in entries:
        owner = getattr(getattr(info.func, "func", None), "__self__", None)
        if owner is None or getattr(owner, "guard_manager", None) is not manager:
            continue
        obj = info.weakref()
        finalizer.detach()
        moved += 1
        if obj is not None:
            _watch(obj, guards, (getattr(info.func, "keywords", None) or {}).get("obj_str"))
    return moved


def _watch(obj, guards, name: str | None) -> None:
    key = id(obj)
    entry = _watched.get(key)
    if entry is None or entry[0]() is not obj:
        entry = (weakref.ref(obj), weakref.WeakSet())
        _watched[key] = entry
        weakref.finalize(obj, _freed, key, name or type(obj).__name__)
    entry[1].add(guards)


def _freed(key: int, name: str) -> None:
    entry = _watched.pop(key, None)
    for guards in list(entry[1]) if entry else ():
        guards.stale(f"{name} (matched by identity at capture) was freed")


patches.register(patches.Patch(
    "guard finalizers", "weakref.finalize entries of Dynamo's CheckFunctionManager (its cache invalidation)",
    "each finalizer keeps a capture's whole guard tree alive for as long as a watched object lives; adopt() "
    "moves them onto our Guards, one small finalizer per object", ("process",),
    "only the finalizers of our own captures' frames; another frame's are untouched", "permanent by design: "
    "the capture's frame is never run again (its cache entry dies with the capture), so torch's invalidation "
    "has nothing left to invalidate; our finalizer marks our Guards stale instead"))
