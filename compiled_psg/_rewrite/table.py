"""The rule table: ATen op -> per-sample rewrite rule. The supported-op list is generated from it.

Two kinds of rules:
- ``CONTRACTION_RULES``: nodes whose inputs carry the batch and whose output does not (see ``contraction.py``).
  For a multi-output op (``convolution_backward``) the key is the op; the rule receives the ``getitem`` node.
- ``LIFT_RULES`` (in ``rules/lift.py``): ops after a contraction, given per-sample inputs.

A rule declines by returning None; the node then takes the vmap fallback (``fallback.py``), which is counted.
To add a rule: write ``def my_op(node, batch) -> Contraction | None`` in ``rules/``, add it below, add the op to
the zoo in ``tests/``. ``docs/contributing.md`` walks through one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from .._analyze.batch_dims import BatchDims
from .contraction import Contraction
from .rules import conv, embedding, embedding_bag, linear, norm, reduce
from .rules.lift import LIFT_RULES, LINEAR_LIFTS, pointwise

ATEN = torch.ops.aten
ContractionRule = Callable[[fx.Node, BatchDims], Contraction | None]

CONTRACTION_RULES: dict[torch._ops.OpOverload, ContractionRule] = {
    ATEN.mm.default: linear.mm,
    ATEN.bmm.default: linear.bmm,
    ATEN._trilinear.default: linear.trilinear,
    ATEN.sum.dim_IntList: reduce.sum_or_mean,
    ATEN.sum.default: reduce.sum_or_mean,
    ATEN.mean.dim: reduce.sum_or_mean,
    ATEN.mean.default: reduce.sum_or_mean,
    ATEN.nll_loss_forward.default: reduce.nll_loss,
    ATEN.nll_loss2d_forward.default: reduce.nll_loss,
    ATEN.mse_loss.default: reduce.mse_loss,
    ATEN.convolution_backward.default: conv.convolution_backward,
    ATEN.embedding_dense_backward.default: embedding.embedding_dense_backward,
    ATEN.native_layer_norm_backward.default: norm.native_layer_norm_backward,
    ATEN.native_group_norm_backward.default: norm.native_group_norm_backward,
    ATEN.native_batch_norm_backward.default: norm.native_batch_norm_backward,
    ATEN._embedding_bag_backward.default: embedding_bag.embedding_bag_backward,
    ATEN._embedding_bag_dense_backward.default: embedding_bag.embedding_bag_dense_backward,
}


def supported_ops() -> list[dict[str, str]]:
    """One row per rule in the table: the op, the kind of rule, and the first line of its docstring."""
    rows = []
    for op, rule in CONTRACTION_RULES.items():
        doc = (rule.__doc__ or "").strip().splitlines()[0]
        rows.append({"op": str(op), "kind": "contraction", "rule": f"{rule.__module__}.{rule.__name__}",
                     "summary": doc})
    for op, rule in LIFT_RULES.items():
        doc = (rule.__doc__ or "").strip().splitlines()[0]
        rows.append({"op": str(op), "kind": "lift" + (" (linear)" if op in LINEAR_LIFTS else ""),
                     "rule": f"{rule.__module__}.{rule.__name__}", "summary": doc})
    rows.append({"op": "any op tagged torch.Tag.pointwise", "kind": "lift", "rule": f"{pointwise.__module__}.pointwise",
                 "summary": (pointwise.__doc__ or "").strip().splitlines()[0]})
    return rows
