"""Make a rewritten graph safe to hand to Inductor, and lighter for it, without changing what it computes.

``aten.view`` nodes captured from the user's code were valid for the strides eager PyTorch gave their inputs.
Inductor's decompositions can give an input other strides (``cat`` of an empty tensor and ``k`` returns ``k``
itself, transposed): the view then fails inside ``compile_fx`` ("Cannot view a tensor with shape ... and
strides ..."), as with attention over a ``DynamicCache``. In a functional graph ``reshape`` is the same value
and lets the compiler copy where the strides require it.

A tied weight's per-sample gradient sums its uses: for GPT-2's embedding and LM head, the head's ``[n, v, d]``
GEMM output plus the lookup's per-sample table, a scatter-add into ``[n*v, d]`` zeros
(``rules/embedding.py``). Inductor allocates both tables. Scattering into the GEMM's output instead
(``scatters_into_sums``) is the same sum with one table: Inductor then adds in place (GPT-2 small at B = 8 on the
CPU: 393 MiB fewer at the step's peak, ``benchmarks/scale_notes.md``).

The backward's seed, ``ones_like(total loss)``, reads only the loss's shape, so for Inductor no backward kernel
depends on the losses. A kernel that computes the losses (the per-sample and the reported loss: a gather of the
log-probabilities at the targets) then stays a reader of the logits until the end, and the log-softmax backward,
fused with it, cannot write the logits' gradient over the logits: two ``[tokens, vocabulary]`` buffers where
the plain compiled step holds one (GPT-2 on the CPU: 196 MiB). ``seeds_after_losses`` makes the seed read the
total's value, adding an exact zero (``nan_to_num(total * 0)``), so the losses are computed first, as in eager
``loss.backward()``, and Inductor can reuse the logits' buffer.

Inductor in torch 2.13 writes ``index_put``, ``index_add`` and ``index_copy`` into the storage of a broadcast input
(an ``expand``, every row one stride-0 buffer) instead of a fresh tensor, so each row holds the writes of all of
them: vmap's batching rule of ``index_put`` into a shared base makes exactly that (the per-sample gradient of a
parameter read as ``table[index]``, Swin's relative position bias, came out as the batch's sum, silently).
``writes_into_broadcasts`` clones such a base first, the same values (torch 2.14 and 2.15 compile it right).

Pre-condition: ``gm`` is functional (no in-place op but a final ``copy_`` into inputs). Post-condition: no
``aten.view.default`` node is left, nor an ``add`` of a scatter-add into zeros that nothing else reads and
whose shape and dtype are the sum's, nor an indexed write into a broadcast input, nor a ``ones_like`` of a 0-d
floating tensor that does not read its value; the graph lints.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

ATEN = torch.ops.aten


def for_inductor(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with every ``view`` a ``reshape``, scatter-adds into zeros folded into the sums that take
    them and indexed writes into broadcast inputs given a copy to write; returns it with the counts of rewrites in
    ``gm.meta["views_as_reshapes"]``, ``gm.meta["scatters_into_sums"]`` and ``gm.meta["writes_into_broadcasts"]``."""
    gm = copy.deepcopy(gm)
    gm.meta["writes_into_broadcasts"] = writes_into_broadcasts(gm.graph)
    gm.meta["scatters_into_sums"] = scatters_into_sums(gm.graph)
    gm.meta["seeds_after_losses"] = seeds_after_losses(gm.graph)
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is ATEN.view.default:
            node.target = ATEN.reshape.default
            count += 1
    gm.graph.lint()
    gm.recompile()
    gm.meta["views_as_reshapes"] = count
    return gm


#: functional indexed writes that Inductor (torch 2.13) compiles into their input's own storage
_INDEXED_WRITES = (ATEN.index_put.default, ATEN._unsafe_index_put.default, ATEN.index_add.default,
                   ATEN.index_copy.default)


def _broadcast(value) -> bool:
    """A tensor whose elements share storage along some dimension: stride 0 on a size that may exceed 1."""
    return isinstance(value, torch.Tensor) and any(
        type(stride) is int and stride == 0 and not (type(size) is int and size <= 1)
        for size, stride in zip(value.shape, value.stride(), strict=True))


def writes_into_broadcasts(graph: fx.Graph) -> int:
    """``index_put(b, ...)`` (``index_add``, ``index_copy``) of a broadcast ``b`` -> the same op on ``clone(b)``, a
    tensor of its own; returns how many."""
    count = 0
    for node in list(graph.nodes):
        base = node.args[0] if node.op == "call_function" and node.target in _INDEXED_WRITES else None
        if not isinstance(base, fx.Node) or not _broadcast(base.meta.get("val")):
            continue
        with graph.inserting_before(node):
            copied = graph.call_function(ATEN.clone.default, (base,), {"memory_format": torch.contiguous_format})
        copied.meta["val"] = base.meta["val"].clone(memory_format=torch.contiguous_format)
        node.args = (copied, *node.args[1:])
        count += 1
    return count


