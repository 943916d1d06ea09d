"""The strategy table: for each quantity, the exact ways to compute it from one parameter's contractions.

Each strategy has ``applies(ctx, p) -> Cost | None`` (None: it does not apply to this parameter) and
``emit(ctx, p, *extra) -> node``. ``choose`` takes the cheapest by ``Cost.total``, the one cost function; a new
fast path is a new ``@strategy``. Costs are per sample, for a contraction whose per-sample gradient is
``g[n] = A[n]^T X[n]`` with ``A [n, t, o]`` and ``X [n, t, i]`` (index letters: n batch, t tokens or positions,
o out, i in); where a rule gives no such factors, ``P`` (the parameter's size) stands for both.

- ``sq_norm``: ``ghost`` (the rule's norm from the factors, ``<A A^T, X X^T>``, ``||a|| ||x||`` for t = 1) or
  ``materialize``;
- ``clip_sq_norm``: squared norms that clip a weighted sum of the same parameter (``clip_sum``, ``compile_step``).
  A clip factor bounds what is summed only if the norm bounds those values, so the norm and its sum are priced
  together: ``ghost`` (certified for any sum), ``materialize`` (the sum reuses the materialized values, kept alive
  until the clip factors are known) or ``materialize, bounded`` (the materialized norm plus a bound on the
  rounding of a book-keeping sum, so each per-sample gradient is freed after its norm);
- ``weighted_sum``: ``book-keeping`` (scale one sample's rows of the operand that is cheapest to scale, the
  cotangent or the layer input, redo the contraction, replay the tail) or ``materialize``;
- ``sum_squares``: ``factored`` (``(A*A)^T (X*X)`` for t = 1) or ``materialize``;
- ``variance``: ``factored`` (from the sum and the factored sum of squares) or ``materialize`` (two passes);
- ``gram``: ``factored`` (``sum_ts (A_n A_m^T)_ts (X_n X_m^T)_ts``) or ``materialize``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.fx as fx

from .._analyze.batch_dims import value_of
from .._analyze.layout import scale_batch, weighted_batch_sum
from .._heap import retains
from .._rewrite.contraction import (
    GHOST_WIDTH_BYTES,
    Contraction,
    bounded_materialized_sq_norms,
    cpu_rounds_in_float32,
    factored_gram,
    factored_sum_squares,
    float32_matmuls_highest,
    summed_factored_sq_norms,
)
from .._rewrite.per_sample_pass import LiftResult


@dataclass
class ParamGrad:
    """One parameter's gradient in the rewritten graph."""

    name: str
    shape: tuple[int, ...]
    grad: fx.Node | None  # the ordinary (batch-summed) gradient node; None when the loss does not use it
    contractions: list[Contraction] = field(default_factory=list)
    tail: list[fx.Node] = field(default_factory=list)  # region nodes between contractions and grad, in order
    linear_tail: bool = True


class ReduceContext(Protocol):
    """What a strategy prices and emits through: ``context.ReduceContext``, which calls the strategies (the plan
    does not import the emitter)."""

    lifted: LiftResult
    batch_ref: fx.Node
    drops_samples: bool

    def emit(self, fn: Callable, inputs: list, tag: str) -> fx.Node: ...
    def per_sample(self, p: ParamGrad) -> fx.Node: ...
    def total(self, p: ParamGrad) -> fx.Node: ...
    def single_isometric(self, p: ParamGrad) -> Contraction | None: ...
    def one_term_per_entry(self, p: ParamGrad) -> bool: ...
    def replay_tail(self, p: ParamGrad, replaced: dict[fx.Node, fx.Node]) -> fx.Node: ...
    def summed_contractions(self, p: ParamGrad) -> list[tuple[Contraction, bool]] | None: ...
    def assign(self, quantity: str, strategies: dict[str, str]) -> None: ...
    def assigned(self, quantity: str, p: ParamGrad) -> str | None: ...
    def in_forward(self, node: fx.Node) -> bool: ...

