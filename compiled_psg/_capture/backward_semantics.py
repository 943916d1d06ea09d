"""What in the loss changes autograd's backward without showing in the forward ATen graph.

The per-sample backward is re-derived from the forward ops (``retrace.py``), so whatever makes eager autograd
compute something else than the derivative of those ops would be lost, silently. Dynamo's graph still shows it:

- a custom ``torch.autograd.Function`` (``autograd_function_apply``): its own ``backward`` (gradient reversal,
  straight-through estimators, clipped gradients) replaces the forward's derivative. Refused.
- ``tensor.register_hook`` inside the loss: the hook rewrites the gradient flowing through that tensor. Refused.
- ``h.detach_()``: later uses of ``h`` carry no gradient. Rewritten into ``h.detach()`` for those uses.
- ``t.backward()`` inside the loss: it writes ``.grad`` as well. Refused (``torch.autograd.grad`` is supported).
- ``checkpoint(f, x, use_reentrant=True)`` where no tensor argument requires grad (the batch): eager autograd
  gives the parameters inside ``f`` no gradient, while Dynamo traces every checkpoint with the non-reentrant
  meaning. Refused (``reentrant_checkpoints_marked``, a change to Dynamo in the patches registry, marks them).
- ``squeeze()`` without a dim on a batched value, or ``squeeze(dim)`` of the batch dimension: a batch of one (the
  per-sample loss) drops the batch dimension too, so its loss differs from what the graph computes for larger
  batches. Refused.

Hooks on parameters live outside the loss; ``refuse_parameter_hooks`` checks them at each call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.fx as fx

from .._analyze.source import installed_library, where
from .._errors import BatchInputError, CaptureError, UnsupportedError
from . import patches

# Dynamo's graph node of a reentrant checkpoint none of whose tensor arguments requires grad carries this mark.
_REENTRANT_WITHOUT_GRAD = "psg_reentrant_checkpoint_without_grad"


def _is_call(node: fx.Node, name: str) -> bool:
    if node.op == "call_method":
        return node.target == name
    if node.op == "call_function":
        return getattr(node.target, "__name__", None) == name
    return False


def _has_symbolic_size(node: fx.Node) -> bool:
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and any(not isinstance(s, int) for s in value.shape)


def _called_as_backward(node: fx.Node) -> bool:
    """Dynamo records ``t.backward()`` as ``torch.autograd.grad`` plus writes to ``.grad``; only the user's line
    tells them apart."""
    lines = [line for line in (node.meta.get("stack_trace") or "").splitlines() if line.strip()]
    code = [line for line in lines if not line.strip().startswith(("File ", "^", "~"))]
    return bool(code) and ".backward(" in code[-1]


def custom_backward_sites(gm: fx.GraphModule) -> list[str]:
    """One line per site in Dynamo's graph whose backward (or batch-of-one meaning) the re-derived backward would
    miss, naming the construct, the user's line and the fix."""
    sites = []
    for node in gm.graph.nodes:
        if _is_call(node, "autograd_function_apply"):
            sites.append(f"a custom torch.autograd.Function at {where(node)}: its backward replaces the derivative "
                         "of its forward, and compiled_psg derives per-sample gradients from the forward ops. Fix: "
                         "write the custom gradient as a differentiable expression (straight-through: "
                         "x + (f(x) - x).detach(); gradient reversal: (1 + a) * x.detach() - a * x)")
        elif node.op == "call_function" and node.target is torch.autograd.grad and _called_as_backward(node):
            sites.append(f".backward() inside the loss at {where(node)}: it also writes .grad, which the per-sample "
                         "gradients cannot follow. Fix: differentiate with torch.autograd.grad(..., "
                         "create_graph=True) and use its result")
        elif node.meta.get(_REENTRANT_WITHOUT_GRAD):
            sites.append(f"checkpoint(..., use_reentrant=True) at {where(node)} with no tensor argument that "
                         "requires grad: eager autograd then gives the parameters inside the checkpointed function "
                         "no gradient, and the compiled capture would give them one. Fix: pass "
                         "use_reentrant=False (torch's recommended form; those parameters then get their "
                         "gradients), or call the function under torch.no_grad() if they should not train")
        elif _is_call(node, "register_hook"):
            sites.append(f"tensor.register_hook at {where(node)}: the hook rewrites the gradient, and compiled_psg "
                         "derives per-sample gradients from the forward ops. Fix: remove the hook, or express "
                         "its effect in the loss (scale with x.detach() * (1 - s) + x * s)")
        elif (_is_call(node, "squeeze") or _is_call(node, "squeeze_")) and len(node.args) == 1 \
                and "dim" not in node.kwargs and _has_symbolic_size(node.args[0]):
            sites.append(f"squeeze() without a dim at {where(node)}: for a batch of one (a sample's own loss) it "
                         "also drops the batch dimension, so the loss differs from the batched one. Fix: "
                         + _edit_or_compute(node, "name the dimension, squeeze(-1)"))
        elif (_is_call(node, "squeeze") or _is_call(node, "squeeze_")) and _squeezes_a_symbolic_dim(node):
            sites.append(f"squeeze(dim) of the batch dimension at {where(node)}: it does nothing to the batch, but "
                         "for a batch of one (a sample's own loss) it drops the batch dimension, so the loss differs "
                         "from the batched one. Fix: "
                         + _edit_or_compute(node, "remove the squeeze, or squeeze another dimension"))
    return list(dict.fromkeys(sites))  # two squeezes of one line are one site


