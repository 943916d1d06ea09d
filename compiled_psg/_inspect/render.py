"""Readable, stable text for FX graphs: one line per node with its shape; rewritten nodes are marked.

The batch symbol is printed as ``B`` so dumps do not churn when Dynamo numbers its symbols differently.
"""

from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx

_SYMBOL = re.compile(r"\bs\d+\b")


def normalize(text: str) -> str:
    return _SYMBOL.sub("B", text)


def shape_of(value) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        return f"{dtype}[{', '.join(str(s) for s in value.shape)}]"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(shape_of(v) for v in value) + ")"
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        return f"sym {value}"
    return repr(value) if value is not None else "None"


def _target_name(node: fx.Node) -> str:
    if node.target is operator.getitem:
        return "getitem"
    if isinstance(node.target, torch._ops.OpOverload):
        return f"aten.{node.target.__name__}"
    return getattr(node.target, "__name__", str(node.target))


def _arg(a) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]"
    return repr(a)


def node_line(node: fx.Node, label: str | None = None) -> str:
    shape = shape_of(node.meta.get("val"))
    mark = f"  # psg: {node.meta['psg']}" if "psg" in node.meta else ""
    if node.op == "placeholder":
        return f"{node.name}: {shape}  # input{': ' + label if label else ''}"
    if node.op == "output":
        return f"return {_arg(node.args[0])}"
    args = ", ".join([_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()])
    return f"{node.name}: {shape} = {_target_name(node)}({args}){mark}"


def graph_text(gm: fx.GraphModule, labels: dict[str, str] | None = None) -> str:
    labels = labels or {}
    return normalize("\n".join(node_line(n, labels.get(n.name)) for n in gm.graph.nodes)) + "\n"
