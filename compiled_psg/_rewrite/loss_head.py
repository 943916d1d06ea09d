"""The loss-head pass: make the forward graph also return each sample's own loss.

A user's loss is usually ``mean`` (or a masked mean) over the batch. The gradient of a batch mean is the mean of
per-sample gradients, each divided by ``n``; with a masked token mean, each sample's share depends on the other
samples' token counts. The per-sample gradient is defined on the batch of one, so we rewrite the *head* (the
nodes from the first reduction over the batch to the loss) to compute every sample's batch-of-one loss.

Before::   nll = aten.nll_loss_forward(logp [n, c], y [n], None, mean, -100)[0]    # []
After::    nll = ... (kept, the reported loss)
           ps  = per-sample nll_loss                                              # [n]
           output (nll, ps)

Pre-condition: no sample mixing in the forward graph. Post-condition: the graph returns ``(loss, [n] losses)``.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .._analyze.batch_dims import BatchDims, value_of
from .._errors import BatchInputError
from .per_sample_pass import LiftResult, lift_to_per_sample, substitute_batch_values


def _batch_values_read_one(graph: fx.Graph, batch: BatchDims) -> None:
    """Per-sample values that use the batch size as a number (``out / len(x)``) see a batch of one."""
    for node in list(graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if torch.Tag.pointwise not in target.tags or not batch.is_batched(node):
            continue
        twin = substitute_batch_values(graph, node, batch)
        if twin is not node:
            node.replace_all_uses_with(twin)
            graph.erase_node(node)


def per_sample_loss_head(forward: fx.GraphModule, loss: fx.Node, batch: BatchDims) -> LiftResult:
    graph = forward.graph
    _batch_values_read_one(graph, batch)
    loss_val = value_of(loss)
    dims = batch.dims(loss_val)
    if loss_val.dim() == 0:
        result = lift_to_per_sample(graph, [loss], batch)
        if loss not in result.per_sample:
            raise BatchInputError("the loss does not depend on the batch: there is nothing per sample")
        per_sample = result.per_sample[loss]
    elif loss_val.dim() == 1 and dims == (0,) and batch.is_whole(loss_val, 0):
        result = LiftResult()
        per_sample = loss
    else:
        raise BatchInputError(
            f"the loss function must return a scalar (a sum or mean over samples) or per-sample losses of shape "
            f"[B]; it returned shape {_with_b(loss_val.shape, batch)}. Fix: reduce the extra dimensions, e.g. "
            "loss.mean(dim=1) or loss.sum()")
    graph.output_node().args = ((loss, per_sample),)
    graph.eliminate_dead_code()
    graph.lint()
    forward.recompile()
    return result




def _with_b(shape, batch: BatchDims) -> str:
    sizes = [str(s).replace(str(batch.symbol), "B") for s in shape]
    return "(" + ", ".join(sizes) + ")"