ITEMSIZE = 4  # bytes per element in the estimates; only the ratios between strategies matter
FLOPS_PER_BYTE = 4.0  # machine balance: a byte moved costs about this many FLOPs (2-core CPU: ~100 GF/s, 25 GB/s)
# A buffer kept alive across the program is not recycled between calls: each call faults in fresh zeroed pages,
# which costs about six more written bytes per byte (docs/benchmarks-probes.md, "Fresh pages cost more").
FRESH_PAGE_FACTOR = 6.0


def held_price() -> float:
    """Where the heap keeps freed memory (glibc, opted in: ``compiled_psg.retain_freed_memory``) a held buffer's
    pages are recycled and it costs its bytes alone; elsewhere its fresh pages every call."""
    return 0.0 if retains() else FRESH_PAGE_FACTOR


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float
    held: float = 0  # bytes kept alive across the rest of the program (not recycled between calls)
    # bytes alive at once while the strategy runs, freed before the next layer's (a per-sample gradient formed for
    # its norm alone, a ghost norm's float64 factors and Grams); where a strategy also holds, ``held`` counts them
    transient: float = 0

    @property
    def total(self) -> float:
        """The one cost function: FLOPs plus bytes weighted by the machine balance, and held bytes at the price
        of the fresh pages they take every call where the heap does not keep freed memory
        (``compiled_psg/_heap.py``)."""
        return self.flops + FLOPS_PER_BYTE * (self.bytes + held_price() * self.held)

    def __add__(self, other: Cost) -> Cost:
        """Work adds up; the parts run one after the other, so the larger transient is the one alive at once."""
        return Cost(self.flops + other.flops, self.bytes + other.bytes, self.held + other.held,
                    max(self.transient, other.transient))


@dataclass(frozen=True)
class Strategy:
    quantity: str
    name: str
    applies: Callable[[ReduceContext, ParamGrad], Cost | None]
    emit: Callable[..., fx.Node]


STRATEGIES: dict[str, list[Strategy]] = {}


def strategy(quantity: str, name: str, applies: Callable[[ReduceContext, ParamGrad], Cost | None]):
    """Register ``emit`` as a strategy for ``quantity``, applicable where ``applies`` gives a cost."""
    def register(emit: Callable[..., fx.Node]) -> Callable[..., fx.Node]:
        STRATEGIES.setdefault(quantity, []).append(Strategy(quantity, name, applies, emit))
        return emit
    return register


def priced(ctx: ReduceContext, quantity: str, p: ParamGrad) -> list[tuple[Strategy, Cost]]:
    """Every strategy of ``quantity`` that applies to ``p``, with its cost, cheapest first."""
    options = [(s, c) for s in STRATEGIES[quantity] if (c := s.applies(ctx, p)) is not None]
    if not options:
        from .._errors import InternalError

        raise InternalError(f"no strategy computes {quantity} for {p.name}")
    return sorted(options, key=lambda sc: sc[1].total)


def choose(ctx: ReduceContext, quantity: str, p: ParamGrad) -> tuple[Strategy, Cost, tuple[str, Cost] | None]:
    """The strategy the memory plan assigned (``fit_memory``), else the cheapest applicable one; its cost, and
    the runner-up (name, cost) if any."""
    options = priced(ctx, quantity, p)
    assigned = ctx.assigned(quantity, p)
    if assigned is not None:
        options.sort(key=lambda sc: sc[0].name != assigned)
    runner_up = (options[1][0].name, options[1][1]) if len(options) > 1 else None
    return options[0][0], options[0][1], runner_up


@dataclass(frozen=True)
class MemoryFit:
    """What ``fit_memory`` planned, in bytes at its batch size: the values held across the program, and the peak
    (held plus the largest transient of one parameter's strategy), for the assigned plan and the cheapest one."""

    held: float
    peak: float
    held_by_cheapest: float
    peak_by_cheapest: float


