"""What a DP step releases besides the noisy update: nothing computed from the batch.

A loss may update tensors in place (``Captured.mutated``): a buffer that tracks a batch statistic under
``torch.no_grad()`` (``self.running.mul_(0.9).add_(0.1 * x.mean(0))``), ``F.embedding``'s ``max_norm`` renorming
the rows a batch looked up. The runner writes those values into the model on every step (``_compile/run.py``), and
they leave with it, outside the DP mechanism: a statistic of the data, or which rows the batch used. A DP step
refuses a write to a parameter or buffer whose new value depends on a batched argument, before it runs (the
capture's mutation graph, followed back from the written value to the inputs it reads), and so a write to a
tensor outside the model (a global, a tensor the loss closes over) or to an argument not sliced per sample
(``in_dims`` None: the caller keeps it, and one value for the whole batch is a statistic of it). A batched argument
is the batch itself: writing it releases nothing the caller does not hold. ``public_buffers`` names the buffers
the user declares public: their writes are released as they are, by the user's choice.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from .._analyze.source import source_line
from .._capture.dynamo import Captured
from .._errors import DPConfigError


def batch_dependent_writes(captured: Captured) -> list[tuple[int, fx.Node]]:
    """``(placeholder index, written value)`` of each in-place write to a parameter, a buffer, a tensor outside
    the model or an unbatched argument whose new value depends on a batched argument; found once per capture (a
    step asks before every run)."""
    if captured.batch_dependent_writes is None:
        captured.batch_dependent_writes = _find_batch_dependent_writes(captured)
    return captured.batch_dependent_writes


def _find_batch_dependent_writes(captured: Captured) -> list[tuple[int, fx.Node]]:
    if not captured.mutated or captured.mutation_graph is None:
        return []
    graph = captured.mutation_graph.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    batched = {node for node, role in zip(placeholders, captured.roles, strict=False) if role.batched}
    values = graph.output_node().args[0]
    found = []
    for index, value in zip(captured.mutated, values, strict=True):
        role = captured.roles[index]
        if not isinstance(value, fx.Node) or not (role.kind in ("param", "const")
                                                  or (role.kind == "arg" and not role.batched)):
            continue
        if _reads_any(value, batched):
            found.append((index, value))
    return found


def _symbolic(value) -> bool:
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) and not value.node.expr.is_number


def _reads_any(node: fx.Node, sources: set[fx.Node]) -> bool:
    """Whether ``node``'s value depends on a node of ``sources`` or on the batch size: a size is symbolic only
    where it is the batch's (``self.seen.add_(x.shape[0])`` releases the sampled batch size, which Poisson
    sampling keeps private), whether it reaches the write as a node or as an argument."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in sources or _symbolic(current.meta.get("val")):
            return True
        if any(_symbolic(a) for a in pytree.tree_leaves((current.args, current.kwargs))):
            return True
        if current in seen:
            continue
        seen.add(current)
        stack.extend(current.all_input_nodes)
    return False


