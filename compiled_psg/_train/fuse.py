"""Splice the optimizer update after the per-sample graph: one program for a whole training step.

Before, two graphs (index letters: n batch, j parameter)::

    per-sample (clip_sum):  (params, batch)                    -> (loss, losses[n], {name: S_j}, norms[n])
    update:                 (G_j, scale, params, .grad, state)  -> ()    # ends with copy_ into params, .grad, state

After, one graph::

    (params, batch, [bounds], [partial_j], [noise_j], [count], [scale], .grad, state)
            -> (loss, losses[n], [norms[n]], [count])
        S_j = <per-sample graph>                # bounds: the reduction's own run-time input (adaptive clipping)
        G_j = S_j + partial_j                   # micro-batching: the clipped sums of the earlier micro-batches
        G_j = G_j + noise_j                     # noise placeholders only on the process that adds the noise
        G, count = all_reduce(cat(G_j, count))  # one collective, only under torch.distributed
        scale = 1 / max(count, 1)               # in the graph only when dividing by the global batch size
        G_j = G_j.to(param_j.dtype)             # the sums are float32 for bfloat16 parameters (mixed precision)
        <update graph on G_j and scale>           # its copy_ into the user's tensors become outputs

The program writes nothing of the user's: the update graph's closing ``copy_`` into parameters, ``.grad`` and
optimizer state become outputs (``commit_k``), and ``commit`` writes them after the program returns, with
``torch._foreach_copy_``. A step that raises inside the program has changed nothing, so the transaction needs no
copy of the parameters and state (``transaction.py``), and the new values are allocated at the program's end,
after the backward has freed its activations, not across the step's peak.

Pre-conditions: the per-sample graph's result is ``{name: tensor}`` or ``({name: tensor}, norms)`` with an entry
for every parameter the optimizer updates; the update graph comes from ``capture_update``. Post-conditions: the
graph lints, mutates none of its inputs, ``StepProgram.inputs`` describes every placeholder after the
per-sample graph's own, and ``StepProgram.commits`` names the tensor each ``commit_k`` output is written into.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .._compile.build import Rewritten
from .._errors import InternalError
from . import foreach
from .inputs import InputKind
from .results import split_result
from .update_graph import UpdateGraph

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclass
class StepProgram:
    """The fused graph. ``inputs``: one ``(InputKind, key)`` per placeholder after the per-sample graph's own
    (``inputs.InputKind`` says what feeds each); ``outputs``: names of the flat outputs; ``commits[k]``: what
    output ``commit_k`` is written into, ``("param", name)`` or an ``inputs`` entry (``.grad``, optimizer state)."""

    gm: fx.GraphModule
    inputs: list[tuple[str, object]]
    outputs: list[str]
    commits: list[tuple[str, object]]


def fuse_step(rewritten: Rewritten, update: UpdateGraph, params: list[torch.Tensor], names: list[str], *,
              noisy: bool, group_name: str | None, divide_by_count: bool, accumulate: bool = False) -> StepProgram:
    """``params[j]``/``names[j]``: the optimizer's ``j``-th parameter; ``group_name``: the process group to
    all-reduce over (None: one process); ``divide_by_count``: the scale is 1 / the global batch size;
    ``accumulate``: inputs ``partial_j`` are added to the clipped sums (the earlier micro-batches of a logical
    batch), before the noise."""
    per_sample_gm = rewritten.graph_module
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    loss, losses, *flat = graph.graph_copy(per_sample_gm.graph, env)
    result = pytree.tree_unflatten(list(flat), rewritten.out_spec)
    # a custom reduction's result, checked as the eager path checks it (the program may run from the first step)
    split_result(pytree.tree_map(lambda v: v.meta.get("val") if isinstance(v, fx.Node) else v, result), names, params)
    sums, norms = result if isinstance(result, tuple) else (result, None)
    missing = [n for n in names if n not in sums]
    if missing:
        raise InternalError(f"the per-sample graph has no gradient for {missing}")
    own = _placeholders(per_sample_gm.graph)
    roles = zip(rewritten.roles, own[:len(rewritten.roles)], strict=True)
    param_placeholder = {r.key: env[n] for r, n in roles if r.kind == "param"}
    first_compute = next(n for n in graph.nodes if n.op != "placeholder")
    # the reduction's own run-time inputs (adaptive clipping bounds) come first after the captured ones
    inputs: list[tuple[str, object]] = [(InputKind.REDUCE_INPUT, k)
                                        for k in range(len(own) - len(rewritten.roles))]

    feeds: dict[fx.Node, tuple[str, object]] = {node: ("param", key) for key, node in param_placeholder.items()}

    def placeholder(kind: InputKind, key: object, name: str) -> fx.Node:
        with graph.inserting_before(first_compute):  # after the per-sample graph's own, in order
            node = graph.placeholder(f"step_{len(inputs)}_{name}")  # the target is the argument's name
        inputs.append((kind, key))
        feeds[node] = (kind, key)
        return node

    call = graph.call_function
    grads = [sums[n] for n in names]
    if accumulate:
        grads = [call(aten.add.Tensor, (g, placeholder(InputKind.PARTIAL, j, f"partial_{j}")))
                 for j, g in enumerate(grads)]
    if noisy:
        grads = [call(aten.add.Tensor, (g, placeholder(InputKind.NOISE, j, f"noise_{j}")))
                 for j, g in enumerate(grads)]
    outputs, output_names = [loss, losses], ["loss", "per_sample_losses"]
    if norms is not None:
        outputs.append(norms)
        output_names.append("norms")
    scale = None
    if group_name is not None:
        count = placeholder(InputKind.COUNT, None, "count")
        grads, count = _all_reduce_flat(graph, grads, count, [p.shape for p in params], group_name)
        outputs.append(count)
        output_names.append("global_count")
        if divide_by_count:
            scale = call(aten.reciprocal.default, (call(aten.clamp_min.default, (count, 1)),))
    if scale is None:
        scale = placeholder(InputKind.SCALE, None, "scale")
    # the sums are float32 for bfloat16 parameters (noise added in float32 too): the update gets the param dtype
    grads = [g if _dtype(sums[n]) in (None, p.dtype)
             else call(aten._to_copy.default, (g,), {"dtype": p.dtype})
             for g, n, p in zip(grads, names, params, strict=True)]

    by_identity = {id(p): n for p, n in zip(params, names, strict=True)}
    update_env: dict[fx.Node, fx.Node] = {}
    for node, (kind, key) in zip(_placeholders(update.gm.graph), update.sources, strict=True):
        if kind == InputKind.GRAD:
            update_env[node] = grads[key]
        elif kind == InputKind.SCALE:
            update_env[node] = scale
        elif kind == InputKind.TENSOR and id(key) in by_identity:  # the parameters, which the per-sample graph reads
            update_env[node] = param_placeholder[by_identity[id(key)]]
        else:
            update_env[node] = placeholder(kind, key, node.name)
    graph.graph_copy(update.gm.graph, update_env)
    commits = _writes_as_outputs(graph, [update_env[n] for n in update.gm.graph.nodes
                                         if n.target is aten.copy_.default], feeds)
    outputs.extend(value for _, value in commits)
    output_names.extend(f"commit_{k}" for k in range(len(commits)))
    graph.output(tuple(outputs))

    unrolled = foreach.unroll_foreach(graph) + update.foreach_unrolled
    root = torch.nn.Module()
    _register_constants(per_sample_gm, env, root, "per_sample_")
    _register_constants(update.gm, update_env, root, "update_")
    graph.lint()
    gm = fx.GraphModule(root, graph)
    gm.meta["foreach_unrolled"] = unrolled
    return StepProgram(gm, inputs, output_names, [target for target, _ in commits])


def _writes_as_outputs(graph: fx.Graph, writes: list[fx.Node],
                       feeds: dict[fx.Node, tuple[str, object]]) -> list[tuple[tuple[str, object], fx.Node]]:
    """Remove the update's ``copy_(placeholder, value)`` nodes; ``(what feeds the placeholder, value)`` for each.

    Pre: each write's destination is a placeholder with an entry in ``feeds``, written once, and nothing reads the
    write (AOT's functional graph ends with them). Post: a value that is, or is a view of, an input is cloned, so
    that writing one output cannot change another before it is written."""
    commits, seen = [], set()
    for write in writes:
        target, value = write.args[0], write.args[1]
        if write.users or target not in feeds or target in seen:
            raise InternalError(f"the optimizer update writes {target} in a form the step cannot commit")
        seen.add(target)
        if _views_an_input(value):
            with graph.inserting_before(write):
                value = graph.call_function(aten.clone.default, (value,))
                value.meta["val"] = value.args[0].meta.get("val")
        graph.erase_node(write)
        commits.append((feeds[target], value))
    return commits


_ALIASING = (aten._unsafe_view.default, aten.alias.default, aten.reshape.default, aten.contiguous.default)


def _views_an_input(node: fx.Node) -> bool:
    """Whether ``node`` may share an input's memory: the input itself, or a view (or a reshape, which may be one)
    of it."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
            and (node.target.is_view or node.target in _ALIASING):
        node = node.args[0]
    return node.op == "placeholder"


def commit(targets: list[torch.Tensor], values: list[torch.Tensor], snapshot=None) -> None:
    """Write a step program's ``commit_k`` outputs into the user's tensors: one ``_foreach_copy_`` per device and
    dtype (torch takes its one-kernel route only for lists of one device and dtype; Adam's ``step`` counters sit on
    the CPU beside CUDA parameters). The copies allocate nothing (each value has its target's shape).
    ``snapshot`` (the step's ``transaction.Snapshot``) is marked unrestorable just before: from there on, a
    failure counts the step, so the commit is made whole first: an interrupt between two groups' copies (or before
    the first) finishes the remaining ones before it propagates (a copy done twice writes the same values)."""
    groups: dict[tuple, tuple[list, list]] = {}
    for target, value in zip(targets, values, strict=True):
        key = (target.device, target.dtype, value.device, value.dtype)
        group = groups.setdefault(key, ([], []))
        group[0].append(target)
        group[1].append(value)
    pending = list(groups.values())
    with torch.no_grad():
        if snapshot is not None:
            snapshot.restorable = False
        try:
            while pending:
                torch._foreach_copy_(*pending[0])
                pending.pop(0)
        except BaseException:
            for group_targets, group_values in pending:
                torch._foreach_copy_(group_targets, group_values)
            raise


def _dtype(node: fx.Node) -> torch.dtype | None:
    value = node.meta.get("val")
    return value.dtype if isinstance(value, torch.Tensor) else None


def _placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def _all_reduce_flat(graph: fx.Graph, grads: list[fx.Node], count: fx.Node, shapes: list, group_name: str):
    """``cat(G_j.view(-1), count.view(1))`` summed over the ranks in ONE collective, the layout
    ``distributed.all_reduce_flat`` uses, so that a rank running eagerly (its first step, an empty batch)
    joins the same collective."""
    call = graph.call_function
    pieces = [call(aten.view.default, (g, [-1])) for g in grads] + [call(aten.view.default, (count, [1]))]
    flat = call(aten.cat.default, (pieces,))
    summed = call(c10d.wait_tensor.default, (call(c10d.all_reduce.default, (flat, "sum", group_name)),))
    sizes = [math.prod(s) for s in shapes] + [1]
    parts = call(aten.split_with_sizes.default, (summed, sizes))
    views = [call(aten.view.default, (call(operator.getitem, (parts, k)), list(s)))
             for k, s in enumerate([*shapes, ()])]
    return views[:-1], views[-1]


def _register_constants(source: fx.GraphModule, env: dict, root: torch.nn.Module, prefix: str) -> None:
    """Values the copied graph reads with ``get_attr``, moved to the fused module under ``prefix``."""
    for node in [n for n in source.graph.nodes if n.op == "get_attr"]:
        value = source
        for part in node.target.split("."):
            value = getattr(value, part)
        name = prefix + node.target.replace(".", "_")
        if isinstance(value, torch.Tensor):
            root.register_buffer(name, value)
        else:
            setattr(root, name, value)
        env[node].target = name
