"""Where the batch sits inside a merged dimension.

A Linear on ``[B, T, i]`` flattens to ``[B*T, i]``; a sequence-first one flattens ``[T, B, i]`` to ``[T*B, i]``.
Both have the size ``T*B``: only the view chain that made the dimension tells the order. A merged dimension of
size ``outer*B*inner`` has *layout* ``(outer, inner)``: element ``k`` belongs to sample ``(k // inner) % B``.
``batch_layout`` walks back through views, transposes and pointwise ops to find it; ``split_batch`` (run inside
traced rule code) uses it to bring the batch to the front.
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from .batch_dims import BatchDims, value_of

ATEN = torch.ops.aten
Layout = tuple[int, int]

_VIEWS = {ATEN.view.default, ATEN._unsafe_view.default, ATEN.reshape.default}
_SAME_SHAPE = {ATEN.clone.default, ATEN.alias.default, ATEN.detach.default, ATEN._to_copy.default,
               ATEN.contiguous.default}
_PROBE = 10007  # a stand-in batch size for grouping view dimensions; prime so no product collides with it


def _concrete(size, symbol) -> int:
    if isinstance(size, torch.SymInt):
        return int(size.node.expr.subs(symbol, _PROBE))
    return int(size)


def view_groups(src: list[int], dst: list[int]) -> list[tuple[list[int], list[int]]]:
    """Group the dimensions of a view: each source group has the same element count as its target group."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj, ps, pd = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd:
                if i >= len(src):
                    return []
                gi.append(i)
                ps *= src[i]
                i += 1
            else:
                if j >= len(dst):
                    return []
                gj.append(j)
                pd *= dst[j]
                j += 1
        groups.append((gi, gj))
    if groups:  # trailing size-1 dimensions join the last group
        groups[-1][0].extend(range(i, len(src)))
        groups[-1][1].extend(range(j, len(dst)))
    return groups


def batch_layout(node: fx.Node, dim: int, batch: BatchDims, depth: int = 0) -> Layout | None:
    """The ``(outer, inner)`` layout of the batch inside dimension ``dim`` of ``node``, or None if unknown."""
    value = value_of(node)
    if not isinstance(value, torch.Tensor) or depth > 64:
        return None
    dim = dim % value.dim()
    if batch.is_whole(value, dim):
        return (1, 1)
    if batch.factor(value.shape[dim]) is None:
        return None
    target = node.target
    args = node.args
    if target in _VIEWS:
        src = value_of(args[0])
        src_sizes = [_concrete(s, batch.symbol) for s in src.shape]
        dst_sizes = [_concrete(s, batch.symbol) for s in value.shape]
        for gi, gj in view_groups(src_sizes, dst_sizes):
            if dim not in gj:
                continue
            if len([d for d in gj if dst_sizes[d] != 1]) > 1:
                return None  # the merged dimension was split again: no single layout
            batched = [d for d in gi if d in batch.dims(src)]
            if len(batched) != 1:
                return None
            e = batched[0]
            below = batch_layout(args[0], e, batch, depth + 1)
            if below is None:
                return None
            before = [src_sizes[d] for d in gi if d < e]
            after = [src_sizes[d] for d in gi if d > e]
            outer = int(sympy.prod(before)) * below[0]
            inner = below[1] * int(sympy.prod(after))
            return (outer, inner)
        return None
    if target is ATEN.t.default:
        return batch_layout(args[0], 1 - dim if value.dim() == 2 else dim, batch, depth + 1)
    if target is ATEN.transpose.int:
        d0, d1 = (d % value.dim() for d in args[1:3])
        src_dim = d1 if dim == d0 else d0 if dim == d1 else dim
        return batch_layout(args[0], src_dim, batch, depth + 1)
    if target is ATEN.permute.default:
        return batch_layout(args[0], args[1][dim] % value.dim(), batch, depth + 1)
    if target in (ATEN.mm.default, ATEN.addmm.default):
        a, b = args[-2:]
        return batch_layout(a, 0, batch, depth + 1) if dim == 0 else batch_layout(b, 1, batch, depth + 1)
    if target is ATEN.bmm.default:
        a, b = args
        if dim == 0:
            return batch_layout(a, 0, batch, depth + 1)
        return batch_layout(a, 1, batch, depth + 1) if dim == 1 else batch_layout(b, 2, batch, depth + 1)
    if target is operator.getitem or target in _SAME_SHAPE or _is_pointwise(target) or target in _ELEMENTWISE:
        return _through_elementwise(node, value, dim, batch, depth)
    return None


# Ops whose output dims line up with their (broadcast) tensor inputs, beyond those tagged pointwise.
_ELEMENTWISE = {
    ATEN.threshold_backward.default, ATEN.gelu_backward.default, ATEN.tanh_backward.default,
    ATEN.sigmoid_backward.default, ATEN.native_dropout_backward.default, ATEN.silu_backward.default,
    ATEN.expand.default, ATEN._log_softmax_backward_data.default, ATEN._softmax_backward_data.default,
    ATEN._log_softmax.default, ATEN._softmax.default, ATEN.native_dropout.default,
}


def _is_pointwise(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def _through_elementwise(node, value, dim, batch, depth):
    if node.target is operator.getitem:
        src = node.args[0]
        src_vals = value_of(src)
        if not isinstance(src_vals, (tuple, list)):
            return None
        # a multi-output op: follow its first batched tensor input with the same rank
        candidates = [a for a in src.all_input_nodes if isinstance(value_of(a), torch.Tensor)]
    else:
        candidates = [a for a in node.all_input_nodes if isinstance(value_of(a), torch.Tensor)]
    for a in candidates:
        av = value_of(a)
        offset = value.dim() - av.dim()
        src_dim = dim - offset
        if src_dim < 0 or src_dim >= av.dim():
            continue
        if batch.factor(av.shape[src_dim]) == batch.factor(value.shape[dim]):
            found = batch_layout(a, src_dim, batch, depth + 1)
            if found is not None:
                return found
    return None


def split_batch(t: torch.Tensor, dim: int, layout: Layout) -> torch.Tensor:
    """Runs inside traced rules: ``[..., outer*B*inner at dim, ...]`` -> ``[B, ..., outer*inner at dim, ...]``."""
    outer, inner = layout
    shape = list(t.shape)
    merged = shape[dim]
    nbatch = merged // (outer * inner)
    if outer == 1 and inner == 1:
        return t.movedim(dim, 0).unsqueeze(dim + 1) if dim else t.unsqueeze(1)
    t = t.reshape(shape[:dim] + [outer, nbatch, inner] + shape[dim + 1:])
    t = t.movedim(dim + 1, 0)
    return t.reshape([nbatch] + shape[:dim] + [outer * inner] + shape[dim + 1:])


def scale_batch(t: torch.Tensor, weights: torch.Tensor, dim: int, layout: Layout) -> torch.Tensor:
    """Runs inside traced rules: multiply every element of sample ``b`` by ``weights[b]``."""
    outer, inner = layout
    shape = list(t.shape)
    nbatch = shape[dim] // (outer * inner)
    view = shape[:dim] + [outer, nbatch, inner] + shape[dim + 1:]
    w_shape = [1] * len(view)
    w_shape[dim + 1] = nbatch
    return (t.reshape(view) * weights.reshape(w_shape).to(t.dtype)).reshape(shape)
