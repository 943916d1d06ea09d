"""The per-sample pass: give every shared value that depends on the batch a per-sample twin ``[n, *shape]``.

Pre-condition (checked): the graph has no sample mixing (``find_mixing`` is empty) and ``targets`` carry no
batch dimension. Post-condition (checked): every target has a per-sample node whose value is
``[n, *target.shape]``; the graph lints; nothing of the original graph is removed (dead nodes go at DCE).

The *region* is the set of nodes between the batch and the targets that carry no batch dimension: the
contractions (batched inputs, shared output) and what follows them. In a backward graph the targets are the
parameter gradients; in a forward graph the target is the loss, and the region is the loss head.
"""

from __future__ import annotations

import logging
import operator
import re
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from .._analyze import ops
from .._analyze.batch_dims import BatchDims, value_of
from .._analyze.layout import layout_stop
from .._analyze.source import source_line
from .._errors import InternalError, UnsupportedError
from .contraction import Contraction
from .emit import emit
from .fallback import fallback_contraction, fallback_lift
from .registry import lift_rule_for
from .rules.lift import flat_nodes, is_linear_lift
from .table import CONTRACTION_RULES

log = logging.getLogger("compiled_psg")


@dataclass
class RewriteRecord:
    """One node of the region and what became of it."""

    node: str
    op: str
    rule: str  # the rule's name, or "fallback:vmap"
    kind: str  # "contraction" or "lift"
    shape: tuple
    source: str
    linear: bool = True  # for lifts: linear in their per-sample inputs


@dataclass
class LiftResult:
    per_sample: dict[fx.Node, fx.Node] = field(default_factory=dict)
    contractions: dict[fx.Node, Contraction] = field(default_factory=dict)
    records: list[RewriteRecord] = field(default_factory=list)
    region: list[fx.Node] = field(default_factory=list)

    @property
    def fallbacks(self) -> list[RewriteRecord]:
        return [r for r in self.records if r.rule.startswith("fallback")]


def _depends_on_batch(graph: fx.Graph, batch: BatchDims) -> dict[fx.Node, bool]:
    depends: dict[fx.Node, bool] = {}
    for node in graph.nodes:
        if node.target in ops.SHAPE_ONLY and not batch.is_batched(node):
            # the tensor argument gives only the shape, dtype and device; a fill value may be the batch size
            # (``x.new_full((), len(x))``)
            depends[node] = any(depends[a] for a in node.all_input_nodes
                                if not isinstance(value_of(a), torch.Tensor))
            continue
        value = value_of(node)
        here = batch.is_batched(node)
        if isinstance(value, (torch.SymInt, torch.SymFloat)):
            here = batch.symbol in value.node.expr.free_symbols
        depends[node] = here or any(depends[a] for a in node.all_input_nodes)
    return depends


def find_region(graph: fx.Graph, targets: list[fx.Node], batch: BatchDims) -> list[fx.Node]:
    """Shared-valued nodes that reach a target through shared-valued nodes only, and depend on the batch.

    Shared side inputs of batched ops (``total_weight`` of a loss, a parameter's transpose) are not in it: their
    per-sample value is never needed.
    """
    depends = _depends_on_batch(graph, batch)
    wanted: set[fx.Node] = set()
    stack = list(targets)
    while stack:
        n = stack.pop()
        if n in wanted or n.op != "call_function" or batch.is_batched(n) or not depends[n]:
            continue
        wanted.add(n)
        if n.target is operator.getitem and not batch.is_batched(n.args[0]):
            stack.extend(n.args[0].all_input_nodes)  # a wholly shared multi-output op: look through it
        elif n.target is not operator.getitem:
            stack.extend(n.all_input_nodes)
    return [n for n in graph.nodes if n in wanted and isinstance(value_of(n), torch.Tensor)]


def _effective_op(node: fx.Node) -> fx.Node:
    return node.args[0] if node.target is operator.getitem else node


