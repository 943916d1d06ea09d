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

import operator

import torch
import torch.fx as fx

from .._analyze import ops
from .._analyze.batch_dims import BatchDims, value_of
from .._analyze.source import source_line
from .._errors import BatchInputError, UnsupportedError
from .per_sample_pass import LiftResult, lift_to_per_sample, substitute_batch_values


def _batch_values_read_one(graph: fx.Graph, loss: fx.Node, batch: BatchDims) -> fx.Node:
    """The loss with per-sample semantics for values that use the batch size as a number (``out / len(x)``):
    they see a batch of one. Returns the node computing it (``loss`` itself when nothing reads the batch size).

    The reported loss keeps the batch's values: each op with a batch-valued argument that ``_reads_one`` allows
    gets a twin reading 1, and each node downstream of a twin up to the loss a copy reading the twins. The
    originals stay (the reported loss uses them; DCE drops those nothing else needs).
    """
    twins: dict[fx.Node, fx.Node] = {}
    for node in list(graph.nodes):
        if node is loss.next or node.op == "output":
            break
        if node.op != "call_function":
            continue
        twin = node
        target = node.target
        if _reads_one(node, batch):
            twin = substitute_batch_values(graph, node, batch)
            if twin is not node and torch.Tag.nondeterministic_seeded in target.tags:
                raise UnsupportedError(
                    f"{target} at {source_line(node)} draws random numbers with an argument computed from the batch "
                    "size (x.shape[0], len(x)); each sample's loss reads the batch size as 1, and a second draw "
                    "would not match the batch's. Fix: apply the batch size after the random op")
        if any(a in twins for a in node.all_input_nodes):
            if twin is node:  # a copy of the node, to read the twins
                twin = _copy(graph, node)
            twin.args = fx.map_arg(twin.args, lambda a: twins.get(a, a))
            twin.kwargs = fx.map_arg(twin.kwargs, lambda a: twins.get(a, a))
        if twin is not node:
            twins[node] = twin
    return twins.get(loss, loss)


def _reads_one(node: fx.Node, batch: BatchDims) -> bool:
    """Whether the node's batch-size-valued arguments may read 1: in a pointwise batched op (``out / len(x)``),
    or in any op making a value without the batch (``torch.full((), len(x))``, ``scalar_tensor(sqrt(n))``).
    Sizes of batched values (``x.view(n, -1)``) and the shape checks keep the batch's size."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target in ops.CHECKS | ops.SIZE_QUERIES:
        return False
    if batch.is_batched(node):
        return torch.Tag.pointwise in target.tags
    return any(isinstance(v, torch.Tensor) for v in _values(value_of(node)))


def _values(value) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _same_mask_dropout(x: torch.Tensor, p: float, train, mask: torch.Tensor):
    """``native_dropout(x, p, train)`` with the mask the batch drew (``mask``), not a new one."""
    if train is False:  # None means train, as in ATen
        return x, mask
    return x * mask * (1.0 / (1.0 - p) if p < 1 else 0.0), mask  # ATen's order: input.mul(mask).mul_(scale)


def _copy(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """A copy of ``node`` (its arguments to be redirected to twins). A random op draws again in a copy: dropout
    reuses the batch's mask; other random ops on a value computed from the batch size are refused."""
    target = node.target
    if target is torch.ops.aten.native_dropout.default:
        with graph.inserting_after(node):
            mask = graph.call_function(operator.getitem, (node, 1))
            mask.meta = {**node.meta, "val": value_of(node)[1]}
        with graph.inserting_after(mask):
            twin = graph.call_function(_same_mask_dropout, (*node.args, mask))
    elif isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags:
        raise UnsupportedError(
            f"{target} at {source_line(node)} draws random numbers from a value computed from the batch size "
            "(x.shape[0], len(x)); each sample's loss reads the batch size as 1, and a second draw would not match "
            "the batch's. Fix: apply the batch size after the random op (e.g. divide the loss, not the op's input)")
    else:
        with graph.inserting_before(node):
            twin = graph.call_function(target, node.args, node.kwargs)
    twin.meta = dict(node.meta)
    return twin


def per_sample_loss_head(forward: fx.GraphModule, loss: fx.Node, batch: BatchDims) -> LiftResult:
    graph = forward.graph
    own = _batch_values_read_one(graph, loss, batch)
    loss_val = value_of(loss)
    dims = batch.dims(loss_val)
    if loss_val.dim() == 0:
        result = lift_to_per_sample(graph, [own], batch)
        if own not in result.per_sample:
            raise BatchInputError("the loss does not depend on the batch: there is nothing per sample")
        per_sample = result.per_sample[own]
    elif loss_val.dim() == 1 and dims == (0,) and batch.is_whole(loss_val, 0):
        result = LiftResult()
        per_sample = own
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
