"""Where the batch sits inside a merged dimension.

A Linear on ``[B, T, i]`` flattens to ``[B*T, i]``; a sequence-first one flattens ``[T, B, i]`` to ``[T*B, i]``.
Both have the size ``T*B``: only the view chain that made the dimension tells the order. A merged dimension of
size ``outer*B*inner`` has *layout* ``(outer, inner)``: element ``k`` belongs to sample ``(k // inner) % B``.
``batch_layout`` walks back through views, transposes, slices, pointwise ops, reductions over other dimensions,
``cat`` and ``repeat`` along the batch (``r`` blocks of the samples: outer factor times ``r``) to find it;
``split_batch`` (run inside traced rule code) uses it to bring the batch to the front.
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

from . import ops
from .batch_dims import BatchDims, value_of

ATEN = torch.ops.aten
Layout = tuple[int, int]

_PROBE = 10007  # a stand-in batch size for grouping view dimensions; prime so no product collides with it


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
    if target in ops.VIEWS:
        return _through_view(args[0], value, dim, batch, depth)
    if target is ATEN.cat.default:
        return _through_cat(node, value, dim, batch, depth)
    if target is ATEN.repeat.default:  # x.repeat(r, ...) along the batch: r blocks of samples, as cat([x] * r)
        repeats = args[1]
        src_dim = dim - (len(repeats) - value_of(args[0]).dim())
        below = None if src_dim < 0 else batch_layout(args[0], src_dim, batch, depth + 1)
        return None if below is None or not isinstance(repeats[dim], int) else (below[0] * repeats[dim], below[1])
    if target in (ATEN.unsqueeze.default, ATEN.squeeze.dim, ATEN.select.int):
        k = args[1] % (value.dim() if target is ATEN.unsqueeze.default else value_of(args[0]).dim())
        if target is ATEN.unsqueeze.default:
            return None if dim == k else batch_layout(args[0], dim if dim < k else dim - 1, batch, depth + 1)
        return batch_layout(args[0], dim if dim < k else dim + 1, batch, depth + 1)
    if target is ATEN.slice.Tensor:  # along another dimension, or whole: every sample stays where it was
        k = (args[1] if len(args) > 1 else 0) % value.dim()
        return batch_layout(args[0], dim, batch, depth + 1) if k != dim or same_size(
            value.shape[dim], value_of(args[0]).shape[dim]) else None
    if target is ATEN.t.default:
        return batch_layout(args[0], 1 - dim if value.dim() == 2 else dim, batch, depth + 1)
    if target is ATEN.transpose.int:
        d0, d1 = (d % value.dim() for d in args[1:3])
        src_dim = d1 if dim == d0 else d0 if dim == d1 else dim
        return batch_layout(args[0], src_dim, batch, depth + 1)
    if target is ATEN.permute.default:
        return batch_layout(args[0], args[1][dim] % value.dim(), batch, depth + 1)
    if target in ops.REDUCTIONS:
        return _through_reduction(node, dim, batch, depth)
    if target is operator.getitem and getattr(args[0], "target", None) in ops.REDUCTIONS:  # max.dim's values
        return _through_reduction(args[0], dim, batch, depth)
    if target in (ATEN.mm.default, ATEN.addmm.default):
        a, b = args[-2:]
        return batch_layout(a, 0, batch, depth + 1) if dim == 0 else batch_layout(b, 1, batch, depth + 1)
    if target in (ATEN.bmm.default, ATEN.baddbmm.default):  # baddbmm(input, a, b): as a @ b (input broadcasts)
        a, b = args if target is ATEN.bmm.default else args[1:3]
        if dim == 0:
            return batch_layout(a, 0, batch, depth + 1)
        return batch_layout(a, 1, batch, depth + 1) if dim == 1 else batch_layout(b, 2, batch, depth + 1)
    if (target is operator.getitem or target in ops.IDENTITY or ops.is_pointwise(target) or target in ops.ALONG_DIM
            or target is ATEN.expand.default):
        return _through_elementwise(node, value, dim, batch, depth)
    return None


def same_size(a, b) -> bool:
    """Sizes equal for every batch size (integers, or symbolic expressions whose difference simplifies to 0),
    decided on the expressions: no guard is added."""
    ea = a.node.expr if isinstance(a, torch.SymInt) else sympy.Integer(a)
    eb = b.node.expr if isinstance(b, torch.SymInt) else sympy.Integer(b)
    return sympy.simplify(ea - eb) == 0


def _through_cat(node, value, dim, batch, depth):
    """Along another dim the parts hold the samples alike; along the batch dim they are blocks of samples."""
    parts = [p for p in node.args[0] if tuple(value_of(p).shape) != (0,)]  # cat skips legacy empty 1-D parts
    k = (node.args[1] if len(node.args) > 1 else 0) % value.dim()
    layouts = [batch_layout(p, dim, batch, depth + 1) for p in parts]
    if None in layouts:
        return None
    if dim != k:
        return layouts[0] if len(set(layouts)) == 1 else None
    if len({inner for _, inner in layouts}) != 1:
        return None
    return (sum(outer for outer, _ in layouts), layouts[0][1])


def _through_reduction(node, dim, batch, depth):
    """A reduction over other dimensions keeps every element of the batch dimension where it was (the cosine of
    each row of ``[B*T, d]``, summed over ``d``)."""
    dim_name, keep_name = ops.REDUCTIONS[node.target]
    src = node.args[0]
    rank = value_of(src).dim()
    pair = normalize_function(node.target, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True)
    if dim_name is None or pair is None:
        return None
    dims = pair.kwargs.get(dim_name)
    reduced = set(range(rank)) if dims is None or dims == [] else {
        d % rank for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    kept = list(range(rank)) if pair.kwargs.get(keep_name) else [d for d in range(rank) if d not in reduced]
    if dim >= len(kept) or kept[dim] in reduced:
        return None
    return batch_layout(src, kept[dim], batch, depth + 1)


def _through_view(src_node, value, dim, batch, depth):
    src = value_of(src_node)
    src_dims = batch.dims(src)
    if len(src_dims) != 1:
        return None
    below = batch_layout(src_node, src_dims[0], batch, depth + 1)
    if below is None:
        return None
    found = view_layout(src.shape, src_dims[0], below, value.shape, batch.symbol)
    return found[1] if found is not None and found[0] == dim else None


def view_layout(src_shape, src_dim: int, layout: Layout, dst_shape, symbol) -> tuple[int, Layout] | None:
    """Where the batch goes through a reshape: ``(dst_dim, layout)``, or None when the samples do not stay whole.

    List the source's atomic factors (the batch dimension as ``outer, B, inner``), regroup them into the target's
    dimensions (splitting a plain factor where a boundary falls inside it), and read the layout of the target
    dimension that receives the batch factor. A reshape that cuts the batch factor (``x.view(2, B // 2, F)``) or
    interleaves it with other factors in a way no layout describes (``x.t().flatten().view(B, -1)``) gives None.
    """
    factors: list[tuple[int, bool]] = []
    for e, size in enumerate(src_shape):
        if e == src_dim:
            factors += [(layout[0], False), (_PROBE, True), (layout[1], False)]
        else:
            if isinstance(size, torch.SymInt) and size.node.expr.free_symbols:
                return None
            factors.append((int(size), False))
    factors = [f for f in factors if f[0] != 1]
    dst = []
    for s in dst_shape:
        if isinstance(s, torch.SymInt):
            expr = s.node.expr
            if expr.free_symbols - {symbol}:
                return None
            ratio = sympy.simplify(expr / symbol)
            if ratio.free_symbols or not ratio.is_integer:
                if expr.free_symbols:
                    return None
                dst.append(int(expr))
                continue
            dst.append(int(ratio) * _PROBE)
        else:
            dst.append(int(s))
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
        flags = [b for _, b in taken]
        if True in flags:
            if flags.count(True) != 1:
                return None
            k = flags.index(True)
            return j, (int(sympy.prod([f for f, _ in taken[:k]])), int(sympy.prod([f for f, _ in taken[k + 1:]])))
    return None


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
    """Runs inside traced rules: multiply every element of sample ``b`` by ``weights[b]``; a sample of weight 0
    becomes exactly 0, even where its values are not finite (a clip factor of 0 drops a sample whose gradient is
    not finite: ``reductions.clip_factor``)."""
    outer, inner = layout
    shape = list(t.shape)
    nbatch = shape[dim] // (outer * inner)
    view = shape[:dim] + [outer, nbatch, inner] + shape[dim + 1:]
    w_shape = [1] * len(view)
    w_shape[dim + 1] = nbatch
    w = weights.reshape(w_shape).to(t.dtype)
    return torch.where(w != 0, t.reshape(view) * w, torch.zeros((), dtype=t.dtype, device=t.device)).reshape(shape)


def weighted_batch_sum(weights: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``sum_n weights[n] g[n]``, where a sample of weight 0 adds exactly 0 even if its values are not finite
    (``0 * inf`` is NaN). One pass over ``g``: Inductor fuses the select into the sum over the batch."""
    w = weights.to(g.dtype).reshape([-1] + [1] * (g.dim() - 1))
    return torch.where(w != 0, g * w, torch.zeros((), dtype=g.dtype, device=g.device)).sum(0)