def _batch_value(value, batch: BatchDims):
    """A SymInt/SymFloat/SymBool that depends on the batch size, evaluated for a batch of one (per-sample
    semantics: ``loss / len(x)``, ``loss * (len(x) > 1)``)."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) \
            and batch.symbol in value.node.expr.free_symbols:
        result = value.node.expr.subs(batch.symbol, 1)
        if isinstance(value, torch.SymBool):
            return bool(result)
        return int(result) if isinstance(value, torch.SymInt) else float(sympy.N(result))
    return None


def substitute_batch_values(graph: fx.Graph, node: fx.Node, batch: BatchDims) -> fx.Node:
    """A copy of ``node`` whose batch-size-valued scalar arguments (``loss / x.shape[0]``) read 1 instead of n."""
    changed = False

    def replace(arg):
        nonlocal changed
        if isinstance(arg, fx.Node):
            concrete = _batch_value(value_of(arg), batch)
            if concrete is not None:
                changed = True
                return concrete
        return arg

    args = fx.map_arg(node.args, replace)
    kwargs = fx.map_arg(node.kwargs, replace)
    if not changed:
        return node
    with graph.inserting_before(node):
        twin = graph.call_function(node.target, args, kwargs)
    twin.meta = dict(node.meta)
    return twin


def _view_root(node):
    """The tensor a chain of views reads (``as_strided(new_zeros(...))`` -> ``new_zeros``)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        alias = returns[0].alias_info if len(returns) == 1 else None
        if alias is None or alias.is_write or not node.args or not isinstance(node.args[0], fx.Node):
            return node
        node = node.args[0]
    return node


def refuse_hidden_writes(graph: fx.Graph, targets: list[fx.Node], batch: BatchDims) -> None:
    """Pre-condition of the per-sample pass: no value that depends on the batch reaches a target along no edge.
    An in-place write of such a value into a view of a buffer that does not (``as_strided``'s backward:
    ``copy_(as_strided(new_zeros(...)), grad)``, then a second view of the buffer returned as the gradient) is seen
    by the buffer's later readers, but the pass would take them for independent of the batch and give every sample
    the whole batch's gradient. Refused by name. (A write into a buffer computed from the batch is lifted with it.)"""
    order = {n: i for i, n in enumerate(graph.nodes)}
    depends = None
    writes = []  # (position, written root, node)
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        arguments = node.target._schema.arguments  # positional first (fewer than the schema's), then by name
        given = [*zip(arguments, node.args, strict=False),
                 *((a, node.kwargs[a.name]) for a in arguments if a.name in node.kwargs)]
        for argument, value in given:
            if argument.alias_info is None or not argument.alias_info.is_write or not isinstance(value, fx.Node):
                continue
            depends = depends or _depends_on_batch(graph, batch)
            root = _view_root(value)
            if not depends[root] and any(depends[a] for a in node.all_input_nodes):
                writes.append((order[node], root, node))
    if not writes:
        return
    def user_line(writer: fx.Node, read: fx.Node) -> str:
        """A backward's nodes carry no source line: the user's line of a forward op of the kind that reads the
        written tensor (as_strided's backward reads its buffer through as_strided)."""
        line = source_line(writer)
        forward = [n for n in graph.nodes if n.target is read.target and n.meta.get("stack_trace")]
        return source_line(forward[0]) if "unknown" in line and forward else line

    seen, stack = set(), list(targets)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for position, root, writer in writes:
            if order[n] > position and _view_root(n) is root:
                raise UnsupportedError(
                    f"the backward of {n.target} at {user_line(writer, n)} writes in place ({writer.target}) into "
                    "a buffer that a parameter's gradient then reads through a view: compiled_psg follows values "
                    "along the graph's edges and cannot give that write its per-sample form. Fix: use an op whose "
                    "backward is functional (for as_strided on a parameter: t(), transpose, permute or view)")
        stack.extend(n.all_input_nodes)


