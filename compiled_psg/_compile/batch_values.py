"""Errors about the batch's values that do not show them.

A loss that the capture accepted (on fake tensors) and that fails on the real batch fails because of a value of
the batch: a label past the number of classes, a token id past an embedding's rows. torch's message names that
value (``Target 17 is out of bounds``). In a DP library a training example's content must not leave through an
error message or a log, so these messages keep the op, the user's line, the range the op accepts and the
positions of the failing samples in the batch, and leave the values out: torch's own text is shown with its
numbers replaced by ``#``, and not chained as the error's cause.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten


@dataclass
class OutOfRange:
    """The index argument of a failing op, the entries of it the op accepts, and that range in words."""

    index: fx.Node
    accepted: torch.Tensor  # bool, shaped like the index's value
    range: str


def out_of_range(node: fx.Node, value_of: Callable[[object], object]) -> OutOfRange | None:
    """Which index argument of ``node`` (a call of the captured graph that raised) holds values outside what the
    op accepts, read from ``value_of(arg)`` (the values the failed run computed); None for an op not known here,
    or one whose indices are all in range (it failed another way)."""
    target, args = node.target, node.args
    if target in (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default):
        logits, ignore = value_of(args[0]), args[4]
        classes = logits.shape[1] if logits.dim() >= 2 else logits.shape[0]
        return _check(args[1], value_of, 0, classes, f"[0, {classes}), the number of classes, or the ignore_index "
                                                     f"{ignore}", also=ignore)
    if target in (aten.multi_margin_loss.default, aten.multilabel_margin_loss_forward.default):
        logits = value_of(args[0])
        classes = logits.shape[-1]
        low = -1 if target is aten.multilabel_margin_loss_forward.default else 0
        return _check(args[1], value_of, low, classes, f"[{low}, {classes}), the number of classes"
                                                       + (" (-1 ends a sample's targets)" if low else ""))
    if target in (aten.embedding.default, aten._embedding_bag.default, aten._embedding_bag_forward_only.default):
        rows = value_of(args[0]).shape[0]
        return _check(args[1], value_of, 0, rows, f"[0, {rows}), the embedding's rows")
    if target in _ALONG_DIM:
        dim = args[1] % max(value_of(args[0]).dim(), 1)
        size = value_of(args[0]).shape[dim] if value_of(args[0]).dim() else 1
        return _check(args[2], value_of, 0, size, f"[0, {size}), the size of dimension {dim}")
    if target in (aten.index.Tensor, aten._unsafe_index.Tensor, aten.index_put.default, aten._unsafe_index_put.default):
        shape, dim = value_of(args[0]).shape, 0
        for index in args[1]:
            value = value_of(index) if isinstance(index, fx.Node) else None
            if value is not None and value.dtype == torch.bool:  # a mask consumes as many dimensions as it has
                dim += value.dim()
                continue
            if value is not None and dim < len(shape):
                size = shape[dim]
                found = _check(index, value_of, -size, size,
                               f"[-{size}, {size}), the size of dimension {dim} (a negative index counts from "
                               "its end)")
                if found is not None:
                    return found
            dim += 1
    return None


_ALONG_DIM = tuple(op for op in (aten.gather.default, aten.index_select.default, aten.scatter.src,
                                 aten.scatter.value, aten.scatter_add.default, aten.scatter_reduce.two,
                                 aten.index_add.default, aten.index_copy.default, aten.index_fill.int_Scalar))


def _check(index: object, value_of, low: int, high: int, words: str, also: int | None = None) -> OutOfRange | None:
    if not isinstance(index, fx.Node):
        return None
    value = value_of(index)
    if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.dtype == torch.bool:
        return None
    accepted = (value >= low) & (value < high)
    if also is not None:
        accepted |= value == also
    return None if bool(accepted.all()) else OutOfRange(index, accepted, words)


def failing_samples(found: OutOfRange, batch_symbol) -> list[int]:
    """The batch positions whose indices the op does not accept, where the index holds the batch in one dimension
    of its own; [] where it does not (the batch merged with another dimension: ``y.view(-1)`` of ``[B, T]``)."""
    value = found.index.meta.get("val")
    dims = [d for d, size in enumerate(getattr(value, "shape", ()))
            if isinstance(size, torch.SymInt) and size.node.expr == batch_symbol]
    if len(dims) != 1:
        return []
    rejected = ~found.accepted.movedim(dims[0], 0)
    return rejected.reshape(rejected.shape[0], -1).any(1).nonzero().flatten().tolist()


_NUMBER = re.compile(r"(?<![\w.#])[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w.])")


def without_numbers(text: str) -> str:
    """torch's message with its numbers replaced by ``#`` (``Target 17 is out of bounds`` -> ``Target # is out of
    bounds``): a failure on the real batch is about its values, which torch's text may name."""
    return _NUMBER.sub("#", text)
