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

import collections
import copy
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch.utils import _pytree as pytree

from .._capture.dynamo import CAPTURE_LOCK
from .._errors import InternalError
from . import foreach

aten = torch.ops.aten
log = logging.getLogger(__name__)


class StateMissing(Exception):
    """The traced step created optimizer state (momentum buffers, moments): run one eager step first."""


class PythonValuesChange(Exception):
    """The traced step changed a Python number it keeps (``state["step"] += 1`` on an int, as several of timm's
    optimizers do): the graph would hold the first value as a constant, so the update stays eager."""


def _readable(key: tuple) -> str:
    """``("state", 0, "step", 0)`` as ``state["step"] of parameter 0``; ``("group", 0, "lr", 0)`` as
    ``param_groups[0]["lr"]``."""
    if key[0] == "state":
        return f'state[{key[2]!r}] of parameter {key[1]}'
    if key[0] == "group":
        return f"param_groups[{key[1]}][{key[2]!r}]"
    return repr(key)


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
    foreach_unrolled: int = 0  # foreach ops made one op per parameter (``foreach.unroll_foreach``)


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


def creates_no_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` keeps no state, so that the step's program can run from the first step (no
    eager step to create state first). Known for torch's ``SGD`` without momentum (DP-SGD's own update), whose
    ``step`` reads ``state`` only where ``momentum != 0``; any other optimizer takes one eager step first."""
    return type(optimizer) is torch.optim.SGD and all(group["momentum"] == 0 for group in optimizer.param_groups)


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
            add(("group", g, key), group[key])
        for p in group["params"]:
            tensors.append((("param", j), p))
            if j in position:
                tensors.append((("dot_grad", position[j]), p.grad))
            else:  # a frozen parameter: the step reads (and applies) a .grad it may still hold, like eager torch
                add(("frozen_grad", j), p.grad)
            for key in sorted(optimizer.state.get(p, {})):
                add(("state", j, key), optimizer.state[p][key])
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
    create optimizer state.

    One of torch's per-parameter optimizers (``PER_PARAMETER``) is traced for one parameter of each kind and
    copied for the others (``_by_representatives``), where that graph shows each parameter's update reading only
    its own tensors and its group's settings; any other optimizer, whole."""
    kinds = _kinds(optimizer, trained)
    if kinds is not None and len(set(kinds)) < len(kinds):
        try:
            return _by_representatives(optimizer, trained, dtype, kinds)
        except StateMissing:
            raise
        except Exception as e:  # noqa: BLE001 -- the whole trace below fails with its own error, or succeeds
            log.debug("compiled_psg: the update is traced whole: %s: %s", type(e).__name__, e)
    return _whole(optimizer, trained, dtype)


def _whole(optimizer: torch.optim.Optimizer, trained: list[int], dtype: torch.dtype) -> UpdateGraph:
    shadow = copy.deepcopy(optimizer)
    for copied, p in zip(flat_params(shadow), flat_params(optimizer), strict=True):
        copied.grad = None if p.grad is None else p.grad.clone()  # deepcopy leaves .grad out
    real = dict(_tensors_and_values(optimizer, trained)[0])
    if list(real) != [k for k, _ in _tensors_and_values(shadow, trained)[0]]:
        raise InternalError("The optimizer's copy holds different tensors")
    gm, traced = _trace(shadow, trained, dtype)
    sources = [key if key[0] in ("grad", "scale", "dot_grad") else ("tensor", real[key]) for key in traced]
    return UpdateGraph(gm, sources, signature(optimizer, trained), gm.meta.get("foreach_unrolled", 0))


def _trace(shadow: torch.optim.Optimizer, trained: list[int], dtype: torch.dtype) -> tuple[fx.GraphModule, list]:
    """The update graph of ``shadow`` (a copy: the trace runs its step), and what feeds each placeholder: ``("grad",
    i)``, ``("scale", None)``, or the key of one of ``shadow``'s tensors in ``_tensors_and_values``."""
    hidden = _hide_float64_state(shadow)
    shadow_tensors, shadow_values = _tensors_and_values(shadow, trained)
    keys = {id(t): key for key, t in shadow_tensors}
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

    param_dtypes = {key[1]: t.dtype for key, t in shadow_tensors if key[0] == "param"}
    widened: dict[int, torch.dtype] = {}  # id of a float64 copy of a state counter: the counter's own dtype

    def backend(gm, example_inputs):
        # AOT autograd traces the one-element state in float64 where Dynamo traced it in float32 (see "one-element
        # state" below): the float64 state itself, or a float64 copy of float32 state that eager code reads as a
        # Python float
        for name, tensor in list(gm.named_buffers(remove_duplicate=False)):
            key = keys.get(id(tensor))
            if key is None:
                continue
            if id(tensor) in hidden:
                traced = hidden[id(tensor)]
            elif _reads_as_python_number(key, tensor, param_dtypes):
                traced = tensor.to(torch.float64)
                widened[id(traced)] = tensor.dtype
            else:
                continue
            owner, _, attribute = name.rpartition(".")
            gm.get_submodule(owner)._buffers[attribute] = traced
            keys[id(traced)] = key
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
        raise StateMissing(f"{type(shadow).__name__}.step creates state")
    changed = [key for (key, before), (_, after) in zip(shadow_values, after_values, strict=True)
               if repr(before) != repr(after)]
    if changed:  # Dynamo baked the value in as a constant; the graph would replay the first step's forever
        raise PythonValuesChange(
            f"{type(shadow).__name__}.step changes Python numbers it keeps (state or settings: "
            f"{', '.join(_readable(key) for key in changed[:3])}), which a graph can only hold as constants")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise InternalError(f"{len(placeholders)} update placeholders for {len(inputs)} inputs")
    if widened:
        # one op per parameter first: an in-place update of the state (NAdam's `_foreach_mul_(mu_products, mus)`)
        # is then an element op, which _read_widened computes at the state's dtype
        gm.meta["foreach_unrolled"] = foreach.unroll_foreach(gm.graph)
        for node, value in zip(placeholders, inputs, strict=True):
            if id(value) in widened:
                _read_widened(gm.graph, node, widened[id(value)])
        gm.graph.lint()
        gm.recompile()
    grad_index = {id(g): i for i, g in enumerate(new_grads)}
    fed: list = []
    for value in inputs:
        if id(value) in grad_index:
            fed.append(("grad", grad_index[id(value)]))
        elif value is scale:
            fed.append(("scale", None))
        elif id(value) in keys:
            fed.append(keys[id(value)])
        else:
            raise InternalError(f"The optimizer step reads an unknown input of type {type(value)}")
    return gm, fed


# ----- one-element state -----
#
# Eager code reads a one-element state tensor as a Python float (``_get_value(step)`` is ``step.item()``): the bias
# corrections ``1 - beta2 ** step``, RAdam's rectification, NAdam's ``mu``, ASGD's ``eta`` are computed in
# double. Traced, they stay tensors of the state's dtype, float32 unless the default dtype was float64 when the
# state was made: ``1 - 0.999 ** step`` rounded to float32 puts Adam's update 6e-6 off at step 1, RAdam's 1e-3.
# For a float64 parameter, AOT autograd traces such state in float64 (``_reads_as_python_number``), and the graph
# reads it converted and writes it back at its own dtype (``_read_widened``), as eager code does. A float32
# parameter keeps the traced float32 terms, which eager code rounds to float32 where they meet the parameter: its
# program holds no float64 arithmetic.
#
# Dynamo itself sees float32 state only (``_hide_float64_state``): on a one-element float64 tensor it drops an
# in-place update that ``.item()`` reads (Adafactor's ``step += 1; step.item()``, torch 2.13), so that the graph
# would never count a step.


def _hide_float64_state(shadow: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    """Replace each one-element float64 tensor of ``shadow``'s state with a float32 copy, for Dynamo's trace; the
    float64 tensor, by the copy's id, for AOT autograd's (``_trace``'s backend puts it back)."""
    hidden = {}
    for state in shadow.state.values():
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.float64:
                state[key] = value.to(torch.float32)
                hidden[id(state[key])] = value
    return hidden


def _reads_as_python_number(key: tuple, tensor: torch.Tensor, param_dtypes: dict[int, torch.dtype]) -> bool:
    """Whether the traced step reads ``tensor`` (the shadow's, at ``key`` of ``_tensors_and_values``) in float64:
    a one-element floating state tensor below float64 (``step``, NAdam's ``mu_product``, ASGD's ``eta`` and
    ``mu``) of a float64 parameter."""
    return (key[0] == "state" and param_dtypes.get(key[1]) == torch.float64 and tensor.dim() == 0
            and tensor.is_floating_point() and tensor.dtype != torch.float64)


def _read_widened(graph: fx.Graph, placeholder: fx.Node, dtype: torch.dtype) -> None:
    """Make ``placeholder``, traced as float64, the state tensor itself (``dtype``) read in float64.

    Pre: the graph was traced with a float64 copy at ``placeholder`` and writes it back with one closing
    ``copy_(placeholder, value)`` if at all. Post: the placeholder has ``dtype``; its readers read it converted to
    float64; the written value is rounded to ``dtype`` before any other node reads it, as a write into the state
    stores it; an in-place update of the state (``mu_product *= mu``: the value is a pointwise op of the state's
    read) is computed at ``dtype``, with the Python numbers that eager code passes it (here float64 tensors)
    rounded to ``dtype`` first, as eager torch does with a Python number."""
    wide_value = placeholder.meta["val"]
    with wide_value.fake_mode:
        placeholder.meta["val"] = wide_value.to(dtype)
    writes = [n for n in placeholder.users if n.target is aten.copy_.default and n.args[0] is placeholder]
    readers = [n for n in placeholder.users if n not in writes]
    with graph.inserting_after(placeholder):
        read = _convert(graph, placeholder, torch.float64)
    for reader in readers:
        reader.replace_input_with(placeholder, read)
    if len(writes) != 1:
        return
    (write,) = writes
    written = write.args[1]
    if _is_update_of(written, read):
        with graph.inserting_after(written):
            narrow_args = [placeholder if a is read else _convert_before(graph, written, a, dtype)
                           for a in written.args]
            stored = graph.call_function(written.target, tuple(narrow_args), dict(written.kwargs))
    else:
        with graph.inserting_after(written):
            stored = _convert(graph, written, dtype)
    stored.meta["val"] = _fake_like(written.meta["val"], dtype)
    with graph.inserting_after(stored):
        reread = _convert(graph, stored, torch.float64)
    for reader in [n for n in written.users if n not in (write, stored)]:
        reader.replace_input_with(written, reread)
    write.replace_input_with(written, stored)
    if not written.users:
        graph.erase_node(written)


def _is_update_of(value: fx.Node, read: fx.Node) -> bool:
    return (value.op == "call_function" and isinstance(value.target, torch._ops.OpOverload)
            and torch.Tag.pointwise in value.target.tags and bool(value.args) and value.args[0] is read)


def _convert(graph: fx.Graph, node: fx.Node, dtype: torch.dtype) -> fx.Node:
    converted = graph.call_function(torch.ops.prims.convert_element_type.default, (node, dtype))
    converted.meta["val"] = _fake_like(node.meta["val"], dtype)
    return converted


def _convert_before(graph: fx.Graph, user: fx.Node, arg, dtype: torch.dtype):
    if not isinstance(arg, fx.Node) or not isinstance(arg.meta.get("val"), torch.Tensor):
        return arg
    with graph.inserting_before(user):
        return _convert(graph, arg, dtype)


def _fake_like(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with value.fake_mode:
        return value.to(dtype)


# ----- one trace per kind of parameter -----
#
# Dynamo's and AOT autograd's time grows with the ops traced: a dozen per parameter for SGD with momentum, about
# thirty for Adam, so most of a minute for ResNet-50's 161 parameters (docs/benchmarks-probes.md, "The update
# traced once per kind of parameter"). torch's own optimizers update each parameter from its gradient, its state and its
# group's settings alone (a loop, or foreach ops over the list). So one parameter of each kind (group, shape,
# dtype, device, state) is traced, and its graph is copied for the others. Subclasses are not trusted with it (a
# subclass may override ``step``); the traced graph must show the separation too (``_by_representatives``).
PER_PARAMETER = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta") if hasattr(torch.optim, name))


class NotSeparable(Exception):
    """A parameter's traced update reads another parameter's tensors."""


def _kind_of(value) -> tuple:
    """What a traced update bakes in about ``value``: a tensor's layout, type and ``requires_grad``; a Python
    value itself."""
    if isinstance(value, torch.Tensor):
        return ("tensor", type(value), tuple(value.shape), value.stride(), value.dtype, value.device,
                value.requires_grad)
    return ("value", _hashable(value))


def _kinds(optimizer: torch.optim.Optimizer, trained: list[int]) -> list[tuple] | None:
    """Each parameter's kind (in ``flat_params`` order), or None where the update is traced whole: an optimizer
    outside ``PER_PARAMETER``, or one that also holds parameters the step does not train (it updates them from a
    ``.grad`` they may hold), or one that lists a parameter twice or shares a state tensor between two (the copies
    would each update their own)."""
    params = flat_params(optimizer)
    if type(optimizer) not in PER_PARAMETER or sorted(trained) != list(range(len(params))):
        return None
    held = [id(p) for p in params] + [id(v) for p in params for v in optimizer.state.get(p, {}).values()
                                      if isinstance(v, torch.Tensor)]
    if len(set(held)) < len(held):
        return None
    kinds = []
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            kinds.append((g, _kind_of(p), _kind_of(p.grad),
                          tuple((key, _kind_of(state[key])) for key in sorted(state, key=str))))
    return kinds


def _by_representatives(optimizer: torch.optim.Optimizer, trained: list[int], dtype: torch.dtype,
                        kinds: list[tuple]) -> UpdateGraph:
    """Trace the update of a copy of ``optimizer`` over one parameter of each kind, then copy each one's part of
    the graph for every parameter of its kind.

    Pre: ``kinds`` from ``_kinds``. Post: the graph's placeholders are the shared ones (the scale, tensor
    settings of a group) and then each parameter's own, in ``flat_params`` order; each parameter's nodes read
    its own placeholders and the shared nodes only (else ``NotSeparable``)."""
    params = flat_params(optimizer)
    first: dict[tuple, int] = {}
    for j, kind in enumerate(kinds):
        first.setdefault(kind, j)
    chosen = sorted(first.values())  # the representatives, by position in flat_params
    shadow, group_of = _shadow_over(optimizer, chosen)
    gm, fed = _trace(shadow, list(range(len(chosen))), dtype)
    # one op per parameter, so that the parts separate
    unrolled = foreach.unroll_foreach(gm.graph) + gm.meta.get("foreach_unrolled", 0)

    # whose each node of the traced graph is: the index of its representative, or None (shared)
    owner: dict[fx.Node, int | None] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, key in zip(placeholders, fed, strict=True):
        owner[node] = _owner(key)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        owners = {owner[n] for n in node.all_input_nodes} - {None}
        if len(owners) > 1:
            raise NotSeparable(f"{node.format_node()} reads the tensors of {len(owners)} parameters")
        owner[node] = owners.pop() if owners else None
        if owner[node] is None and node.op == "call_function" and _mutates(node):
            raise NotSeparable(f"{node.format_node()} writes a tensor no one parameter owns")
    if gm.graph.output_node().args[0] not in ((), []):
        raise NotSeparable("the traced step returns values")

    position = {j: i for i, j in enumerate(trained)}
    real = dict(_tensors_and_values(optimizer, trained)[0])
    rep_of = {j: chosen.index(first[kind]) for j, kind in enumerate(kinds)}
    graph, sources = fx.Graph(), []
    env_shared: dict[fx.Node, fx.Node] = {}
    shared_by_source: dict[tuple, fx.Node] = {}
    for node, key in zip(placeholders, fed, strict=True):
        if owner[node] is None:
            source = _source(key, None, group_of, position, real)
            same = shared_by_source.get(_identity(source))
            if same is None:
                same = shared_by_source[_identity(source)] = graph.placeholder(node.name)
                same.meta = dict(node.meta)
                sources.append(source)
            env_shared[node] = same
    members = {j: [] for j in range(len(params))}
    for node, key in zip(placeholders, fed, strict=True):
        if owner[node] is not None:
            for j in (j for j in range(len(params)) if rep_of[j] == owner[node]):
                members[j].append((node, key))
    env_of: dict[int, dict[fx.Node, fx.Node]] = {}
    for j in range(len(params)):
        env = env_of[j] = dict(env_shared)
        for node, key in members[j]:
            new = env[node] = graph.placeholder(f"p{j}_{node.name}")
            new.meta = dict(node.meta)
            sources.append(_source(key, j, group_of, position, real))
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    for node in body:
        if owner[node] is None:
            env_shared[node] = graph.node_copy(node, lambda n: env_shared[n])
    for j in range(len(params)):
        env = {**env_of[j], **env_shared}
        for node in body:
            if owner[node] == rep_of[j]:
                env[node] = graph.node_copy(node, lambda n, env=env: env[n])
    graph.output(())
    graph.lint()
    return UpdateGraph(fx.GraphModule(gm, graph), sources, signature(optimizer, trained), unrolled)


def _shadow_over(optimizer: torch.optim.Optimizer, chosen: list[int]) -> tuple[torch.optim.Optimizer, list[int]]:
    """A copy of ``optimizer`` over copies of the parameters at ``chosen`` (with their ``.grad`` and state), and
    the optimizer's group of each of the copy's groups. Nothing of the user's is copied but those."""
    shadow = object.__new__(type(optimizer))
    shadow.__dict__.update(optimizer.__dict__)
    wanted, groups, group_of = set(chosen), [], []
    state: collections.defaultdict = collections.defaultdict(dict)
    j = 0
    for g, group in enumerate(optimizer.param_groups):
        members = []
        for p in group["params"]:
            if j in wanted:
                clone = copy.deepcopy(p)
                clone.grad = None if p.grad is None else p.grad.clone()
                state[clone] = copy.deepcopy(optimizer.state.get(p, {}))
                members.append(clone)
            j += 1
        if members:
            groups.append({**{k: copy.deepcopy(v) for k, v in group.items() if k != "params"}, "params": members})
            group_of.append(g)
    shadow.param_groups, shadow.state = groups, state
    return shadow, group_of


def _owner(key: tuple) -> int | None:
    """The copy's parameter a traced placeholder belongs to (a key of ``_trace``), None if shared."""
    return key[1] if key[0] in ("grad", "dot_grad", "param", "state") else None


def _source(key: tuple, member: int | None, group_of: list[int], position: dict[int, int],
            real: dict) -> tuple:
    """What feeds a placeholder of the copy's graph for parameter ``member`` of the optimizer (None: shared)."""
    if key[0] == "grad":
        return ("grad", position[member])
    if key[0] == "scale":
        return ("scale", None)
    if key[0] == "dot_grad":
        return ("dot_grad", position[member])
    if key[0] == "param":
        return ("tensor", real[("param", member)])
    if key[0] == "state":
        return ("tensor", real[("state", member, *key[2:])])
    if key[0] == "group":  # a tensor setting of a group (a tensor lr)
        return ("tensor", real[("group", group_of[key[1]], *key[2:])])
    raise NotSeparable(f"the update reads {key}")


def _identity(source: tuple) -> tuple:
    kind, value = source
    return (kind, id(value)) if isinstance(value, torch.Tensor) else source


def _mutates(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable
