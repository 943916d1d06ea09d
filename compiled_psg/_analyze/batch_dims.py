"""Which dimensions of a graph value carry the batch.

Only the batch dimension is symbolic in captured graphs, so a dimension carries the batch exactly when its
size is a SymInt whose expression contains the batch symbol. ``B`` is a whole dimension; ``T*B`` is the batch
merged with other dimensions (a sequence Linear folds ``[B, T, i]`` into ``[B*T, i]``).
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

ATEN = torch.ops.aten


def value_of(node: fx.Node | object):
    """The fake value recorded for ``node`` (a FakeTensor, a SymInt, a tuple of them), or the constant itself."""
    if isinstance(node, fx.Node):
        return node.meta.get("val")
    return node


def _expr(size) -> sympy.Expr | None:
    if isinstance(size, torch.SymInt):
        return size.node.expr
    return None


class BatchDims:
    """Answers questions about the batch dimension of the values of one graph."""

    def __init__(self, symbol: sympy.Symbol):
        self.symbol = symbol

    def dims(self, value) -> tuple[int, ...]:
        """The dimensions of a tensor value that contain the batch symbol."""
        if isinstance(value, fx.Node):
            value = value_of(value)
        if not isinstance(value, torch.Tensor):
            return ()
        found = []
        for d, size in enumerate(value.shape):
            expr = _expr(size)
            if expr is not None and self.symbol in expr.free_symbols:
                found.append(d)
        return tuple(found)

    def is_batched(self, node) -> bool:
        value = value_of(node)
        if isinstance(value, (tuple, list)):
            return any(self.dims(v) for v in value)
        return bool(self.dims(value))

    def is_whole(self, value, dim: int) -> bool:
        """True when dimension ``dim`` is exactly the batch, not merged with anything."""
        if isinstance(value, fx.Node):
            value = value_of(value)
        expr = _expr(value.shape[dim])
        return expr is not None and expr == self.symbol

    def factor(self, size) -> int | None:
        """``k`` when ``size`` is ``k*B`` (``1`` for ``B`` itself), else None."""
        expr = _expr(size)
        if expr is None:
            return None
        ratio = sympy.simplify(expr / self.symbol)
        if ratio.free_symbols:
            return None
        try:
            return int(ratio)
        except TypeError:
            return None


def find_batch_symbol(values) -> sympy.Symbol | None:
    """The symbol of the first symbolic dimension among ``values`` (the batch inputs)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            for size in v.shape:
                expr = _expr(size)
                if expr is not None and expr.free_symbols:
                    return next(iter(expr.free_symbols))
    return None
