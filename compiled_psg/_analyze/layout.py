"""Where the batch sits inside a merged dimension.

A Linear on ``[B, T, i]`` flattens to ``[B*T, i]``; a sequence-first one flattens ``[T, B, i]`` to ``[T*B, i]``.
Both have the size ``T*B``: only the view chain that made the dimension tells the order. A merged dimension of
size ``outer*B*inner`` has *layout* ``(outer, inner)``: element ``k`` belongs to sample ``(k // inner) % B``.
``batch_layout`` walks back through views, transposes, slices, pointwise ops, reductions over other dimensions,
``cat`` and ``repeat`` along the batch (``r`` blocks of the samples: outer factor times ``r``) to find it;
``split_batch`` (run inside traced rule code) uses it to bring the batch to the front.
"""

from __future__ import annotations

import contextvars
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


#: While ``layout_stop`` runs: the nodes where the walk failed with no failure further back, deepest first.
_STOPS: contextvars.ContextVar[list | None] = contextvars.ContextVar("layout_stops", default=None)


def layout_stop(node: fx.Node, dim: int, batch: BatchDims) -> fx.Node | None:
    """Where ``batch_layout(node, dim)`` loses the layout: the node, furthest back from ``node``, whose own step
    has no rule (or whose rule declines), for a refusal to name; None when the layout is found."""
    token = _STOPS.set([])
    try:
        found = batch_layout(node, dim, batch)
        stops = _STOPS.get()
    finally:
        _STOPS.reset(token)
    return None if found is not None or not stops else stops[0]


def batch_layout(node: fx.Node, dim: int, batch: BatchDims, depth: int = 0) -> Layout | None:
    """The ``(outer, inner)`` layout of the batch inside dimension ``dim`` of ``node``, or None if unknown; a
    layout always covers the dimension (``outer * inner * B`` rows: a gather of fewer rows than its input has
    none)."""
    stops = _STOPS.get()
    if stops is None:
        return _batch_layout(node, dim, batch, depth)
    mark = len(stops)
    found = _batch_layout(node, dim, batch, depth)
    if found is not None:
        del stops[mark:]  # the failures of branches tried on the way were not the cause
    elif len(stops) == mark and node.target not in ops.SHAPE_ONLY and any(batch.dims(a) for a in node.all_input_nodes):
        stops.append(node)  # nothing further back failed: this step is where the layout is lost (a fill shaped
        # like the batch, x.new_zeros(n * t, d), reads no rows: the step that reads it is where)
    return found


def _batch_layout(node: fx.Node, dim: int, batch: BatchDims, depth: int) -> Layout | None:
    value = value_of(node)
    if not isinstance(value, torch.Tensor) or depth > 64:
        return None
    dim = dim % value.dim()
    if batch.is_whole(value, dim):
        return (1, 1)
    factor = batch.factor(value.shape[dim])
    if factor is None:
        return None
    found = _layout(node, value, dim, batch, depth)
    return found if found is not None and found[0] * found[1] == factor else None