def seeds_after_losses(graph: fx.Graph) -> int:
    """Replace each ``ones_like(t)`` of a 0-d floating ``t``, of ``t``'s dtype and device (the backward's seed), by
    ``ones_like(t) + nan_to_num(t * 0, 0, 0, 0)``: the same ones (the added zero is exact for every ``t``,
    inf and NaN included), now reading ``t``; returns how many."""
    count = 0
    for node in list(graph.nodes):
        total = node.args[0] if node.op == "call_function" and node.target is ATEN.ones_like.default else None
        value = total.meta.get("val") if isinstance(total, fx.Node) else None
        ones = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dim() != 0 or not value.dtype.is_floating_point \
                or not isinstance(ones, torch.Tensor) or (ones.dtype, ones.device) != (value.dtype, value.device):
            continue  # the seed is ones like the total itself; a ones_like(t, dtype=...) of the user's is left
        with graph.inserting_after(node):
            times_zero = graph.call_function(ATEN.mul.Tensor, (total, 0.0))
            with graph.inserting_after(times_zero):
                zero = graph.call_function(ATEN.nan_to_num.default, (times_zero, 0.0, 0.0, 0.0))
            with graph.inserting_after(zero):
                seed = graph.call_function(ATEN.add.Tensor, (node, zero))
        node.replace_all_uses_with(seed, delete_user_cb=lambda user, seed=seed: user is not seed)
        times_zero.meta["val"] = zero.meta["val"] = value * 0
        seed.meta["val"] = node.meta["val"]
        count += 1
    if count:
        graph.lint()
    return count


_RESHAPES = (ATEN.view.default, ATEN.reshape.default, ATEN._unsafe_view.default, ATEN.alias.default)


def _zeros(node: fx.Node) -> bool:
    """A fresh tensor of zeros: ``zeros``, ``new_zeros``, or ``full``/``new_full`` with 0."""
    if node.op != "call_function":
        return False
    if node.target in (ATEN.zeros.default, ATEN.new_zeros.default):
        return True
    if node.target is ATEN.full.default:
        return node.args[1] == 0
    return node.target is ATEN.new_full.default and node.args[2] == 0


def _size_queries(node: fx.Node) -> list[fx.Node] | None:
    """The users of ``node`` that read one of its sizes, each answerable from the size list ``node`` was made
    with (a reshape's or a fresh tensor's); None if one is not."""
    queries = [u for u in node.users if u.target is ATEN.sym_size.int]
    sizes = _made_with_size(node)
    if queries and (sizes is None or any(sizes[q.args[1]] == -1 for q in queries)):
        return None
    return queries


def _made_with_size(node: fx.Node) -> list | None:
    if node.target in (ATEN.view.default, ATEN.reshape.default, ATEN._unsafe_view.default):
        return list(node.args[1])
    if node.target in (ATEN.zeros.default, ATEN.full.default):
        return list(node.args[0])
    if node.target in (ATEN.new_zeros.default, ATEN.new_full.default):
        return list(node.args[1])
    if node.target is ATEN.index_add.default:
        return _made_with_size(node.args[0])
    return None


def _answer_size_queries(node: fx.Node) -> None:
    """Replace each ``sym_size(node, d)`` by the size ``node`` was made with (a SymInt node or an int)."""
    sizes = _made_with_size(node)
    for query in [u for u in node.users if u.target is ATEN.sym_size.int]:
        size = sizes[query.args[1]]
        for user in list(query.users):
            user.args = fx.map_arg(user.args, lambda a, q=query, v=size: v if a is q else a)
            user.kwargs = fx.map_arg(user.kwargs, lambda a, q=query, v=size: v if a is q else a)
        query.graph.erase_node(query)


def _scatter_into_zeros(node: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """``(index_add, [reshapes after it])`` when ``node`` is, through reshapes that nothing else reads but for their
    sizes, an ``index_add`` into fresh zeros that nothing else reads."""
    chain = []

    def value_users(n: fx.Node) -> int:
        queries = _size_queries(n)
        return -1 if queries is None else len(n.users) - len(queries)

    while node.op == "call_function" and node.target in _RESHAPES and value_users(node) == 1:
        chain.append(node)
        node = node.args[0]
    if node.op != "call_function" or node.target is not ATEN.index_add.default or value_users(node) != 1:
        return None
    base = node.args[0]
    if not isinstance(base, fx.Node) or not _zeros(base) or value_users(base) != 1:
        return None
    return node, chain[::-1]


def scatters_into_sums(graph: fx.Graph) -> int:
    """``a + index_add(zeros, dim, index, src)`` (through reshapes) -> ``index_add(a, dim, index, src)`` where
    ``a`` has the sum's shape and dtype: the same sum, one buffer fewer. Returns the count of rewrites."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not ATEN.add.Tensor or node.kwargs or len(node.args) != 2:
            continue
        out = node.meta.get("val")
        for other, scattered in (node.args, node.args[::-1]):
            if other is scattered:  # s + s: the scatter has two uses
                continue
            found = _scatter_into_zeros(scattered) if isinstance(scattered, fx.Node) else None
            value = other.meta.get("val") if isinstance(other, fx.Node) else None
            if found is None or not all(isinstance(v, torch.Tensor) for v in (value, out, scattered.meta.get("val"))) \
                    or not value.shape == scattered.meta["val"].shape == out.shape \
                    or not value.dtype == scattered.meta["val"].dtype == out.dtype:
                continue  # a broadcast or a type promotion: not the same sum in place
            index_add, chain = found
            zeros = index_add.args[0]
            for replaced in (zeros, index_add, *chain):
                _answer_size_queries(replaced)
            size = zeros.args[0] if zeros.target in (ATEN.zeros.default, ATEN.full.default) else zeros.args[1]
            with graph.inserting_before(node):
                flat = graph.call_function(ATEN.reshape.default, (other, size))
                result = graph.call_function(ATEN.index_add.default, (flat, *index_add.args[1:]), index_add.kwargs)
                made = [(flat, zeros), (result, index_add)]
                for reshape in chain:
                    result = graph.call_function(reshape.target, (result, *reshape.args[1:]), reshape.kwargs)
                    made.append((result, reshape))
            for new, old in made:  # the same values as the nodes they replace
                new.meta.update(old.meta)
            result.meta.update(node.meta)  # the sum's own tags
            node.replace_all_uses_with(result)
            for dead in (node, *reversed(chain), index_add, zeros):
                graph.erase_node(dead)
            count += 1
            break
    return count
