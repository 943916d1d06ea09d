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
        return _through_view(args[0], value, dim, batch, depth)
    if target in (ATEN.unsqueeze.default, ATEN.squeeze.dim, ATEN.select.int):
        k = args[1] % (value.dim() if target is ATEN.unsqueeze.default else value_of(args[0]).dim())
        if target is ATEN.unsqueeze.default:
            return None if dim == k else batch_layout(args[0], dim if dim < k else dim - 1, batch, depth + 1)
        return batch_layout(args[0], dim if dim < k else dim + 1, batch, depth + 1)
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


def _through_view(src_node, value, dim, batch, depth):
    """Follow a view: list the source's atomic factors (the batch dim as ``outer, B, inner``), regroup them into
    the target's dimensions (splitting a non-batch factor where a boundary falls inside it), and read the
    layout of the target dimension from its factors."""
    src = value_of(src_node)
    factors: list[tuple[int, bool]] = []
    for e, size in enumerate(src.shape):
        if e in batch.dims(src):
            below = batch_layout(src_node, e, batch, depth + 1)
            if below is None:
                return None
            factors += [(below[0], False), (_PROBE, True), (below[1], False)]
        else:
            factors.append((_concrete(size, batch.symbol), False))
    factors = [f for f in factors if f[0] != 1]
    dst = [_concrete(s, batch.symbol) for s in value.shape]
    pos = 0
    for j, need in enumerate(dst):
        taken: list[tuple[int, bool]] = []
        while need > 1:
            if pos >= len(factors):
                return None
            size, is_batch = factors[pos]
            if size <= need and need % size == 0:
                taken.append((size, is_batch))
                need //= size
                pos += 1
            elif not is_batch and size % need == 0:  # split a plain factor across two target dims
                taken.append((need, False))
                factors[pos] = (size // need, False)
                need = 1
            else:
                return None
        if j == dim:
            flags = [b for _, b in taken]
            if flags.count(True) != 1:
                return None
            k = flags.index(True)
            return (int(sympy.prod([f for f, _ in taken[:k]])), int(sympy.prod([f for f, _ in taken[k + 1:]])))
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