def _layout(node: fx.Node, value: torch.Tensor, dim: int, batch: BatchDims, depth: int) -> Layout | None:
    target = node.target
    args = node.args
    if target in ops.VIEWS:
        return _through_view(args[0], value, dim, batch, depth)
    if target is ATEN.cat.default:
        return _through_cat(node, value, dim, batch, depth)
    if target is ATEN.stack.default:  # unbind's backward: the parts hold the samples alike
        return _through_stack(node, value, dim, batch, depth)
    if target is ATEN.repeat.default:  # x.repeat(r, ...) along the batch: r blocks of samples, as cat([x] * r)
        repeats = args[1]
        src_dim = dim - (len(repeats) - value_of(args[0]).dim())
        if not batch.dims(args[0]):  # a shared value tiled n times: one copy per sample
            return shared_tiled(args[0], src_dim, repeats[dim], batch)
        below = None if src_dim < 0 else batch_layout(args[0], src_dim, batch, depth + 1)
        return None if below is None or not isinstance(repeats[dim], int) else (below[0] * repeats[dim], below[1])
    if target in (ATEN.unsqueeze.default, ATEN.squeeze.dim, ATEN.select.int):
        k = args[1] % (value.dim() if target is ATEN.unsqueeze.default else value_of(args[0]).dim())
        if target is ATEN.unsqueeze.default:
            return None if dim == k else batch_layout(args[0], dim if dim < k else dim - 1, batch, depth + 1)
        return batch_layout(args[0], dim if dim < k else dim + 1, batch, depth + 1)
    if target is ATEN.slice.Tensor:  # along another dimension every sample stays where it was
        k = (args[1] if len(args) > 1 else 0) % value.dim()
        below = batch_layout(args[0], dim, batch, depth + 1)
        if k != dim or below is None:
            return below
        start, step = (args[2] if len(args) > 2 else 0), (args[4] if len(args) > 4 else 1)
        return sliced_layout(below, value_of(args[0]).shape[dim], value.shape[dim], start, step, batch)
    if target is ATEN.slice_backward.default:  # zeros shaped input_sizes, the slice's gradient at its blocks
        g, sizes, k, start, _end, step = args[:6]
        if k % value.dim() != dim:
            return batch_layout(g, dim, batch, depth + 1)
        below = batch_layout(g, dim, batch, depth + 1)
        whole = batch.factor(value.shape[dim])
        if below is None or whole is None or whole % below[1]:
            return None
        layout = (whole // below[1], below[1])
        return layout if sliced_layout(layout, value.shape[dim], value_of(g).shape[dim], start, step,
                                       batch) == below else None
    if target in KEEP_LEADING:  # pooling, padding, upsampling: the leading dims stay as they are
        if dim >= value_of(args[0]).dim() - KEEP_LEADING[target]:
            return None
        return batch_layout(args[0], dim, batch, depth + 1)
    if target in ops.CONVOLUTIONS or target in ops.BATCH_FIRST:  # rows of dim 0 apart, the other dims mixed
        return batch_layout(args[0], 0, batch, depth + 1) if dim == 0 else None
    if target in SAME_DIMS:  # the other dims stay where they are
        kw = _normalized(node)
        rank = value_of(args[0]).dim()
        over = SAME_DIMS[target]
        moved = {d % rank for d in (over if isinstance(over, tuple) else _listed(kw.get(over) if kw else None))}
        if kw is None or dim in moved or dim >= rank or (target is ATEN.roll.default and not moved):
            return None  # a roll without dims rolls the flattened tensor
        return batch_layout(args[0], dim, batch, depth + 1)
    if target in SCATTERS:  # writes along dim k of x from a source shaped like x: the other dims stay
        kw = _normalized(node)
        if kw is None or dim == kw["dim"] % value.dim():
            return None
        found = batch_layout(args[0], dim, batch, depth + 1)
        source = kw.get("source", kw.get("src"))
        if found is None and isinstance(source, fx.Node) and value_of(source).dim() == value.dim():
            found = batch_layout(source, dim, batch, depth + 1)  # into zeros (index_select's backward)
        return found
    if target in (ATEN.view_as_real.default, ATEN.view_as_complex.default):  # the (real, imag) pair is last
        last = value.dim() - 1 if target is ATEN.view_as_real.default else value.dim()
        return batch_layout(args[0], dim, batch, depth + 1) if dim < last else None
    if target is ATEN.unfold_backward.default:  # (grad [.., windows, ..., size], input_sizes, dim, size, step)
        return None if dim == args[2] % value.dim() else batch_layout(args[0], dim, batch, depth + 1)
    if target is ATEN.diagonal_backward.default:  # (grad [kept dims..., diagonal], input_sizes, offset, d1, d2)
        taken = {args[3] % value.dim(), args[4] % value.dim()}
        kept = [d for d in range(value.dim()) if d not in taken]
        return batch_layout(args[0], kept.index(dim), batch, depth + 1) if dim in kept else None
    if target in (ATEN.diagonal.default, ATEN.diagonal_copy.default):  # the other dims in order, the diagonal last
        kw = _normalized(node)
        rank = value_of(args[0]).dim()
        taken = {kw.get("dim1", 0) % rank, kw.get("dim2", 1) % rank} if kw is not None else set(range(rank))
        kept = [d for d in range(rank) if d not in taken]
        return batch_layout(args[0], kept[dim], batch, depth + 1) if dim < len(kept) else None
    if target is ATEN.constant_pad_nd.default:  # a dimension padded by nothing stays as it is
        pads = list(args[1])
        j = value.dim() - 1 - dim
        return batch_layout(args[0], dim, batch, depth + 1) if pads[2 * j: 2 * j + 2] in ([], [0, 0]) else None
    if target is ATEN.embedding.default:  # embedding(weight, indices): a row of the table per index
        indices = args[1]
        return batch_layout(indices, dim, batch, depth + 1) if dim < value_of(indices).dim() else None
    if target in (ATEN.index.Tensor, ATEN._unsafe_index.Tensor):
        return _through_shared_index(args[0], list(args[1]), dim, batch, depth)
    if target in (ATEN.index_put.default, ATEN._unsafe_index_put.default):  # x[indices] = values
        return _shared_index_put(node, dim, batch, depth)
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
    if target is operator.getitem and getattr(args[0], "target", None) in _PARTS:  # q, k, v = qkv.unbind(0)
        return _through_part(args[0], dim, batch, depth)
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


# op -> number of trailing dims it mixes: the dims before them are the input's, in order, with the same samples.
# Pooling, padding and upsampling mix their spatial dims (ops.SPATIAL, channels too for ops.MIXES_CHANNELS);
# their backwards read the gradient first.
KEEP_LEADING: dict = {}
for _op, _k in [*ops.SPATIAL.items(), *ops.SPATIAL_BACKWARDS.items()]:
    KEEP_LEADING[_op] = _k + (_op in ops.MIXES_CHANNELS)

# op -> the dims it moves values along (an argument's name, or the dims): every other dim of the output is the
# input's dim (FFTs, rot90, channel_shuffle, flip, roll, index_select, gather, unfold's windows).
SAME_DIMS: dict = dict(ops.OVER_DIMS)
for _names, _over in [(("flip", "roll"), "dims"), (("index_select", "gather"), "dim"),
                      (("unfold", "unfold_copy"), "dimension")]:
    for _op in ops._overloads(*_names):
        SAME_DIMS[_op] = _over


SCATTERS = ops._overloads("scatter.src", "scatter.value", "scatter_add", "scatter_reduce.two", "index_add",
                          "index_copy", "index_fill.int_Scalar", "index_fill.int_Tensor")


def _normalized(node) -> dict | None:
    pair = normalize_function(node.target, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True)
    return None if pair is None else pair.kwargs


def _listed(dims) -> list:
    return [] if dims is None else list(dims) if isinstance(dims, (list, tuple)) else [dims]


def uniform(node) -> bool:
    """A value filled with one constant (``torch.zeros_like(h)``, ``torch.full((n * t,), 0)``): every layout
    describes it, so it pairs with per-sample values of any layout (a loss's target of zeros)."""
    target = getattr(node, "target", None)
    return target in ops.FACTORIES and torch.Tag.nondeterministic_seeded not in target.tags and \
        target.overloadpacket.__name__ not in ("empty", "empty_like", "empty_strided", "new_empty",
                                               "new_empty_strided", "empty_permuted")


def shared_tiled(src: fx.Node, src_dim: int, times, batch: BatchDims) -> Layout | None:
    """``w.repeat(k * n)`` of a shared ``w`` of ``size`` entries along ``src_dim``: element ``j`` is
    ``w[j % size]``, so each sample owns ``k * size`` consecutive rows holding the same values (layout
    ``(1, k * size)``). In any other layout the samples read different entries of ``w`` (``w.repeat(n)`` beside
    step-major rows). None when the count is not a multiple of ``n``, or when every layout fits (``tiled_uniform``):
    a layout found here must be the one mixing.py proved."""
    times = value_of(times)
    k = batch.factor(times) if isinstance(times, torch.SymInt) else None
    size = value_of(src).shape[src_dim] if src_dim >= 0 else 1
    return None if k is None or not isinstance(size, int) or tiled_uniform(src, src_dim) else (1, k * size)


def tiled_uniform(src: fx.Node, src_dim: int) -> bool:
    """Copies of a constant fill, or of a dim of size 1 (``w.repeat(n, 1)`` of ``w`` ``[c]``), are the same in
    every layout."""
    return src_dim < 0 or value_of(src).shape[src_dim] == 1 or uniform(src)


def sliced_layout(layout: Layout, in_size, out_size, start, step, batch: BatchDims) -> Layout | None:
    """The layout of a slice along a dimension of ``in_size = outer*B*inner`` rows holding the samples with
    ``layout``, the slice ``out_size`` rows long from ``start`` with ``step``: the input's layout when it keeps
    every row (``h[-n:]``; ``h[:1000]`` under Dynamo's guard ``n <= 1000``), ``(k, inner)`` when it keeps ``k``
    whole blocks of the samples (``torch.cat([a, b, c])[n:2 * n]``); None when it cuts into a block (some samples
    only, or samples shifted against the others: ``h[1:]``)."""
    outer, inner = layout
    if step != 1:
        return None
    if same_size(out_size, in_size):
        return layout
    unit = batch.symbol * inner
    first, count = _in_blocks(value_of(start) if start is not None else 0, unit), _in_blocks(out_size, unit)
    if first is None or count is None:
        return None
    first += outer if first < 0 else 0  # h[-n:] starts n rows before the end
    return (count, inner) if count >= 1 and 0 <= first and first + count <= outer else None


def at_batch_of_one(value, batch: BatchDims) -> int | None:
    """A size or slice bound as a batch of one reads it (``n - 1`` is 0): an int, None for a bound left out, or
    None where it is neither an int nor a size of the batch alone (read with ``bound_at_one`` below)."""
    value = value_of(value) if isinstance(value, fx.Node) else value
    if isinstance(value, torch.SymInt):
        expr = value.node.expr.subs(batch.symbol, 1)
        return int(expr) if expr.is_Integer else None
    return value if type(value) is int else None


def slice_at_batch_of_one(size, start, end, step, batch: BatchDims) -> tuple[int, int | None, int | None, int] | None:
    """``(size, start, end, step)`` of a slice along the batch dimension, as a batch of one reads them; None when
    one of them is not a size of the batch alone."""
    given = (size, start, end, step)
    read = tuple(at_batch_of_one(v, batch) for v in given)
    return None if any(v is None and g is not None for g, v in zip(given, read, strict=True)) else read


def _in_blocks(size, unit) -> int | None:
    """``size / unit`` when it is a whole number for every batch size (``2*n`` in blocks of ``n``), else None."""
    expr = size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size) if isinstance(size, int) else None
    ratio = None if expr is None else sympy.simplify(expr / unit)
    return int(ratio) if ratio is not None and ratio.is_Integer else None


