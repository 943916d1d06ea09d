"""From the captured joint graph to the joint graph of the per-sample losses.

1. ``forward_slice``: the forward part of the captured joint graph (the ancestors of the loss).
2. The loss-head pass (``_rewrite/loss_head.py``) makes it return per-sample losses ``[n]`` as well.
3. ``retrace_joint``: ``make_fx`` of ``autograd.grad(sum(per-sample losses), params)`` on the same fake inputs
   (the batch stays symbolic). Its backward sums exactly the batch-of-one gradients, so every contraction in it
   is a sum of per-sample gradients as the user defines them, whatever mean or mask the loss applied.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

ATEN = torch.ops.aten


def forward_slice(joint: fx.GraphModule, loss_output: int) -> tuple[fx.GraphModule, fx.Node]:
    """A copy of ``joint`` returning only the loss (all placeholders kept, in order)."""
    gm = copy.deepcopy(joint)
    graph = gm.graph
    loss = graph.output_node().args[0][loss_output]
    if loss.target is ATEN.detach.default:  # our joint returned loss.detach()
        loss = loss.args[0]
    graph.output_node().args = ((loss,),)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return gm, loss


def retrace_joint(forward: fx.GraphModule, fake_inputs: list, param_positions: list[int]) -> fx.GraphModule:
    """Joint graph of ``forward`` (which returns ``(loss, per_sample_losses)``) with outputs
    ``(loss, per_sample_losses, *grads)``; a gradient is None where the loss does not use the parameter."""

    def joint(*inputs):
        with fx_traceback.preserve_node_meta():  # keep the user's stack traces on the forward nodes
            loss, per_sample = fx.Interpreter(forward).run(*inputs)
        wrt = [inputs[i] for i in param_positions]
        grads = torch.autograd.grad(per_sample.sum(), wrt, allow_unused=True)
        return (loss.detach(), per_sample.detach(), *grads)

    inputs = [
        v.detach().requires_grad_(i in param_positions) if isinstance(v, torch.Tensor) else v
        for i, v in enumerate(fake_inputs)
    ]
    with torch.enable_grad(), detect_fake_mode(fake_inputs):  # constants made by autograd must be fake too
        gm = make_fx(joint)(*inputs)
    return gm