def _edit_or_compute(node: fx.Node, edit: str) -> str:
    """The fix of a construct: ``edit`` on the user's own line; in an installed library's code, which the user does
    not own, computing that step outside it (for a model's built-in loss: the loss from its outputs)."""
    library = installed_library(node)
    if library is None:
        return edit
    return (f"that line is in {library}, not in your code, so compute that step yourself from what it returns "
            "(for a model's built-in loss: call the model without labels= and compute the loss from its logits, "
            "e.g. F.mse_loss(out.logits.squeeze(-1), labels) for a regression head)")


def _squeezes_a_symbolic_dim(node: fx.Node) -> bool:
    """``squeeze(dim)`` / ``squeeze(dims)`` naming a dimension whose size is symbolic (the batch)."""
    value = node.args[0].meta.get("example_value") if isinstance(node.args[0], fx.Node) else None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not isinstance(value, torch.Tensor) or dims is None or value.dim() == 0:
        return False
    dims = dims if isinstance(dims, (tuple, list)) else (dims,)
    return any(isinstance(d, int) and not isinstance(value.shape[d % value.dim()], int) for d in dims)


def detach_in_place(gm: fx.GraphModule) -> int:
    """Rewrite ``h.detach_()`` into ``d = h.detach()`` read by every later use of ``h``; returns how many.

    Post: no ``detach_`` remains; nodes after it read the detached value, nodes before it the original."""
    count = 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in [n for n in gm.graph.nodes if _is_call(n, "detach_")]:
        source = node.args[0]
        with gm.graph.inserting_before(node):
            detached = gm.graph.call_method("detach", (source,))
            detached.meta.update(node.meta)
        node.replace_all_uses_with(detached)
        for user in list(source.users):
            if user is not detached and user is not node and order.get(user, -1) > order[node]:
                user.replace_input_with(source, detached)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def refuse_parameter_hooks(params: dict[str, torch.Tensor]) -> None:
    """Gradient hooks on parameters (``p.register_hook``) change what autograd returns for them."""
    hooked = [name for name, p in params.items() if getattr(p, "_backward_hooks", None)]
    if hooked:
        raise UnsupportedError(
            f"parameter{'s' if len(hooked) > 1 else ''} {', '.join(hooked)} "
            f"{'have' if len(hooked) > 1 else 'has'} a gradient hook (register_hook), which rewrites the gradient; "
            "compiled_psg derives per-sample gradients from the forward ops and cannot apply it per sample. Fix: "
            "remove the hook and apply its transformation to the per-sample result")


def refuse_arguments_from_parameters(args: tuple, params: dict[str, torch.Tensor]) -> None:
    """An argument computed from the parameters outside the loss (``feats = model[0](x)``, then ``f(feats, y)``)
    carries part of their gradient that the loss function never sees: the capture would treat it as data and
    miss that part (the loop, differentiating through it, does not). Only tensors with a ``grad_fn`` are
    walked, so ordinary data costs one attribute read."""
    for pos, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.grad_fn is not None:
            reached = _parameters_behind(a.grad_fn, {id(p): n for n, p in params.items()})
            if reached:
                raise BatchInputError(
                    f"argument {pos} was computed from the parameters ({', '.join(sorted(reached)[:3])}) outside "
                    "the loss function, so part of their gradient flows through it, where per-sample gradients "
                    "cannot follow. Fix: compute it inside the loss function, or pass it .detach()ed if it is "
                    "meant as data")


def refuse_parameters_as_batched_arguments(args: tuple, params: dict[str, torch.Tensor],
                                           batch_dims: dict[int, int]) -> None:
    """A parameter passed as a batched argument (a learnable weight per example, ``loss(x, y, model.w)``): the
    capture reads each sample's slice of it as data, so its gradient would be 0 where the loop's flows through the
    slice (red team P). Unbatched (``in_dims`` None), it is read whole, as the loop reads it: exact."""
    names = {id(p): n for n, p in params.items()}
    for pos in batch_dims:
        name = names.get(id(args[pos]))
        if name is not None:
            raise BatchInputError(
                f"argument {pos} is the parameter {name!r}, passed as a batched argument: each sample's slice of it "
                "would be read as data, without its gradient. Fix: pass the samples' indices as a batched argument "
                f"and index the parameter inside the loss ({name.rpartition('.')[2]}[idx]), or pass it with in_dims "
                "None to read it whole")