def same_size(a, b) -> bool:
    """Sizes equal for every batch size (integers, or symbolic expressions whose difference simplifies to 0),
    decided on the expressions: no guard is added."""
    ea = a.node.expr if isinstance(a, torch.SymInt) else sympy.Integer(a)
    eb = b.node.expr if isinstance(b, torch.SymInt) else sympy.Integer(b)
    return sympy.simplify(ea - eb) == 0


def _read_dims(x, indices, batch) -> tuple[dict[int, int], int] | None:
    """For ``x[indices]`` with shared integer index tensors: where each dim of ``x`` that is not indexed lands in
    the result (advanced indexing's rule), and the result's rank. None when an index holds the batch or a mask."""
    rank = value_of(x).dim()
    indices = list(indices) + [None] * (rank - len(indices))
    positions = [p for p, i in enumerate(indices) if i is not None]
    values = [value_of(indices[p]) for p in positions]
    if not positions or any(batch.dims(v) or v.dtype == torch.bool for v in values):
        return None
    s_rank = max(v.dim() for v in values)
    rest = [d for d in range(rank) if d not in positions]
    if positions == list(range(positions[0], positions[-1] + 1)):  # the index dims replace the indexed ones
        lands = {d: i if d < positions[0] else i + s_rank for i, d in enumerate(rest)}
    else:  # the index dims go first
        lands = {d: s_rank + i for i, d in enumerate(rest)}
    return lands, len(rest) + s_rank


