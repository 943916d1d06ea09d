"""``_embedding_bag_backward`` (and its dense form): per-sample ``nn.EmbeddingBag`` gradients.

Each bag belongs to one sample (a 2-D input ``[n, t]`` makes one bag per sample), so every token's
contribution goes to its own sample's ``[v, o]`` table. Index letters: n batch, t tokens, v vocab, o out (the
embedding size), b bags.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..._analyze.batch_dims import BatchDims, value_of
from ..._analyze.layout import batch_layout
from ..._compat import embedding_bag_counts_each_id
from ..contraction import Contraction
from ..registry import contraction_rule

ATEN = torch.ops.aten
MODE_SUM, MODE_MEAN, MODE_MAX = 0, 1, 2


def per_sample_bags(grad, indices, offset2bag, bag_size, max_indices, psw, *, layout, num_weights: int, mode: int,
                    scale_by_freq: bool, padding_idx: int) -> torch.Tensor:
    """``grad [b, o]`` of the bags -> ``[n, v, o]``; token ``k`` of ``indices`` belongs to sample
    ``(k // inner) % n`` (``layout = (outer, inner)``), and one ``[n*v, o]`` table holds every sample's rows."""
    outer, inner = layout
    tokens = indices.shape[0]
    n = tokens // (outer * inner)
    dim_o = grad.shape[-1]
    sample = torch.div(torch.arange(tokens, device=indices.device), inner, rounding_mode="floor") % n
    table = grad.new_zeros(n * num_weights, dim_o)
    if mode == MODE_MAX:
        # bag -> sample, from any of its tokens; an empty bag has max index -1 and no gradient
        bag_sample = torch.zeros(grad.shape[0], dtype=sample.dtype, device=sample.device).index_put(
            (offset2bag,), sample)
        valid = max_indices >= 0
        rows = max_indices.clamp(min=0) + (bag_sample * num_weights).unsqueeze(1)
        table = table.scatter_add(0, rows, grad * valid.to(grad.dtype))
        return table.view(n, num_weights, dim_o)
    token_grads = grad.index_select(0, offset2bag)
    if mode == MODE_MEAN:
        token_grads = token_grads / bag_size.index_select(0, offset2bag).clamp(min=1).unsqueeze(1).to(grad.dtype)
    if psw is not None:
        token_grads = token_grads * psw.unsqueeze(1)
    rows = indices + sample * num_weights
    if padding_idx is not None and padding_idx >= 0:
        token_grads = token_grads * (indices != padding_idx).unsqueeze(1).to(grad.dtype)
    if scale_by_freq:
        token_grads = token_grads / _freq_scale(indices, rows, n, num_weights).unsqueeze(1).to(grad.dtype)
    return table.index_add(0, rows, token_grads).view(n, num_weights, dim_o)


def _freq_scale(indices, rows, n: int, num_weights: int) -> torch.Tensor:
    """The count each token's gradient is divided by, as torch's CPU kernel computes it for a batch of one.

    torch 2.14+: the id's own count in the sample. Up to 2.13 that kernel (``_embedding_bag_dense_backward_cpu_
    sum_mean``) divides the ``k``-th distinct id (in sorted order) by the count of ``sorted_ids[k]``, which is the
    id's own count only while no id repeats before it. Autograd on one sample, the reference, does what the
    kernel does, so the per-sample gradient must too (``_compat.embedding_bag_counts_each_id``).
    """
    counts = torch.zeros(n * num_weights, dtype=torch.long, device=indices.device).index_add(
        0, rows, torch.ones_like(rows))
    if embedding_bag_counts_each_id():
        return counts[rows]
    ids = indices.reshape(n, -1)
    sorted_ids, order = ids.sort(dim=1, stable=True)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    group = first.long().cumsum(1) - 1  # rank of each sorted token's distinct id
    offsets = (torch.arange(n, device=ids.device) * num_weights).unsqueeze(1)
    count_at = counts[sorted_ids + offsets]  # count of the id at each sorted position
    divisor_sorted = count_at.gather(1, group)
    return torch.empty_like(divisor_sorted).scatter(1, order, divisor_sorted).reshape(-1)


def _rule(node: fx.Node, batch: BatchDims, grad, indices, offset2bag, bag_size, max_indices, num_weights,
          scale_by_freq, mode, psw, padding_idx, rebuild) -> Contraction | None:
    if batch.dims(indices) != (0,) or value_of(indices).dim() != 1:
        return None
    if mode == MODE_MAX and scale_by_freq:
        return None
    layout = batch_layout(indices, 0, batch)
    if layout is None or (scale_by_freq and layout[0] != 1):  # the frequency scale needs [n, t] token rows
        return None
    tensors = [grad, indices, offset2bag, bag_size, max_indices] + ([psw] if psw is not None else [])

    def per_sample(grad, indices, offset2bag, bag_size, max_indices, *psw):  # psw: () or (weights,)
        return per_sample_bags(grad, indices, offset2bag, bag_size, max_indices, *(psw or (None,)), layout=layout,
                               num_weights=num_weights, mode=mode, scale_by_freq=scale_by_freq,
                               padding_idx=padding_idx)

    linear = 0 if not scale_by_freq and batch.dims(grad) == (0,) and batch.is_whole(grad, 0) else None
    return Contraction(rule=str(node.target).split(".")[-2], node=node, inputs=tensors, per_sample=per_sample,
                       linear_arg=linear, linear_layout=(0, (1, 1)) if linear is not None else None,
                       rebuild=rebuild)


@contraction_rule(ATEN._embedding_bag_backward.default)
def embedding_bag_backward(node: fx.Node, batch: BatchDims) -> Contraction | None:
    """``_embedding_bag_backward(g [b, o], idx [n*t], offsets, offset2bag, bag_size, max_idx, v, scale, mode, ...)``.

    Before::  eb = aten._embedding_bag_backward(g [n, o], idx [n*t], offsets, o2b [n*t], size [n], max_idx, v,
                                                 False, mode, False, psw [n*t], pad)        # [v, o]

    After: every token's row goes to its sample's block of one ``[n*v, o]`` table::

        tok = g[o2b] / size[o2b] (mean) * psw (weights) * (idx != pad)   # [n*t, o]
        ps = zeros(n*v, o).index_add(0, idx + sample(k) * v, tok).view(n, v, o)
        max mode: ps = zeros(n*v, o).scatter_add(0, max_idx [b, o] + sample(bag) * v, g)
    """
    args = list(node.args) + [None] * (12 - len(node.args))
    grad, indices, _offsets, offset2bag, bag_size, max_indices, num_weights, scale, mode, sparse, psw, pad = args
    pad = node.kwargs.get("padding_idx", pad if pad is not None else -1)
    if sparse:
        return None  # a sparse gradient: AOT autograd gives dense ones in the graphs we capture

    # the dense form computes the same gradient without the offsets
    return _rule(node, batch, grad, indices, offset2bag, bag_size, max_indices, num_weights, scale, mode, psw,
                 pad, _dense_rebuild(num_weights, scale, mode, pad))


@contraction_rule(ATEN._embedding_bag_dense_backward.default)
def embedding_bag_dense_backward(node: fx.Node, batch: BatchDims) -> Contraction | None:
    """``_embedding_bag_dense_backward(g [b, o], idx [n*t], offset2bag, bag_size, max_idx, v, scale, mode, psw)``.

    Before::  eb = aten._embedding_bag_dense_backward(g [n, o], idx [n*t], o2b, size, max_idx, v, False, mode,
                                                       psw, pad)                             # [v, o]

    After: as ``_embedding_bag_backward``: one ``[n*v, o]`` table, sample ``n`` owning rows ``n*v .. n*v+v-1``.
    """
    args = list(node.args) + [None] * (10 - len(node.args))
    grad, indices, offset2bag, bag_size, max_indices, num_weights, scale, mode, psw, pad = args
    pad = node.kwargs.get("padding_idx", pad if pad is not None else -1)
    return _rule(node, batch, grad, indices, offset2bag, bag_size, max_indices, num_weights, scale, mode, psw,
                 pad, _dense_rebuild(num_weights, scale, mode, pad))


def _dense_rebuild(num_weights, scale, mode, pad):
    def rebuild(grad, indices, offset2bag, bag_size, max_indices, *psw):
        return ATEN._embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, max_indices, num_weights,
                                                  scale, mode, *(psw or (None,)), pad)

    return rebuild
