"""The optimizer's foreach ops, one op per parameter.

A captured optimizer with ``foreach=True`` (torch's default on CUDA) updates every parameter in one ``_foreach_*``
op. Inductor lowers each to a combo kernel, which it does not fuse with the write of ``p.grad`` (``G * scale``):
the clipped sum and the noise are read twice, once per kernel. Per parameter, the write of ``p.grad`` and the
update are pointwise over the same elements, and Inductor fuses them into one kernel. The update capture unrolls
them too, before it checks that each parameter's update reads nothing of another's (``update_graph``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten

# the element op's overload for each foreach overload (``_foreach_add.List`` -> ``add.Tensor``)
_ELEMENT_OVERLOADS = {"default": ("default",), "List": ("Tensor", "default"), "Scalar": ("Scalar", "Tensor", "default"),
                      "ScalarList": ("Scalar", "Tensor", "default"), "Tensor": ("Tensor", "default"),
                      "ScalarAndTensor": ("Scalar",)}


def unroll_foreach(graph: fx.Graph) -> int:
    """Replace each functional ``_foreach_*`` op whose results are read by ``getitem`` with one element op per
    list entry; returns how many were replaced.

    Pre: the graph is functional. Post: the same values (element ``k`` of ``_foreach_op(xs, ys, s)`` is
    ``op(xs[k], ys[k], s)``; a scalar list gives its ``k``-th scalar); an op whose element form cannot be found,
    is kept; the graph lints."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if not node.target._schema.name.startswith("aten::_foreach_"):
            continue
        if not node.users or any(u.target is not operator.getitem for u in node.users):
            continue
        elements = _element_calls(node)
        if elements is None:
            continue
        with graph.inserting_before(node):
            new = [graph.call_function(op, args, kwargs) for op, args, kwargs, _ in elements]
        for element, (_, _, _, val) in zip(new, elements, strict=True):
            element.meta["val"] = val
        for user in list(node.users):
            user.replace_all_uses_with(new[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        count += 1
    if count:
        graph.eliminate_dead_code()  # entries no getitem read
        graph.lint()
    return count


def _element_calls(node: fx.Node) -> list[tuple] | None:
    """``(op, args, kwargs, fake value)`` per list entry, or None when no element op's schema takes the entries."""
    schema = node.target._schema
    base = getattr(aten, schema.name.split("::")[1][len("_foreach_"):], None)
    wanted = node.meta.get("val")
    if base is None or not isinstance(wanted, list | tuple):
        return None
    given = schema.arguments[:len(node.args)]
    for overload_name in _ELEMENT_OVERLOADS.get(node.target._overloadname, ()):
        op = getattr(base, overload_name, None)
        if op is None or not _takes_entries(op._schema, given, node.kwargs):
            continue
        lists = [isinstance(a.type, torch.ListType) for a in given]
        n_positional = sum(not a.kwarg_only for a in op._schema.arguments)
        calls = []
        for k, val in enumerate(wanted):
            entries = [a[k] if is_list else a for a, is_list in zip(node.args, lists, strict=True)]
            keywords = {a.name: e for a, e in zip(given[n_positional:], entries[n_positional:], strict=True)}
            calls.append((op, tuple(entries[:n_positional]), {**node.kwargs, **keywords}, val))
        return calls
    return None


def _takes_entries(element: torch.FunctionSchema, given: list, kwargs: dict) -> bool:
    """``element`` returns one tensor and takes, at each position of ``given``, one entry of a list argument
    (``Tensor[]`` -> ``Tensor``, ``Scalar[]`` -> ``Scalar``) or the same kind of value, and every keyword. A
    given argument past the element's positional ones must be its keyword of the same name (``value`` of
    ``addcmul``)."""
    positional = [a for a in element.arguments if not a.kwarg_only]
    by_name = {a.name: a for a in element.arguments}
    if len(element.returns) != 1 or not isinstance(element.returns[0].type, torch.TensorType):
        return False
    if any(k not in by_name for k in kwargs):
        return False
    extra = given[len(positional):]
    if any(a.name not in by_name or not by_name[a.name].kwarg_only for a in extra):
        return False
    for mine, theirs in zip(given, positional[:len(given)] + [by_name[a.name] for a in extra], strict=True):
        kind = mine.type.getElementType() if isinstance(mine.type, torch.ListType) else mine.type
        if _kind(kind) != _kind(theirs.type):
            return False
    required = [a for a in positional[len(given):] if not a.has_default_value()]
    return not required


def _kind(t) -> str:
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return "tensor" if isinstance(t, torch.TensorType) else "scalar" if isinstance(
        t, torch.NumberType | torch.FloatType | torch.IntType) else str(t)