def lift_to_per_sample(graph: fx.Graph, targets: list[fx.Node], batch: BatchDims) -> LiftResult:
    for t in targets:
        if batch.is_batched(t):
            raise InternalError(f"pre-condition: target {t.name} must not carry the batch")
    refuse_hidden_writes(graph, targets, batch)
    result = LiftResult(region=find_region(graph, targets, batch))
    ps = result.per_sample
    for node in result.region:
        op_node = _effective_op(node)
        args = flat_nodes(op_node)
        batched_args = [a for a in args if batch.is_batched(a)]
        if op_node.target in ops.SHAPE_ONLY and batched_args == [op_node.args[0]]:
            batched_args = []  # x.new_full((), len(x)): x gives the dtype and device, its values are not read
        after = node.next
        if batched_args:
            if any(a in ps for a in args):
                raise UnsupportedError(
                    f"{op_node.target} at {source_line(node)} combines per-sample values of the loss head with "
                    "batched values; return per-sample losses of shape [B] from the loss function instead")
            rule = CONTRACTION_RULES.get(op_node.target)
            contraction = rule(node, batch) if rule is not None else None
            if contraction is None:
                contraction = fallback_contraction(node, batch)
                if contraction is None:
                    raise _no_layout(node, op_node, batch)
                log.warning("compiled_psg: no rule for %s (%s); using the vmap fallback for this op",
                            op_node.target, source_line(node))
            ps[node] = _emit_rule(graph, contraction.per_sample, contraction.inputs, contraction.rule, after, op_node,
                                  node)
            if contraction.rule.startswith("fallback"):
                _refuse_if_batch_pinned(ps[node], op_node, node, batch)
            result.contractions[node] = contraction
            result.records.append(RewriteRecord(node.name, str(op_node.target), contraction.rule, "contraction",
                                                tuple(value_of(ps[node]).shape), source_line(node)))
            continue
        if not any(a in ps for a in args):
            # depends on the batch only through its size (``torch.full([], n)``): evaluate for a batch of one
            twin = substitute_batch_values(graph, node, batch)
            source, dim = batch_size_source(graph, batch)
            ps[node] = emit(graph, _broadcast_over_batch(dim), [source, twin], tag="constant_per_sample", before=after)
            result.records.append(RewriteRecord(node.name, str(op_node.target), "constant_per_sample", "lift",
                                                tuple(value_of(ps[node]).shape), source_line(node)))
            continue
        twin = substitute_batch_values(graph, op_node, batch) if op_node is node else node
        lift_args = flat_nodes(_effective_op(twin))
        lifted = [a in ps for a in lift_args]
        rule = lift_rule_for(twin)
        fn = rule(twin, lifted) if rule is not None else None
        name = getattr(rule, "__name__", "?")
        if fn is None:
            fn = fallback_lift(twin, lifted)
            name = "fallback:vmap"
            log.warning("compiled_psg: no lift rule for %s (%s); using the vmap fallback for this op",
                        op_node.target, source_line(node))
        ps[node] = _emit_rule(graph, fn, [ps.get(a, a) for a in lift_args], name, after, op_node, node)
        if name.startswith("fallback"):
            _refuse_if_batch_pinned(ps[node], op_node, node, batch)
        result.records.append(RewriteRecord(node.name, str(op_node.target), name, "lift",
                                            tuple(value_of(ps[node]).shape), source_line(node),
                                            linear=is_linear_lift(twin, lifted)))
    for t in targets:
        if t in ps:
            expected = tuple(value_of(t).shape)
            got = tuple(value_of(ps[t]).shape)[1:]
            if got != expected:
                raise InternalError(f"post-condition: per-sample {t.name} has shape {got}, expected {expected}")
    graph.lint()
    return result


# torch's words where a kernel or shape function needs a size as a number ("SymIntArrayRef expected to contain
# only concrete integers", "Cannot call sizes() on tensor with symbolic sizes/strides")
_SYMBOLIC_SIZE_FAILURE = re.compile(r"concrete integers|symbolic sizes|SymInt", re.IGNORECASE)


def _emit_rule(graph: fx.Graph, fn, inputs: list, tag: str, before: fx.Node, op_node: fx.Node, node: fx.Node):
    """Emit a rule's per-sample form; where the vmap fallback's trace fails (torch's batching rule or shape
    function of the op cannot take a symbolic batch size: ``linalg_solve_triangular`` in the backward of
    ``cholesky`` and ``lu_factor``), refuse naming the op instead of failing the capture as a whole."""
    if not tag.startswith("fallback"):
        return emit(graph, fn, inputs, tag=tag, before=before)
    try:
        return emit(graph, fn, inputs, tag=tag, before=before)
    except RuntimeError as e:
        if not _SYMBOLIC_SIZE_FAILURE.search(str(e)):
            raise  # a failure of the op itself (kthvalue(2) of one sample, sparse tensors): the capture names it
        first = (str(e).strip().splitlines() or [""])[0]
        where = _where(node)
        raise UnsupportedError(
            f"no rule for {op_node.target} {where}, and the vmap fallback for it fails with a "
            f"symbolic batch size ({type(e).__name__}: {first}). Fix: compute this step with ops that have rules "
            "(docs/supported-ops.md; for a solve with a matrix factored from a parameter, make the factor the "
            "parameter or use torch.linalg.solve), or add a rule in compiled_psg/_rewrite/rules "
            "(docs/contributing.md)") from e