def refuse_closures_from_parameters(fn, params: dict[str, torch.Tensor]) -> None:
    """A tensor the loss function reads from its closure or globals, computed from the parameters outside it
    (``doubled = lin.weight * 2``, then ``lambda x: x @ doubled``): its gradient path runs outside the captured
    graph, which Dynamo cannot trace (a graph break, or under ``-W error`` a warning about ``.grad``). Named
    here, with the variable, before the capture. Only the function's own free and global names are read."""
    by_id = {id(p): n for n, p in params.items()}
    for name, value in names_read_from_outside(fn).items():
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            reached = _parameters_behind(value.grad_fn, by_id)
            if reached:
                raise CaptureError(
                    f"the loss function reads `{name}`, a tensor computed from the parameters "
                    f"({', '.join(sorted(reached)[:3])}) outside it: part of their gradient flows through it, "
                    "outside the captured graph, where per-sample gradients cannot follow. Fix: compute it inside "
                    "the loss function, or .detach() it where it is meant as a constant")


def names_read_from_outside(fn) -> dict[str, object]:
    """The values of the function's own free variables and of the globals it names (not those of the functions
    it calls)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    named = {n: c.cell_contents for n, c in zip(code.co_freevars, fn.__closure__ or (), strict=False) if _filled(c)}
    scope = getattr(fn, "__globals__", {})
    named.update((n, scope[n]) for n in code.co_names if n in scope)
    return named


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _parameters_behind(fn, by_id: dict[int, str]) -> set[str]:
    """The names of the parameters an autograd graph accumulates into."""
    found, seen, stack = set(), set(), [fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad
        if variable is not None and id(variable) in by_id:
            found.add(by_id[id(variable)])
        stack.extend(f for f, _ in node.next_functions)
    return found


def _checkpoint_method() -> tuple[type, str]:
    """Dynamo's variable for ``torch.utils.checkpoint.checkpoint`` and the name of its method that traces a call
    (``_call_function`` in the torch versions we support; ``call_function`` in older ones)."""
    from torch._dynamo.variables.higher_order_ops import CheckpointHigherOrderVariable as variable

    return variable, "_call_function" if "_call_function" in vars(variable) else "call_function"


def _reentrant_without_grad(args: list, kwargs: dict) -> bool:
    """Whether a ``checkpoint`` call Dynamo traces (``args``: the function and its arguments, as Dynamo's
    variables) is reentrant, with grad enabled, and none of its top-level tensor arguments requires grad, so that
    eager autograd's output carries no gradient (``CheckpointFunction`` is an ``autograd.Function`` of those
    arguments alone). ``use_reentrant`` omitted means True in the torch versions we support (with a warning)."""
    from torch._dynamo.variables import TensorVariable

    flag = kwargs.get("use_reentrant")
    reentrant = flag.as_python_constant() if flag is not None and flag.is_python_constant() else None
    if reentrant is False or not torch.is_grad_enabled():
        return False
    tensors = [a for a in args[1:] if isinstance(a, TensorVariable)]
    # a value with no example (none seen so far) counts as requiring grad: no mark, the capture's meaning
    return not any(getattr(a.as_proxy().node.meta.get("example_value"), "requires_grad", True) for a in tensors)


@contextlib.contextmanager
def reentrant_checkpoints_marked() -> Iterator[None]:
    """Mark the graph node of each checkpoint Dynamo traces that eager autograd would give no gradient
    (``_reentrant_without_grad``), for ``custom_backward_sites`` to refuse: Dynamo traces every checkpoint with
    the non-reentrant meaning (gradients reach the parameters inside)."""
    variable, name = _checkpoint_method()
    before = vars(variable)[name]

    def traced(self, tx, args, kwargs):
        marked = _reentrant_without_grad(args, kwargs)
        graph = tx.output.graph
        seen = set(graph.nodes)
        result = before(self, tx, args, kwargs)
        if marked:
            for node in graph.nodes:
                if node not in seen and node.op == "call_function" \
                        and node.target is torch.ops.higher_order.tag_activation_checkpoint:
                    node.meta[_REENTRANT_WITHOUT_GRAD] = True
        return result

    setattr(variable, name, traced)
    try:
        yield
    finally:
        setattr(variable, name, before)


patches.register(patches.Patch(
    "reentrant checkpoints marked",
    "torch._dynamo.variables.higher_order_ops.CheckpointHigherOrderVariable._call_function (call_function before)",
    "Dynamo traces checkpoint(use_reentrant=True) with the non-reentrant meaning; where no tensor argument "
    "requires grad, eager autograd gives the parameters inside no gradient: the node is marked and the capture "
    "refuses it", ("capture",), "the class attribute is process-wide; the wrapper only adds a mark to the node "
    "of a checkpoint whose eager meaning differs, for whichever thread traces it",
    "the original method restored on exit", enter=reentrant_checkpoints_marked,
    current=lambda: (vars(_checkpoint_method()[0])[_checkpoint_method()[1]],)))
