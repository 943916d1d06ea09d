"""Batching rules for the ops *after* a contraction: the per-sample value gains a leading batch dimension.

A parameter gradient rarely ends at its contraction: ``t`` and ``view`` shape it, ``add`` sums the uses of a
tied weight, ``_weight_norm_interface_backward`` maps it back to a parametrization's leaves; in a loss head,
``div`` and ``mul`` follow the batch sum. A lift rule receives the node and which of its graph arguments are
per-sample (``[n, *shape]``) rather than shared, and returns tensor code computing the per-sample output, or
None to decline. Each rule registers with ``@lift_rule(op, linear=...)``: through ops linear in their per-sample
arguments, a weighted sum over samples can be taken before the op (the book-keeping form of ``clip_sum``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from ..._analyze.batch_dims import value_of
from ..._errors import InternalError
from ..registry import is_linear, lift_rule, linear_op, tag_lift_rule

ATEN = torch.ops.aten
LiftFn = Callable[..., torch.Tensor]


def _logical_rank(node: fx.Node) -> int:
    return value_of(node).dim()


def _call(node: fx.Node, values, transform_args=None):
    """Call ``node.target`` with its graph arguments replaced by ``values`` (in order)."""
    it = iter(values)
    args = fx.map_arg(node.args, lambda _: next(it))
    kwargs = fx.map_arg(node.kwargs, lambda _: next(it))
    if transform_args is not None:
        args = transform_args(args)
    return node.target(*args, **kwargs)


@tag_lift_rule(torch.Tag.pointwise)
def pointwise(node: fx.Node, lifted: list[bool]) -> LiftFn | None:
    """Any op tagged pointwise: align per-sample arguments as ``[n, 1, ..., *shape]`` and broadcast.

    Before::  add_3 = aten.add(mm_1, mm_2)           # [o, i] + [o, i]
    After::   ps = aten.add(ps_1, ps_2)              # [n, o, i]
    """
    rank = _logical_rank(node)
    ranks = [value_of(a).dim() if isinstance(value_of(a), torch.Tensor) else 0 for a in flat_nodes(node)]

    def run(*values):
        aligned = []
        for v, is_ps, r in zip(values, lifted, ranks, strict=True):
            if is_ps:
                v = v.reshape([v.shape[0]] + [1] * (rank - r) + list(v.shape[1:]))
            aligned.append(v)
        return _call(node, aligned)

    return run


def flat_nodes(node: fx.Node) -> list[fx.Node]:
    """The graph arguments of ``node`` in the order lift functions receive them."""
    found: list[fx.Node] = []
    fx.map_arg((node.args, node.kwargs), lambda n: found.append(n))
    return found


def _only_first_lifted(lifted: list[bool]) -> bool:
    return lifted[0] and not any(lifted[1:])


_SHAPE_OPS = [
    ATEN.t.default, ATEN.transpose.int, ATEN.permute.default, ATEN.view.default, ATEN._unsafe_view.default,
    ATEN.reshape.default, ATEN.expand.default, ATEN.unsqueeze.default, ATEN.squeeze.dim, ATEN.squeeze.dims,
    ATEN.sum.dim_IntList, ATEN.mean.dim, ATEN.sum.default, ATEN.mean.default, ATEN.clone.default,
    ATEN.alias.default, ATEN.detach.default, ATEN.contiguous.default, ATEN._to_copy.default,
    ATEN.slice.Tensor, ATEN.select.int,
]


@lift_rule(*_SHAPE_OPS, linear=True)
def shape_op(node: fx.Node, lifted: list[bool]) -> LiftFn | None:
    """Views, transposes, slices and reductions of one per-sample tensor: shift every dimension argument by one.

    Before::  t_3 = aten.t(mm_1)                      # [i, o]
    After::   ps = aten.transpose(ps_mm_1, 1, 2)      # [n, i, o]
    """
    if not _only_first_lifted(lifted):
        return None
    target = node.target
    if node.kwargs and target in (ATEN.slice.Tensor, ATEN.select.int):  # bounds given by keyword: not seen so far
        return None
    rank = _logical_rank(node.args[0])

    def shift(d):
        return d % max(rank, 1) + 1

    def run(*values):
        it = iter(values)
        args = fx.map_arg(node.args, lambda _: next(it))  # sizes may be SymInt nodes: use their values
        x = args[0]
        if target is ATEN.t.default:
            return x.transpose(1, 2) if rank == 2 else x
        if target is ATEN.transpose.int:
            return x.transpose(shift(args[1]), shift(args[2]))
        if target is ATEN.permute.default:
            return x.permute([0] + [shift(d) for d in args[1]])
        if target in (ATEN.view.default, ATEN._unsafe_view.default, ATEN.reshape.default):
            return x.reshape([x.shape[0]] + list(args[1]))
        if target is ATEN.expand.default:  # expand may add leading dimensions: align ranks first
            size = list(args[1])
            x = x.reshape([x.shape[0]] + [1] * (len(size) - rank) + list(x.shape[1:]))
            return x.expand([x.shape[0]] + size)
        if target is ATEN.unsqueeze.default:
            return x.unsqueeze(args[1] % (rank + 1) + 1)
        if target is ATEN.squeeze.dim:
            return x.squeeze(shift(args[1]))
        if target is ATEN.squeeze.dims:
            return x.squeeze([shift(d) for d in args[1]])
        if target in (ATEN.sum.dim_IntList, ATEN.mean.dim):
            dims = args[1] if args[1] else list(range(rank))
            keep = bool(args[2]) if len(args) > 2 else False
            op = torch.sum if target is ATEN.sum.dim_IntList else torch.mean
            return op(x, [shift(d) for d in dims], keepdim=keep)
        if target in (ATEN.sum.default, ATEN.mean.default):
            op = torch.sum if target is ATEN.sum.default else torch.mean
            return op(x, list(range(1, x.dim()))) if x.dim() > 1 else x
        if target is ATEN.detach.default:  # a detach stops the gradient of the per-sample value too: make_fx
            # records x.detach() as alias on torch 2.15, so the op is detach_copy, which the re-trace detaches
            # (``_capture/retrace.py``, ``_Differentiable``)
            return ATEN.detach_copy.default(x)
        if target in (ATEN.clone.default, ATEN.alias.default, ATEN.contiguous.default):
            return x
        if target is ATEN._to_copy.default:
            return x.to(node.kwargs.get("dtype") or x.dtype)
        if target is ATEN.slice.Tensor:
            dim, *bounds = args[1:] if len(args) > 1 else (0,)
            return ATEN.slice.Tensor(x, shift(dim), *bounds)
        if target is ATEN.select.int:
            return x.select(shift(args[1]), args[2])
        raise InternalError(target)

    return run


@lift_rule(ATEN._weight_norm_interface_backward.default, linear=True)
def weight_norm_backward(node: fx.Node, lifted: list[bool]) -> LiftFn | None:
    """``_weight_norm_interface_backward(grad_w, v, g, norms, dim)`` with a per-sample ``grad_w``.

    w = g * v / ||v|| (norm over all dims but ``dim``), so per sample::

        grad_g = sum(grad_w * v) / ||v||
        grad_v = g / ||v|| * (grad_w - v * grad_g / ||v||)
    """
    if node.target is not operator.getitem or not lifted[0] or any(lifted[1:]):
        return None
    op = node.args[0]
    index = node.args[1]
    dim = op.args[4]
    rank = value_of(op.args[1]).dim()
    reduce_dims = [d for d in range(rank) if d != dim % rank]

    def run(grad_w, v, g, norms):
        norms = norms.unsqueeze(0)
        grad_g = (grad_w * v.unsqueeze(0)).sum([d + 1 for d in reduce_dims], keepdim=True) / norms
        if index == 1:
            return grad_g
        return g.unsqueeze(0) / norms * (grad_w - v.unsqueeze(0) * grad_g / norms)

    return run


#: backward of a view that picks part of a tensor -> positions of its dimension arguments, after
#: ``(grad, input_sizes)``: zeros shaped ``input_sizes`` with the gradient written at the picked positions
VIEW_BACKWARD_DIMS = {ATEN.slice_backward.default: (2,), ATEN.select_backward.default: (2,),
                      ATEN.diagonal_backward.default: (3, 4), ATEN.unfold_backward.default: (2,)}


@lift_rule(*VIEW_BACKWARD_DIMS, linear=True)
def view_backward(node: fx.Node, lifted: list[bool]) -> LiftFn | None:
    """The gradient of a view of a parameter (slice, select, diagonal, unfold), placed back into its shape.

    Before::  sb = aten.slice_backward(g, [o, i], 1, 0, 9223372036854775807, 2)    # g [o, i/2] -> [o, i]
    After::   ps = aten.slice_backward(ps_g, [n, o, i], 2, 0, 9223372036854775807, 2)   # [n, o, i]

    Likewise ``select_backward(g, sizes, dim, index)``, ``diagonal_backward(g, sizes, offset, dim1, dim2)`` and
    ``unfold_backward(g, sizes, dim, size, step)``: ``n`` prepended to ``sizes``, every dimension shifted by one.
    """
    if not _only_first_lifted(lifted) or node.kwargs:  # autograd passes every argument by position
        return None
    rank = len(node.args[1])
    dims = VIEW_BACKWARD_DIMS[node.target]

    def run(*values):
        it = iter(values)
        g, sizes, *rest = fx.map_arg(node.args, lambda _: next(it))
        for k in dims:
            rest[k - 2] = rest[k - 2] % rank + 1
        return node.target(g, [g.shape[0], *sizes], *rest)

    return run


#: ops that place a per-sample gradient at shared indices along ``dim`` (args[1]): the backwards of ``gather``,
#: ``sort``, ``max(dim)``, ``topk``, ``cummax``, ``index_select`` and ``take_along_dim`` on a parameter, and of a
#: parameter scattered into a tensor
_INDEXED = (ATEN.scatter.src, ATEN.scatter.value, ATEN.scatter_add.default, ATEN.index_add.default,
            ATEN.gather.default, ATEN.index_select.default)
#: ops that make the zeros a backward scatters into: a shared ``self`` of these keeps the scatter linear
ZEROS_OPS = (ATEN.zeros.default, ATEN.zeros_like.default, ATEN.new_zeros.default)


def _indexed_linear(node: fx.Node, lifted: list[bool]) -> bool:
    """Linear in the per-sample source where the tensor it is written into is per-sample too, or zeros."""
    if node.target in (ATEN.gather.default, ATEN.index_select.default):
        return lifted[0]
    if node.target is ATEN.scatter.value:  # the gradient of W.scatter(dim, idx, value): zeros written at idx
        return lifted[0] and node.args[3] == 0
    written = node.args[0]
    return lifted[0] or (isinstance(written, fx.Node) and written.target in ZEROS_OPS)


@lift_rule(*_INDEXED, linear=_indexed_linear)
def indexed(node: fx.Node, lifted: list[bool]) -> LiftFn | None:
    """Scatters, gathers and index ops of per-sample values at indices every sample shares: dim shifted by one.

    The indices are expanded over the samples (those of ``index_add`` and ``index_select`` are one-dimensional
    along ``dim``, and stay as they are).

    Before::  s = aten.scatter(zeros, 1, idx, mm_1)          # [o, i]: the backward of W.sort(1) or W.gather(1, idx)
    After::   ps = aten.scatter(zeros.expand(n, o, i), 2, idx.expand(n, o, i), ps_mm_1)      # [n, o, i]
    """
    graph_args = flat_nodes(node)
    index = node.args[2]
    if node.kwargs or not isinstance(index, fx.Node) or lifted[graph_args.index(index)]:
        return None  # indices that differ per sample: the op moves values between samples' positions
    rank = _logical_rank(node.args[0])
    dim = node.args[1] % max(rank, 1) + 1
    target = node.target

    def run(*values):
        n = next(v.shape[0] for v, is_ps in zip(values, lifted, strict=True) if is_ps)
        it = iter(zip(values, lifted, strict=True))
        args = []
        for a in node.args:
            if not isinstance(a, fx.Node):
                args.append(a)
                continue
            v, is_ps = next(it)
            args.append(v if is_ps else v.unsqueeze(0).expand(n, *v.shape))
        written, _, idx, *rest = args
        if target in (ATEN.index_add.default, ATEN.index_select.default):
            idx = idx[0]  # one-dimensional: the same positions for every sample
        return target(written, dim, idx, *rest)

    return run


def _cat_linear(node: fx.Node, lifted: list[bool]) -> bool:
    tensors = [isinstance(value_of(n), torch.Tensor) for n in flat_nodes(node)]
    return all(is_ps for is_ps, is_t in zip(lifted, tensors, strict=True) if is_t)


@lift_rule(ATEN.cat.default, linear=_cat_linear)
def cat(node: fx.Node, lifted: list[bool]) -> LiftFn | None:
    """``cat`` of per-sample and shared tensors: expand the shared ones, concatenate at ``dim + 1``."""
    dim = node.args[1] if len(node.args) > 1 else 0
    rank = _logical_rank(node)

    def run(*values):
        n = next(v.shape[0] for v, is_ps in zip(values, lifted, strict=True) if is_ps)
        parts = [v if is_ps else v.unsqueeze(0).expand([n] + list(v.shape))
                 for v, is_ps in zip(values, lifted, strict=True)]
        return torch.cat(parts, dim % rank + 1)

    return run


def _add_linear(node: fx.Node, lifted: list[bool]) -> bool:
    """``a + b`` is linear in per-sample values only when both operands are per-sample (else affine)."""
    return len(node.args) >= 2 and all(isinstance(a, fx.Node) for a in node.args[:2]) and all(lifted)


def _product_linear(node: fx.Node, lifted: list[bool]) -> bool:
    """``a * b`` with one per-sample operand; ``a / b`` with a per-sample numerator only."""
    return sum(lifted) == 1 and (node.target is ATEN.mul.Tensor or lifted[0])


linear_op(ATEN.add.Tensor, ATEN.sub.Tensor, linear=_add_linear)
linear_op(ATEN.mul.Tensor, ATEN.div.Tensor, linear=_product_linear)
linear_op(ATEN.neg.default, ATEN.mul.Scalar, ATEN.div.Scalar)


def is_linear_lift(node: fx.Node, lifted: list[bool]) -> bool:
    """True when ``node`` is linear in its per-sample arguments, so weighted sums commute with it."""
    target = node.target
    if target is operator.getitem:
        target = node.args[0].target
    return is_linear(target, node, lifted)
