"""What a captured graph assumed that Dynamo's guards do not check: a later change must recapture, not run stale.

Dynamo's guard manager (``dynamo.Guards``) misses three kinds of change after a capture, each of which would
make the cached graph compute what the loss no longer computes:

- the global module hooks (``nn.modules.module.register_module_forward_hook`` and its siblings): the dicts
  are snapshot at capture and compared on every call (a global backward hook is then refused by the capture,
  ``backward_hook_refusal``);
- a module class's methods (``nn.Tanh.forward = ...``): for each class of a module Dynamo traced (it matched
  those classes by identity), the functions its own class body and its bases up to ``nn.Module`` define;
- graph inputs Dynamo built from an object rather than read as a tensor (``___from_numpy(G['TEMP'])`` for a
  numpy scalar or array), whose sources ``dynamo.Guards`` cannot re-evaluate: a numpy scalar must keep its
  value, a numpy array its identity (the captured tensor shares its memory, so in-place updates are seen).
  Any other source that cannot be re-checked is refused at capture (an allow-list): no silent trust.

``GlobalGuards.failure`` is the per-call check: identity comparisons only, no allocation on the common path.
"""

from __future__ import annotations

import operator
import re
import weakref

import numpy as np
import torch
import torch.nn as nn
from torch.nn.modules import module as _module

from .._errors import CaptureError, UnsupportedError

#: The global hook dicts of ``torch.nn.modules.module``: any registration or removal changes what a module call does.
_HOOK_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
               "_global_forward_hooks_with_kwargs", "_global_backward_pre_hooks", "_global_backward_hooks",
               "_global_buffer_registration_hooks", "_global_module_registration_hooks",
               "_global_parameter_registration_hooks")

_FROM_NUMPY = re.compile(r"^___from_numpy\((.*)\)$")


def _hook_dicts() -> list[tuple[str, dict]]:
    return [(name, getattr(_module, name)) for name in _HOOK_DICTS]


def _methods(cls: type) -> tuple[str, ...]:
    """The names of the methods ``cls`` and its bases below ``nn.Module`` define (dunders but ``__call__`` and
    ``__getattr__`` left out). A classmethod reads as a new bound method every time: those compare by ``==``
    (the same function bound to the same class), the others by identity first."""
    names = []
    for klass in cls.__mro__:
        if klass is nn.Module or not issubclass(klass, nn.Module):
            break
        for name, value in vars(klass).items():
            if name in names or isinstance(value, type) or \
                    (name.startswith("__") and name not in ("__call__", "__getattr__")):
                continue
            if callable(value) or isinstance(value, (staticmethod, classmethod, property)):
                names.append(name)
    return tuple(names)


def _getter(names: tuple[str, ...]):
    """``cls -> tuple`` of those attributes (attrgetter returns a bare value for one name)."""
    return operator.attrgetter(*names) if len(names) > 1 else operator.attrgetter(names[0], names[0])


def _module_classes(manager, joint: torch.fx.GraphModule) -> set[type]:
    """The ``nn.Module`` classes Dynamo matched by identity for the captured frame (every module it traced into,
    also one that adds no op, like ``nn.Identity``), and those named in the graph's ``nn_module_stack``."""
    classes = set()
    registry = getattr(weakref.finalize, "_registry", None)  # CPython's registry of live finalizers
    for info in list(registry.values()) if registry is not None and manager is not None else ():
        owner = getattr(getattr(info.func, "func", None), "__self__", None)
        if owner is None or getattr(owner, "guard_manager", None) is not manager:
            continue
        obj = info.weakref()
        if isinstance(obj, type) and issubclass(obj, nn.Module):
            classes.add(obj)
    for node in joint.graph.nodes:
        for entry in (node.meta.get("nn_module_stack") or {}).values():
            cls = entry[1] if isinstance(entry, tuple) and len(entry) > 1 else None
            if isinstance(cls, type) and issubclass(cls, nn.Module):
                classes.add(cls)
    return classes


class _NumpyInput:
    """A graph input Dynamo converted from a numpy object read at ``source``: still the same value?"""

    def __init__(self, source: str, code, obj, tensor: torch.Tensor):
        self.source, self.code, self.obj = source, code, obj
        self.copy = None  # the values to compare, where the captured tensor does not share the array's memory
        if isinstance(obj, np.ndarray) and not (obj.size == 0 or tensor.data_ptr() == obj.ctypes.data):
            self.copy = obj.copy()

    def holds(self, scope: dict) -> bool:
        try:
            current = eval(self.code, scope)  # noqa: S307 - Dynamo's own source expression, less its conversion
        except Exception:  # the path no longer resolves: Dynamo's guard on the conversion fails too
            return False
        if current is self.obj:
            return self.copy is None or np.array_equal(current, self.copy, equal_nan=True)
        if isinstance(self.obj, np.generic) and type(current) is type(self.obj):  # immutable: equal value is enough
            return bool(np.array_equal(current, self.obj, equal_nan=np.issubdtype(type(current), np.inexact)))
        return False