def refuse_private_writes(captured: Captured, model: nn.Module, public_buffers: Iterable[str],
                          loss_fn: object = None) -> None:
    """Raise ``DPConfigError`` naming each parameter or buffer (not in ``public_buffers``), each tensor outside
    the model (a global, a tensor the loss closes over) and each unbatched argument of ``loss_fn`` that the loss
    writes from the batch, the line that writes it and the fixes that apply to it."""
    writes = batch_dependent_writes(captured)
    if not writes:
        return
    names = {id(t): n for n, t in model.named_parameters(remove_duplicate=False)}
    names.update({id(t): n for n, t in model.named_buffers(remove_duplicate=False)})
    public = set(public_buffers)
    in_model, outside = [], []
    for index, value in writes:
        role = captured.roles[index]
        name = role.key if role.kind == "param" else names.get(id(captured.constants.get(index)))
        if name in public:
            continue
        where = _writer_line(value)
        if role.kind == "arg":
            outside.append(f"{_argument(loss_fn, role.key)}, which in_dims does not slice per sample (None), "
                           f"written at {where}")
        elif name is None:
            what = captured.tensor_names.get(index, "a tensor outside the model")
            outside.append(f"{what}, written at {where}")
        else:
            in_model.append(f"{'parameter' if role.kind == 'param' else 'buffer'} {name!r}, written at {where}")
    if not in_model and not outside:
        return
    into = " and ".join(w for w, sites in (("the model", in_model), ("tensors outside it" if in_model else
                                                                      "tensors outside the model", outside)) if sites)
    fixes = []
    if in_model:
        fixes.append("put the module that writes it in eval mode, freeze it (compute it outside the DP step, from "
                     "public data), or, for a buffer whose value you declare public, name it in compile_step(..., "
                     "public_buffers=[...]). Embedding(max_norm=...) renorms the rows the batch looked up: use "
                     "max_norm=None in DP training")
    if outside:
        fixes.append("for a tensor outside the model or an argument of the loss, remove the write from the loss, or "
                     "compute that value outside the DP step from public data (public_buffers takes the model's "
                     "buffers only)")
    raise DPConfigError(
        f"the loss writes values computed from the batch into {into}, which a DP step would release un-noised "
        "(they keep the values after the step): " + "; ".join(in_model + outside) + ". No step was taken. Fix: "
        + "; ".join(fixes))


def _argument(loss_fn: object, position: int) -> str:
    """``argument 2 (stats) of the loss``: the position, and the name where the loss's signature gives one."""
    try:
        names = [p.name for p in inspect.signature(loss_fn).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):  # no signature (a builtin, None): the position alone
        names = []
    named = f" ({names[position]})" if position < len(names) else ""
    return f"argument {position}{named} of the loss"


def _writer_line(value: fx.Node) -> str:
    """The user's line behind the written value, or behind the nearest node before it that has one."""
    seen, stack = set(), [value]
    while stack:
        node = stack.pop(0)
        line = source_line(node)
        if line != "unknown source line":
            return line
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return "an unknown source line"


def refuse_padded_writes(captured: Captured, model: nn.Module, public_buffers: Iterable[str],
                         loss_fn: object = None) -> None:
    """Under ``batch_buckets`` (``buckets.py``), raise ``DPConfigError`` naming each public buffer the loss writes
    from the batch and each batched argument it writes, the line that writes it and the fix. The loss runs on
    the padded batch: a buffer's new value would read the padded copies or the bucket's size
    (``self.seen.add_(x.shape[0])``), which no re-weighting undoes, and an argument's write would go into the
    padded copy of the argument, not the caller's tensor. Writes that do not read the batch (a step counter)
    pass: padding does not change them."""
    names = {id(t): n for n, t in model.named_buffers(remove_duplicate=False)}
    public = set(public_buffers)
    found = []
    for index, value in batch_dependent_writes(captured):
        name = names.get(id(captured.constants.get(index)))
        if captured.roles[index].kind == "const" and name in public:
            found.append(f"public buffer {name!r}, written at {_writer_line(value)}, would read the padded batch "
                         "(the copies of its first sample, the bucket's size as the batch size)")
    if captured.mutated and captured.mutation_graph is not None:
        values = captured.mutation_graph.graph.output_node().args[0]
        for index, value in zip(captured.mutated, values, strict=True):
            role = captured.roles[index]
            if role.kind == "arg" and role.batched:
                where = _writer_line(value) if isinstance(value, fx.Node) else "an unknown source line"
                found.append(f"{_argument(loss_fn, role.key)}, written at {where}, would be written into the padded "
                             "copy of the argument, not your tensor")
    if found:
        raise DPConfigError(
            "with batch_buckets the loss runs on each (micro-)batch padded with copies of its first sample, and it "
            "writes tensors whose new values would not be the batch's: " + "; ".join(found) + ". No step was "
            "taken. Fix: batch_buckets=None (and cuda_graphs=False), or move the write out of the loss (update "
            "the buffer or the tensor from the real batch before or after the step)")