def fit_memory(ctx: ReduceContext, quantity: str, params: list[ParamGrad], budget: float,
               batch_size: int) -> MemoryFit:
    """Assign each parameter a strategy of ``quantity`` so that the peak of per-sample values fits ``budget``.

    The peak is what the plan holds across the program (``Cost.held``, per sample, times ``batch_size``) plus the
    largest transient beyond it (``Cost.transient``: one layer's per-sample gradient formed for its norm alone, a
    ghost norm's float64 Grams), since layers run one after another. For each cap on that transient: the cheapest
    plan whose strategies stay under the cap, then, while it does not fit, the move to a strategy holding less
    that costs least per byte freed. The result is the cheapest of those plans that fits, else the one with the
    lowest peak (over ``budget`` where no strategy holding less applies)."""
    options = {p.name: priced(ctx, quantity, p) for p in params}
    # Cost counts ITEMSIZE bytes per value of the gradient's dtype; the budget is in bytes
    scale = {p.name: batch_size * _itemsize(p) / ITEMSIZE for p in params}
    held = {n: [c.held * scale[n] for _, c in choices] for n, choices in options.items()}
    extra = {n: [max(0.0, c.transient - c.held) * scale[n] for _, c in choices] for n, choices in options.items()}
    price = {n: [c.total for _, c in choices] for n, choices in options.items()}

    def peak(pick: dict[str, int]) -> float:
        return sum(held[n][j] for n, j in pick.items()) + max((extra[n][j] for n, j in pick.items()), default=0.0)

    def total(pick: dict[str, int]) -> float:
        return sum(price[n][j] for n, j in pick.items())

    def best_move(name: str, current: int, allowed: list[int]) -> tuple[float, int] | None:
        """(extra cost per byte freed, option) of the cheapest move of ``name`` to an option holding less."""
        moves = [((price[name][j] - price[name][current]) / (held[name][current] - held[name][j]), j)
                 for j in allowed if held[name][j] < held[name][current]]
        return min(moves) if moves else None

    def free_held(pick: dict[str, int], allowed: dict[str, list[int]]) -> None:
        """Greedy moves until ``pick`` fits, each in O(log P): heaps of the moves (a move changes its own
        parameter's best move only) and of the transients, whose stale entries are skipped."""
        held_total = sum(held[n][j] for n, j in pick.items())
        moves = [(m[0], n, j, m[1]) for n, j in pick.items() if (m := best_move(n, j, allowed[n])) is not None]
        extras = [(-extra[n][j], n, j) for n, j in pick.items()]
        heapq.heapify(moves)
        heapq.heapify(extras)
        while True:
            while extras and pick[extras[0][1]] != extras[0][2]:
                heapq.heappop(extras)
            if held_total - (extras[0][0] if extras else 0.0) <= budget:
                return
            while moves and pick[moves[0][1]] != moves[0][2]:
                heapq.heappop(moves)
            if not moves:
                return
            _, name, current, j = heapq.heappop(moves)
            held_total += held[name][j] - held[name][current]
            pick[name] = j
            heapq.heappush(extras, (-extra[name][j], name, j))
            if (move := best_move(name, j, allowed[name])) is not None:
                heapq.heappush(moves, (move[0], name, j, move[1]))

    cheapest = dict.fromkeys(options, 0)
    plans = []
    for cap in sorted({e for values in extra.values() for e in values}):
        allowed = {n: [j for j, e in enumerate(values) if e <= cap] for n, values in extra.items()}
        if not all(allowed.values()):
            continue
        pick = {n: js[0] for n, js in allowed.items()}  # ``priced`` lists the cheapest first
        free_held(pick, allowed)
        plans.append(pick)
    fitting = [pick for pick in plans if peak(pick) <= budget]
    best = min(fitting, key=total) if fitting else min(plans, key=lambda pick: (peak(pick), total(pick)),
                                                        default=cheapest)
    ctx.assign(quantity, {name: options[name][j][0].name for name, j in best.items()})
    return MemoryFit(sum(held[n][j] for n, j in best.items()), peak(best),
                     sum(held[n][j] for n, j in cheapest.items()), peak(cheapest))


def _itemsize(p: ParamGrad) -> int:
    return ITEMSIZE if p.grad is None else value_of(p.grad).dtype.itemsize


def _float64_values(p: ParamGrad, values: float) -> float:
    """``values`` float64 values in ``Cost``'s unit, which ``fit_memory`` scales by the gradient's itemsize: the
    ghost norm's Grams and factor copies are float64 whatever the model's dtype."""
    return values * 8 * ITEMSIZE / _itemsize(p)