class _SameObject:
    """A graph input read through a source with Dynamo's helper functions (``___odict_getitem(...)``): still the
    object the graph holds?"""

    def __init__(self, source: str, code, obj):
        self.source, self.code, self.obj = source, code, obj

    def holds(self, scope: dict) -> bool:
        try:
            return eval(self.code, scope) is self.obj  # noqa: S307 - Dynamo's own source expression
        except Exception:
            return False


def _dynamo_helpers() -> dict:
    """The helper functions Dynamo's source expressions call (``___from_numpy``, ``___odict_getitem``, ...)."""
    get = getattr(torch._dynamo.guards, "_get_closure_vars", None)
    return dict(get()) if get is not None else {}


class GlobalGuards:
    """The per-call check of what ``dynamo.Guards`` does not guard (module docstring)."""

    def __init__(self, classes: set[type], inputs: list[_NumpyInput | _SameObject], g_scope: dict):
        self._hooks = [(name, d, dict(d)) for name, d in _hook_dicts()]
        self._classes = []
        for cls in sorted(classes, key=lambda c: (c.__module__, c.__qualname__)):
            names = _methods(cls)
            if names:
                get = _getter(names)
                self._classes.append((cls, get, names, get(cls)))
        self._inputs = inputs
        self._scope = {**_dynamo_helpers(), "G": g_scope} if inputs else {}

    def failure(self, f_locals: dict) -> str | None:
        """None while the captured graph still applies; else what changed since the capture."""
        for name, current, saved in self._hooks:
            if current != saved:
                return f"torch.nn.modules.module.{name} changed (a global module hook was registered or removed)"
        for cls, get, names, values in self._classes:
            now = get(cls)
            if now != values:  # identity first, element by element
                changed = [n for n, v, w in zip(names, values, now, strict=False) if v is not w and v != w]
                return f"{cls.__module__}.{cls.__qualname__}.{', '.join(changed)} was replaced"
        if self._inputs:
            scope = {**self._scope, "L": f_locals}
            for entry in self._inputs:
                if not entry.holds(scope):
                    what = "numpy value" if isinstance(entry, _NumpyInput) else "object"
                    return f"the {what} at {entry.source} is another object or value than at capture"
        return None


def capture(manager, joint: torch.fx.GraphModule, sources: list, constants: dict[int, object],
            g_scope: dict, f_locals: dict, evaluable) -> GlobalGuards:
    """The checks for one capture, right after Dynamo traced it; ``evaluable(source)``: whether
    ``dynamo.Guards`` re-checks that source itself (then nothing is added for it).

    Raises ``CaptureError`` for a graph input whose source cannot be re-checked on a later call."""
    inputs: list[_NumpyInput | _SameObject] = []
    scope = {**_dynamo_helpers(), "G": g_scope, "L": f_locals}
    for i, value in constants.items():
        source = sources[i] if i < len(sources) else None
        if source and evaluable(source):
            continue
        match = _FROM_NUMPY.match(source or "")
        if match and evaluable(match.group(1)):
            code = compile(match.group(1), "<numpy source>", "eval")
            try:
                obj = eval(code, scope)  # noqa: S307 - Dynamo's own source expression
            except Exception:
                obj = None
            if isinstance(obj, (np.ndarray, np.generic)):
                inputs.append(_NumpyInput(match.group(1), code, obj, value))
                continue
        elif source:
            try:
                code = compile(source, "<graph input source>", "eval")
                same = eval(code, scope) is value  # noqa: S307 - Dynamo's own source expression
            except Exception:
                same = False
            if same:
                inputs.append(_SameObject(source, code, value))
                continue
        raise CaptureError(
            f"the loss reads a {'tensor' if isinstance(value, torch.Tensor) else type(value).__name__} from "
            f"{source or 'an object Dynamo gave no source for'}, which compiled_psg cannot re-check on later calls, "
            "so a changed value would go unseen. Fix: pass it to the loss as a tensor argument (in_dims None for "
            "it), or keep it as a torch tensor in a global, closure or module attribute")
    return GlobalGuards(_module_classes(manager, joint), inputs, g_scope)


def backward_hook_refusal(text: str) -> UnsupportedError | None:
    """Dynamo's graph break on a module backward hook, in compiled_psg's words (None for any other break)."""
    if "Module-level backwards hooks" not in text:
        return None
    where = "a global module backward hook (register_module_full_backward_hook, register_module_backward_hook " \
            "or register_module_full_backward_pre_hook)" if (_module._global_backward_hooks or
                                                              _module._global_backward_pre_hooks) else \
        "a module backward hook (register_full_backward_hook, register_backward_hook or " \
        "register_full_backward_pre_hook)"
    return UnsupportedError(
        f"the loss calls a module with {where}: the hook rewrites the gradient flowing through the module, and "
        "compiled_psg derives per-sample gradients from the forward ops and cannot apply it per sample. Fix: remove "
        "the hook and apply its transformation to the per-sample result")