def _no_layout(node: fx.Node, op_node: fx.Node, batch: BatchDims) -> UnsupportedError:
    """No rule, and no fallback: the layout of a batched input is unknown. Where the batch is merged with another
    dimension (``[B*T, ...]`` rows of ``x.flatten(0, 1)``), the layout walk (``_analyze/layout.py``) lost which rows
    belong to which sample at an op it has no fact for; the user can view the rows back to ``[B, T, ...]``."""
    where = _where(node)
    merged = [(a, d) for a in flat_nodes(op_node) for d in batch.dims(a) if not batch.is_whole(a, d)]
    if merged:
        value, dim = merged[0]
        shape = ", ".join(str(s).replace(str(batch.symbol), "B") for s in value_of(value).shape)
        stop = layout_stop(value, dim, batch)
        if stop is None:
            lost = "an op between the merge (x.flatten(0, 1), torch.cat, repeat) and here has no layout rule"
            ask = "the ops in between"
        else:
            lost = (f"the layout walk (compiled_psg/_analyze/layout.py) has no rule to follow the rows through "
                    f"{_op_name(stop)} {_where(stop)}")
            ask = _op_name(stop)
        return UnsupportedError(
            f"{op_node.target} {where} reads a value whose batch dimension is merged with another one ({shape}), "
            f"and compiled_psg cannot tell which of its rows belong to which sample: {lost}. Fix: view the merged "
            "rows back to [B, T, ...] right after the layer that needs them merged (h = conv(x.flatten(0, 1)); h = "
            f"h.view(x.shape[0], -1, *h.shape[1:])), or open an issue naming {ask}")
    return UnsupportedError(
        f"no rule for {op_node.target} {where}, and the vmap fallback cannot find the batch dimension of its "
        "inputs. Add a rule in compiled_psg/_rewrite/rules (docs/contributing.md) or open an issue with this message")


def _op_name(node: fx.Node) -> str:
    target = node.target
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


def _where(node: fx.Node) -> str:
    """``at <the user's line>``, or for a backward node (which carries none) ``in the backward of <the line of
    the forward value it reads>``."""
    line = source_line(node)
    return f"in the backward of {_forward_line(node)}" if line.startswith("unknown") else f"at {line}"


def _forward_line(node: fx.Node) -> str:
    """A backward node carries no source line: the line of the nearest forward tensor it reads (a convolution's
    backward reads the convolution's input; a size read from a forward tensor, ``B, N, C = x.shape``, is not the
    op)."""
    seen, queue = {node}, list(node.all_input_nodes)
    while queue:
        n = queue.pop(0)
        if n.meta.get("stack_trace") and isinstance(value_of(n), torch.Tensor):
            return source_line(n)
        queue += [a for a in n.all_input_nodes if a not in seen]
        seen.update(n.all_input_nodes)
    return "the loss"


def _refuse_if_batch_pinned(emitted: fx.Node, op_node: fx.Node, node: fx.Node, batch: BatchDims) -> None:
    """vmap's batching rules can read sizes and fix the batch size: then the fallback is no use for this op."""
    env = getattr(detect_fake_mode([value_of(emitted)]), "shape_env", None)
    if env is not None and batch.symbol in env.replacements:
        raise UnsupportedError(
            f"no rule for {op_node.target} {_where(node)}, and its vmap fallback fixes the batch size. "
            "Add a rule in compiled_psg/_rewrite/rules (docs/contributing.md) or open an issue with this message")


def batch_size_source(graph: fx.Graph, batch: BatchDims) -> tuple[fx.Node, int]:
    """A tensor node and dimension whose size is exactly the batch size."""
    for node in graph.nodes:
        if node.op == "placeholder" and isinstance(value_of(node), torch.Tensor):
            for d in batch.dims(node):
                if batch.is_whole(value_of(node), d):
                    return node, d
    raise InternalError("no input has the batch as a whole dimension")


def _broadcast_over_batch(dim: int):
    """``(ref, v) -> [n, *v.shape]`` with ``n = ref.shape[dim]`` (two arguments only: ``emit`` traces them all)."""
    def run(ref, v):
        return v.unsqueeze(0).expand([ref.shape[dim]] + list(v.shape))
    return run


def broadcast_per_sample(graph: fx.Graph, shared: fx.Node, batch: BatchDims) -> fx.Node:
    """A shared value every sample receives whole (a regularizer's gradient): ``[n, *shape]``."""
    source, dim = batch_size_source(graph, batch)
    return emit(graph, _broadcast_over_batch(dim), [source, shared], tag="shared_per_sample")
