"""Emit plain PyTorch code into an FX graph as ATen nodes.

Rules are written as ordinary tensor functions. ``emit`` traces such a function with ``make_fx`` on the fake
values of its input nodes (so the batch size stays symbolic) and splices the resulting ATen nodes into the
graph. The new nodes carry ``meta["val"]`` like every captured node, and ``meta["psg"]`` naming who made them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from .._analyze.batch_dims import value_of


def emit(
    graph: fx.Graph,
    fn: Callable[..., object],
    inputs: Sequence[fx.Node],
    *,
    tag: str,
    before: fx.Node | None = None,
):
    """Trace ``fn(*fake values of inputs)`` and insert its nodes into ``graph``; return the output node(s).

    ``inputs`` must be tensor-valued nodes; constants belong in ``fn``'s closure.
    """
    fakes = [value_of(n) for n in inputs]
    mode = detect_fake_mode(fakes)
    allowed = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True  # user code (a custom reduction) may close over real tensors
    try:
        with torch.no_grad(), mode:
            sub = make_fx(fn)(*[f.detach() if isinstance(f, torch.Tensor) else f for f in fakes])
    finally:
        mode.allow_non_fake_inputs = allowed
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, inputs, strict=True))
    anchor = before if before is not None else graph.output_node()
    result = None
    with graph.inserting_before(anchor):
        for node in sub.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                result = _plain(fx.map_arg(node.args[0], lambda n: env[n]))
                break
            if node.op == "get_attr":  # a tensor the traced code closed over: keep it on the module
                owner = graph.owning_module
                name = f"_psg_constant_{len([k for k in dir(owner) if k.startswith('_psg_constant_')])}"
                constant = getattr(sub, node.target)
                owner.register_buffer(name, constant, persistent=False)
                new = graph.get_attr(name)
                new.meta["val"] = mode.from_tensor(constant)
                new.meta["psg"] = tag
                env[node] = new
                continue
            new = graph.node_copy(node, lambda n: env[n])
            new.meta["psg"] = tag
            env[node] = new
    return result


def _plain(value):
    """``value`` with fx's immutable dicts and lists (what ``map_arg`` builds) as plain ones: the structure is the
    result's, which the caller gets back (a custom reduction's dict)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_plain(v) for v in value)
    return value
