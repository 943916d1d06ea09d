"""The math of reducing per-sample gradients inside the graph, per parameter, without materializing them.

For each parameter the context knows its contractions (from the per-sample pass) and the ops between them and
the gradient (the *tail*). It picks the cheapest exact form per layer and records the choice:

- squared norms: the rule's ghost norm (``||g_n|| ||x_n||``, ``<G G^T, X X^T>``) when the tail only reshapes
  and the cost model prefers it; else materialize ``[n, *shape]`` and reduce at once (Inductor fuses it).
- weighted sums over samples (``clip_sum``): scale the cotangent rows and redo the contraction, then replay the
  tail (book-keeping: exact because the gradient is linear in the cotangent); else from the materialized value.
- sums of squares, Gram matrices: from the low-rank factors where ``t == 1``, else materialize.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .._analyze import ops
from .._analyze.batch_dims import BatchDims
from .._analyze.layout import scale_batch
from .._rewrite.contraction import Contraction, factored_gram, factored_sum_squares, ghost_is_cheaper
from .._rewrite.emit import emit
from .._rewrite.per_sample_pass import LiftResult, broadcast_per_sample

ATEN = torch.ops.aten
# ops that only rearrange the elements (norms and Gram matrices pass through them unchanged)
_ISOMETRIC = ops.VIEWS | (ops.IDENTITY - {ATEN._to_copy.default}) | {ATEN.t.default, ATEN.transpose.int,
                                                                     ATEN.permute.default}


@dataclass
class ParamGrad:
    """One parameter's gradient in the rewritten graph."""

    name: str
    shape: tuple[int, ...]
    grad: fx.Node | None  # the ordinary (batch-summed) gradient node; None when the loss does not use it
    contractions: list[Contraction] = field(default_factory=list)
    tail: list[fx.Node] = field(default_factory=list)  # region nodes between contractions and grad, in order
    linear_tail: bool = True


@dataclass
class Choice:
    quantity: str
    method: str
    cost: dict[str, float] = field(default_factory=dict)


