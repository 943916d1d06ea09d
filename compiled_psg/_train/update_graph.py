"""Capture ``optimizer.step()`` as a functional ATen graph, so that it can be spliced after the per-sample graph.

Dynamo traces the optimizer's own ``step`` (as ``torch.compile(optimizer.step)`` would) and AOT autograd
functionalizes it with the input mutations kept: the graph reads the new gradients, the parameters and the
optimizer state, and ends with ``copy_`` into every tensor the step updates in place.

The trace runs on a deep copy of the optimizer, so capturing updates copies, never the user's tensors; the
copy's tensors are then mapped back to the originals by position. Dynamo bakes Python numbers (``lr=0.1``,
betas, ``weight_decay``) into the graph as constants, so ``signature(optimizer)`` records them together with
the identity of every tensor the graph reads: a changed value or a replaced tensor (a scheduler setting a float
``lr``, ``load_state_dict``) means the graph is stale and must be captured again.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch.utils import _pytree as pytree

from .._capture.dynamo import CAPTURE_LOCK
from .._errors import InternalError


class StateMissing(Exception):
    """The traced step created optimizer state (momentum buffers, moments): run one eager step first."""


@dataclass
class UpdateGraph:
    """``gm(*inputs)`` performs one optimizer step. ``sources[k]`` says what feeds placeholder ``k``:
    ``("grad", i)`` the new gradient of the ``i``-th trained parameter, ``("scale", None)`` the factor the
    gradients are multiplied by, ``("dot_grad", i)`` the ``.grad`` tensor of the ``i``-th trained parameter
    (written with the scaled gradient, as ``optimizer.step()`` leaves it), ``("tensor", t)`` another tensor of the
    user's (a parameter, optimizer state, a tensor hyperparameter)."""

    gm: fx.GraphModule
    sources: list[tuple[str, object]]
    signature: tuple


def raw_step(optimizer: torch.optim.Optimizer) -> Callable:
    """The optimizer's own ``step``, without the hook and ``no_grad`` wrappers (graph breaks)."""
    fn = type(optimizer).step
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    from torch.optim import optimizer as optim_module

    return bool(getattr(optimizer, "_optimizer_step_pre_hooks", None)
                or getattr(optimizer, "_optimizer_step_post_hooks", None)
                or getattr(optim_module, "_global_optimizer_pre_hooks", None)
                or getattr(optim_module, "_global_optimizer_post_hooks", None))