@contextlib.contextmanager
def preferred(quantity: str, name: str) -> Iterator[None]:
    """Price strategy ``name`` of ``quantity`` at zero wherever it applies, for the captures made inside: every
    parameter it applies to gets it, the others keep the cheapest (how tests and benchmarks force a plan)."""
    saved = STRATEGIES[quantity]

    def free(applies):
        return lambda ctx, p: None if applies(ctx, p) is None else Cost(0, 0)

    STRATEGIES[quantity] = [dataclasses.replace(s, applies=free(s.applies)) if s.name == name else s for s in saved]
    try:
        yield
    finally:
        STRATEGIES[quantity] = saved


def emit_strategy(ctx: ReduceContext, quantity: str, name: str, p: ParamGrad, *extra: fx.Node) -> fx.Node:
    """Emit the strategy ``name`` for ``quantity``, where a reduction needs that one (not the cheapest)."""
    return next(s for s in STRATEGIES[quantity] if s.name == name).emit(ctx, p, *extra)


# ----- shapes and the costs they imply -----


def _size(p: ParamGrad) -> int:
    size = 1
    for s in p.shape:
        size *= int(s)
    return size


def _factor_shape(ctx: ReduceContext, p: ParamGrad) -> tuple[int, int, int] | None:
    c = ctx.single_isometric(p)
    return None if c is None else c.factor_shape


def materialize_cost(ctx: ReduceContext, p: ParamGrad) -> Cost:
    """Writing ``g[n]`` (``P`` values) and reading it back, after computing it; a t = 1 outer product fuses into
    its consumer, so only its factors move."""
    shape = _factor_shape(ctx, p)
    size = _size(p)
    if shape is None:
        return _summed_materialize_cost(ctx, p) or Cost(flops=size, bytes=2 * size * ITEMSIZE,
                                                        transient=size * ITEMSIZE)
    t, o, i = shape
    if t == 1:
        return Cost(flops=2 * o * i, bytes=(o + i) * ITEMSIZE)
    return Cost(flops=2 * t * o * i, bytes=(2 * o * i + t * (o + i)) * ITEMSIZE, transient=size * ITEMSIZE)


def _summed_materialize_cost(ctx: ReduceContext, p: ParamGrad) -> Cost | None:
    """Each use of a tied weight written into the one per-sample table: a GEMM per dense contraction, a scatter
    of its rows per embedding (None: not a sum of contractions whose sizes are known)."""
    parts = ctx.summed_contractions(p)
    if parts is None:
        return None
    cost = Cost(0, 2 * _size(p) * ITEMSIZE, transient=_size(p) * ITEMSIZE)
    for c, _ in parts:
        if c.factor_shape is not None:
            t, o, i = c.factor_shape
            cost += Cost(flops=2 * t * o * i, bytes=t * (o + i) * ITEMSIZE)
        elif (t := c.notes.get("tokens")) is not None:
            cost += Cost(flops=t * p.shape[1], bytes=2 * t * p.shape[1] * ITEMSIZE)
        else:
            return None
    return cost


# ----- squared norms -----


def rounds_below_float32(c: Contraction) -> bool:
    """Whether the contraction's float32 matmuls may round below float32: in TF32 on CUDA
    (``torch.backends.cuda.matmul.allow_tf32``, or a float32 matmul precision below "highest"), in bfloat16 or TF32
    in oneDNN on the CPU (``contraction.cpu_rounds_in_float32``). The certified ghost norm and the bound of a
    materialized norm over a book-keeping sum assume rounding in float32, so they do not apply."""
    value = c.node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
        return False
    if value.device.type == "cpu":
        return not cpu_rounds_in_float32("matmul")
    if value.device.type != "cuda":
        return False
    return torch.backends.cuda.matmul.allow_tf32 or not float32_matmuls_highest()


