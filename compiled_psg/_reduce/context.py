"""The context reductions are emitted through: per parameter, its contractions and its tail, and the choice of
strategy for each quantity.

For each parameter the context knows its contractions (from the per-sample pass) and the ops between them and
the gradient (the *tail*). Each quantity (squared norms, weighted sums, sums of squares, variance, Gram) is
computed by the cheapest exact strategy of ``strategies.py`` that applies to the parameter; the choice and its
estimated FLOPs and bytes are recorded (``psg.explain`` shows them).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .._analyze import ops
from .._analyze.batch_dims import BatchDims, value_of
from .._rewrite.contraction import Contraction
from .._rewrite.emit import emit
from .._rewrite.per_sample_pass import LiftResult, broadcast_per_sample
from .strategies import SUM_AFTER, ParamGrad, choose, emit_strategy, fit_memory

ATEN = torch.ops.aten
# ops that only rearrange the elements (norms and Gram matrices pass through them unchanged)
_ISOMETRIC = ops.VIEWS | (ops.IDENTITY - {ATEN._to_copy.default}) | {ATEN.t.default, ATEN.transpose.int,
                                                                     ATEN.permute.default}


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
        self._norm_strategy: dict[str, str] = {}
        self._assigned: dict[str, dict[str, str]] = {}  # quantity -> {parameter: strategy} (fit_memory)
        self._summed: dict[str, list | None] = {}  # summed_contractions, by parameter
        self.memory_plan: dict | None = None  # what fit_memory planned, for psg.explain
        self._forward: set[fx.Node] | None = None  # the per-sample losses and every node they depend on
        # a weight of 0 drops a sample whatever its values (a DP step's factor for a gradient that is not finite):
        # a book-keeping sum then zeroes the sample in every operand, not only the one it scales
        self.drops_samples = False

    def batch_size_hint(self) -> int:
        """The batch size of the capture's example inputs (the batch is symbolic; this is its hint)."""
        size = value_of(self._batch_ref).shape[0]
        return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)

    def in_forward(self, node: fx.Node) -> bool:
        """Whether ``node`` is an activation, not a value of the backward: the per-sample losses depend on it, or it
        is a view of such a value that the backward took (``mm``'s weight gradient reads ``x.t()``)."""
        if self._forward is None:
            self._forward, stack = set(), [self._batch_ref]
            while stack:
                n = stack.pop()
                if n not in self._forward:
                    self._forward.add(n)
                    stack.extend(n.all_input_nodes)
        while node not in self._forward and _target(node) in _ISOMETRIC and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        return node in self._forward

    def assign(self, quantity: str, strategies: dict[str, str]) -> None:
        self._assigned[quantity] = strategies

    def assigned(self, quantity: str, p: ParamGrad) -> str | None:
        return self._assigned.get(quantity, {}).get(p.name)

    def fit_memory(self, quantity: str, params: list[ParamGrad], budget: float | None) -> None:
        """Plan ``quantity``'s strategies within ``budget`` bytes of per-sample values at the peak (None: the
        cheapest plan), at the batch size of the capture's example; ``memory_plan`` records it."""
        if budget is None or not params:
            return
        batch_size = self.batch_size_hint()
        fit = fit_memory(self, quantity, params, float(budget), batch_size)
        self.memory_plan = {"budget": float(budget), "batch_size": batch_size, "held": fit.held, "peak": fit.peak,
                            "held_by_cheapest": fit.held_by_cheapest, "peak_by_cheapest": fit.peak_by_cheapest,
                            "fits": fit.peak <= budget}

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

    # ----- the quantities: each picks the cheapest applicable strategy of strategies.py -----
    def compute(self, quantity: str, p: ParamGrad, *extra: fx.Node) -> fx.Node:
        """Emit ``quantity`` for ``p`` by the cheapest strategy that applies; record the choice and its cost."""
        strategy, cost, rejected = choose(self, quantity, p)
        details = {"flops": cost.flops, "bytes": cost.bytes}
        if cost.held:
            details["held"] = cost.held
        if rejected is not None and rejected[1].total < cost.total:
            details["for"] = "memory_budget"  # the budget moved it off the cheapest strategy
        if rejected is not None:
            other = rejected[1]
            held = f", {other.held:g} held" if other.held else ""
            details[f"vs {rejected[0]}"] = f"{other.flops:g} flops, {other.bytes:g} bytes{held}"
        # a clip norm is shown as the squared norm it is, its cost including the sum it bounds
        self._note(p, "sq_norm" if quantity == "clip_sq_norm" else quantity, strategy.name, **details)
        if quantity in ("sq_norm", "clip_sq_norm"):
            self._norm_strategy[p.name] = strategy.name
        return strategy.emit(self, p, *extra)

    def sq_norms(self, p: ParamGrad) -> fx.Node:
        """``[n]`` squared L2 norms of the per-sample gradients of ``p``."""
        return self.compute("sq_norm", p)

    def clip_sq_norms(self, p: ParamGrad) -> fx.Node:
        """``[n]`` squared norms that will clip ``weighted_sum(p, ...)``: the norm and the sum it bounds are
        priced together (strategies ``clip_sq_norm``), and ``weighted_sum`` then uses the sum that norm bounds."""
        return self.compute("clip_sq_norm", p)

    def weighted_sum(self, p: ParamGrad, weights: fx.Node) -> fx.Node:
        """``sum_n weights[n] * g_n`` for ``weights`` of shape ``[n]``.

        Weights are clip factors computed from the norms, and a clip bound holds for the values summed only if
        the norm bounds those values. A materialized norm is of ``fl(g_n)``; another strategy (book-keeping)
        rounds its sum of ``t`` terms per entry differently, and where the terms cancel (near-repeated tokens with
        opposite gradients) the two differ by more than ``g_n`` itself: 1.35 C got into a float32 sum. So after a
        materialized norm the sum is taken of the same materialized values, unless each entry is one product
        (``t = 1``, nothing to cancel) or the norm carries a bound on the book-keeping sum's rounding
        (``materialize, bounded``). A ghost norm is certified against both roundings
        (``contraction.certified_sq_norms``), so any sum strategy fits it."""
        if p.grad is None:
            return self.total(p)
        norm = self._norm_strategy.get(p.name)
        fitting = SUM_AFTER.get(norm)
        if norm == "materialize" and self.one_term_per_entry(p):
            fitting = None
        if fitting is not None:
            detail = "the values its norm was taken of" if fitting == "materialize" else "the sum its norm bounds"
            self._note(p, "weighted_sum", f"{fitting} ({detail})")
            return emit_strategy(self, "weighted_sum", fitting, p, weights)
        return self.compute("weighted_sum", p, weights)

    def one_term_per_entry(self, p: ParamGrad) -> bool:
        """Each entry of the per-sample gradient is one product (``a x^T`` for t = 1, a bias of ``[n, o]``)."""
        c = self.single_isometric(p)
        if c is None:
            return False
        terms = c.factor_shape[0] if c.factor_shape is not None else c.notes.get("terms_per_entry")
        return terms == 1

    def sum_squares(self, p: ParamGrad) -> fx.Node:
        """``sum_n g_n ** 2`` (elementwise)."""
        return self.compute("sum_squares", p)

    def variance(self, p: ParamGrad) -> fx.Node:
        """Population variance over samples, per coordinate."""
        return self.compute("variance", p)

    def gram(self, p: ParamGrad) -> fx.Node:
        """``[n, n]`` inner products of the per-sample gradients of ``p``."""
        return self.compute("gram", p)

    def input(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> fx.Node:
        """A new placeholder after the graph's own: a value the caller feeds at run time (``run(..., extra)``),
        such as clipping bounds that change every step without recompiling."""
        from torch._guards import detect_fake_mode

        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        with self.graph.inserting_after(placeholders[-1]):
            node = self.graph.placeholder(name)
        mode = detect_fake_mode([self._batch_ref.meta["val"]])
        ref = self._batch_ref.meta["val"]
        node.meta["val"] = mode.from_tensor(torch.zeros(shape, dtype=dtype, device=ref.device), static_shapes=True)
        node.meta["psg"] = "reduce_input"
        return node

    @property
    def batch_ref(self) -> fx.Node:
        return self._batch_ref

    def single_isometric(self, p: ParamGrad) -> Contraction | None:
        """The one contraction of ``p`` when the ops after it only rearrange elements (norms pass through)."""
        return self._single_isometric(p)

    def summed_contractions(self, p: ParamGrad) -> list[tuple[Contraction, bool]] | None:
        """The contractions of a matrix ``p`` whose gradient is their sum through ops that only rearrange
        elements (a weight tied between an embedding and a head: ``t(t(mm)) + embedding_dense_backward``), each
        with whether it reaches the gradient transposed; None for one contraction or any other tail. Read once per
        parameter (every strategy's price asks)."""
        if p.name not in self._summed:
            self._summed[p.name] = self._read_summed(p)
        return self._summed[p.name]

    def _read_summed(self, p: ParamGrad) -> list[tuple[Contraction, bool]] | None:
        if len(p.contractions) < 2 or len(p.shape) != 2:
            return None
        dtype = value_of(p.grad).dtype  # the certificate counts the rounding of one dtype
        if any(value_of(c.node).dtype != dtype for c in p.contractions):
            return None
        reached = {c.node: {c.node: False} for c in p.contractions}  # node -> {contraction node: transposed}
        for node in p.tail:
            value, inputs = value_of(node), [a for a in node.all_input_nodes if a in reached]
            if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.dtype != dtype:
                return None
            if node.target is ATEN.add.Tensor and len(inputs) == 2 and len(node.args) == 2 and not node.kwargs:
                left, right = (reached[a] for a in node.args)
                if left.keys() & right.keys() or value_of(node.args[0]).shape != value_of(node.args[1]).shape:
                    return None
                reached[node] = {**left, **right}
            elif len(node.all_input_nodes) == 1 and inputs and _target(node) in _ISOMETRIC:
                before = value_of(inputs[0]).shape
                if _is_transpose(node):
                    reached[node] = {c: not flipped for c, flipped in reached[inputs[0]].items()}
                elif value.shape == before and node.target is not ATEN.permute.default:
                    reached[node] = reached[inputs[0]]
                else:
                    return None
            else:
                return None
        final = reached.get(p.grad, {})
        if len(final) != len(p.contractions):
            return None
        by_node = {c.node: c for c in p.contractions}
        return [(by_node[n], flipped) for n, flipped in final.items()]

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


def _is_transpose(node: fx.Node) -> bool:
    """A 2-D transpose: ``t``, ``transpose(0, 1)`` or ``permute([1, 0])``."""
    if node.target is ATEN.t.default:
        return True
    if node.target is ATEN.transpose.int:
        return sorted(d % 2 for d in node.args[1:3]) == [0, 1]
    return node.target is ATEN.permute.default and [d % 2 for d in node.args[1]] == [1, 0]


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

