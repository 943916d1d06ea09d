"""``embedding_dense_backward``: per-sample embedding gradients, padding_idx and scale_grad_by_freq included."""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from ..._analyze.batch_dims import BatchDims, value_of
from ..._analyze.layout import batch_layout, split_batch
from ..contraction import Contraction, certified_sq_norms
from ..registry import contraction_rule, lift_rule
from .lift import ZEROS_OPS

ATEN = torch.ops.aten


def per_sample_table(grads: torch.Tensor, ids: torch.Tensor, num_weights: int, padding_idx, scale_by_freq: bool):
    """``[n, l, d]`` token gradients and ``[n, l]`` ids -> ``[n, v, d]``: one scatter-add into an ``[n*v, d]``
    table, sample ``n`` owning rows ``n*v .. n*v+v-1``."""
    n, dim_d = grads.shape[0], grads.shape[-1]
    rows = ids + torch.arange(n, device=ids.device).unsqueeze(1) * num_weights
    if padding_idx is not None and padding_idx >= 0:
        grads = grads * (ids != padding_idx).unsqueeze(-1).to(grads.dtype)
    if scale_by_freq:
        counts = grads.new_zeros(n * num_weights).index_add(0, rows.flatten(), grads.new_ones(rows.numel()))
        grads = grads / counts[rows].unsqueeze(-1)
    table = grads.new_zeros(n * num_weights, dim_d).index_add(0, rows.flatten(), grads.reshape(-1, dim_d))
    return table.view(n, num_weights, dim_d)


@contraction_rule(ATEN.embedding_dense_backward.default)
def embedding_dense_backward(node: fx.Node, batch: BatchDims) -> Contraction | None:
    """``embedding_dense_backward(g [*idx, d], idx, v, padding_idx, scale)``; n batch, t tokens, v vocab.

    Before::  emb_bw = aten.embedding_dense_backward(g [n, t, d], idx [n, t], v, pad, False)   # [v, d]

    After: a scatter-add into one ``[n*v, d]`` table, sample ``n`` owning rows ``n*v .. n*v+v-1``::

        rows = idx' + arange(n)[:, None] * v                    # [n, t]
        ps = zeros(n*v, d).index_add(0, rows, g' * (idx' != pad)).view(n, v, d)

    Squared norms need no table: ``||G_n||^2 = sum_ts [idx_nt == idx_ns] <g_nt, g_ns>`` (the ghost norm).
    """
    g, idx, num_weights, padding_idx, scale_by_freq = node.args
    dims = batch.dims(idx)
    if len(dims) != 1:
        return None
    bdim = dims[0]
    layout = batch_layout(idx, bdim, batch)
    if layout is None:
        return None
    dim_d = value_of(g).shape[-1]

    def tokens(g, idx):  # [n, t, d], [n, t]
        ids = split_batch(idx, bdim, layout)
        grads = split_batch(g, bdim, layout)
        n = ids.shape[0]
        return grads.reshape(n, -1, dim_d), ids.reshape(n, -1)

    def per_sample(g, idx):
        return per_sample_table(*tokens(g, idx), num_weights, padding_idx, scale_by_freq)

    def sq_norms(g, idx):
        """The ghost norm over token pairs with the same row; float64 and certified, as ``factored_sq_norms``
        (two tokens of one row with nearly opposite gradients cancel)."""
        grads, ids = tokens(g, idx)
        grads64 = grads.double()
        same = ids.unsqueeze(2) == ids.unsqueeze(1)
        if padding_idx is not None and padding_idx >= 0:
            same = same & (ids != padding_idx).unsqueeze(2)
        gg = torch.bmm(grads64, grads64.transpose(1, 2))
        if scale_by_freq:  # a padding token counts 0 times: clamp, its terms are masked out anyway
            counts = same.sum(2).clamp_min(1).to(gg.dtype)
            gg = gg / (counts.unsqueeze(2) * counts.unsqueeze(1))
        scale = grads64.norm(dim=2).sum(1).square()
        return certified_sq_norms((gg * same.to(gg.dtype)).sum((1, 2)), scale, 2 * grads.shape[2],
                                  grads.shape[1], torch.promote_types(grads.dtype, torch.float32), grads.dtype)

    def index_factors(g, idx):  # A[n, t] = one_hot(ids[n, t]), zero for a padding token
        grads, ids = tokens(g, idx)
        weight = torch.ones_like(ids, dtype=grads.dtype)
        if padding_idx is not None and padding_idx >= 0:
            weight = (ids != padding_idx).to(grads.dtype)
        return ids, weight, grads

    def rebuild(g, idx):
        return ATEN.embedding_dense_backward(g, idx, num_weights, padding_idx, scale_by_freq)

    linear = None if scale_by_freq else 0  # the frequency scale is per sample, not per batch
    tokens_per_sample = math.prod(s for d, s in enumerate(value_of(idx).shape) if d != bdim) * layout[0] * layout[1]
    notes = {"tokens": tokens_per_sample} if isinstance(tokens_per_sample, int) else {}
    return Contraction(rule="embedding_dense_backward", node=node, inputs=[g, idx], per_sample=per_sample,
                       linear_arg=linear, linear_layout=(bdim, layout), rebuild=rebuild, sq_norms=sq_norms,
                       index_factors=None if scale_by_freq else index_factors, notes=notes)


