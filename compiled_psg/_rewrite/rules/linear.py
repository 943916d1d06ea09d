"""Matrix products that contract the batch: Linear weights, ``x @ W.T``, einsum, attention projections."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..._analyze.batch_dims import BatchDims, value_of
from ..._analyze.layout import batch_layout, split_batch
from ..contraction import Contraction, factored_per_sample, factored_sq_norms
from ..registry import contraction_rule

ATEN = torch.ops.aten


def _batch_in_k(a: fx.Node, x: fx.Node, batch: BatchDims):
    """The batch layout of ``k`` in ``a [o, k]`` and ``x [k, ...]``, or None when the batch is elsewhere or the two
    lay it out differently."""
    if batch.dims(a) != (1,) or batch.dims(x) != (0,):
        return None
    layout = batch_layout(a, 1, batch)
    return layout if layout is not None and layout == batch_layout(x, 0, batch) else None


@contraction_rule(ATEN.mm.default)
def mm(node: fx.Node, batch: BatchDims) -> Contraction | None:
    """``mm(a [o, k], x [k, i])`` where ``k`` carries the batch (``n`` or ``n*t`` in either order).

    Before::

        t_2 = aten.t(grad_out)            # [o, n*t]
        mm_1 = aten.mm(t_2, x_flat)       # [o, i]     <- contraction over n*t

    After::

        a = split_batch(aten.t(t_2))      # [n, t, o]
        x = split_batch(x_flat)           # [n, t, i]
        ps = aten.bmm(a.transpose(1, 2), x)   # [n, o, i]
    """
    a, x = node.args
    layout = _batch_in_k(a, x, batch)
    if layout is None:
        return None

    def factors(a, x):
        return split_batch(a.t(), 0, layout), split_batch(x, 0, layout)

    def per_sample(a, x):
        return factored_per_sample(*factors(a, x))

    o, i = value_of(node).shape
    t = layout[0] * layout[1]
    return Contraction(
        rule="mm", node=node, inputs=[a, x], per_sample=per_sample,
        linear_arg=1, linear_layout=(0, layout), other_linear=((0, (1, layout)),), rebuild=torch.mm,
        factors=factors, factor_shape=(t, int(o), int(i)),
        sq_norms=lambda a, x: factored_sq_norms(*factors(a, x)),
    )


@contraction_rule(ATEN.mv.default)
def mv(node: fx.Node, batch: BatchDims) -> Contraction | None:
    """``mv(a [o, k], v [k])`` where ``k`` carries the batch: a parameter vector or row read by ``x @ w``.

    Before::

        t_1 = aten.t(x)                   # [o, n]
        mv_1 = aten.mv(t_1, grad_out)     # [o]       <- contraction over n (or n*t)

    After::

        ps = (split_batch(aten.t(t_1)) * split_batch(grad_out).unsqueeze(-1)).sum(1)   # [n, t, o] -> [n, o]
    """
    a, v = node.args
    layout = _batch_in_k(a, v, batch)
    if layout is None:
        return None

    def per_sample(a, v):
        a_s, v_s = split_batch(a.t(), 0, layout), split_batch(v, 0, layout)  # [n, t, o], [n, t]
        return (a_s * v_s.unsqueeze(-1)).sum(1)

    return Contraction(rule="mv", node=node, inputs=[a, v], per_sample=per_sample,
                       linear_arg=1, linear_layout=(0, layout), other_linear=((0, (1, layout)),), rebuild=torch.mv)


@contraction_rule(ATEN.bmm.default)
def bmm(node: fx.Node, batch: BatchDims) -> Contraction | None:
    """``bmm(a [h, o, k], x [h, k, i])`` with the batch in ``k``: per head ``h``, as ``mm``.

    Before::  bmm_3 = aten.bmm(a, x)                       # [h, o, i]
    After::   ps = einsum("nhto,nhti->nhoi", a', x')       # [n, h, o, i]
    """
    a, x = node.args
    if batch.dims(a) != (2,) or batch.dims(x) != (1,):
        return None
    layout = batch_layout(a, 2, batch)
    if layout is None or layout != batch_layout(x, 1, batch):
        return None

    def per_sample(a, x):
        a_s = split_batch(a, 2, layout)  # [n, h, o, t]
        x_s = split_batch(x, 1, layout)  # [n, h, t, i]
        return torch.matmul(a_s, x_s)

    return Contraction(rule="bmm", node=node, inputs=[a, x], per_sample=per_sample,
                       linear_arg=1, linear_layout=(1, layout), other_linear=((0, (2, layout)),),
                       rebuild=torch.bmm)


@contraction_rule(ATEN._trilinear.default)
def trilinear(node: fx.Node, batch: BatchDims) -> Contraction | None:
    """``_trilinear`` (nn.Bilinear) whose summed dimensions include the batch.

    Before::  _trilinear_3 = aten._trilinear(x1, x2, g, expand1, expand2, expand3, sumdim)   # [o, i, j]
    After::   ps = sum over sumdim minus the batch of (x1' * x2' * g'), split at the batch  # [n, o, i, j]
    """
    i1, i2, i3, e1, e2, e3, sumdim = node.args[:7]
    tensors = [i1, i2, i3]
    expands = [e1, e2, e3]
    rank = value_of(i1).dim() + len(e1)
    common_dims = []
    for t, e in zip(tensors, expands, strict=True):
        kept = [d for d in range(rank) if d not in e]
        common_dims.extend(kept[d] for d in batch.dims(t))
    if len(set(common_dims)) != 1:
        return None
    c = common_dims[0]
    layouts = {}
    for t in tensors:
        for d in batch.dims(t):
            layouts[batch_layout(t, d, batch)] = True
    if len(layouts) != 1 or None in layouts:
        return None
    layout = next(iter(layouts))
    if c not in sumdim:
        return None

    def per_sample(a, b, g):
        full = None
        for t, e in zip((a, b, g), expands, strict=True):
            for d in sorted(e):
                t = t.unsqueeze(d)
            full = t if full is None else full * t
        split = split_batch(full, c, layout)
        return split.sum([d + 1 for d in sumdim])

    return Contraction(rule="_trilinear", node=node, inputs=tensors, per_sample=per_sample)
