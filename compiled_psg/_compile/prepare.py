"""Make a rewritten graph safe to hand to Inductor, without changing what it computes.

``aten.view`` nodes captured from the user's code were valid for the strides eager PyTorch gave their inputs.
Inductor's decompositions can give an input other strides (``cat`` of an empty tensor and ``k`` returns ``k``
itself, transposed): the view then fails inside ``compile_fx`` ("Cannot view a tensor with shape ... and
strides ..."), as with attention over a ``DynamicCache``. In a functional graph ``reshape`` is the same value
and lets the compiler copy where the strides require it.

Pre-condition: ``gm`` is functional (no in-place op but a final ``copy_`` into inputs). Post-condition: no
``aten.view.default`` node is left; the graph lints.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

ATEN = torch.ops.aten


def for_inductor(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with every ``view`` a ``reshape``; returns it with the count of rewrites in
    ``gm.meta["views_as_reshapes"]``."""
    gm = copy.deepcopy(gm)
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is ATEN.view.default:
            node.target = ATEN.reshape.default
            count += 1
    gm.graph.lint()
    gm.recompile()
    gm.meta["views_as_reshapes"] = count
    return gm
