"""Reductions over the batch: biases, elementwise parameters (scales, shifts, temperatures), and loss heads."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..._analyze import ops
from ..._analyze.batch_dims import BatchDims, value_of
from ..._analyze.layout import batch_layout, slice_at_batch_of_one, split_batch, uniform
from ..._errors import InternalError
from ..contraction import Contraction
from ..registry import contraction_rule, lift_rule

ATEN = torch.ops.aten


def _single_batched_dim(node: fx.Node, batch: BatchDims, like=None):
    """``(dim, layout)`` of the one batch dimension of ``node``; ``like``'s layout for a constant fill (a target of
    zeros shaped like the batch fits any layout)."""
    dims = batch.dims(node)
    if len(dims) != 1:
        return None
    if like is not None and uniform(node) and dims[0] == like[0]:
        return like
    layout = batch_layout(node, dims[0], batch)
    return None if layout is None else (dims[0], layout)


def _dims_arg(node: fx.Node, rank: int) -> list[int]:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return [d % rank for d in dims]


@contraction_rule(ATEN.sum.dim_IntList, ATEN.sum.default, ATEN.mean.dim, ATEN.mean.default)
def sum_or_mean(node: fx.Node, batch: BatchDims) -> Contraction | None:
    """``sum``/``mean`` over dimensions that include the batch: the same reduction on each sample's slice.

    Before::  sum_2 = aten.sum.dim_IntList(grad_out, [0], True)           # [1, o]
    After::   ps = aten.sum.dim_IntList(split_batch(grad_out), [1], True)  # [n, 1, o]

    For ``mean`` the slice is the batch of one, so a mean loss gives each sample its own mean.
    """
    x = node.args[0]
    found = _single_batched_dim(x, batch)
    if found is None:
        return None
    bdim, layout = found
    rank = value_of(x).dim()
    dims = _dims_arg(node, rank)
    if bdim not in dims:
        return None
    keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
    is_mean = node.target in (ATEN.mean.dim, ATEN.mean.default)
    dtype = node.kwargs.get("dtype")

    def per_sample(x):
        s = split_batch(x, bdim, layout)
        shifted = [d + 1 for d in dims]
        out = s.mean(shifted, keepdim=keepdim) if is_mean else s.sum(shifted, keepdim=keepdim)
        return out if dtype is None else out.to(dtype)

    def rebuild(x):
        out = x.mean(dims, keepdim=keepdim) if is_mean else x.sum(dims, keepdim=keepdim)
        return out if dtype is None else out.to(dtype)

    shape = value_of(x).shape
    terms = layout[0] * layout[1]  # each sample's own rows in the batch dimension, times the other reduced sizes
    for d in dims:
        terms *= 1 if d == bdim else int(shape[d])
    return Contraction(rule=str(node.target.overloadpacket.__name__), node=node, inputs=[x],
                       per_sample=per_sample, linear_arg=None if is_mean else 0,
                       linear_layout=(bdim, layout), rebuild=rebuild, notes={"terms_per_entry": terms})


@contraction_rule(ATEN.slice.Tensor)
def slice_of_the_batch(node: fx.Node, batch: BatchDims) -> Contraction | None:
    """``slice`` along the batch to a fixed number of rows (``prompt.expand(n, -1)[:1]``): each sample's batch of one.

    Before::  s = aten.slice(p [n, t], 0, 0, 1)                     # [1, t]: rows the same for every sample
    After::   ps = aten.slice(split_batch(p) [n, 1, t], 1, 0, 1)    # [n, 1, t]

    Declines unless a batch of one keeps as many rows as the node has (the mixing analysis accepts only such
    slices of values that are the same for every sample). Not linear in the book-keeping sense: the slice of a
    weighted batch keeps some samples' rows, not a weighted sum of every sample's own rows.
    """
    if node.kwargs:
        return None
    x, dim, start, end, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1:])[:5]
    value = value_of(x)
    dim %= value.dim()
    if batch.dims(x) != (dim,):
        return None
    factor = batch.factor(value.shape[dim])
    layout = batch_layout(x, dim, batch) or ((factor, 1) if factor and uniform(x) else None)
    read = slice_at_batch_of_one(value.shape[dim], start, end, step, batch)  # the bounds a batch of one reads
    if layout is None or read is None or len(range(read[0])[slice(*read[1:])]) != value_of(node).shape[dim]:
        return None
    _, start, end, step = read

    def per_sample(x):
        return ATEN.slice.Tensor(split_batch(x, dim, layout), dim + 1, start, end, step)

    return Contraction(rule="slice", node=node, inputs=[x], per_sample=per_sample)


@contraction_rule(ATEN.nll_loss_forward.default, ATEN.nll_loss2d_forward.default)
def nll_loss(node: fx.Node, batch: BatchDims) -> Contraction | None:
    """``nll_loss_forward``/``nll_loss2d_forward`` over a batch: each sample's own (weighted) mean or sum.

    Before::  nll = aten.nll_loss_forward(logp [n*t, c], target [n*t], w, reduction=mean, ignore)[0]   # []
    After::   l = nll_loss(logp, target, reduction=none).view(n, t)
              ps = l.sum(1) / (w[target] * (target != ignore)).sum(1)                                  # [n]

    A sample whose targets are all ignored gets loss NaN (0 / 0) and gradient 0, as its batch of one does in eager
    mode: the NaN is a constant in ``where``'s other branch, so no gradient flows through it.
    """
    inp, target, weight, reduction, ignore_index = node.args[0].args[:5]
    if node.args[1] != 0:
        return None  # total_weight: only used by the backward
    found = _single_batched_dim(inp, batch)
    tfound = None if found is None else _single_batched_dim(target, batch, like=found)
    if found is None or tfound is None or found[0] != 0 or tfound[0] != 0 or found[1] != tfound[1]:
        return None
    layout = found[1]
    two_d = node.args[0].target is ATEN.nll_loss2d_forward.default
    inputs = [inp, target] + ([weight] if isinstance(weight, fx.Node) else [])

    def per_sample(logp, tgt, *w):
        wt = w[0] if w else None
        if two_d:  # [n, c, h, w] with targets [n, h, w]
            losses = F.nll_loss(logp, tgt, wt, reduction="none", ignore_index=ignore_index)
        else:
            losses = F.nll_loss(logp.reshape(-1, logp.shape[-1]) if logp.dim() > 1 else logp, tgt.reshape(-1),
                                wt, reduction="none", ignore_index=ignore_index)
        losses = split_batch(losses.reshape(tgt.shape), 0, layout).flatten(1)
        if reduction == 2:  # sum
            return losses.sum(1)
        if reduction == 0:
            raise InternalError("unreduced nll_loss cannot contract the batch")
        ignored = tgt == ignore_index
        valid = (~ignored).to(logp.dtype)
        # ignored targets may lie outside the classes (ignore_index=9 of 4 classes, or -100): read class 0 there
        weights = valid if wt is None else wt[tgt.masked_fill(ignored, 0)] * valid
        weights = split_batch(weights.reshape(tgt.shape), 0, layout).flatten(1).sum(1)
        safe = torch.where(weights > 0, weights, torch.ones_like(weights))
        return torch.where(weights > 0, losses.sum(1) / safe, torch.full_like(safe, float("nan")))

    return Contraction(rule="nll_loss_forward", node=node, inputs=inputs, per_sample=per_sample)


@lift_rule(ATEN.nll_loss_forward.default, ATEN.nll_loss2d_forward.default)
def nll_loss_lift(node: fx.Node, lifted: list[bool]):
    """``nll_loss_forward`` of per-sample log-probabilities with shared targets: each sample's own loss.

    A loss head that pools over the batch first (``F.cross_entropy(h.mean(0), y)``) gives every sample its own
    ``h`` and the same targets (the vmap fallback fixed the batch size here)::

        Before::  l = aten.nll_loss_forward(logp [t, c], y [t], w, reduction=mean, ignore)[0]           # []
        After::   l = nll_loss(ps_logp [n*t, c], y.expand(n, t), reduction=none).view(n, t)
                  ps = l.sum(1) / (w[y] * (y != ignore)).sum()                                           # [n]
    """
    if node.target is not operator.getitem or node.args[1] != 0 or not lifted[0] or any(lifted[1:]):
        return None  # total_weight (read by the backward only), or per-sample targets or weights
    op = node.args[0]
    if op.kwargs:
        return None
    _inp, target, weight, reduction, ignore_index = op.args[:5]
    shape = tuple(value_of(target).shape)

    def run(logp, tgt, *w):
        n = logp.shape[0]
        wt = w[0] if w else None
        rows = tgt.expand(n, *shape)
        flat = logp.flatten(0, 1) if shape else logp  # [n*t, c, ...] (one target per sample: [n, c])
        losses = F.nll_loss(flat, rows.flatten(0, 1) if shape else rows, wt, reduction="none",
                            ignore_index=ignore_index).reshape(n, -1)
        if reduction == 0:
            return losses.reshape(n, *shape)
        if reduction == 2:
            return losses.sum(1)
        valid = tgt != ignore_index  # the same for every sample: one total weight (0 / 0 is NaN, as in eager)
        weights = valid.to(logp.dtype) if wt is None else wt[tgt.masked_fill(~valid, 0)] * valid
        return losses.sum(1) / weights.sum()

    return run


def elementwise_loss(op: torch._ops.OpOverload):
    """The rule of a loss op of ``ops.LOSSES``: an elementwise loss of ``(input, target, *extra)`` reduced by its
    ``reduction`` argument (1 mean, 2 sum) over every element. Each sample's own loss is the op with
    ``reduction=0`` (none), split by sample and reduced over that sample's elements alone. Tensor extras
    (``weight``, ``pos_weight``) broadcast over the samples, or are batched like the input.

    Before::  l = aten.mse_loss(y [n, o], t [n, o], reduction=mean)                               # []
    After::   ps = split_batch(aten.mse_loss(y, t, reduction=none)).mean(1)                      # [n]
    """
    names = [a.name for a in op._schema.arguments]
    defaults = [a.default_value if a.has_default_value() else None for a in op._schema.arguments]

    def rule(node: fx.Node, batch: BatchDims) -> Contraction | None:
        values = [node.args[k] if k < len(node.args) else node.kwargs.get(name, defaults[k])
                  for k, name in enumerate(names)]
        reduction = values[names.index("reduction")]
        inp, target = values[:2]
        if reduction == 0 or value_of(inp).shape != value_of(target).shape:
            return None
        found = _single_batched_dim(inp, batch)
        if found is None:
            return None
        tensors = [k for k, v in enumerate(values) if isinstance(v, fx.Node)]
        for k in tensors[1:]:  # batched operands: the input's shape and batch dimension
            other = values[k]
            if batch.dims(other) and (value_of(other).shape != value_of(inp).shape
                                      or _single_batched_dim(other, batch, like=found) != found):
                return None
        bdim, layout = found

        def per_sample(*given):
            unreduced = list(values)
            for k, v in zip(tensors, given, strict=True):
                unreduced[k] = v
            unreduced[names.index("reduction")] = 0
            losses = split_batch(op(*unreduced), bdim, layout)
            dims = list(range(1, losses.dim()))
            return losses.mean(dims) if reduction == 1 else losses.sum(dims)

        return Contraction(rule=short, node=node, inputs=[values[k] for k in tensors], per_sample=per_sample)

    short = op.__name__.split(".")[0]
    rule.__name__ = short
    rule.__doc__ = (f"``{short}`` with ``reduction`` mean or sum: each sample's own mean (or sum) of its elementwise "
                    "losses (``elementwise_loss``).")
    return rule


for _op in ops.LOSSES:
    contraction_rule(_op)(elementwise_loss(_op))