def fresh_function(fn: Callable) -> Callable:
    """A copy of ``fn`` with its own code object, so that Dynamo keeps a separate cache for it."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def flat_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _tensors_and_values(optimizer: torch.optim.Optimizer, trained: list[int]):
    """Every tensor the step may read, keyed and in a fixed order, and every Python value it may bake in
    (nested containers, such as tensor betas, flattened)."""
    tensors, values = [], []

    def add(key, value):
        if value is None or isinstance(value, torch.Tensor | float | int | str):  # a leaf: no pytree walk per step
            (tensors if isinstance(value, torch.Tensor) else values).append(((*key, 0), value))
            values.append(((*key, "structure"), "*"))
            return
        leaves, _ = pytree.tree_flatten(value)
        for i, leaf in enumerate(leaves):
            (tensors if isinstance(leaf, torch.Tensor) else values).append(((*key, i), leaf))
        values.append(((*key, "structure"), repr(pytree.tree_structure(value))))

    position = {j: i for i, j in enumerate(trained)}
    j = 0
    for g, group in enumerate(optimizer.param_groups):
        for key in sorted(k for k in group if k != "params"):
            add((g, key), group[key])
        for p in group["params"]:
            tensors.append((("param", j), p))
            if j in position:
                tensors.append((("dot_grad", position[j]), p.grad))
            else:  # a frozen parameter: the step reads (and applies) a .grad it may still hold, like eager torch
                add(("frozen_grad", j), p.grad)
            for key in sorted(optimizer.state.get(p, {})):
                add((j, key), optimizer.state[p][key])
            j += 1
    return tensors, values


def signature(optimizer: torch.optim.Optimizer, trained: list[int]) -> tuple:
    """Changes whenever a captured update graph would be stale (see the module docstring)."""
    tensors, values = _tensors_and_values(optimizer, trained)
    # .grad of trained parameters is not part of it: the step owns those buffers and reinstalls them each call
    return (tuple((k, id(t)) for k, t in tensors if k[0] != "dot_grad"),
            tuple((k, _hashable(v)) for k, v in values), tuple(trained))


def _hashable(value):
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


def capture_update(optimizer: torch.optim.Optimizer, trained: list[int], dtype: torch.dtype) -> UpdateGraph:
    """Trace ``p.grad = new_grad * scale; optimizer.step()`` for the parameters at positions ``trained`` of
    ``flat_params(optimizer)`` (their ``.grad`` must be allocated). Raises ``StateMissing`` if the step would
    create optimizer state."""
    shadow = copy.deepcopy(optimizer)
    for copied, p in zip(flat_params(shadow), flat_params(optimizer), strict=True):
        copied.grad = None if p.grad is None else p.grad.clone()  # deepcopy leaves .grad out
    real_tensors, _ = _tensors_and_values(optimizer, trained)
    shadow_tensors, shadow_values = _tensors_and_values(shadow, trained)
    if [k for k, _ in real_tensors] != [k for k, _ in shadow_tensors]:
        raise InternalError("The optimizer's copy holds different tensors")
    original = {id(s): (key, r) for (key, s), (_, r) in zip(shadow_tensors, real_tensors, strict=True)}
    params = flat_params(shadow)
    trained_params = [params[j] for j in trained]
    new_grads = [torch.zeros_like(p) for p in trained_params]
    scale = torch.ones((), dtype=dtype, device=trained_params[0].device)
    step = raw_step(shadow)

    def update(grads, factor):
        for p, g in zip(trained_params, grads, strict=True):
            p.grad.copy_(g * factor)
        step(shadow)

    state: dict[str, object] = {}

    def fw_compiler(gm, example_inputs):
        state["gm"] = gm
        return gm.forward

    inner = aot_autograd(fw_compiler=fw_compiler, keep_inference_input_mutations=True)

    def backend(gm, example_inputs):
        # aot_autograd lifts the Dynamo graph's parameters and buffers (optimizer state) before its inputs
        lifted = [*dict(gm.named_parameters(remove_duplicate=False)).values(),
                  *dict(gm.named_buffers(remove_duplicate=False)).values()]
        state["inputs"] = lifted + list(example_inputs)
        return inner(gm, example_inputs)

    fn = fresh_function(update)
    try:
        # one trace at a time with the captures and compiles: torch.fx's tracer patches nn.Module.__call__ through
        # one process-global patcher, which two traces in two threads leave patched for good
        with CAPTURE_LOCK, torch.no_grad():
            torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(new_grads, scale)
        gm, inputs = state["gm"], state["inputs"]
    finally:
        torch._dynamo.reset_code(fn.__code__)
        state.clear()  # Dynamo keeps the backend (and so this dict) alive: drop the copies' tensors
    after_tensors, after_values = _tensors_and_values(shadow, trained)
    if ([k for k, _ in after_tensors] != [k for k, _ in shadow_tensors]
            or [k for k, _ in after_values] != [k for k, _ in shadow_values]):
        raise StateMissing(f"{type(optimizer).__name__}.step creates state")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise InternalError(f"{len(placeholders)} update placeholders for {len(inputs)} inputs")
    grad_index = {id(g): i for i, g in enumerate(new_grads)}
    sources: list[tuple[str, object]] = []
    for value in inputs:
        if id(value) in grad_index:
            sources.append(("grad", grad_index[id(value)]))
        elif value is scale:
            sources.append(("scale", None))
        elif id(value) in original:
            key, real = original[id(value)]
            sources.append(key if key[0] == "dot_grad" else ("tensor", real))
        else:
            raise InternalError(f"The optimizer step reads an unknown input of type {type(value)}")
    return UpdateGraph(gm, sources, signature(optimizer, trained))