def _ghost_cost(ctx: ReduceContext, p: ParamGrad) -> Cost | None:
    c = ctx.single_isometric(p)
    if c is None:
        return _summed_ghost_cost(ctx, p)
    if c.sq_norms is None:
        return None
    if c.factor_shape is not None and c.factor_shape[0] > 1 and rounds_below_float32(c):
        return None
    if c.factor_shape is None:  # a rule's own norm without factors (embeddings): never writes the [n, P] gradient
        return Cost(flops=_size(p), bytes=_size(p) * ITEMSIZE)
    t, o, i = c.factor_shape
    if t == 1:
        return Cost(flops=2 * (o + i), bytes=(o + i) * ITEMSIZE)
    # float64 (certified against cancellation, ``factored_sq_norms``): a float64 FLOP counts as two, and the
    # factors are read, converted and read again; their float64 copies and the two Grams exist at once
    return Cost(flops=2 * (2 * t * t * (o + i) + t * t), bytes=(3 * t * (o + i) + 2 * t * t) * 2 * ITEMSIZE,
                transient=_float64_values(p, t * (o + i) + 2 * t * t))


def _summed_parts(ctx: ReduceContext, p: ParamGrad) -> list[tuple[Contraction, bool]] | None:
    """The contractions summed into ``p``'s gradient when each has factors, dense or selecting rows, that round
    in float32 (the certified ghost norm's assumption)."""
    parts = ctx.summed_contractions(p)
    if parts is None or any(c.factors is None and c.index_factors is None for c, _ in parts):
        return None
    if any(c.factors is not None and rounds_below_float32(c) for c, _ in parts):
        return None
    return parts


def _tokens(c: Contraction) -> int | None:
    return c.factor_shape[0] if c.factor_shape is not None else c.notes.get("tokens")


def _summed_ghost_cost(ctx: ReduceContext, p: ParamGrad) -> Cost | None:
    """The blocks ``<A_k A_l^T, X_k X_l^T>`` of every pair: a dense factor's Gram costs its width per entry, a
    selecting one's a comparison or a gather; in float64, as ``_ghost_cost``."""
    parts = _summed_parts(ctx, p)
    tokens = None if parts is None else [_tokens(c) for c, _ in parts]
    if parts is None or None in tokens:
        return None
    o, i = p.shape

    def widths(c: Contraction, flipped: bool) -> tuple[int, int]:  # a selecting side reads one entry per row
        if c.factors is not None:
            return o, i
        return (i, 1) if flipped else (1, i)

    sides = [widths(c, flipped) for c, flipped in parts]
    flops = sum(2 * t * u * (min(a[0], b[0]) + min(a[1], b[1])) + t * u
                for a, t in zip(sides, tokens, strict=True) for b, u in zip(sides, tokens, strict=True))
    reads = sum(t * (a[0] + a[1]) for a, t in zip(sides, tokens, strict=True))
    # alive at once: the float64 Grams of every pair, and two float64 slices of dense rows (``dense_gram``)
    slices = min(reads, 2 * GHOST_WIDTH_BYTES / 8)
    return Cost(flops=2 * flops, bytes=(3 * reads + 2 * sum(tokens) ** 2) * 2 * ITEMSIZE,
                transient=_float64_values(p, 2 * sum(tokens) ** 2 + slices))


@strategy("sq_norm", "ghost", _ghost_cost)
def _sq_norm_ghost(ctx: ReduceContext, p: ParamGrad) -> fx.Node:
    c = ctx.single_isometric(p)
    if c is not None:
        return ctx.emit(c.sq_norms, c.inputs, f"ghost_norm[{c.rule}]")
    parts = _summed_parts(ctx, p)
    sizes = [len(c.inputs) for c, _ in parts]
    sum_dtype = value_of(p.grad).dtype
    width = sum(p.shape)

    def summed(*values):
        factored = []
        for (c, flipped), size in zip(parts, sizes, strict=True):
            inputs, values = values[:size], values[size:]
            if c.factors is not None:
                a, x = c.factors(*inputs)
            else:
                ids, weight, x = c.index_factors(*inputs)
                a = (ids, weight)
            factored.append((x, a) if flipped else (a, x))
        return summed_factored_sq_norms(factored, width, sum_dtype)

    rules = "+".join(c.rule for c, _ in parts)
    return ctx.emit(summed, [v for c, _ in parts for v in c.inputs], f"ghost_norm[{rules}]")


def _materialize_and_reduce_cost(ctx: ReduceContext, p: ParamGrad) -> Cost:
    """Materialize ``g[n]``, then one pass of pointwise work over it."""
    cost = materialize_cost(ctx, p)
    return dataclasses.replace(cost, flops=cost.flops + 2 * _size(p))


