"""Find where samples mix in the forward graph. Per-sample gradients are undefined there: we refuse.

A value mixes samples when sample ``i``'s entries depend on sample ``j``'s inputs:
- a reduction over the batch whose result flows back into per-sample values (``x - x.mean(0)``);
- BatchNorm in training mode (its statistics are such a reduction, inside one op);
- an op working *along* the batch dimension (softmax, cumsum, sort, roll, index_select over samples);
- a value with the batch in two dimensions (``z @ z.T``: a similarity matrix across samples).
Reductions over the batch whose results flow only into the loss are the loss head: allowed, and rewritten so
that each sample gets its own loss (``loss_head.py``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .batch_dims import BatchDims, value_of
from .source import where

ATEN = torch.ops.aten

_BATCH_NORM_TRAINING_ARG = {  # op -> index of its `training` argument
    ATEN._native_batch_norm_legit_functional.default: 5,
    ATEN._native_batch_norm_legit.default: 5,
    ATEN._native_batch_norm_legit.no_stats: 3,
    ATEN.native_batch_norm.default: 5,
}
_ALONG_DIM_OPS = {  # op -> index of its dim argument
    ATEN._softmax.default: 1, ATEN._log_softmax.default: 1, ATEN.cumsum.default: 1, ATEN.cumprod.default: 1,
    ATEN.logcumsumexp.default: 1, ATEN.sort.default: 1, ATEN.sort.stable: 2, ATEN.topk.default: 2,
    ATEN.index_select.default: 1, ATEN.gather.default: 1, ATEN.cummax.default: 1, ATEN.cummin.default: 1,
    ATEN.roll.default: 2, ATEN.flip.default: 1,
}


@dataclass
class MixingSite:
    op: str
    node: str
    source: str
    reason: str
    fix: str

    def __str__(self) -> str:
        return f"{self.op} ({self.node}) at {self.source}: {self.reason}. Fix: {self.fix}"


def _dims_hit(arg, rank: int) -> list[int]:
    if isinstance(arg, int):
        return [arg % rank]
    if isinstance(arg, (list, tuple)):
        return [d % rank for d in arg if isinstance(d, int)]
    return []


def find_mixing(graph: fx.Graph, batch: BatchDims) -> list[MixingSite]:
    sites: list[MixingSite] = []
    reduced_from: dict[fx.Node, fx.Node] = {}  # unbatched node -> the batch reduction it derives from
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        value = value_of(node)
        target = node.target
        if target is operator.getitem:  # one output of a multi-output op: reductions are per output
            src = node.args[0]
            if isinstance(value, torch.Tensor) and not batch.dims(value):
                if src in reduced_from:
                    reduced_from[node] = reduced_from[src]
                elif any(batch.is_batched(a) for a in src.all_input_nodes):
                    reduced_from[node] = node
            continue
        tensor_inputs = [a for a in node.all_input_nodes if isinstance(value_of(a), (torch.Tensor, tuple, list))]
        batched_inputs = [a for a in tensor_inputs if batch.is_batched(a)]
        name = str(getattr(target, "__name__", target)) if target is not operator.getitem else "getitem"
        op = f"aten.{name}" if isinstance(target, torch._ops.OpOverload) else name

        if target in _BATCH_NORM_TRAINING_ARG and batched_inputs:
            idx = _BATCH_NORM_TRAINING_ARG[target]
            training = node.args[idx] if len(node.args) > idx else True
            x_dims = batch.dims(node.args[0])
            if training and any(d != 1 for d in x_dims):
                sites.append(MixingSite(op, node.name, where(node),
                                        "BatchNorm in training mode normalizes each sample with statistics of the "
                                        "whole batch",
                                        "call model.eval() so BatchNorm uses its running statistics, or replace "
                                        "BatchNorm with GroupNorm or LayerNorm"))
                continue
        if target in _ALONG_DIM_OPS and batched_inputs:
            x = node.args[0]
            idx = _ALONG_DIM_OPS[target]
            dims = node.args[idx] if len(node.args) > idx else 0
            rank = value_of(x).dim()
            if set(_dims_hit(dims, rank)) & set(batch.dims(x)):
                sites.append(MixingSite(op, node.name, where(node),
                                        "it works along the batch dimension, so each sample's output depends on "
                                        "the others",
                                        "apply it along a non-batch dimension, or pass in_dims so the batch "
                                        "dimension is the one you mean"))
                continue
        outputs = value if isinstance(value, (tuple, list)) else [value]
        if any(isinstance(v, torch.Tensor) and len(batch.dims(v)) > 1 for v in outputs):
            in_counts = [len(batch.dims(a)) for a in batched_inputs]
            if not in_counts or max(in_counts) < max(len(batch.dims(v)) for v in outputs
                                                      if isinstance(v, torch.Tensor)):
                sites.append(MixingSite(op, node.name, where(node),
                                        "its result pairs every sample with every other sample",
                                        "compute per-sample quantities only; losses over pairs of samples "
                                        "(contrastive losses) have no per-sample gradient"))
                continue
        tainted = [reduced_from[a] for a in tensor_inputs if a in reduced_from]
        if batch.is_batched(node):
            if tainted:
                origin = tainted[0]
                sites.append(MixingSite(f"aten.{getattr(origin.target, '__name__', origin.target)}", origin.name,
                                        where(origin),
                                        f"it reduces over the batch, and its result flows back into per-sample "
                                        f"values ({op} at {where(node)})",
                                        "reduce over non-batch dimensions only (e.g. x.mean(1) instead of "
                                        "x.mean(0)), or move batch statistics out of the loss function"))
            continue
        if tainted:
            reduced_from[node] = tainted[0]
        elif batched_inputs and isinstance(value, torch.Tensor):
            reduced_from[node] = node
    return sites

