"""The generic fallback for one op without a rule: ``torch.vmap`` over that op alone, never over the model.

Per-sample semantics of any node is "the same op on each sample's slice of its batched inputs": the slice keeps
its batch dimension with size one, so a contraction sees a batch of one and a loss head takes each sample's
own mean. Every use is counted, reported by ``explain`` and logged as a warning on the ``compiled_psg`` logger.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .._analyze.batch_dims import BatchDims, value_of
from .._analyze.layout import batch_layout, split_batch
from .contraction import Contraction
from .rules.lift import flat_nodes


def fallback_contraction(node: fx.Node, batch: BatchDims) -> Contraction | None:
    """vmap ``op`` over the samples of every batched input (each must have one batch dim of known layout)."""
    op_node = node.args[0] if node.target is operator.getitem else node
    index = node.args[1] if node.target is operator.getitem else None
    inputs = flat_nodes(op_node)
    plans = []
    for n in inputs:
        dims = batch.dims(n)
        if not dims:
            plans.append(None)
            continue
        if len(dims) != 1:
            return None
        layout = batch_layout(n, dims[0], batch)
        if layout is None:
            return None
        plans.append((dims[0], layout))
    if all(p is None for p in plans) or any(
        isinstance(value_of(n), torch.SymInt) and batch.symbol in value_of(n).node.expr.free_symbols
        for n in inputs
    ):
        return None

    def per_sample(*values):
        split = [v if p is None else split_batch(v, p[0], p[1]) for v, p in zip(values, plans, strict=True)]
        batched_pos = [i for i, p in enumerate(plans) if p is not None]

        def one(*slices):
            call = list(split)
            for i, s in zip(batched_pos, slices, strict=True):
                call[i] = s
            it = iter(call)
            args = fx.map_arg(op_node.args, lambda _: next(it))
            kwargs = fx.map_arg(op_node.kwargs, lambda _: next(it))
            out = op_node.target(*args, **kwargs)
            return out[index] if index is not None else out

        return torch.vmap(one)(*[split[i] for i in batched_pos])

    return Contraction(rule="fallback:vmap", node=node, inputs=inputs, per_sample=per_sample)


def fallback_lift(node: fx.Node, lifted: list[bool]):
    """vmap a shared-output op whose inputs include per-sample values (a tail or loss-head op with no rule)."""
    op_node = node.args[0] if node.target is operator.getitem else node
    index = node.args[1] if node.target is operator.getitem else None
    in_dims = tuple(0 if is_ps else None for is_ps in lifted)

    def run(*values):
        def one(*vals):
            it = iter(vals)
            args = fx.map_arg(op_node.args, lambda _: next(it))
            kwargs = fx.map_arg(op_node.kwargs, lambda _: next(it))
            out = op_node.target(*args, **kwargs)
            return out[index] if index is not None else out

        return torch.vmap(one, in_dims=in_dims)(*values)

    return run