@strategy("sq_norm", "materialize", _materialize_and_reduce_cost)
def _sq_norm_materialize(ctx: ReduceContext, p: ParamGrad) -> fx.Node:
    return ctx.emit(lambda g: g.reshape(g.shape[0], -1).pow(2).sum(1), [ctx.per_sample(p)], "sq_norm")


# ----- weighted sums over samples (clip_sum) -----


def scale_cost(c: Contraction, arg: int, dim: int, layout) -> Cost | None:
    """Scaling one sample's part of ``c.inputs[arg]`` by its weight: read and write its elements (None: a size
    other than the batch is symbolic). The one price of an operand choice for book-keeping."""
    shape = value_of(c.inputs[arg]).shape
    size = layout[0] * layout[1]
    for d, s in enumerate(shape):
        if d == dim:
            continue
        if not isinstance(s, int) and not (isinstance(s, torch.SymInt) and s.node.expr.is_number):
            return None
        size *= int(s)
    return Cost(flops=size, bytes=2 * size * ITEMSIZE)


def scaled_operand(c: Contraction) -> tuple[tuple[int, int, object], Cost | None]:
    """The ``(arg, dim, layout)`` whose scaling costs least (by ``Cost.total``) among the arguments the
    contraction is linear in, and its cost; ``linear_arg`` when no size is known. For a Linear weight
    ``sum_n c_n g_n^T x_n`` the narrower of ``g`` and ``x`` per sample (fc1 9216 -> 128: the 128-wide ``g``)."""
    priced = [((arg, dim, layout), scale_cost(c, arg, dim, layout)) for arg, (dim, layout) in c.linear_options()]
    known = [(choice, cost) for choice, cost in priced if cost is not None]
    if not known:
        return priced[0][0], None
    return min(known, key=lambda cc: cc[1].total)


def _book_keeping_cost(ctx: ReduceContext, p: ParamGrad) -> Cost | None:
    if p.grad not in ctx.lifted.per_sample or not p.linear_tail or not all(
            c.rebuild is not None and c.linear_arg is not None for c in p.contractions):
        return None
    shape = _factor_shape(ctx, p)
    scaling = [scaled_operand(c)[1] for c in p.contractions]
    held = sum(_backward_operands(ctx, c) for c in p.contractions) * ITEMSIZE
    if shape is None or any(cost is None for cost in scaling):
        return Cost(flops=_size(p), bytes=_size(p) * ITEMSIZE, held=held)
    t, o, i = shape
    # scale the cheaper operand, redo the GEMM
    return Cost(flops=2 * t * o * i + sum(c.flops for c in scaling), bytes=sum(c.bytes for c in scaling), held=held)


def _backward_operands(ctx: ReduceContext, c: Contraction) -> int:
    """Values per sample of the operands of ``c`` that the backward computed (a layer's output gradient), which a
    book-keeping sum keeps until the clip factors are known where the plain step frees them at the layer. At
    GPT-2's T = 1024 they outweigh a per-sample weight gradient (the LM head's ``[T, 50257]`` against ``[50257,
    768]``), so a memory budget materializes there; at T = 128 the book-keeping sum holds less. The operands the
    loss depends on are activations, held across the backward by the plain step too."""
    held = 0
    for arg, (dim, layout) in c.linear_options():
        if not ctx.in_forward(c.inputs[arg]):
            size = scale_cost(c, arg, dim, layout)
            held += 0 if size is None else int(size.flops)
    return held


@strategy("weighted_sum", "book-keeping", _book_keeping_cost)
def _weighted_sum_book_keeping(ctx: ReduceContext, p: ParamGrad, weights: fx.Node) -> fx.Node:
    replaced = {}
    for c in p.contractions:
        (arg, dim, layout), _ = scaled_operand(c)
        others = [(a, d) for a, d in c.linear_options() if a != arg] if ctx.drops_samples else []
        replaced[c.node] = ctx.emit(_scaled_rebuild(c, arg, dim, layout, others), [*c.inputs, weights],
                                    f"book_keeping[{c.rule}]")
    return ctx.replay_tail(p, replaced)


