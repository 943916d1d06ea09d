"""``_cdist_backward``: the per-sample gradient of points shared by all samples (prototypes, centroids, codebook
entries) in ``torch.cdist(x, P)``. Not a product: no factors, so norms materialize the per-sample gradient, and a
weighted sum rescales the op's gradient argument (book-keeping)."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..._analyze.batch_dims import BatchDims
from ..._analyze.layout import batch_layout, split_batch
from ..contraction import Contraction
from ..registry import contraction_rule

ATEN = torch.ops.aten


@contraction_rule(ATEN._cdist_backward.default)
def cdist_backward(node: fx.Node, batch: BatchDims) -> Contraction | None:
    """``_cdist_backward(g [r, n], x1 [r, m], x2 [n, m], p, d [r, n])``: the gradient of the shared ``x1`` (``r``
    points) through ``d = cdist(x2, x1)``, where ``x2``'s rows are the samples (``n``, or ``n*t``): a sum over them.

    Before (autograd calls the op with the operands swapped, so that its output is the shared points' gradient)::

        d = aten._cdist_forward(x, P, p)                        # [n, r]
        gP = aten._cdist_backward(g.T, P, x, p, d.T)            # [r, m]   <- sum over the samples

    After: the same op, with each sample as its own batch entry (``_cdist_backward`` takes leading batch
    dimensions), so each entry sums over that sample's rows only::

        ps = aten._cdist_backward(g_n [n, r, t], P.expand(n, r, m), x_n [n, t, m], p, d_n [n, r, t])   # [n, r, m]

    Weighted sums: the op is linear in ``g``, so the clipped sum scales each sample's columns of ``g`` and calls
    the op once on the whole batch (``rebuild``).
    """
    g, x1, x2, p, d = node.args[:5]
    if batch.dims(x1) != () or batch.dims(x2) != (0,) or batch.dims(g) != (1,) or batch.dims(d) != (1,):
        return None
    layout = batch_layout(x2, 0, batch)
    if layout is None or layout != batch_layout(g, 1, batch) or layout != batch_layout(d, 1, batch):
        return None

    def per_sample(g, x1, x2, d):
        xs = split_batch(x2, 0, layout)                 # [n, t, m]
        gs, ds = split_batch(g, 1, layout), split_batch(d, 1, layout)  # [n, r, t]
        points = x1.expand(xs.shape[0], *x1.shape)      # [n, r, m]
        return ATEN._cdist_backward(gs.contiguous(), points.contiguous(), xs.contiguous(), p, ds.contiguous())

    def rebuild(g, x1, x2, d):
        return ATEN._cdist_backward(g.contiguous(), x1, x2, p, d)

    return Contraction(rule="_cdist_backward", node=node, inputs=[g, x1, x2, d], per_sample=per_sample,
                       linear_arg=0, linear_layout=(1, layout), rebuild=rebuild)