class ReduceContext:
    """Emits reductions of per-sample gradients into ``graph``; one instance per rewrite."""

    def __init__(self, graph: fx.Graph, batch: BatchDims, lifted: LiftResult, params: list[ParamGrad],
                 batch_ref: fx.Node):
        self.graph, self.batch, self.lifted, self.params = graph, batch, lifted, params
        self._batch_ref = batch_ref  # a node of shape [n] (the per-sample losses): sizes for new tensors
        self.choices: dict[str, list[Choice]] = {p.name: [] for p in params}
        self._materialized: dict[str, fx.Node] = {}

    # ----- helpers -----
    def emit(self, fn, inputs, tag: str):
        return emit(self.graph, fn, inputs, tag=tag)

    def _note(self, p: ParamGrad, quantity: str, method: str, **cost):
        self.choices[p.name].append(Choice(quantity, method, cost))

    def _single_isometric(self, p: ParamGrad) -> Contraction | None:
        if len(p.contractions) != 1:
            return None
        if all(_target(n) in _ISOMETRIC for n in p.tail):
            return p.contractions[0]
        return None

    # ----- the quantities -----
    def per_sample(self, p: ParamGrad) -> fx.Node:
        """``[n, *shape]``, the materialized per-sample gradient."""
        if p.name not in self._materialized:
            if p.grad is None:
                ref = self._batch_ref
                shape = p.shape
                node = self.emit(lambda r: r.new_zeros([r.shape[0]] + list(shape)), [ref], "unused_parameter")
            elif p.grad in self.lifted.per_sample:
                node = self.lifted.per_sample[p.grad]
            else:
                node = broadcast_per_sample(self.graph, p.grad, self.batch)
            self._materialized[p.name] = node
        return self._materialized[p.name]

    def total(self, p: ParamGrad) -> fx.Node:
        """The sum over samples: the ordinary gradient the joint graph already computes."""
        if p.grad is None:
            shape = p.shape
            return self.emit(lambda r: r.new_zeros(shape), [self._batch_ref], "unused_parameter")
        return p.grad

    def sq_norms(self, p: ParamGrad) -> fx.Node:
        """``[n]`` squared L2 norms of the per-sample gradients of ``p``."""
        c = self._single_isometric(p)
        if c is not None and c.sq_norms is not None:
            t, o, i = c.factor_shape or (1, 1, 1)
            cost = {"t": t, "ghost_flops": 2 * t * t * (o + i) if t > 1 else o + i, "materialize_flops": t * o * i}
            if c.factor_shape is None or ghost_is_cheaper(t, o, i):
                self._note(p, "sq_norm", "ghost", **(cost if c.factor_shape else {}))
                return self.emit(c.sq_norms, c.inputs, f"ghost_norm[{c.rule}]")
            self._note(p, "sq_norm", "materialize", **cost)
        else:
            self._note(p, "sq_norm", "materialize")
        ps = self.per_sample(p)
        return self.emit(lambda g: g.reshape(g.shape[0], -1).pow(2).sum(1), [ps], "sq_norm")

    def weighted_sum(self, p: ParamGrad, weights: fx.Node) -> fx.Node:
        """``sum_n weights[n] * g_n`` for ``weights`` of shape ``[n]``."""
        if p.grad is None:
            return self.total(p)
        if p.grad in self.lifted.per_sample and p.linear_tail and all(
                c.rebuild is not None and c.linear_arg is not None for c in p.contractions):
            replaced = {}
            for c in p.contractions:
                dim, layout = c.linear_layout
                arg = c.linear_arg

                def scaled(*values, _c=c, _dim=dim, _layout=layout, _arg=arg):
                    *inputs, w = values
                    inputs[_arg] = scale_batch(inputs[_arg], w, _dim, _layout)
                    return _c.rebuild(*inputs)

                replaced[c.node] = self.emit(scaled, [*c.inputs, weights], f"book_keeping[{c.rule}]")
            self._note(p, "weighted_sum", "book-keeping")
            return self.replay_tail(p, replaced)
        self._note(p, "weighted_sum", "materialize")
        ps = self.per_sample(p)
        return self.emit(lambda g, w: torch.tensordot(w.to(g.dtype), g, dims=1), [ps, weights], "weighted_sum")

    def sum_squares(self, p: ParamGrad) -> fx.Node:
        """``sum_n g_n ** 2`` (elementwise)."""
        c = self._single_isometric(p)
        if c is not None and c.factors is not None and (c.factor_shape or (0,))[0] == 1:
            self._note(p, "sum_squares", "factored")
            node = self.emit(lambda *v: factored_sum_squares(*c.factors(*v)), c.inputs, f"sum_squares[{c.rule}]")
            return self.replay_tail(p, {c.node: node})
        self._note(p, "sum_squares", "materialize")
        return self.emit(lambda g: g.pow(2).sum(0), [self.per_sample(p)], "sum_squares")

    def variance(self, p: ParamGrad) -> fx.Node:
        """Population variance over samples, per coordinate.

        Two passes over the materialized value (no cancellation) unless a factored sum of squares avoids
        materializing; then ``E[g^2] - E[g]^2``, which loses digits when the samples' gradients nearly agree.
        """
        ref = self._batch_ref
        c = self._single_isometric(p)
        if c is not None and c.factors is not None and (c.factor_shape or (0,))[0] == 1:
            total, squares = self.total(p), self.sum_squares(p)
            self._note(p, "variance", "factored")
            return self.emit(lambda s, q, r: (q / r.shape[0] - (s / r.shape[0]).pow(2)).clamp_min(0),
                             [total, squares, ref], "variance")
        self._note(p, "variance", "materialize")
        return self.emit(lambda g: g.var(0, unbiased=False), [self.per_sample(p)], "variance")

    def gram(self, p: ParamGrad) -> fx.Node:
        """``[n, n]`` inner products of the per-sample gradients of ``p``."""
        c = self._single_isometric(p)
        if c is not None and c.factors is not None:
            t, o, i = c.factor_shape
            if t == 1 or t * t * (o + i) < o * i:
                self._note(p, "gram", "factored", t=t)
                return self.emit(lambda *v: factored_gram(*c.factors(*v)), c.inputs, f"gram[{c.rule}]")
        self._note(p, "gram", "materialize")
        return self.emit(lambda g: g.reshape(g.shape[0], -1) @ g.reshape(g.shape[0], -1).T, [self.per_sample(p)],
                         "gram")

    def replay_tail(self, p: ParamGrad, replaced: dict[fx.Node, fx.Node]) -> fx.Node:
        """Copy the tail from the contractions to ``p.grad`` with some contractions replaced."""
        env = dict(replaced)
        with self.graph.inserting_before(self.graph.output_node()):
            for node in p.tail:
                if node in env:
                    continue
                new = self.graph.node_copy(node, lambda n: env.get(n, n))
                new.meta["psg"] = "tail_replay"
                env[node] = new
        return env.get(p.grad, p.grad)


def _target(node: fx.Node):
    if node.target is operator.getitem:
        return node.args[0].target
    return node.target


def collect_param_grads(names: list[str], grads: list[fx.Node | None], shapes: list[tuple],
                        lifted: LiftResult) -> list[ParamGrad]:
    """Group the region of the per-sample pass by parameter: its contractions and its tail."""
    region = set(lifted.region)
    linear_by_node = {r.node: r.linear for r in lifted.records if r.kind == "lift"}
    result = []
    for name, grad, shape in zip(names, grads, shapes, strict=True):
        p = ParamGrad(name, tuple(shape), grad)
        if grad is not None and grad in lifted.per_sample:
            seen: set[fx.Node] = set()
            stack, nodes = [grad], []
            while stack:
                n = stack.pop()
                if n in seen or n not in region:
                    continue
                seen.add(n)
                nodes.append(n)
                if n in lifted.contractions:
                    continue
                if n.target is operator.getitem:  # replaying it needs its multi-output op too
                    op = n.args[0]
                    if op not in seen:
                        seen.add(op)
                        nodes.append(op)
                    stack.extend(op.all_input_nodes)
                else:
                    stack.extend(n.all_input_nodes)
            order = {n: i for i, n in enumerate(grad.graph.nodes)}
            nodes.sort(key=order.__getitem__)
            p.contractions = [lifted.contractions[n] for n in nodes if n in lifted.contractions]
            p.tail = [n for n in nodes if n not in lifted.contractions]
            p.linear_tail = all(linear_by_node.get(n.name, False) for n in p.tail if n in region)
        result.append(p)
    return result