def _scaled_rebuild(c: Contraction, arg: int, dim: int, layout, others: list):
    """Scale operand ``arg`` by the weights; ``others`` (a DP step's sums: ``ReduceContext.drops_samples``) keep
    their values except where a weight is 0, which they zero: a sample dropped for a gradient that is not finite
    (``reductions.dropping_clip_factor``) may hold NaN in either operand, and ``0 * NaN`` in the contraction's sum
    is NaN. One more pass over each such operand."""
    def scaled(*values):
        *inputs, w = values
        inputs[arg] = scale_batch(inputs[arg], w, dim, layout)
        for other, (other_dim, other_layout) in others:
            inputs[other] = scale_batch(inputs[other], w != 0, other_dim, other_layout)
        return c.rebuild(*inputs)
    return scaled


def _materialize_sum_cost(ctx: ReduceContext, p: ParamGrad) -> Cost:
    """The per-sample values are computed where the backward reaches the parameter and summed once the weights
    (clip factors) are known: held until then, as ``_reuse_cost``'s."""
    return _materialize_and_reduce_cost(ctx, p) + Cost(flops=0, bytes=0, held=_size(p) * ITEMSIZE)


@strategy("weighted_sum", "materialize", _materialize_sum_cost)
def _weighted_sum_materialize(ctx: ReduceContext, p: ParamGrad, weights: fx.Node) -> fx.Node:
    return ctx.emit(lambda g, w: weighted_batch_sum(w, g), [ctx.per_sample(p), weights], "weighted_sum")


# ----- squared norms that clip a weighted sum of the same parameter -----


def _cheapest_sum(ctx: ReduceContext, p: ParamGrad) -> Cost:
    return choose(ctx, "weighted_sum", p)[1]


def _reuse_cost(ctx: ReduceContext, p: ParamGrad) -> Cost:
    """Summing the materialized values again: read them once more, and keep them alive until the clip factors
    are known (``held``: fresh pages every call where the heap gives freed memory back)."""
    size = _size(p)
    return Cost(flops=2 * size, bytes=size * ITEMSIZE, held=size * ITEMSIZE)


def _clip_ghost_cost(ctx: ReduceContext, p: ParamGrad) -> Cost | None:
    norm = _ghost_cost(ctx, p)
    return None if norm is None else norm + _cheapest_sum(ctx, p)


@strategy("clip_sq_norm", "ghost", _clip_ghost_cost)
def _clip_sq_norm_ghost(ctx: ReduceContext, p: ParamGrad) -> fx.Node:
    return _sq_norm_ghost(ctx, p)


def _clip_materialize_cost(ctx: ReduceContext, p: ParamGrad) -> Cost:
    norm = _materialize_and_reduce_cost(ctx, p)
    if ctx.one_term_per_entry(p):  # nothing to cancel: any sum fits the norm
        return norm + _cheapest_sum(ctx, p)
    return norm + _reuse_cost(ctx, p)


@strategy("clip_sq_norm", "materialize", _clip_materialize_cost)
def _clip_sq_norm_materialize(ctx: ReduceContext, p: ParamGrad) -> fx.Node:
    return _sq_norm_materialize(ctx, p)


def _clip_bounded_cost(ctx: ReduceContext, p: ParamGrad) -> Cost | None:
    c = ctx.single_isometric(p)
    if c is None or (c.factors is None and c.token_norms is None) or c.factor_shape is None \
            or c.factor_shape[0] == 1:
        return None
    if c.node.meta["val"].dtype not in (torch.float32, torch.float64) or rounds_below_float32(c):
        return None  # bfloat16/float16: (2t + 2) eps is several times the norm itself (ghost, in float32, fits)
    book_keeping = _book_keeping_cost(ctx, p)
    if book_keeping is None:
        return None
    t, o, i = c.factor_shape
    bound = Cost(flops=2 * t * (o + i), bytes=t * (o + i) * ITEMSIZE)
    return _materialize_and_reduce_cost(ctx, p) + bound + book_keeping