def _through_shared_index(x, indices, dim, batch, depth):
    """``x[indices]`` with shared indices on other dims (``F.interpolate`` gathers rows and columns so): the
    dims not indexed keep their samples."""
    found = _read_dims(x, indices, batch)
    src = [d for d, out in found[0].items() if out == dim] if found is not None else []
    return batch_layout(x, src[0], batch, depth + 1) if src else None


def _shared_index_put(node, dim, batch, depth):
    """``x[indices] = values`` with shared indices on other dims: the samples sit where ``x`` holds them, or, in a
    value with no layout of its own (zeros: ``F.interpolate``'s backward), where ``values`` holds them, read at
    ``x[indices]``."""
    x, indices, values = node.args[:3]
    found = _read_dims(x, indices, batch)
    if found is None or dim not in found[0]:
        return None
    below = batch_layout(x, dim, batch, depth + 1)
    if below is not None:
        return below
    lands, read_rank = found
    src = lands[dim] - (read_rank - value_of(values).dim())
    return batch_layout(values, src, batch, depth + 1) if src >= 0 else None


def _through_cat(node, value, dim, batch, depth):
    """Along another dim the parts hold the samples alike; along the batch dim they are blocks of samples."""
    parts = [p for p in node.args[0] if tuple(value_of(p).shape) != (0,)]  # cat skips legacy empty 1-D parts
    k = (node.args[1] if len(node.args) > 1 else 0) % value.dim()
    if dim != k:  # a constant fill beside the others holds any layout (zeros in a split's backward)
        parts = [p for p in parts if not uniform(p)] or parts
    layouts = [batch_layout(p, dim, batch, depth + 1) for p in parts]
    if None in layouts:
        return None
    if dim != k:
        return layouts[0] if len(set(layouts)) == 1 else None
    if len({inner for _, inner in layouts}) != 1:
        return None
    return (sum(outer for outer, _ in layouts), layouts[0][1])