def _shared_indices(node: fx.Node, lifted: list[bool]) -> bool:
    """Linear in the gradient only while every sample scatters into the same rows."""
    return lifted[0] and not any(lifted[1:])


@lift_rule(ATEN.embedding_dense_backward.default, linear=_shared_indices)
def embedding_dense_backward_lift(node: fx.Node, lifted: list[bool]):
    """``embedding_dense_backward`` of a per-sample gradient: each sample's own table.

    A position embedding (``pos_emb(arange(t))`` is added to every sample) sums the samples' gradients first, then
    scatters them.

    Before::  s = sum(g, [0]);  eb = aten.embedding_dense_backward(s [t, d], arange(t), v, pad, False)   # [v, d]
    After::   ps = zeros(n*v, d).index_add(0, arange(t) + n*v offsets, ps_s [n, t, d]).view(n, v, d)

    The indices may be per sample too where they are computed from the batch's shape (PEFT's prompt tokens,
    ``arange(t).expand(n, -1)[:1]``): each sample's own, read from its row.
    """
    if not lifted[0]:
        return None
    _g, _idx, num_weights, padding_idx, scale_by_freq = node.args
    own_ids = lifted[1]

    def run(grads, idx, *_sizes):
        n = grads.shape[0]
        ids = idx.reshape(n, -1) if own_ids else idx.reshape(1, -1).expand(n, -1)
        return per_sample_table(grads.reshape(n, ids.shape[1], grads.shape[-1]), ids, num_weights, padding_idx,
                                scale_by_freq)

    return run


@contraction_rule(ATEN.index_add.default)
def index_add_rows(node: fx.Node, batch: BatchDims) -> Contraction | None:
    """``index_add(zeros, dim, idx, g)`` with batched ``idx``: rows of a table read with the batch's ids.

    The backward of ``E.index_select(dim, ids)``, an embedding without its layer (the rows along ``dim``).

    Before::  ia = aten.index_add(zeros [v, d], 0, idx [n], g [n, d])       # [v, d]
    After::   ps = zeros(n*v, d).index_add(0, idx' + arange(n) * v, g').view(n, v, d)   # as embedding_dense_backward
    """
    written, dim, idx, g = node.args[:4]
    shape = tuple(value_of(node).shape)
    if not (len(node.args) == 4 and not node.kwargs and isinstance(dim, int) and isinstance(written, fx.Node)):
        return None
    dim %= len(shape)
    if (written.target not in ZEROS_OPS
            or batch.dims(written) or tuple(batch.dims(idx)) != (0,) or tuple(batch.dims(g)) != (dim,)):
        return None
    layout = batch_layout(idx, 0, batch)
    if layout is None or batch_layout(g, dim, batch) != layout:
        return None
    # the rows along ``dim`` first: ``[v, *f]`` with the other dimensions, in order, as the features
    moved = (shape[dim], *shape[:dim], *shape[dim + 1:])
    num_weights, features = moved[0], math.prod(moved[1:])

    def tokens(g, idx):  # [n, t, f], [n, t]
        ids = split_batch(idx, 0, layout)
        grads = split_batch(g.movedim(dim, 0), 0, layout)
        n = ids.shape[0]
        return grads.reshape(n, -1, features), ids.reshape(n, -1)

    def per_sample(g, idx):
        table = per_sample_table(*tokens(g, idx), num_weights, None, False)
        return table.view(table.shape[0], *moved).movedim(1, dim + 1)

    def index_factors(g, idx):
        grads, ids = tokens(g, idx)
        return ids, torch.ones_like(ids, dtype=grads.dtype), grads

    def rebuild(g, idx):
        return g.new_zeros(shape).index_add(dim, idx, g)

    return Contraction(rule="index_add_rows", node=node, inputs=[g, idx], per_sample=per_sample, linear_arg=0,
                       linear_layout=(dim, layout), rebuild=rebuild,
                       # the factors' rows are the table's first dimension (``[v, f]`` read as the parameter)
                       index_factors=index_factors if dim == 0 else None)