@strategy("clip_sq_norm", "materialize, bounded", _clip_bounded_cost)
def _clip_sq_norm_bounded(ctx: ReduceContext, p: ParamGrad) -> fx.Node:
    """Before: ``g[n, o, i] = bmm(A^T, X)``, its norm, and the clipped sum of ``g`` (kept until the factors are
    known). After: the norm of ``g`` plus the bound of ``bounded_materialized_sq_norms`` (``g`` freed at once),
    and the clipped sum by book-keeping (``SUM_AFTER``)."""
    c = ctx.single_isometric(p)
    sq = _sq_norm_materialize(ctx, p)
    eps = torch.finfo(c.node.meta["val"].dtype).eps
    return ctx.emit(lambda s, *v: bounded_materialized_sq_norms(s, *c.row_norms(*v), eps), [sq, *c.inputs],
                    f"bounded_norm[{c.rule}]")


# the weighted sum each clip norm's bound holds for (None: any): a materialized norm bounds only its own values
SUM_AFTER = {"ghost": None, "materialize": "materialize", "materialize, bounded": "book-keeping"}


# ----- sums of squares and variance -----


def _factored_squares_cost(ctx: ReduceContext, p: ParamGrad) -> Cost | None:
    c = ctx.single_isometric(p)
    if c is None or c.factors is None or c.factor_shape is None or c.factor_shape[0] != 1:
        return None
    _, o, i = c.factor_shape
    return Cost(flops=2 * o * i + o + i, bytes=(o + i) * ITEMSIZE)


@strategy("sum_squares", "factored", _factored_squares_cost)
def _sum_squares_factored(ctx: ReduceContext, p: ParamGrad) -> fx.Node:
    c = ctx.single_isometric(p)
    node = ctx.emit(lambda *v: factored_sum_squares(*c.factors(*v)), c.inputs, f"sum_squares[{c.rule}]")
    return ctx.replay_tail(p, {c.node: node})


@strategy("sum_squares", "materialize", _materialize_and_reduce_cost)
def _sum_squares_materialize(ctx: ReduceContext, p: ParamGrad) -> fx.Node:
    return ctx.emit(lambda g: g.pow(2).sum(0), [ctx.per_sample(p)], "sum_squares")


@strategy("variance", "factored", _factored_squares_cost)
def _variance_factored(ctx: ReduceContext, p: ParamGrad) -> fx.Node:
    """``E[g^2] - E[g]^2``: one pass, loses digits when the samples' gradients nearly agree."""
    total, squares = ctx.total(p), _sum_squares_factored(ctx, p)
    return ctx.emit(lambda s, q, r: (q / r.shape[0] - (s / r.shape[0]).pow(2)).clamp_min(0),
                    [total, squares, ctx.batch_ref], "variance")


@strategy("variance", "materialize", _materialize_and_reduce_cost)
def _variance_materialize(ctx: ReduceContext, p: ParamGrad) -> fx.Node:
    """Two passes over the materialized value: no cancellation."""
    return ctx.emit(lambda g: g.var(0, unbiased=False), [ctx.per_sample(p)], "variance")


# ----- Gram matrices (costs per pair of samples) -----


def _factored_gram_cost(ctx: ReduceContext, p: ParamGrad) -> Cost | None:
    c = ctx.single_isometric(p)
    if c is None or c.factors is None or c.factor_shape is None:
        return None
    t, o, i = c.factor_shape
    return Cost(flops=2 * t * t * (o + i), bytes=t * (o + i) * ITEMSIZE)


def _materialized_gram_cost(ctx: ReduceContext, p: ParamGrad) -> Cost:
    return Cost(flops=2 * _size(p), bytes=_size(p) * ITEMSIZE)


@strategy("gram", "factored", _factored_gram_cost)
def _gram_factored(ctx: ReduceContext, p: ParamGrad) -> fx.Node:
    c = ctx.single_isometric(p)
    return ctx.emit(lambda *v: factored_gram(*c.factors(*v)), c.inputs, f"gram[{c.rule}]")


@strategy("gram", "materialize", _materialized_gram_cost)
def _gram_materialize(ctx: ReduceContext, p: ParamGrad) -> fx.Node:
    return ctx.emit(lambda g: g.reshape(g.shape[0], -1) @ g.reshape(g.shape[0], -1).T, [ctx.per_sample(p)], "gram")
