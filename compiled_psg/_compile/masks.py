"""Narrow the ``output_mask`` of multi-output backward ops to the outputs the graph reads.

Autograd asks ``convolution_backward`` (and the norm backwards) for the gradients of every input that requires
one. After the per-sample rewrite, the batch-summed weight gradient of such a node usually has no reader left:
the reduction recomputes it per sample or as a clipped sum, and dead-code elimination removes the ``getitem``
that read it. The op itself stays (its input gradient is read), and Inductor runs it as an ATen fallback with
the old mask: it still computes the weight gradient, for nothing. Dead ``mm``/``sum`` nodes need no pass:
``eliminate_dead_code`` removes them, having a single output.

Pre-condition: ``gm`` is functional and dead code has been eliminated (an unread output has no ``getitem``).
Post-conditions: for each op of ``MASKED`` whose every use is a ``getitem``, ``output_mask[k]`` is True only if
output ``k`` was requested before and is read; ``meta["val"]`` is recomputed for the narrowed node; the graph
lints. The values of the outputs that are read do not change (the mask only skips computations).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

ATEN = torch.ops.aten

# ops whose ``output_mask[k]`` says whether output ``k`` is computed (one entry per tensor output)
MASKED = (
    ATEN.convolution_backward.default,
    ATEN.native_layer_norm_backward.default,
    ATEN.native_group_norm_backward.default,
    ATEN.native_batch_norm_backward.default,
    ATEN.batch_norm_backward.default,
    ATEN._fused_rms_norm_backward.default,
    ATEN.grid_sampler_2d_backward.default,
    ATEN.grid_sampler_3d_backward.default,
    ATEN.linear_backward.default,
)


def narrow_output_masks(gm: fx.GraphModule) -> int:
    """Narrow the masks in place; returns how many outputs were dropped (0: ``gm`` unchanged)."""
    dropped = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in MASKED:
            continue
        if not node.users or any(u.target is not operator.getitem for u in node.users):
            continue  # the tuple itself escapes (read whole): every output may be read
        read = {u.args[1] for u in node.users}
        position = _mask_position(node.target)
        old = _get_arg(node, position)
        new = [bool(m) and k in read for k, m in enumerate(old)]
        if new == list(old):
            continue
        dropped += sum(old) - sum(new)
        _set_arg(node, position, new)
        _refresh_meta(node)
    if dropped:
        gm.graph.lint()
        gm.recompile()
    return dropped


def _mask_position(target) -> int:
    return next(k for k, a in enumerate(target._schema.arguments) if a.name == "output_mask")


def _get_arg(node: fx.Node, position: int):
    return node.args[position] if len(node.args) > position else node.kwargs["output_mask"]


def _set_arg(node: fx.Node, position: int, value: list[bool]) -> None:
    if len(node.args) > position:
        args = list(node.args)
        args[position] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, "output_mask": value}


def _refresh_meta(node: fx.Node) -> None:
    """The fake value with the new mask (a dropped output is None), for passes and compilers that read it."""
    if "val" not in node.meta:
        return
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    mode = detect_fake_mode(fx.node.map_arg(node.args, lambda n: n.meta.get("val")))
    if mode is None:
        return
    with mode:
        node.meta["val"] = node.target(*args, **kwargs)