#: ops that cut a tensor into parts along ``dim`` (``unbind`` drops it): each part holds the other dims as they were
_PARTS = ops._overloads("unbind.int", "split.Tensor", "split_with_sizes", "unsafe_split.Tensor",
                        "unsafe_split_with_sizes", "chunk", "unbind_copy.int", "split_copy.Tensor",
                        "split_with_sizes_copy")


def _through_part(node, dim, batch, depth):
    """A part of ``unbind``/``split``/``chunk`` of ``x`` along ``k``: dim ``d`` is ``x``'s dim ``d`` (``d + 1`` from
    ``k`` on, for ``unbind``); a part of the batch dimension itself holds some samples only."""
    kw = _normalized(node)
    if kw is None:
        return None
    rank = value_of(node.args[0]).dim()
    k = kw.get("dim", 0) % rank
    if node.target.overloadpacket.__name__.startswith("unbind"):
        return batch_layout(node.args[0], dim + (dim >= k), batch, depth + 1)
    return None if dim == k else batch_layout(node.args[0], dim, batch, depth + 1)


def _through_stack(node, value, dim, batch, depth):
    """``stack(parts, k)``: output dim ``d`` is dim ``d - (d > k)`` of every part; the new dim ``k`` holds none."""
    k = (node.args[1] if len(node.args) > 1 else 0) % value.dim()
    if dim == k:
        return None
    parts = [p for p in node.args[0] if not uniform(p)] or list(node.args[0])
    layouts = {batch_layout(p, dim - (dim > k), batch, depth + 1) for p in parts}
    return layouts.pop() if len(layouts) == 1 else None


def _through_reduction(node, dim, batch, depth):
    """A reduction over other dimensions keeps every element of the batch dimension where it was (the cosine of
    each row of ``[B*T, d]``, summed over ``d``)."""
    dim_name, keep_name = ops.REDUCTIONS[node.target]
    src = node.args[0]
    rank = value_of(src).dim()
    kw = _normalized(node)
    if dim_name is None or kw is None:
        return None
    reduced = {d % rank for d in _listed(kw.get(dim_name))} or set(range(rank))
    kept = list(range(rank)) if kw.get(keep_name) else [d for d in range(rank) if d not in reduced]
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
