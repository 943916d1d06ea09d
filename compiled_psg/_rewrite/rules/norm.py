"""Affine parameters of LayerNorm, GroupNorm and BatchNorm in eval mode."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..._analyze.batch_dims import BatchDims, value_of
from ..._analyze.layout import batch_layout, split_batch
from ..contraction import Contraction
from ..registry import contraction_rule

ATEN = torch.ops.aten


def _getitem(node: fx.Node, index_ok=(1, 2)):
    if node.target is not operator.getitem or node.args[1] not in index_ok:
        return None, None
    return node.args[0], node.args[1]


def node_args(op_node: fx.Node) -> list[fx.Node]:
    """The graph-valued arguments of ``op_node`` (tensors and SymInts), in order: what rules take as inputs."""
    return [a for a in op_node.args if isinstance(a, fx.Node)]


def _rebuild(op_node: fx.Node, index: int):
    """The original multi-output op, computing only output ``index``, as a function of ``node_args``."""
    args = list(op_node.args)

    def rebuild(*values):
        it = iter(values)
        call = [next(it) if isinstance(a, fx.Node) else a for a in args]
        mask = [False, False, False]
        mask[index] = True
        call[-1] = mask
        return op_node.target(*call)[index]

    return rebuild


@contraction_rule(ATEN.native_layer_norm_backward.default)
def native_layer_norm_backward(node: fx.Node, batch: BatchDims) -> Contraction | None:
    """Outputs 1 (weight) and 2 (bias) of ``native_layer_norm_backward``; n batch, d normalized dims.

    Before::  lnb = aten.native_layer_norm_backward(g [n, t, d], x, [d], mean, rstd, w, b, mask)
              gw = lnb[1]                                        # [d]
    After::   ps = split_batch(g * (x - mean) * rstd).sum(t)     # [n, d]   (weight)
              ps = split_batch(g).sum(t)                         # [n, d]   (bias)
    """
    op, index = _getitem(node)
    if op is None:
        return None
    g, x, normalized_shape, mean, rstd = op.args[:5]
    dims = batch.dims(x)
    if len(dims) != 1 or batch.dims(g) != dims:
        return None
    bdim = dims[0]
    layout = batch_layout(x, bdim, batch)
    if layout is None:
        return None
    lead = value_of(x).dim() - len(normalized_shape)

    def per_sample(g, x, mean, rstd, *_):
        term = g * ((x - mean) * rstd) if index == 1 else g
        s = split_batch(term, bdim, layout)
        return s.sum(list(range(1, lead + 1)))

    return Contraction(rule=f"native_layer_norm_backward[{index}]", node=node, inputs=node_args(op),
                       per_sample=per_sample, linear_arg=0, linear_layout=(bdim, layout),
                       rebuild=_rebuild(op, index))


@contraction_rule(ATEN.native_group_norm_backward.default)
def native_group_norm_backward(node: fx.Node, batch: BatchDims) -> Contraction | None:
    """Outputs 1 and 2 of ``native_group_norm_backward(g, x, mean [n, G], rstd [n, G], w, N, C, HxW, G)``.

    Before::  gnb = aten.native_group_norm_backward(g [n, c, *s], x, mean, rstd, w, n, c, hw, G, mask)
    After::   xhat = ((x.view(n, G, c/G, -1) - mean) * rstd).view(n, c, -1)
              ps = (g.view(n, c, -1) * xhat).sum(-1)             # [n, c]  (weight; bias without xhat)
    """
    op, index = _getitem(node)
    if op is None:
        return None
    g, x, mean, rstd = op.args[:4]
    group = op.args[8]
    if batch.dims(x) != (0,) or batch.dims(g) != (0,):
        return None
    layout = batch_layout(x, 0, batch)
    if layout is None:
        return None
    channels = int(value_of(x).shape[1])

    def per_sample(g, x, mean, rstd, *_):
        n = x.shape[0]
        gf = g.reshape(n, channels, -1)
        if index == 1:
            xg = x.reshape(n, group, channels // group, -1)
            xhat = ((xg - mean.reshape(n, group, 1, 1)) * rstd.reshape(n, group, 1, 1)).reshape(n, channels, -1)
            gf = gf * xhat
        per_row = gf.sum(-1)  # [n*r, c]
        return split_batch(per_row, 0, layout).sum(1)

    return Contraction(rule=f"native_group_norm_backward[{index}]", node=node, inputs=node_args(op),
                       per_sample=per_sample, linear_arg=0, linear_layout=(0, layout),
                       rebuild=_rebuild(op, index))


@contraction_rule(ATEN.native_batch_norm_backward.default)
def native_batch_norm_backward(node: fx.Node, batch: BatchDims) -> Contraction | None:
    """Outputs 1 and 2 of ``native_batch_norm_backward`` in eval mode (running statistics).

    Before::  bnb = aten.native_batch_norm_backward(g, x, w, rmean, rvar, _, _, False, eps, mask)
    After::   ps = (g * (x - rmean) / sqrt(rvar + eps)).sum(spatial)    # [n, c]   (weight)

    In training mode the statistics mix samples; the mixing analysis refuses that before any rule runs.
    """
    op, index = _getitem(node)
    if op is None:
        return None
    g, x, w, running_mean, running_var, _save_mean, _save_invstd, train, eps = op.args[:9]
    if train or batch.dims(x) != (0,) or not isinstance(running_mean, fx.Node) or not isinstance(w, fx.Node):
        return None
    layout = batch_layout(x, 0, batch)
    if layout is None:
        return None

    def per_sample(g, x, _w, rmean, rvar, *_):
        shape = [1, -1] + [1] * (x.dim() - 2)
        term = g * ((x - rmean.reshape(shape)) * torch.rsqrt(rvar.reshape(shape) + eps)) if index == 1 else g
        s = split_batch(term, 0, layout)  # [n, r, c, *s]
        return s.sum([1] + list(range(3, s.dim())))

    return Contraction(rule=f"native_batch_norm_backward[{index}]", node=node,
                       inputs=node_args(op), per_sample=per_sample, linear_arg=0,
                       linear_layout=(0, layout), rebuild=_rebuild(op, index))
