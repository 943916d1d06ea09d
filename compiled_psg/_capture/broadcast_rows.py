"""Read slices, flips, rolls and cats of a value broadcast over the batch as that value, broadcast.

``w.unsqueeze(0).expand(n, -1, -1)`` holds ``w`` in every row, so ``[:1]``, ``[-1:]``, ``.flip(0)`` and
``torch.cat([e[:1], e[1:]])`` of it are ``w`` broadcast again, for every batch size. Left as they are, the mixing
analysis must refuse them where a gradient flows back: autograd hands the kept row the gradient of every sample
that reads it, through the batch position ``[:1]`` took (sample 0's). Read as ``aten.expand(w, shape)``, the
same computation broadcasts ``w`` where it meets the samples, and each sample's part of the gradient is an
ordinary per-sample contraction.

A row op (``ROW_OPS``: an op that selects, reorders or joins rows along some dimensions) is folded when
``broadcast_source`` finds its value to be ``src.expand(shape)``, with ``src`` of size 1 (or absent) along every
dimension the op moves rows along; the source is followed back through ``expand``, through ``repeat`` of such
dimensions, ``clone``, ``alias`` and the row ops themselves (never ``detach``: the gradient must stop where it
stopped), and the parts of a ``cat`` must be the same value (one node, or nodes computing the same from the same
inputs). A node is folded only where it moves rows along a dimension that carries the batch, of a floating or
complex value (the values a gradient flows back through; integer ids, PEFT's
``arange(k).expand(n, -1)[:1]``, are accepted by the analysis and read by the rewrite rules as they are), and
where a batch of one computes the same shape (``_same_at_one``): ``e[:2]`` keeps two rows of a larger batch but
one row of a batch of one, so it stays, and the analysis refuses it. An ``expand`` to a symbolic size takes a
node of the graph that holds that size: ``e[1:]`` (``n - 1`` rows, a size no node holds) stays, and a ``cat`` that
joins it back to ``n`` rows is folded whole.

Pre-condition: ``gm`` is a functional captured forward graph with ``meta["val"]`` on its nodes, only the batch
dimension symbolic. Post-condition: every folded node's users read ``src``, or ``aten.expand(src, sizes)`` of
the node's shape (``aten.clone`` of it, contiguous, where a user views the node's strides and they differ), the
same values for every batch size, a batch of one included; the nodes the fold left unused are removed; the
output node's arguments are unchanged; the graph lints.

Before::  u = aten.unsqueeze(w, 0);  e = aten.expand(u, [n, -1, -1])               # w [k, d], e [n, k, d]
          s = aten.slice(e, 0, 0, 1)                                                 # [1, k, d]
          c = aten.cat([s, aten.slice(e, 0, 1, INT_MAX)])                            # [n, k, d]
          f = aten.slice(aten.flip(e, [0]), 0, -1, INT_MAX)                          # [1, k, d]
After::   s = u;  c = aten.expand(u, [n, -1, -1]);  f = u
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.operator_schemas import normalize_function

from .._analyze.batch_dims import BatchDims, value_of
from .._analyze.layout import at_batch_of_one, same_size

ATEN = torch.ops.aten
_DEPTH = 64  # how far back a source is followed
_SAME_DEPTH = 8  # how deep two nodes are compared (each level compares every argument)


@dataclass(frozen=True)
class RowOp:
    """An op whose output is made of rows of its inputs ``parts(kw)`` along the dimensions ``moves(kw, rank)``,
    and is its inputs' dimension along every other one. ``size_at_one(kw, dim, sizes, batch)``: the output's size
    along a moved ``dim`` at a batch of one, from the parts' sizes there (None where a bound is not a size of the
    batch alone)."""

    parts: Callable[[dict], list]
    moves: Callable[[dict, int], set[int]]
    size_at_one: Callable[[dict, int, list[int], BatchDims], int | None]


def _listed_dims(dims, rank: int) -> set[int]:
    listed = list(dims) if isinstance(dims, (list, tuple)) else [] if dims is None else [dims]
    return {d % max(rank, 1) for d in listed}


def _kept_rows(kw: dict, dim: int, sizes: list[int], batch: BatchDims) -> int | None:
    """How many rows the slice keeps of ``sizes[0]``, its bounds read at a batch of one (``e[n - 1:]`` from 0)."""
    start, end = (kw.get(b) for b in ("start", "end"))
    read = [None if b is None else at_batch_of_one(b, batch) for b in (start, end)]
    if any(r is None and b is not None for r, b in zip(read, (start, end), strict=True)):
        return None
    return len(range(sizes[0])[slice(read[0], read[1], kw.get("step", 1))])


def _same_rows(kw: dict, dim: int, sizes: list[int], batch: BatchDims) -> int | None:
    return sizes[0]


def _joined_rows(kw: dict, dim: int, sizes: list[int], batch: BatchDims) -> int | None:
    return sum(sizes)


ROW_OPS: dict = {
    ATEN.slice.Tensor: RowOp(lambda kw: [kw["input"]], lambda kw, rank: _listed_dims(kw.get("dim", 0), rank),
                             _kept_rows),
    ATEN.flip.default: RowOp(lambda kw: [kw["input"]], lambda kw, rank: _listed_dims(kw["dims"], rank), _same_rows),
    # roll without dims rolls the flattened tensor: it moves elements along every dimension
    ATEN.roll.default: RowOp(lambda kw: [kw["input"]],
                             lambda kw, rank: _listed_dims(kw.get("dims"), rank) or set(range(rank)), _same_rows),
    ATEN.cat.default: RowOp(lambda kw: list(kw["tensors"]), lambda kw, rank: _listed_dims(kw.get("dim", 0), rank),
                            _joined_rows),
}
# the same values as their input: followed back to a source, never folded themselves
_IDENTITIES = (ATEN.clone.default, ATEN.alias.default)
# users that read their input's strides: a view of a broadcast value may not exist where one of a copy did
_READS_STRIDES = (ATEN.view.default, ATEN._unsafe_view.default, ATEN.view_copy.default, ATEN.as_strided.default,
                  ATEN.view.dtype, ATEN.view_as_real.default, ATEN.view_as_complex.default)


def _kwargs(node: fx.Node) -> dict | None:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    pair = normalize_function(node.target, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True)
    return None if pair is None else pair.kwargs


def _rank(node) -> int:
    return value_of(node).dim()


def _broadcast_at(src: fx.Node, dim: int, rank: int) -> bool:
    """Whether ``src``, right-aligned against a value of ``rank`` dimensions, has size 1 or no dimension at
    ``dim``."""
    j = dim - (rank - _rank(src))
    return j < 0 or (type(value_of(src).shape[j]) is int and value_of(src).shape[j] == 1)


def broadcast_source(node: fx.Node, depth: int = 0) -> fx.Node:
    """The node ``src`` furthest back such that ``node``'s value is ``src.expand(node.shape)`` (``node`` itself
    where none is found)."""
    kw = _kwargs(node) if depth < _DEPTH else None
    if kw is None:
        return node
    target = node.target
    if target in _IDENTITIES or target is ATEN.expand.default:
        return broadcast_source(kw["input"], depth + 1)
    if target is ATEN.repeat.default:
        src, repeats = broadcast_source(kw["input"], depth + 1), list(kw["repeats"])
        tiled = [j for j, r in enumerate(repeats) if not (type(r) is int and r == 1)]
        return src if all(_broadcast_at(src, j, len(repeats)) for j in tiled) else node
    op = ROW_OPS.get(target)
    if op is None:
        return node
    rank, parts = _rank(node), op.parts(kw)
    if any(not isinstance(p, fx.Node) or _rank(p) != rank for p in parts):  # cat's legacy empty parts
        return node
    sources = [broadcast_source(p, depth + 1) for p in parts]
    if all(_same_value(s, sources[0]) for s in sources[1:]) and \
            all(_broadcast_at(sources[0], d, rank) for d in op.moves(kw, rank)):
        return sources[0]
    return node


def _same_value(a, b, depth: int = 0) -> bool:
    """``a`` and ``b`` hold the same value: the same node or constant, or the same deterministic op of the same
    arguments (``P.unsqueeze(0)`` traced once for each of its reads)."""
    if a is b:
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y, depth) for x, y in zip(a, b, strict=True))
    if isinstance(a, fx.Node) != isinstance(b, fx.Node):
        return False
    if not isinstance(a, fx.Node):
        return type(a) is type(b) and a == b
    if depth >= _SAME_DEPTH or a.op != "call_function" or a.target is not b.target or a.is_impure() \
            or (isinstance(a.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in a.target.tags):
        return False
    return _same_value(a.args, b.args, depth + 1) and a.kwargs.keys() == b.kwargs.keys() and \
        all(_same_value(a.kwargs[k], b.kwargs[k], depth + 1) for k in a.kwargs)


def _size_at_one(node, dim: int, batch: BatchDims, depth: int = 0) -> int | None:
    """``node``'s size along ``dim`` where the loss runs on a batch of one, following the ops that
    ``broadcast_source`` follows (any other node: its symbolic size read at a batch of one)."""
    kw = _kwargs(node) if depth < _DEPTH else None
    target = getattr(node, "target", None)
    if kw is not None and target is ATEN.expand.default:
        size, offset = kw["size"][dim], len(kw["size"]) - _rank(kw["input"])
        keep = type(size) is int and size == -1
        return _size_at_one(kw["input"], dim - offset, batch, depth + 1) if keep else at_batch_of_one(size, batch)
    if kw is not None and target is ATEN.repeat.default:
        times, offset = kw["repeats"][dim], len(kw["repeats"]) - _rank(kw["input"])
        inner = 1 if dim < offset else _size_at_one(kw["input"], dim - offset, batch, depth + 1)
        times = at_batch_of_one(times, batch)
        return None if inner is None or times is None else inner * times
    if kw is not None and target in _IDENTITIES:
        return _size_at_one(kw["input"], dim, batch, depth + 1)
    if kw is not None and target in ROW_OPS:
        op = ROW_OPS[target]
        parts = op.parts(kw)
        if dim not in op.moves(kw, _rank(node)):
            return _size_at_one(parts[0], dim, batch, depth + 1)
        sizes = [_size_at_one(p, dim, batch, depth + 1) for p in parts]
        return None if None in sizes else op.size_at_one(kw, dim, sizes, batch)
    return at_batch_of_one(value_of(node).shape[dim], batch)


def _same_at_one(node: fx.Node, batch: BatchDims) -> bool:
    """A batch of one computes ``node`` with the shape its symbolic sizes give there."""
    for d, size in enumerate(value_of(node).shape):
        read = at_batch_of_one(size, batch)
        if read is None or _size_at_one(node, d, batch) != read:
            return False
    return True


def _on_the_batch(node: fx.Node, kw: dict, batch: BatchDims) -> bool:
    op = ROW_OPS[node.target]
    moved = op.moves(kw, _rank(node))
    return any(d in batch.dims(v) for v in [node, *op.parts(kw)] for d in moved)


def _broadcast(src: fx.Node, node: fx.Node, sizes: dict) -> fx.Node | None:
    """``src`` where it has ``node``'s shape, else a new ``aten.expand(src, ...)`` to it inserted before ``node``
    (a contiguous ``clone`` of it where a user of ``node`` reads strides the expand lacks); None where a
    symbolic size of ``node`` is not held by a node before it."""
    out, have = value_of(node), value_of(src)
    offset = out.dim() - have.dim()
    if offset == 0 and all(same_size(a, b) for a, b in zip(have.shape, out.shape, strict=True)):
        return src
    args: list = []
    for j, size in enumerate(out.shape):
        expr = size.node.expr if isinstance(size, torch.SymInt) else None
        if j >= offset and same_size(have.shape[j - offset], size):
            args.append(-1)
        elif expr is None or expr.is_Integer:
            args.append(int(size) if expr is None else int(expr))
        elif expr in sizes:
            args.append(sizes[expr])
        else:
            return None
    graph = node.graph
    with graph.inserting_before(node), detect_fake_mode([have]) or contextlib.nullcontext():
        expanded = graph.call_function(ATEN.expand.default, (src, args))
        expanded.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")})
        expanded.meta["val"] = ATEN.expand.default(have, [value_of(a) for a in args])
        if not _strides_read(node, expanded):
            return expanded
        if not out.is_contiguous():
            graph.erase_node(expanded)
            return None
        copied = graph.call_function(ATEN.clone.default, (expanded,), {"memory_format": torch.contiguous_format})
        copied.meta.update(expanded.meta)
        copied.meta["val"] = ATEN.clone.default(expanded.meta["val"], memory_format=torch.contiguous_format)
        return copied


def _strides_read(node: fx.Node, replacement: fx.Node) -> bool:
    """A user of ``node`` reads its strides, and ``replacement``'s differ along a dimension of more than one
    element."""
    old, new = value_of(node), value_of(replacement)
    differ = any(not same_size(s, 1) and not same_size(a, b)
                 for s, a, b in zip(old.shape, old.stride(), new.stride(), strict=True))
    return differ and any(u.target in _READS_STRIDES for u in node.users)


def _erase_unused(graph: fx.Graph, node: fx.Node) -> set[fx.Node]:
    """Erase ``node`` and the inputs it leaves unused, back to the first node with another use; returns them."""
    erased, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in erased or n.users or n.op != "call_function" or n.is_impure():
            continue
        stack.extend(n.all_input_nodes)
        graph.erase_node(n)
        erased.add(n)
    return erased


def fold_broadcast_rows(gm: fx.GraphModule, batch: BatchDims) -> int:
    """Fold, in place, the row ops of ``gm`` that select, reorder or join rows of a value broadcast over the
    batch (module docstring); returns how many."""
    graph = gm.graph
    outputs = set(graph.output_node().all_input_nodes)
    sizes: dict = {}  # symbolic sizes held by nodes seen so far, by expression: the sizes an expand may take
    folded = 0
    for node in list(graph.nodes):
        value = value_of(node)
        if isinstance(value, torch.SymInt):
            sizes.setdefault(value.node.expr, node)
        if node.target not in ROW_OPS or node in outputs or not isinstance(value, torch.Tensor) \
                or not (value.is_floating_point() or value.is_complex()):
            continue
        kw = _kwargs(node)
        if kw is None or not _on_the_batch(node, kw, batch):
            continue
        src = broadcast_source(node)
        if src is node or not _same_at_one(node, batch):
            continue
        replacement = _broadcast(src, node, sizes)
        if replacement is None:
            continue
        node.replace_all_uses_with(replacement)
        erased = _erase_unused(graph, node)
        sizes = {e: n for e, n in sizes.items() if n not in erased}
        folded += 1
    if folded:
        graph.lint()
        gm.recompile()
    return folded
