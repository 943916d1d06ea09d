"""Prove that samples stay apart in the forward graph, op by op; refuse every node where that cannot be proved.

Per-sample gradients exist when the batched computation is the same computation on each sample: slice ``i`` of
every batched value equals the value the graph computes on the batch made of sample ``i`` alone. This pass
propagates one *fact* per node from the inputs to the loss and checks that invariant at each op, using the op
facts of ``ops.py``. It is an allow-list: an op in no table, or a use of an op its entry does not cover, is
refused wherever it touches a value that depends on the samples.

The facts (index letters: n batch):

- ``SHARED``: the same for every sample (parameters, constants, sizes; also values computed from the batch size,
  ``torch.full((), len(x))``, which the loss-head pass reads as 1, the batch size of a sample's own loss).
- ``PerSample(dim, layout)``: dimension ``dim`` holds the samples with ``layout`` (``layout.py``); a ``None``
  layout means the values are the same for every sample (``zeros(n, d)``, an expanded parameter, a random draw),
  so any layout fits.
- ``Pooled(origin)``: computed from several samples (a reduction over the batch, ``.item()`` of a batched
  value). Allowed only on the way to the loss, where the loss-head pass gives each sample its own loss.
- ``SampleIndex(dim, stride)``: ``arange(0, n * stride, stride)``, entry ``b`` is ``b * stride``. Allowed only to
  pair each sample with itself (``logits[arange(n), y]``, the offsets of per-sample embedding bags).

A node is refused when its inputs' facts have no per-sample meaning under the op (``SampleMixingError``: data
moves across the batch dimension, a pooled value flows back into per-sample values, two values pair different
samples) or when the op has no entry, or reads the batch size as a value where the loss head cannot read it as 1
(``UnsupportedError``). Every fact is checked against the symbolic shapes:
a ``PerSample`` fact must name the one dimension whose size contains the batch symbol.

Pre-condition: ``graph`` is a captured forward graph whose batched placeholders have the batch symbol in one
dimension. Post-condition: every node has a fact, or the returned sites are not empty.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

from . import ops
from .batch_dims import BatchDims, value_of
from .layout import Layout, same_size, shared_tiled, slice_at_batch_of_one, sliced_layout, tiled_uniform, view_layout
from .source import module_path, where

ATEN = torch.ops.aten


@dataclass(frozen=True)
class Shared:
    pass


SHARED = Shared()


@dataclass(frozen=True)
class PerSample:
    dim: int
    layout: Layout | None


@dataclass(frozen=True)
class Pooled:
    origin: fx.Node
    why: str = "it reduces over the batch"


@dataclass(frozen=True)
class SampleIndex:
    dim: int
    stride: int = 1


Fact = Shared | PerSample | Pooled | SampleIndex | tuple | None


@dataclass
class MixingSite:
    op: str
    node: str
    source: str
    reason: str
    fix: str
    kind: str = "mixing"  # "mixing": SampleMixingError; "unknown": UnsupportedError

    def __str__(self) -> str:
        return f"{self.op} ({self.node}) at {self.source}: {self.reason}. Fix: {self.fix}"


class _Refuse(Exception):
    def __init__(self, reason: str, fix: str, kind: str = "mixing", node: fx.Node | None = None):
        super().__init__(reason)
        self.reason, self.fix, self.kind, self.node = reason, fix, kind, node


_FIX_DIM = ("apply it along a non-batch dimension, or pass in_dims so the batch dimension is the one you mean")
_FIX_PER_SAMPLE = "compute per-sample quantities only, each from its own sample"


def _non_batch_size(dims: list[int]) -> _Refuse:
    """The samples stay apart, but the batch size sizes other dimensions (``F.interpolate(h, size=len(x))``,
    ``x[:, :len(x)]``, ``h.repeat(1, len(x))``): a sample's own loss sees size 1 there, another problem."""
    where_ = f"dimension {dims[0]}" if len(dims) == 1 else f"dimensions {tuple(dims)}"
    return _Refuse(f"it uses the batch size as the size of a non-batch dimension ({where_} of its output), where a "
                   "sample's own loss, on a batch of one, sees size 1, so each sample's problem differs from its part "
                   "of the batched one", "give that dimension a fixed size, or a size read from a non-batch "
                   "dimension (x.shape[1]), instead of x.shape[0] or len(x)", kind="batch_value")


def _mix(reason: str, fix: str = _FIX_PER_SAMPLE) -> _Refuse:
    return _Refuse(reason, fix)


def _unknown(op_name: str, detail: str = "", fix: str = "express this step with common tensor operations, or "
             "open an issue naming the op") -> _Refuse:
    return _Refuse(
        f"compiled_psg has no batch semantics for {op_name}{detail}, so it cannot prove that samples stay apart",
        fix, kind="unknown")


def _channels_last_cause(node: fx.Node) -> tuple[str, str] | tuple[()]:
    """``(detail, fix)`` where an ``as_strided`` gives a 4-d value the strides of channels-last memory format
    (torch's backward of ``AdaptiveAvgPool2d`` after a channels-last convolution, round L): the model's memory
    format is the cause, and the same model in the default format has batch semantics; else nothing to add."""
    if "as_strided" not in str(node.target) or len(node.args) < 3:
        return ()
    size, stride = node.args[1], node.args[2]
    if not (isinstance(size, list | tuple) and isinstance(stride, list | tuple) and len(size) == len(stride) == 4):
        return ()
    _, c, h, w = size
    if not all(isinstance(v, int) for v in (c, h, w)) or list(stride[1:]) != [1, w * c, c]:
        return ()
    return (" (it lays a value out in channels_last memory format, the model's or its input's)",
            "convert the model and its input to the default memory format, model.to(memory_format="
            "torch.contiguous_format) and x.contiguous(); the same model in that format has batch semantics")


# A boolean mask gathers the selected elements of all samples into one row whose length depends on the values.
_MASK_FIX = ("keep the shape: torch.where(mask, new, h) for a masked write, (h * mask) or "
             "h.masked_fill(~mask, 0) for a masked read, then reduce per sample")


# ----------------------------------------------------------------------------------------------- the analysis


def find_mixing(graph: fx.Graph, batch: BatchDims, params: set[fx.Node] | None = None) -> list[MixingSite]:
    """The sites where the forward graph mixes samples or uses an op of unknown batch semantics (empty: none).
    ``params``: the placeholders of the parameters (None: unknown, so any floating value may carry a gradient)."""
    return Analysis(graph, batch, params).run()


class Analysis:
    def __init__(self, graph: fx.Graph, batch: BatchDims, params: set[fx.Node] | None = None):
        self.graph, self.batch, self.params = graph, batch, params
        self.facts: dict[fx.Node, Fact] = {}
        self.sites: list[MixingSite] = []
        self._reported: set[fx.Node] = set()
        self._from_params: dict[fx.Node, bool] = {}
        # shared values as long as the batch whose entries are positions along another dimension (an arange
        # that F.interpolate(h, size=len(x)) indexes time steps with), and their casts, views and pointwise results
        self.other_positions: set[fx.Node] = set()

    def carries_gradient(self, node: fx.Node) -> bool:
        """Whether a parameter's gradient may flow back through ``node``'s value: a floating (or complex) value
        computed from a parameter (any floating value where the parameters are not known)."""
        value = value_of(node)
        if not isinstance(value, torch.Tensor) or not (value.is_floating_point() or value.is_complex()):
            return False
        if self.params is None:
            return True
        found = self._from_params
        for n in self.graph.nodes:  # in order: every input's answer is known before its users'
            if n in found:
                continue
            found[n] = n in self.params or any(found.get(a, False) for a in n.all_input_nodes)
            if n is node:
                break
        return found[node]

    def run(self) -> list[MixingSite]:
        for node in self.graph.nodes:
            if node.op == "placeholder":
                self.facts[node] = self._placeholder(node)
            elif node.op == "get_attr":
                self.facts[node] = SHARED
            elif node.op == "call_function":
                self._visit(node)
        return self.sites

    # ----- per node -----
    def _placeholder(self, node: fx.Node) -> Fact:
        value = value_of(node)
        if isinstance(value, torch.Tensor):
            dims = self.batch.dims(value)
            if not dims:
                return SHARED
            if len(dims) == 1 and self.batch.is_whole(value, dims[0]):
                return PerSample(dims[0], (1, 1))
            return None
        return SHARED

    def _visit(self, node: fx.Node) -> None:
        inputs = node.all_input_nodes
        if any(self.facts.get(a, SHARED) is None for a in inputs):
            self.facts[node] = None  # downstream of a refused node: its site is already reported
            return
        try:
            fact = self._fact(node)
            fact = self._checked(node, fact)
            self._check_batch_size_args(node, fact)
        except _Refuse as refusal:
            self._report(refusal.node or node, refusal)
            fact = self._recovered(node)
        self.facts[node] = fact

    def _recovered(self, node: fx.Node) -> Fact:
        """After a refusal, carry on as if the node kept samples apart, so that later, independent sites (every
        BatchNorm of a deep network) are reported too; values with the batch in two dimensions stop here."""
        value = value_of(node)
        values = value if isinstance(value, (tuple, list)) else [value]
        facts = []
        for v in values:
            dims = self.batch.dims(v) if isinstance(v, torch.Tensor) else ()
            if len(dims) > 1:
                return None
            facts.append(PerSample(dims[0], None) if dims else SHARED)
        return tuple(facts) if isinstance(value, (tuple, list)) else facts[0]

    def _check_batch_size_args(self, node: fx.Node, fact: Fact) -> None:
        """The batch size may size a value (``x.view(n, -1)``) but not be a value: a batch of one sees 1 where the
        batch sees ``n`` (``x[:, n % 3]``, ``layer_norm(eps=n)``, ``roll(x, n)``). Pointwise ops and factories'
        fill values are read as 1 by the loss-head pass; every other use is refused."""
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or ops.has_pointwise_tag(target) or target in (
                ops.ARANGES | ops.FACTORIES | ops.SIZE_QUERIES | ops.CHECKS | ops.SCALAR_READS):
            return
        if not self.batch.is_batched(node):  # a shared value computed from the batch size: the loss head reads 1
            return
        try:
            kwargs = _kwargs(node)
        except _Refuse:
            kwargs = {str(i): a for i, a in enumerate(node.args)} | dict(node.kwargs)
        exempt = set(ops.SIZE_ARGS.get(target, ()))
        if target.overloadpacket.__name__ in ("slice", "narrow") and isinstance(self.fact(node.args[0]), PerSample) \
                and _norm_dim(kwargs.get("dim", 0), _rank(node.args[0])) == self.fact(node.args[0]).dim:
            exempt |= {"start", "end", "length"}  # the whole batch dimension, checked by the slice handler
        for name, value in kwargs.items():
            if name not in exempt and _reads_batch_size(value, self.batch):
                raise _Refuse(f"it uses the batch size as a value (argument {name!r}) of a batched op whose "
                              "arguments compiled_psg cannot read as 1, the batch size a sample's own loss sees",
                              "use a constant, or a per-sample quantity, instead of x.shape[0]", kind="batch_value")

    def _report(self, node: fx.Node, refusal: _Refuse) -> None:
        if node in self._reported:
            return
        self._reported.add(node)
        self.sites.append(MixingSite(_op_name(node), node.name, where(node), refusal.reason, refusal.fix,
                                     refusal.kind))

    def fact(self, arg) -> Fact:
        if isinstance(arg, fx.Node):
            return self.facts.get(arg, SHARED)
        if isinstance(arg, (list, tuple)):
            found = [self.fact(a) for a in arg]
            pooled = [f for f in found if isinstance(f, Pooled)]
            return pooled[0] if pooled else SHARED
        return SHARED

    def _fact(self, node: fx.Node) -> Fact:
        target = node.target
        if target is operator.getitem:
            source = self.facts.get(node.args[0], SHARED)
            if isinstance(source, tuple):
                return source[node.args[1]]
            return source
        if target in ops.CHECKS:
            return SHARED
        if target in ops.SIZE_QUERIES:
            return SHARED
        if target in ops.SYMBOLIC_PYTHON or target in ops.SCALAR_READS:
            facts = [self.fact(a) for a in node.args]
            pooled = [f for f in facts if isinstance(f, Pooled)]
            if pooled:
                return pooled[0]
            if target in ops.SCALAR_READS and any(not isinstance(f, Shared) for f in facts):
                return Pooled(node, "it reads a tensor value of the samples into Python (.item())")
            return SHARED
        handler = _handler_for(target)
        inputs = _tensor_facts(self, node)
        if handler is None:
            if all(isinstance(f, Shared) for f in inputs.values()) and not _output_batched(node, self.batch):
                return SHARED  # a value read from the batch size reads 1 per sample (loss head)
            pooled = [f for f in inputs.values() if isinstance(f, Pooled)]
            if pooled and not _output_batched(node, self.batch) and all(
                    isinstance(f, Shared | Pooled) for f in inputs.values()):
                return pooled[0]
            raise _unknown(_op_name(node), *_channels_last_cause(node))
        return handler(self, node)


    def _checked(self, node: fx.Node, fact: Fact) -> Fact:
        """Post-condition of every handler: the fact agrees with the symbolic shapes; pooled values reaching
        per-sample values are reported at their origin."""
        value = value_of(node)
        if isinstance(value, (tuple, list)) and not isinstance(fact, tuple):
            fact = tuple(fact if isinstance(v, torch.Tensor) else SHARED for v in value)
        if isinstance(fact, tuple):
            return tuple(self._check_one(node, v, f) for v, f in zip(value, fact, strict=True))
        return self._check_one(node, value, fact)

    def _check_one(self, node: fx.Node, value, fact: Fact) -> Fact:
        if not isinstance(value, torch.Tensor):
            return fact
        dims = self.batch.dims(value)
        if isinstance(fact, PerSample | SampleIndex):
            if fact.dim in dims and len(dims) > 1:
                raise _non_batch_size([d for d in dims if d != fact.dim])
            if dims != (fact.dim,):
                raise _unknown(_op_name(node), f" (its output has the batch in dimensions {dims})")
            if isinstance(fact, PerSample) and fact.layout is not None:
                if self.batch.factor(value.shape[fact.dim]) != fact.layout[0] * fact.layout[1]:
                    raise _unknown(_op_name(node), " (its output's size does not match the samples' layout)")
            self._check_no_pooled_inputs(node)
            return fact
        if dims:
            if isinstance(fact, Shared) and (node in self.other_positions or any(
                    a in self.other_positions for a in node.all_input_nodes)):
                self.other_positions.add(node)
                return fact
            if len(dims) > 1:
                raise _mix("its result pairs every sample with every other sample",
                           "compute per-sample quantities only; losses over pairs of samples (contrastive "
                           "losses) have no per-sample gradient")
            raise _unknown(_op_name(node), f" (its output has the batch in dimension {dims[0]})")
        return fact

    def _check_no_pooled_inputs(self, node: fx.Node) -> None:
        for a in node.all_input_nodes:
            f = self.facts.get(a)
            if isinstance(f, Pooled):
                origin = f.origin
                raise _Refuse(
                    f"{f.why}, and its result flows back into per-sample values ({_op_name(node)} at {where(node)})",
                    "reduce over non-batch dimensions only (e.g. x.mean(1) instead of x.mean(0)), or move batch "
                    "statistics out of the loss function", node=origin)


# ----------------------------------------------------------------------------------------------- helpers


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target.overloadpacket.__name__}"
    return str(getattr(target, "__name__", target))


def _reads_batch_size(value, batch: BatchDims) -> bool:
    v = value_of(value) if isinstance(value, fx.Node) else value
    if isinstance(v, (torch.SymInt, torch.SymFloat)):
        return batch.symbol in v.node.expr.free_symbols
    if isinstance(v, (list, tuple)):
        return any(_reads_batch_size(x, batch) for x in v)
    return False


def _output_batched(node: fx.Node, batch: BatchDims) -> bool:
    return batch.is_batched(node)


def _tensor_facts(analysis: Analysis, node: fx.Node) -> dict[fx.Node, Fact]:
    return {a: analysis.facts.get(a, SHARED) for a in node.all_input_nodes
            if isinstance(value_of(a), torch.Tensor)}


def _kwargs(node: fx.Node) -> dict:
    pair = normalize_function(node.target, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True)
    if pair is None:
        raise _unknown(_op_name(node), " (its arguments do not match its schema)")
    return pair.kwargs


def _rank(node) -> int:
    return value_of(node).dim()


def _norm_dim(d: int, rank: int) -> int:
    return d % max(rank, 1)


def _merge_layouts(layouts) -> Layout | None:
    """The common layout of values that must hold the samples alike (None entries fit any layout)."""
    found = {lay for lay in layouts if lay is not None}
    if len(found) > 1:
        first, second = sorted(found)[:2]
        raise _mix("it combines values whose elements belong to different samples (the batch is laid out "
                   f"differently in them: {_rows(first)} in one, {_rows(second)} in another)",
                   "build both in one order: rows of x.flatten(0, 1) (row b*T + t) pair with y.repeat_interleave(T) "
                   "and w.repeat(B); blocks of torch.cat([a, b]) or x.repeat(2, 1) (row t*B + b) pair with "
                   "torch.cat([y, y]) and y.repeat(2)")
    return found.pop() if found else None


def _rows(layout: Layout) -> str:
    """A layout in words: which rows of the merged batch dimension belong to sample ``b``."""
    outer, inner = layout
    if outer == 1:
        return "one row per sample" if inner == 1 else f"each sample's {inner} rows together (row b*{inner} + t)"
    if inner == 1:
        return f"{outer} blocks of B rows (row t*B + b)"
    return f"{outer} blocks of B groups of {inner} rows"


def _no_sample_index(facts) -> None:
    if any(isinstance(f, SampleIndex) for f in facts):
        raise _mix("it uses each sample's position in the batch as a value, which differs from the position 0 the "
                   "sample has in a batch of its own", "index with per-sample values instead of batch positions")


def _pooled(facts) -> Pooled | None:
    return next((f for f in facts if isinstance(f, Pooled)), None)


def _aligned(facts_and_ranks, out_rank: int) -> Fact:
    """Broadcasting: the per-sample inputs must hold the samples in the same output dimension, alike."""
    dims, layouts = set(), []
    for fact, rank in facts_and_ranks:
        if isinstance(fact, PerSample):
            dims.add(fact.dim + out_rank - rank)
            layouts.append(fact.layout)
    if not dims:
        return SHARED
    if len(dims) > 1:
        raise _mix("its result pairs every sample with every other sample",
                   "compute per-sample quantities only; losses over pairs of samples (contrastive losses) have no "
                   "per-sample gradient")
    return PerSample(dims.pop(), _merge_layouts(layouts))


# ----------------------------------------------------------------------------------------------- handlers

Handler = Callable[[Analysis, fx.Node], Fact]
_HANDLERS: dict[object, Handler] = {}


def _handles(ops_set):
    def register(fn: Handler) -> Handler:
        for op in ops_set:
            _HANDLERS[op] = fn
        return fn
    return register


def _handler_for(target) -> Handler | None:
    if target in _HANDLERS:
        return _HANDLERS[target]
    if ops.is_pointwise(target):
        return _pointwise
    return None


#: loss backwards that are elementwise, but with ``reduction=Mean`` (1) scale by 1 / numel, the batch's numel
_MEAN_LOSS_BACKWARDS = ops._overloads("mse_loss_backward", "smooth_l1_loss_backward", "huber_loss_backward")


@_handles(_MEAN_LOSS_BACKWARDS)
def _loss_backward(an: Analysis, node: fx.Node) -> Fact:
    """``mse_loss_backward(grad, x, y, reduction, ...)``: elementwise for sum or none; a mean divides by the whole
    batch's element count, which a sample's own gradient divides by its own (a gradient taken inside the loss)."""
    if len(node.args) > 3 and node.args[3] == 1:
        raise _mix("the gradient of a mean-reduced loss, taken inside the loss, divides by the whole batch's "
                   "element count, where each sample's own gradient divides by its own",
                   "write the mean out, (out - target).pow(2).mean(), or use reduction='none' and take the mean "
                   "of the result")
    return _pointwise(an, node)


@_handles(ops._overloads("rrelu_with_noise", "rrelu_with_noise_functional"))
def _rrelu(an: Analysis, node: fx.Node) -> Fact:
    """``rrelu_with_noise(x, noise, lower, upper, training)``: in eval mode ``leaky_relu`` with the slope's mean,
    elementwise. In training mode its backward reads the slopes the forward wrote into ``noise``, which the
    per-sample graph does not carry (the gradients before it came out wrong): refused."""
    training = node.kwargs.get("training", node.args[4] if len(node.args) > 4 else False)
    if training:
        raise _Refuse("RReLU in training mode draws each element's slope into a buffer its backward reads, which "
                      "the per-sample graph does not carry",
                      "put the module in eval mode (model.eval(): the mean slope), or use nn.LeakyReLU", kind="unknown")
    return _pointwise(an, node)


def _pointwise(an: Analysis, node: fx.Node) -> Fact:
    """Element ``k`` reads element ``k`` of each broadcast input. Batch-size scalars read 1 later (loss head)."""
    facts = _tensor_facts(an, node)
    _no_sample_index(facts.values())
    out = value_of(node)
    out_rank = (out[0] if isinstance(out, (tuple, list)) else out).dim()
    result = _aligned([(f, _rank(a)) for a, f in facts.items()], out_rank)
    if isinstance(result, Shared):
        pooled = _pooled(facts.values())
        if pooled is not None:
            return pooled
        if an.batch.is_batched(node) and not an.other_positions.intersection(facts):
            return _from_shape(an, node)  # a random draw shaped like the batch (rand_like of a shared value)
    return result


def _from_shape(an: Analysis, node: fx.Node) -> Fact:
    """A value that is the same for every sample, shaped with the batch: per-sample with any layout."""
    value = value_of(node)
    values = value if isinstance(value, (tuple, list)) else [value]
    facts = []
    for v in values:
        if not isinstance(v, torch.Tensor):
            facts.append(SHARED)
            continue
        dims = an.batch.dims(v)
        if not dims:
            facts.append(SHARED)
        elif len(dims) == 1:
            facts.append(PerSample(dims[0], None))
        else:
            raise _unknown(_op_name(node), " (it makes a value with the batch in two dimensions)")
    return tuple(facts) if isinstance(value, (tuple, list)) else facts[0]


# dtypes that hold every batch position exactly (float64 up to 2^53): a narrower cast rounds positions together
# (bfloat16 makes 257 into 256, and sample 257 would read sample 256's row)
_EXACT_POSITIONS = (torch.int64, torch.int32, torch.float64)


def _positions_kept(node: fx.Node, fact: Fact) -> Fact:
    value = node.meta.get("val")
    if isinstance(fact, SampleIndex) and isinstance(value, torch.Tensor) and value.dtype not in _EXACT_POSITIONS:
        raise _mix(f"it holds batch positions as {value.dtype}, which rounds large positions together, so a "
                   "sample could be paired with another's row", "keep torch.arange(n) in torch.long (the default)")
    return fact


@_handles(ops.IDENTITY)
def _identity(an: Analysis, node: fx.Node) -> Fact:
    return _positions_kept(node, an.fact(node.args[0]))


@_handles(ops.FACTORIES)
def _factory(an: Analysis, node: fx.Node) -> Fact:
    kw = _kwargs(node)
    for name in ("fill_value", "s", "low", "high", "mean", "std", "from", "to", "value", "lambd", "median",
                 "sigma", "p"):
        if name in kw and _reads_batch_size(kw[name], an.batch) and an.batch.is_batched(node):
            raise _Refuse("it fills a batched value with the batch size, which compiled_psg cannot read as 1, the "
                          "batch size a sample's own loss sees", "fill a value without the batch dimension "
                          "(torch.full((), len(x))) and let broadcasting expand it", kind="batch_value")
    return _from_shape(an, node)  # an unbatched fill value read from the batch size: the loss head reads 1


@_handles(ops.ARANGES)
def _arange(an: Analysis, node: fx.Node) -> Fact:
    kw = _kwargs(node)
    start, end, step = kw.get("start", 0), kw["end"], kw.get("step", 1)
    if not _reads_batch_size([start, end, step], an.batch):
        return SHARED
    step_v = value_of(step) if isinstance(step, fx.Node) else step
    start_v = value_of(start) if isinstance(start, fx.Node) else start
    end_v = value_of(end) if isinstance(end, fx.Node) else end
    if start_v == 0 and isinstance(step_v, int) and step_v > 0 and isinstance(end_v, torch.SymInt):
        if sympy.simplify(end_v.node.expr - step_v * an.batch.symbol) == 0:
            if _indexes_a_non_batch_dimension(an, node):
                an.other_positions.add(node)  # the index op's output check names the batch size there
                return SHARED
            return _positions_kept(node, SampleIndex(0, step_v))
    raise _mix("it makes batch positions into values (an arange whose length depends on the batch size)",
               "index with per-sample values, or use arange(n) only to pair each sample with itself "
               "(logits[torch.arange(n), y])")


_INDEXING = ops._overloads("index.Tensor", "_unsafe_index.Tensor", "index_select")


def _indexes_a_non_batch_dimension(an: Analysis, node: fx.Node) -> bool:
    """Whether ``arange(n)`` reaches, through pointwise ops, casts and views, an index into a dimension of a
    batched value other than its batch dimension: ``F.interpolate(h, size=len(x))`` picks ``len(x)`` time steps
    with it. Its entries are then positions along that dimension, not the samples' positions in the batch."""
    todo, seen = [node], {node}
    while todo:
        current = todo.pop()
        for user in current.users:
            target = user.target
            if target in _INDEXING:
                x = user.args[0]
                positions = ([_norm_dim(user.args[1], _rank(x))] if user.args[2] is current else []) \
                    if target.overloadpacket.__name__ == "index_select" \
                    else [p for p, i in enumerate(user.args[1]) if i is current]
                dims = an.batch.dims(value_of(x))
                if dims and any(p not in dims for p in positions):
                    return True
            elif (ops.has_pointwise_tag(target) or target in ops.IDENTITY or target in ops.VIEWS) \
                    and user not in seen:
                seen.add(user)
                todo.append(user)
    return False


@_handles(ops.POSITIONAL_FACTORIES)
def _positional_factory(an: Analysis, node: fx.Node) -> Fact:
    if _reads_batch_size(list(node.args) + list(node.kwargs.values()), an.batch):
        if node.target is ATEN.randperm.default:
            raise _mix("it draws a random permutation of the batch; using it to index (mixup, shuffling) pairs "
                       "each sample with another", "mix samples outside the loss function (mixup on the data "
                       "loader side), or use per-sample augmentation")
        # not proven mixing (torch.eye(n) @ h is h), but a batch of one would see other values: sizes read as 1
        # are what a sample's own loss sees, and these values are not sizes
        raise _Refuse(*batch_length_values(node.target.overloadpacket.__name__), kind="batch_value")
    return SHARED


def batch_length_values(factory: str) -> tuple[str, str]:
    """``(reason, fix)`` of the refusal of ``torch.<factory>`` (eye, linspace, ...) of the batch's length; the
    capture gives the same refusal where torch takes that length as a Python int (``linspace``'s ``steps``)."""
    return (f"its values depend on the batch size (torch.{factory} of the batch's length), which compiled_psg "
            "cannot read as 1, the batch size a sample's own loss sees",
            "build it from sizes that are not the batch's (the features'), or leave it out where it changes nothing "
            "(torch.eye(n) @ h is h)")


@_handles(ops.FLAT_ORDER)
def _flat_order(an: Analysis, node: fx.Node) -> Fact:
    if all(isinstance(f, Shared) for f in _tensor_facts(an, node).values()):
        return SHARED
    if node.target.overloadpacket.__name__ == "put":  # no index: nothing placed, the input as it is
        kw = _kwargs(node)
        if isinstance(an.fact(kw["index"]), Shared) and value_of(kw["index"]).numel() == 0:
            return _first_input(an, node)[1]
    raise _mix(*FLAT_ORDER_REFUSAL)


#: why an op of ``ops.FLAT_ORDER`` on the batch is refused, and the fix (the capture says the same where torch's
#: backward formula of the op reads the batch size before this analysis runs: ``masked_select``)
FLAT_ORDER_REFUSAL = ("it places elements by their order in the whole flattened tensor, batch included (the k-th "
                      "source element goes to the k-th selected position), so a sample's values can land in another "
                      "sample's rows", "select or scatter within each sample: torch.where(mask, source, out) with a "
                      "source shaped like out")


@_handles(ops.VIEWS)
def _view(an: Analysis, node: fx.Node) -> Fact:
    fact = an.fact(node.args[0])
    out = value_of(node)
    if isinstance(fact, Shared | Pooled):
        return fact
    src = value_of(node.args[0])
    if isinstance(fact, PerSample) and fact.layout is None and an.batch.is_whole(src, fact.dim):
        fact = PerSample(fact.dim, (1, 1))  # the same for every sample (any layout, _from_shape): take it whole
    if isinstance(fact, SampleIndex) or fact.layout is None:
        dims = an.batch.dims(out)
        whole = len(dims) == 1 and an.batch.factor(out.shape[dims[0]]) == an.batch.factor(src.shape[fact.dim])
        if whole and (isinstance(fact, PerSample) or an.batch.is_whole(out, dims[0])):
            return type(fact)(dims[0], fact.stride) if isinstance(fact, SampleIndex) else PerSample(dims[0], None)
        raise _mix("the reshape moves values between samples")
    found = view_layout(src.shape, fact.dim, fact.layout, out.shape, an.batch.symbol)
    if found is None:
        raise _mix("the reshape moves values between samples (it splits the batch dimension or interleaves it "
                   "with other dimensions)", "reshape only the dimensions after the batch, e.g. "
                   "x.view(x.shape[0], -1)")
    return PerSample(*found)


def _moved(fact: Fact, mapping: Callable[[int], int | None], op: str) -> Fact:
    if not isinstance(fact, PerSample | SampleIndex):
        return fact
    new = mapping(fact.dim)
    if new is None:
        raise _mix(f"it {op} the batch dimension", _FIX_DIM)
    return PerSample(new, fact.layout) if isinstance(fact, PerSample) else SampleIndex(new, fact.stride)


@_handles(ops.DIM_OPS)
def _dim_op(an: Analysis, node: fx.Node) -> Fact:
    target = node.target
    name = target.overloadpacket.__name__.removesuffix("_copy")  # a view's functional copy: the view's rule
    if name in ("cat", "stack"):
        return _cat(an, node, name == "stack")
    if name in ("slice_scatter", "select_scatter"):
        return _slice_scatter(an, node)
    x = node.args[0]
    fact = an.fact(x)
    if isinstance(fact, Shared | Pooled) and name != "expand" and name != "repeat":
        return fact if not an.batch.is_batched(node) else _from_shape(an, node)
    kw = _kwargs(node)
    rank = _rank(x)
    out = value_of(node)
    if name == "t":
        return _moved(fact, lambda d: (1 - d) if rank == 2 else d, "moves")
    if name == "transpose":
        a, b = _norm_dim(kw["dim0"], rank), _norm_dim(kw["dim1"], rank)
        return _moved(fact, lambda d: b if d == a else a if d == b else d, "moves")
    if name == "permute":
        perm = [_norm_dim(d, rank) for d in kw["dims"]]
        return _moved(fact, perm.index, "moves")
    if name == "unsqueeze":
        k = _norm_dim(kw["dim"], rank + 1)
        return _moved(fact, lambda d: d if d < k else d + 1, "moves")
    if name == "squeeze":
        removed = [d for d in range(rank) if value_of(x).shape[d] == 1
                   and (kw.get("dim") is None or d in [_norm_dim(e, rank) for e in _as_list(kw["dim"])])]
        return _moved(fact, lambda d: d - sum(r < d for r in removed), "moves")
    if name == "expand":
        offset = out.dim() - rank
        if isinstance(fact, Shared | Pooled):
            return fact if not an.batch.is_batched(node) else _from_shape(an, node)
        return _moved(fact, lambda d: d + offset, "expands")
    if name == "repeat":
        repeats = kw["repeats"]
        offset = len(repeats) - rank
        if isinstance(fact, Shared | Pooled):
            if not an.batch.is_batched(node) or isinstance(fact, Pooled):
                return fact
            return _tiled_shared(an, node, repeats, offset)
        times = repeats[fact.dim + offset]
        if isinstance(fact, SampleIndex) or (times != 1 and not isinstance(times, int)):
            raise _mix("it repeats batch positions")
        layout = None if fact.layout is None else (fact.layout[0] * times, fact.layout[1])
        return PerSample(fact.dim + offset, layout)
    if name == "select":
        k = _norm_dim(kw["dim"], rank)
        return _moved(fact, lambda d: None if d == k else d - (k < d), "picks one element of")
    if name in ("slice", "narrow"):
        k = _norm_dim(kw["dim"], rank)
        if isinstance(fact, PerSample | SampleIndex) and k == fact.dim:
            return _sliced(an, node, kw, fact)
        return fact
    if name == "flip":
        dims = [_norm_dim(d, rank) for d in kw["dims"]]
        return _moved(fact, lambda d: None if d in dims else d, "reverses")
    if name == "roll":  # a shift of 0 leaves its dimension as it is, the batch's included
        dims = [_norm_dim(d, rank) for d in kw.get("dims") or []]
        still = [type(s) is int and s == 0 for s in _as_list(kw["shifts"])]  # a SymInt shift may be nonzero
        if not dims and all(still):
            return fact
        kept = {d for d, s in zip(dims, still, strict=False) if s} | set(range(rank)) - set(dims)
        return _moved(fact, lambda d: d if dims and d in kept else None, "rolls")
    if name in ("split", "split_with_sizes", "chunk", "unsafe_split", "unsafe_split_with_sizes", "unsafe_chunk",
                "tensor_split"):
        k = _norm_dim(kw.get("dim", 0), rank)
        if isinstance(fact, PerSample) and fact.dim == k:
            raise _parts_of_the_batch()
        moved = _moved(fact, lambda d: None if d == k else d, "splits")
        return tuple(moved for _ in out)
    if name == "unbind":
        k = _norm_dim(kw.get("dim", 0), rank)
        moved = _moved(fact, lambda d: None if d == k else d - (k < d), "splits")
        return tuple(moved for _ in out)
    if name == "diagonal":
        a, b = _norm_dim(kw.get("dim1", 0), rank), _norm_dim(kw.get("dim2", 1), rank)
        return _moved(fact, lambda d: None if d in (a, b) else d - (a < d) - (b < d), "takes a diagonal over")
    if name == "unfold":
        k = _norm_dim(kw["dimension"], rank)
        return _moved(fact, lambda d: None if d == k else d, "unfolds")
    if name == "constant_pad_nd":
        pad = list(kw["pad"])
        padded = {rank - 1 - j: (pad[2 * j], pad[2 * j + 1]) for j in range(len(pad) // 2)}
        return _moved(fact, lambda d: None if padded.get(d, (0, 0)) != (0, 0) else d, "pads")
    if name == "one_hot":
        _no_sample_index([fact])
        return fact
    raise _unknown(_op_name(node))


def _tiled_shared(an: Analysis, node: fx.Node, repeats, offset: int) -> Fact:
    """``w.repeat(n)`` of a shared ``w``: each sample's rows hold a copy of ``w`` only in the layout of
    ``shared_tiled`` (``w.repeat(n) * h.flatten(0, 1)`` with ``h`` ``[n, t]``); step-major rows would each read
    other entries of ``w``."""
    dims = an.batch.dims(value_of(node))
    if len(dims) != 1:
        raise _unknown(_op_name(node), " (it tiles a shared value into more than one batch dimension)")
    if tiled_uniform(node.args[0], dims[0] - offset):
        return _from_shape(an, node)
    layout = shared_tiled(node.args[0], dims[0] - offset, repeats[dims[0]], an.batch)
    if layout is None:
        raise _unknown(_op_name(node), " (it tiles a shared value by a count that is not a multiple of the batch "
                                       "size)")
    return PerSample(dims[0], layout)


def _sliced(an: Analysis, node: fx.Node, kw: dict, fact: PerSample | SampleIndex) -> Fact:
    """A slice along the batch dimension: every row (``h[-n:]``), or whole blocks of a batch that ``cat`` or
    ``repeat`` tiled (``torch.cat([a, b])[n:]``, layout ``sliced_layout``). Positions and values the same for
    every sample (no layout) only whole, or, for values, as many rows as a batch of one keeps (one, ``h[:1]``)."""
    src, out = value_of(node.args[0]), value_of(node)
    layout = fact.layout if isinstance(fact, PerSample) and fact.layout is not None else None
    if isinstance(fact, PerSample) and fact.layout is None and not an.batch.dims(out):
        # every row holds the same values (``prompt.expand(n, -1)[:1]``, as PEFT's prompt tuning takes its token
        # ids): the same value for every sample where a batch of one keeps as many rows. Not where a gradient
        # flows back through it: the rows kept would receive every sample's gradient, and the rows of the other
        # samples none (the capture reads such slices of an ``expand`` as the value expanded,
        # ``_capture/broadcast_rows.py``; what reaches here was broadcast otherwise, ``w * ones(n, 1)``)
        alone = _rows_of_a_batch_of_one(kw, src.shape[fact.dim], an.batch)
        if out.shape[fact.dim] != alone:
            kept = "a different number" if alone is None else alone
            raise _mix(f"it keeps {out.shape[fact.dim]} rows of a value that is the same for every sample "
                       f"(expanded over the batch), where a batch of one keeps {kept}: the result depends on the "
                       "batch size", "slice one row (h[:1]) or every row (h[-n:]), or take the value before "
                       "expanding it over the batch")
        if an.carries_gradient(node):
            raise _mix("it keeps some rows of a value that is the same for every sample (broadcast over the batch) "
                       "and computed from a parameter: autograd gives the rows kept the gradient of every sample, "
                       "so no per-sample gradient can follow it", "take the value before broadcasting it over the "
                       "batch (w rather than (w * torch.ones(n, 1))[:1]), or broadcast it with expand, whose rows "
                       "are read as the value itself (w.expand(n, -1)[:1] is w)")
        return SHARED
    blocks = layout or (an.batch.factor(src.shape[fact.dim]) or 1, 1)
    start = kw.get("start")
    found = sliced_layout(blocks, src.shape[fact.dim], out.shape[fact.dim], start, kw.get("step", 1), an.batch)
    if found is not None and (layout is not None or found == blocks):
        return fact if layout is None else PerSample(fact.dim, found)
    if blocks[0] > 1:
        raise _mix(f"it cuts into the {blocks[0]} blocks of samples that cat or repeat joined along the batch "
                   "dimension, keeping only some samples of a block or shifting them against each other",
                   "slice whole blocks (h[n:2 * n] of torch.cat([a, b, c]), n = the batch size), or slice each "
                   "part before joining them")
    raise _mix("it keeps only some samples, or shifts samples against each other (as h[1:] - h[:-1] does along "
               "the batch)", _FIX_DIM)


def _rows_of_a_batch_of_one(kw: dict, size, batch: BatchDims) -> int | None:
    """How many rows a slice (or ``narrow``) keeps of a dimension of ``size`` rows at a batch of one, its bounds
    read there too (``h[n - 1:]`` starts at 0); None when a bound is not a size of the batch alone, or where
    ``narrow`` would raise at a batch of one."""
    if "length" in kw:  # narrow(dim, start, length)
        read = slice_at_batch_of_one(size, kw["start"], kw["length"], 1, batch)
        if read is None or read[1] is None or read[2] is None:
            return None
        size, start, length, _ = read
        start += size if start < 0 else 0
        return length if 0 <= start and start + length <= size else None
    read = slice_at_batch_of_one(size, kw.get("start"), kw.get("end"), kw.get("step", 1), batch)
    return None if read is None else len(range(read[0])[slice(*read[1:])])


def _parts_of_the_batch() -> _Refuse:
    """Each part of a split along the batch holds some of the samples whole, but which ones is a size expression
    (``ceil(n / 2)``), not a layout: no fact follows a part, so whether the parts stay apart (a sum of per-part
    losses) or pair samples of different parts (``a[i] - b[i]``) is not proved either way."""
    return _Refuse(
        "it splits the batch into parts (chunk or split along the batch dimension, as for micro-batches); "
        "compiled_psg follows only values that hold the whole batch, so it cannot prove that the parts keep samples "
        "apart", "compute the loss on the whole batch (a sum of per-part sums is the sum over the batch: "
        "F.cross_entropy(model(x), y, reduction='sum')), or call the per-sample function once per part",
        kind="unknown")


def _as_list(v):
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _whole_slice(node: fx.Node, kw: dict, an: Analysis) -> bool:
    """``x[:]`` along the batch: start 0, step 1, and an end at or past the dimension's size."""
    if "length" in kw:  # narrow
        start, end, step = kw["start"], None, 1
        length = value_of(kw["length"]) if isinstance(kw["length"], fx.Node) else kw["length"]
        size = value_of(node.args[0]).shape[_norm_dim(kw["dim"], _rank(node.args[0]))]
        return start == 0 and same_size(length, size)
    start, end, step = kw.get("start"), kw.get("end"), kw.get("step", 1)
    start = value_of(start) if isinstance(start, fx.Node) else start
    end = value_of(end) if isinstance(end, fx.Node) else end
    if start not in (None, 0) or step != 1:
        return False
    size = value_of(node.args[0]).shape[_norm_dim(kw["dim"], _rank(node.args[0]))]
    return end is None or (isinstance(end, int) and end >= 2 ** 62) or same_size(end, size)


def _cat(an: Analysis, node: fx.Node, stack: bool) -> Fact:
    kw = _kwargs(node)
    parts = [p for p in kw["tensors"] if not (value_of(p).dim() == 1 and value_of(p).shape[0] == 0)]  # legacy []
    facts = [an.fact(p) for p in parts]
    _no_sample_index(facts)
    out = value_of(node)
    k = _norm_dim(kw.get("dim", 0), out.dim())
    if all(isinstance(f, Shared | Pooled) for f in facts):
        return _pooled(facts) or SHARED
    per_sample = [f for f in facts if isinstance(f, PerSample)]
    if stack:
        dims = {f.dim if f.dim < k else f.dim + 1 for f in per_sample}
    else:
        dims = {f.dim for f in per_sample}
    if len(dims) != 1 or len(per_sample) != len(facts):
        raise _mix("it joins values that hold the samples differently (or joins shared values into the batch)")
    dim = dims.pop()
    if stack or dim != k:
        return PerSample(dim, _merge_layouts(f.layout for f in per_sample))
    # along the batch dimension: blocks of samples one after another (a layout with a larger outer factor)
    inner = {f.layout[1] for f in per_sample if f.layout is not None}
    if None in (f.layout for f in per_sample) or len(inner) != 1:
        raise _mix("it joins values along the batch dimension in a way no sample layout describes", _FIX_DIM)
    return PerSample(dim, (sum(f.layout[0] for f in per_sample), inner.pop()))


def _slice_scatter(an: Analysis, node: fx.Node) -> Fact:
    kw = _kwargs(node)
    base, src = an.fact(node.args[0]), an.fact(node.args[1])
    _no_sample_index([base, src])
    rank = _rank(node.args[0])
    k = _norm_dim(kw.get("dim", 0), rank)
    select = node.target.overloadpacket.__name__ == "select_scatter"
    if isinstance(src, PerSample):
        src = PerSample(src.dim + (select and src.dim >= k), src.layout)
    if isinstance(base, PerSample) and base.dim == k and not (not select and _whole_slice(node, kw, an)):
        raise _mix("it writes into some samples only, or into other samples' positions", _FIX_DIM)
    if isinstance(src, PerSample) and src.dim == k and not isinstance(base, PerSample):
        raise _mix("it writes per-sample values into a value that is not per sample", _FIX_DIM)
    return _aligned([(base, rank), (src, rank)], rank) if not isinstance(base, Pooled) else base


@_handles(ops.REDUCTIONS)
def _reduction(an: Analysis, node: fx.Node) -> Fact:
    fact = an.fact(node.args[0])
    _no_sample_index([fact])
    if not isinstance(fact, PerSample):
        return fact
    dim_name, keep_name = ops.REDUCTIONS[node.target]
    kw = _kwargs(node) if dim_name else {}
    rank = _rank(node.args[0])
    dims = kw.get(dim_name) if dim_name else None
    reduced = list(range(rank)) if dims is None or dims == [] else [_norm_dim(d, rank) for d in _as_list(dims)]
    if fact.dim in reduced:
        return Pooled(node)
    keep = bool(kw.get(keep_name)) if keep_name else False
    moved = PerSample(fact.dim if keep else fact.dim - sum(r < fact.dim for r in reduced), fact.layout)
    out = value_of(node)
    return tuple(moved for _ in out) if isinstance(out, (tuple, list)) else moved


@_handles(ops.ALONG_DIM)
def _along_dim(an: Analysis, node: fx.Node) -> Fact:
    facts = _tensor_facts(an, node)
    _no_sample_index(facts.values())
    kw = _kwargs(node)
    first = node.args[0]
    rank = _rank(first)
    k = _norm_dim(kw.get("dim", -1), rank)
    result = _aligned([(f, _rank(a)) for a, f in facts.items()], rank)
    if isinstance(result, PerSample) and result.dim == k:
        raise _mix("it works along the batch dimension, so each sample's output depends on the others", _FIX_DIM)
    if isinstance(result, Shared):
        return _pooled(facts.values()) or SHARED
    out = value_of(node)
    return tuple(result for _ in out) if isinstance(out, (tuple, list)) else result


@_handles(ops._overloads("renorm"))
def _renorm(an: Analysis, node: fx.Node) -> Fact:
    """``renorm(x, p, dim, maxnorm)`` rescales each slice ``x.select(dim, k)`` by its norm over the other dims:
    per sample only when those slices are the samples."""
    fact = an.fact(node.args[0])
    _no_sample_index([fact])
    if isinstance(fact, PerSample) and _norm_dim(node.args[2], _rank(node.args[0])) != fact.dim:
        raise _mix("it normalizes slices that cut across the samples (renorm over a dimension other than the "
                   "batch)", "renorm along the batch dimension, or normalize each sample explicitly")
    return fact


@_handles(ops.SPATIAL)
def _spatial(an: Analysis, node: fx.Node) -> Fact:
    facts = _tensor_facts(an, node)
    _no_sample_index(facts.values())
    x = node.args[0]
    fact = an.fact(x)
    rank = _rank(x)
    mixed = ops.SPATIAL[node.target] + (1 if node.target in ops.MIXES_CHANNELS else 0)
    others = [f for a, f in facts.items() if a is not x]
    fractional = node.target.overloadpacket.__name__.startswith("fractional_max_pool")
    if any(not isinstance(f, Shared) for f in others) and not (fractional and isinstance(fact, PerSample)):
        raise _unknown(_op_name(node), " with per-sample auxiliary inputs")
    if isinstance(fact, PerSample) and fact.dim >= rank - mixed:
        raise _mix("it mixes the dimension that holds the batch (pooling, padding, upsampling or a triangle "
                   "mask over the samples)", _FIX_DIM)
    if fractional and isinstance(fact, PerSample):
        fact = _fractional_regions(an, node, fact, rank - mixed)
    out = value_of(node)
    return tuple(fact for _ in out) if isinstance(out, (tuple, list)) else fact


def _fractional_regions(an: Analysis, node: fx.Node, fact: PerSample, lead: int) -> PerSample:
    """``fractional_max_pool{2,3}d(x, kernel, output, random_samples)`` pools the plane ``(n, c)`` of ``x`` (``c``
    without ``n``) over regions drawn from ``random_samples[n, c]``: per sample where the rows of the samples are
    their own, ``random_samples`` per sample in the dimension matching ``x``'s batch and laid out alike (given
    per sample, or drawn by torch), as a sample alone reads them at position 0."""
    regions = an.fact(node.args[3])
    if not isinstance(regions, PerSample) or regions.dim != fact.dim + 2 - lead:
        raise _mix("each sample's pooling regions come from the row of _random_samples at its position in the "
                   "batch, which a sample alone reads at position 0",
                   "give _random_samples one row per sample as a batched argument, or leave it out (torch then "
                   "draws the rows with the batch)")
    return PerSample(fact.dim, _merge_layouts([fact.layout, regions.layout]))


@_handles(ops.MATMULS)
def _matmul(an: Analysis, node: fx.Node) -> Fact:
    letters, out_letters, names, bias_name = ops.MATMULS[node.target]
    kw = _kwargs(node)
    operands = [kw[n] for n in names]
    facts = [an.fact(o) for o in operands]
    _no_sample_index(facts)
    bias = kw.get(bias_name) if bias_name else None
    pooled = _pooled(facts + ([an.fact(bias)] if bias is not None else []))
    found: dict[str, list] = {}
    for spec, fact in zip(letters, facts, strict=True):
        if isinstance(fact, PerSample):
            found.setdefault(spec[fact.dim], []).append(fact.layout)
    if len(found) > 1:
        raise _mix("its result pairs every sample with every other sample (a product of two per-sample values "
                   "over different dimensions)", "compute per-sample quantities only; similarity matrices "
                   "across the batch have no per-sample gradient")
    if not found:
        product: Fact = pooled or SHARED
    else:
        letter, layouts = next(iter(found.items()))
        layout = _merge_layouts(layouts)
        if letter not in out_letters:
            product = Pooled(node, "it sums over the batch (a matrix product whose inner dimension is the batch)")
        else:
            product = PerSample(out_letters.index(letter), layout)
    if bias is None:
        return product
    if isinstance(product, Pooled) and isinstance(an.fact(bias), PerSample):
        raise _mix("it adds per-sample values to a sum over the batch")
    return _aligned([(product, len(out_letters)), (an.fact(bias), _rank(bias))], len(out_letters)) \
        if not isinstance(product, Pooled) else product


@_handles(ops._overloads("_trilinear"))
def _trilinear(an: Analysis, node: fx.Node) -> Fact:
    i1, i2, i3, e1, e2, e3, sumdim = node.args[:7]
    tensors, expands = [i1, i2, i3], [e1, e2, e3]
    rank = _rank(i1) + len(e1)
    common, layouts = set(), []
    facts = [an.fact(t) for t in tensors]
    _no_sample_index(facts)
    for e, fact in zip(expands, facts, strict=True):
        if isinstance(fact, PerSample):
            kept = [d for d in range(rank) if d not in e]
            common.add(kept[fact.dim])
            layouts.append(fact.layout)
    if not common:
        return _pooled(facts) or SHARED
    if len(common) > 1:
        raise _mix("its result pairs every sample with every other sample")
    c = common.pop()
    layout = _merge_layouts(layouts)
    if c in sumdim:
        return Pooled(node, "it sums over the batch")
    return PerSample(c - sum(s < c for s in sumdim), layout)


@_handles(ops.MATRIX_STACKS)
def _matrix_stack(an: Analysis, node: fx.Node) -> Fact:
    """Linear algebra on stacks of matrices (``linalg.inv_ex``, ``solve_ex``, ``cholesky_ex``, ``det``, ``eigh``,
    ``svd``, their helpers): every matrix is handled on its own, so a batch in dimension 0 of a stack
    ``[B, ..., n, m]`` stays apart; in a matrix dimension it mixes the rows and columns of different samples.
    Shared matrices broadcast over the stack; an argument of one value per matrix (``ops.PER_MATRIX_ARGS``,
    ``[B, ...]``) holds the batch in its dimension 0 too."""
    columns = _solved_columns(an, node)
    if columns is not None:
        return columns
    tensors = [a for a in node.all_input_nodes if isinstance(value_of(a), torch.Tensor)]
    per_matrix = {_kwargs(node).get(name) for name in ops.PER_MATRIX_ARGS.get(node.target, ())} - {None}
    vectors = _vector_right_hand_side(node)
    facts = [an.fact(t) for t in tensors]
    _no_sample_index(facts)
    out = value_of(node)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    per = [(t, f) for t, f in zip(tensors, facts, strict=True) if isinstance(f, PerSample)]
    if not per:
        fact = _pooled(facts) or SHARED
        return tuple(fact for _ in outs) if isinstance(out, (tuple, list)) else fact
    if _pooled(facts) is not None:
        raise _mix("it combines per-sample matrices with a sum over the batch")
    for t, f in per:
        if _rank(t) < (1 if t in per_matrix else 2 if t in vectors else 3) or _norm_dim(f.dim, _rank(t)) != 0:
            raise _mix("the batch sits in a matrix dimension, whose rows and columns this op combines",
                       "keep the batch as the leading dimension of a stack of matrices, [B, n, n] (a solve with a "
                       "shared matrix may also hold the samples as the columns of its right-hand side)")
    layout = _merge_layouts([f.layout for _, f in per])
    found = []
    for v in outs:
        dims = an.batch.dims(v) if isinstance(v, torch.Tensor) else ()
        if dims not in ((), (0,)):
            raise _unknown(_op_name(node), " (an output with the batch outside its leading dimension)")
        found.append(PerSample(0, layout) if dims else SHARED)
    return tuple(found) if isinstance(out, (tuple, list)) else found[0]


def _solved_columns(an: Analysis, node: fx.Node) -> Fact | None:
    """A solve (``ops.SOLVES``) with shared matrices and the samples as the columns of the right-hand side
    (``solve(A, y.t())``; its rows for ``left=False``): each column is solved on its own, and the solution holds
    the samples where the right-hand side does. None for any other use (``_matrix_stack`` decides it)."""
    spec = ops.SOLVES.get(node.target)
    if spec is None:
        return None
    matrices, rhs_name, left_name = spec
    kw = _kwargs(node)
    rhs = kw[rhs_name]
    fact = an.fact(rhs)
    if not isinstance(fact, PerSample) or any(not isinstance(an.fact(kw[m]), Shared) for m in matrices):
        return None
    rank = _rank(rhs)
    from_end = 1 if kw.get(left_name, True) or left_name is None else 2  # a column, or a row for X A = B
    if rank < 2 or rhs in _vector_right_hand_side(node) or _norm_dim(fact.dim, rank) != rank - from_end:
        return None
    out = value_of(node)
    found = []
    for v in out if isinstance(out, (tuple, list)) else (out,):
        dims = an.batch.dims(v) if isinstance(v, torch.Tensor) else ()
        if dims and dims != (v.dim() - from_end,):
            return None
        found.append(PerSample(dims[0], fact.layout) if dims else SHARED)
    return tuple(found) if isinstance(out, (tuple, list)) else found[0]


def _vector_right_hand_side(node: fx.Node) -> set[fx.Node]:
    """``linalg.solve``'s right-hand side when torch reads it as a stack of vectors (``B.shape == A.shape[:-1]``):
    ``[B, ..., n]`` holds one vector per matrix, its batch in dimension 0."""
    if node.target is not torch.ops.aten._linalg_solve_ex.default:
        return set()
    a, b = node.args[:2]
    matrices, rhs = value_of(a), value_of(b)
    if rhs.dim() == matrices.dim() - 1 and tuple(rhs.shape) == tuple(matrices.shape[:-1]):
        return {b}
    return set()


def _first_input(an: Analysis, node: fx.Node) -> tuple[fx.Node, Fact]:
    """The op's first argument and its fact, which must not be a sample's position in the batch."""
    x = node.args[0]
    fact = an.fact(x)
    _no_sample_index([fact])
    return x, fact


@_handles(ops.OVER_DIMS)
def _over_dims(an: Analysis, node: fx.Node) -> Fact:
    """FFTs over ``dim``, ``rot90`` over ``dims``, ``channel_shuffle`` over the channels: each slice along the other
    dimensions on its own, the output as many dimensions as the input."""
    kw = _kwargs(node)
    x, fact = _first_input(an, node)
    if not isinstance(fact, PerSample):
        return fact
    rank = _rank(x)
    over = ops.OVER_DIMS[node.target]
    dims = {_norm_dim(d, rank) for d in (over if isinstance(over, tuple) else _as_list(kw[over]))}
    if node.target.overloadpacket.__name__ == "rot90" and kw.get("k", 1) % 4 == 0:
        return fact  # a whole number of turns: the input as it is
    if _norm_dim(fact.dim, rank) in dims:
        raise _mix("it transforms along the dimension that holds the batch", _FIX_DIM)
    return fact


@_handles(ops._overloads("view_as_real", "view_as_complex"))
def _complex_view(an: Analysis, node: fx.Node) -> Fact:
    """``view_as_real`` appends a dimension of 2 (real, imaginary) and ``view_as_complex`` removes it: every other
    dimension stays where it is."""
    x, fact = _first_input(an, node)
    if isinstance(fact, PerSample) and node.target.overloadpacket.__name__ == "view_as_complex" \
            and _norm_dim(fact.dim, _rank(x)) == _rank(x) - 1:
        raise _mix("it pairs the entries of the dimension that holds the batch as real and imaginary parts", _FIX_DIM)
    return fact if not isinstance(fact, PerSample) else PerSample(_norm_dim(fact.dim, _rank(x)), fact.layout)


@_handles(ops._overloads("diag_embed"))
def _diag_embed(an: Analysis, node: fx.Node) -> Fact:
    """``diag_embed(x, offset, dim1, dim2)``: the last dimension of ``x`` becomes a diagonal on ``(dim1, dim2)`` of
    an output one dimension larger; the other dimensions keep their order."""
    kw = _kwargs(node)
    x, fact = _first_input(an, node)
    if not isinstance(fact, PerSample):
        return fact
    rank = _rank(x)
    d = _norm_dim(fact.dim, rank)
    if d == rank - 1:
        raise _mix("it spreads the dimension that holds the batch over a diagonal", _FIX_DIM)
    diagonal = {_norm_dim(kw.get("dim1", -2), rank + 1), _norm_dim(kw.get("dim2", -1), rank + 1)}
    kept = [e for e in range(rank + 1) if e not in diagonal]
    return PerSample(kept[d], fact.layout)


@_handles(ops._overloads("diagonal_scatter"))
def _diagonal_scatter(an: Analysis, node: fx.Node) -> Fact:
    """``diagonal_scatter(input, src, offset, dim1, dim2)``: ``src``'s dimensions are ``input``'s without ``dim1``
    and ``dim2``, then the diagonal. The batch may sit in any other dimension, the same one in both."""
    kw = _kwargs(node)
    inp, src = kw["input"], kw["src"]
    rank = _rank(inp)
    diagonal = {_norm_dim(kw.get("dim1", 0), rank), _norm_dim(kw.get("dim2", 1), rank)}
    kept = [d for d in range(rank) if d not in diagonal]
    facts = [an.fact(inp), an.fact(src)]
    _no_sample_index(facts)
    dims, layouts = set(), []
    for fact, to_input in ((facts[0], lambda d: d), (facts[1], lambda d: kept[d] if d < len(kept) else None)):
        if not isinstance(fact, PerSample):
            continue
        d = to_input(_norm_dim(fact.dim, rank if fact is facts[0] else rank - 1))
        if d is None or d in diagonal:
            raise _mix("it writes a diagonal across the dimension that holds the batch", _FIX_DIM)
        dims.add(d)
        layouts.append(fact.layout)
    pooled = _pooled(facts)
    if not dims:
        return pooled or SHARED
    if pooled is not None:
        raise _mix("it writes per-sample values into a sum over the batch, or the other way round")
    if len(dims) > 1:
        raise _mix("its result pairs every sample with every other sample")
    return PerSample(dims.pop(), _merge_layouts(layouts))


def _distances(an: Analysis, node: fx.Node, operands: list, roles: list[str], out_rows: str) -> Fact:
    """Pairwise distances and their gradient, by where each operand's batch sits: ``roles`` names each operand's
    last two dimensions (``"pm"``: rows p, features m), the output's are ``out_rows``; leading dimensions
    broadcast. A batch on the feature dimension ``m``, which every distance sums over, mixes the samples; on a row
    dimension missing from the output, the op sums over the batch."""
    facts = [an.fact(o) for o in operands]
    _no_sample_index(facts)
    out_rank = max(_rank(o) for o in operands)
    found: dict[object, list] = {}
    for o, fact, role in zip(operands, facts, roles, strict=True):
        if not isinstance(fact, PerSample):
            continue
        rank = _rank(o)
        dim = _norm_dim(fact.dim, rank)
        if dim >= rank - 2:
            letter = role[dim - rank + 2]
            if letter == "m":
                raise _mix("each distance sums over the features, the dimension that holds the batch", _FIX_DIM)
        else:
            letter = dim + out_rank - rank  # a leading (broadcast) dimension, aligned from the right
        found.setdefault(letter, []).append(fact.layout)
    if not found:
        return _pooled(facts) or SHARED
    if len(found) > 1:
        raise _mix("its result pairs every sample with every other sample (distances between per-sample rows of "
                   "two different inputs)", "compute distances to shared points (a parameter) only")
    letter, layouts = next(iter(found.items()))
    layout = _merge_layouts(layouts)
    if isinstance(letter, int):
        return PerSample(letter, layout)
    if letter not in out_rows:
        return Pooled(node, "it sums over the batch (the gradient of distances to every sample)")
    return PerSample(out_rank - 2 + out_rows.index(letter), layout)


@_handles(ops._overloads("_cdist_forward", "_euclidean_dist"))
def _cdist_forward(an: Analysis, node: fx.Node) -> Fact:
    """``_cdist_forward(x1 [..., p, m], x2 [..., r, m], p, mode) -> [..., p, r]``; ``_euclidean_dist(x1, x2)``,
    cdist's matrix-product form for p = 2 and more than 25 rows, alike."""
    return _distances(an, node, list(node.args[:2]), ["pm", "rm"], "pr")


@_handles(ops._overloads("_cdist_backward"))
def _cdist_backward(an: Analysis, node: fx.Node) -> Fact:
    """``_cdist_backward(grad [..., p, r], x1 [..., p, m], x2 [..., r, m], p, cdist [..., p, r]) -> [..., p, m]``:
    the gradient for ``x1``, a sum over the rows ``r`` of ``x2``."""
    grad, x1, x2, _, dist = node.args[:5]
    return _distances(an, node, [grad, x1, x2, dist], ["pr", "pm", "rm", "pr"], "pm")


@_handles(ops.CONVOLUTIONS)
def _convolution(an: Analysis, node: fx.Node) -> Fact:
    x, weight = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    fact = an.fact(x)
    _no_sample_index([fact])
    if any(not isinstance(an.fact(t), Shared) for t in (weight, bias) if isinstance(t, fx.Node)):
        raise _mix("the convolution's weight or bias depends on the samples")
    if isinstance(fact, PerSample) and fact.dim != 0:
        raise _mix("the convolution slides over, or sums over, the dimension that holds the batch",
                   "keep the batch in dimension 0 of the convolution's input (pass in_dims to name it)")
    return fact


@_handles(ops.LAYER_NORMS)
def _layer_norm(an: Analysis, node: fx.Node) -> Fact:
    kw = _kwargs(node)
    x = node.args[0]
    fact = an.fact(x)
    _no_sample_index([fact])
    for name in ("weight", "bias"):
        if isinstance(kw.get(name), fx.Node) and not isinstance(an.fact(kw[name]), Shared):
            raise _unknown(_op_name(node), " with per-sample weights")
    normalized = len(kw["normalized_shape"])
    if isinstance(fact, PerSample) and fact.dim >= _rank(x) - normalized:
        raise _mix("it normalizes over the dimension that holds the batch", _FIX_DIM)
    out = value_of(node)
    return tuple(fact if isinstance(v, torch.Tensor) and an.batch.dims(v) else _shared_or(fact)
                 for v in out)


def _shared_or(fact: Fact) -> Fact:
    return fact if isinstance(fact, Pooled) else SHARED


@_handles(ops.GROUP_NORMS)
def _group_norm(an: Analysis, node: fx.Node) -> Fact:
    x = node.args[0]
    fact = an.fact(x)
    _no_sample_index([fact])
    if any(not isinstance(an.fact(t), Shared) for t in node.args[1:3] if isinstance(t, fx.Node)):
        raise _unknown(_op_name(node), " with per-sample weights")
    if isinstance(fact, PerSample) and fact.dim != 0:
        raise _mix("GroupNorm normalizes over the dimension that holds the batch", _FIX_DIM)
    return tuple(fact for _ in value_of(node))


@_handles(ops.BATCH_NORMS)
def _batch_norm(an: Analysis, node: fx.Node) -> Fact:
    kw = _kwargs(node)
    x = node.args[0]
    fact = an.fact(x)
    _no_sample_index([fact])
    training = kw.get("training", node.target is not ATEN._native_batch_norm_legit_no_training.default)
    out = value_of(node)
    if not isinstance(fact, PerSample):
        return tuple(fact for _ in out)
    if training and fact.dim != 1 and "InstanceNorm" in (module_path(node) or ""):
        raise _mix("InstanceNorm normalizes over the dimension that holds the batch", _FIX_DIM)
    if training and fact.dim != 1 and _without_running_stats(node, kw):
        raise _Refuse("BatchNorm without running statistics (track_running_stats=False, or F.batch_norm with "
                      "running_mean=None) normalizes each sample with statistics of the whole batch, in eval mode "
                      "too", "replace BatchNorm with GroupNorm or LayerNorm, or keep running statistics "
                      "(track_running_stats=True) and call model.eval()")
    if training and fact.dim != 1:
        raise _Refuse("BatchNorm in training mode normalizes each sample with statistics of the whole batch",
                      "call model.eval() so BatchNorm uses its running statistics, or replace BatchNorm with "
                      "GroupNorm or LayerNorm")
    if fact.dim == 1:  # InstanceNorm's [1, B*C, ...]: each channel, a sample's, normalized on its own
        fact = PerSample(1, _merge_layouts([fact.layout, *_channel_layouts(an, kw)]))
    facts = [fact]
    for v in out[1:]:  # statistics: per channel, so per sample when the samples are the channels
        dims = an.batch.dims(v) if isinstance(v, torch.Tensor) else ()
        facts.append(PerSample(0, fact.layout) if dims == (0,) else SHARED)
    return tuple(facts)


def _channel_layouts(an: Analysis, kw: dict) -> list[Layout | None]:
    """A batch norm over channels that are the samples' (``instance_norm`` repeats its weights and running
    statistics ``n`` times beside ``[1, n*C, ...]``): the layouts of the per-channel tensors, which must hold the
    samples as the channels do (shared ones are the same for every channel)."""
    layouts = []
    for name in ("weight", "bias", "running_mean", "running_var"):
        t = kw.get(name)
        f = an.fact(t) if isinstance(t, fx.Node) else SHARED
        if isinstance(f, Pooled):
            _raise_pooled(f)
        if isinstance(f, PerSample) and f.dim == 0:
            layouts.append(f.layout)
        elif not isinstance(f, Shared):
            raise _mix(f"its per-channel {name} does not hold the samples as its input's channels do", _FIX_DIM)
    return layouts


def _without_running_stats(node: fx.Node, kw: dict) -> bool:
    """A batch norm that has no running statistics to use (``_native_batch_norm_legit.no_stats``, or no
    ``running_mean``): it normalizes with the batch's statistics whatever the module's mode."""
    return node.target is ATEN._native_batch_norm_legit.no_stats or ("running_mean" in kw
                                                                     and kw["running_mean"] is None)


@_handles(ops.ATTENTIONS)
def _attention(an: Analysis, node: fx.Node) -> Fact:
    q, k, v = node.args[:3]
    kw = _kwargs(node)
    mask = kw.get("attn_mask", kw.get("attn_bias"))
    facts = [(an.fact(t), _rank(t)) for t in (q, k, v)]
    if isinstance(mask, fx.Node):
        facts.append((an.fact(mask), _rank(mask)))
    _no_sample_index([f for f, _ in facts])
    rank = _rank(q)
    result = _aligned(facts, rank)
    if isinstance(result, PerSample) and result.dim >= rank - 2:
        raise _mix("attention runs across the dimension that holds the batch (queries attend to other samples)",
                   "keep the batch in a leading dimension of the queries, keys and values")
    if not isinstance(result, PerSample):
        return _pooled([f for f, _ in facts]) or SHARED
    out = value_of(node)
    return tuple(result if isinstance(o, torch.Tensor) and an.batch.dims(o) else SHARED for o in out)


@_handles(ops.NLL_LOSSES)
def _nll_loss(an: Analysis, node: fx.Node) -> Fact:
    kw = _kwargs(node)
    x, target = kw["input"], kw["target"]
    fx_, ft = an.fact(x), an.fact(target)
    _no_sample_index([fx_, ft])
    if isinstance(kw.get("weight"), fx.Node) and not isinstance(an.fact(kw["weight"]), Shared):
        raise _unknown(_op_name(node), " with per-sample class weights")
    if isinstance(fx_, PerSample) and _rank(x) > 1 and fx_.dim == 1:
        raise _mix("the class dimension of the loss holds the batch", _FIX_DIM)
    # the target has the input's dimensions without the class dimension (1)
    x_as_target = None
    if isinstance(fx_, PerSample):
        x_as_target = PerSample(fx_.dim if fx_.dim == 0 else fx_.dim - 1, fx_.layout) if _rank(x) > 1 else None
    elementwise = _aligned([(f, _rank(target)) for f in (x_as_target, ft) if isinstance(f, PerSample)],
                           _rank(target))
    if kw["reduction"] == 0:
        return (elementwise if not isinstance(elementwise, Shared) else _pooled([fx_, ft]) or SHARED,
                _pooled([fx_, ft]) or SHARED)
    if isinstance(elementwise, PerSample):
        return (Pooled(node), Pooled(node))
    pooled = _pooled([fx_, ft]) or SHARED
    return (pooled, pooled)


@_handles(ops.LOSSES)
def _loss(an: Analysis, node: fx.Node) -> Fact:
    kw = _kwargs(node)
    facts = _tensor_facts(an, node)
    _no_sample_index(facts.values())
    out_rank = max(_rank(a) for a in facts)
    elementwise = _aligned([(f, _rank(a)) for a, f in facts.items()], out_rank)
    if kw.get("reduction", 1) == 0:
        return elementwise if not isinstance(elementwise, Shared) else _pooled(facts.values()) or SHARED
    if isinstance(elementwise, PerSample):
        return Pooled(node)
    return _pooled(facts.values()) or SHARED


@_handles(ops._overloads("embedding"))
def _embedding(an: Analysis, node: fx.Node) -> Fact:
    weight, indices = node.args[:2]
    if not isinstance(an.fact(weight), Shared):
        raise _unknown(_op_name(node), " with a per-sample table")
    fact = an.fact(indices)
    _no_sample_index([fact])
    return fact


@_handles(ops._overloads("_embedding_bag", "_embedding_bag_forward_only"))
def _embedding_bag(an: Analysis, node: fx.Node) -> Fact:
    kw = _kwargs(node)
    if not isinstance(an.fact(kw["weight"]), Shared):
        raise _unknown(_op_name(node), " with a per-sample table")
    indices, offsets = an.fact(kw["indices"]), an.fact(kw["offsets"])
    weights = kw.get("per_sample_weights")
    wfact = an.fact(weights) if isinstance(weights, fx.Node) else SHARED
    if isinstance(indices, Shared) and isinstance(offsets, Shared) and isinstance(wfact, Shared):
        return SHARED
    # per-sample bags: 2-D input [n, l] flattened to [n*l] with offsets arange(0, n*l, l)
    ok = (isinstance(indices, PerSample) and indices.layout is not None and indices.layout[0] == 1
          and isinstance(offsets, SampleIndex) and offsets.stride == indices.layout[1]
          and not kw.get("include_last_offset", False)
          and (isinstance(wfact, Shared) or (isinstance(wfact, PerSample) and wfact.layout == indices.layout)))
    if not ok:
        raise _unknown(_op_name(node), " with bags that are not one per sample (pass a 2-D input [n, l])")
    facts = []
    for v in value_of(node):
        factor = an.batch.factor(v.shape[0]) if v.dim() and an.batch.dims(v) == (0,) else None
        facts.append(PerSample(0, (1, factor)) if factor else SHARED)
    return tuple(facts)


@_handles(ops._overloads("index.Tensor", "_unsafe_index.Tensor"))
def _index(an: Analysis, node: fx.Node) -> Fact:
    return _index_read(an, node, node.args[0], list(node.args[1]))


def _index_read(an: Analysis, node: fx.Node, x: fx.Node, indices: list) -> Fact:
    """The fact of ``x[indices]`` (advanced indexing; ``None`` keeps a dimension)."""
    rank = _rank(x)
    indices += [None] * (rank - len(indices))
    fact = an.fact(x)
    positions = [p for p, i in enumerate(indices) if i is not None]
    index_vals = [value_of(indices[p]) for p in positions]
    if any(v.dtype == torch.bool for v in index_vals):
        raise _unknown(_op_name(node), " with a boolean mask", _MASK_FIX)
    s_rank = max(v.dim() for v in index_vals)
    consecutive = positions == list(range(positions[0], positions[-1] + 1))
    rest = [d for d in range(rank) if d not in positions]
    # output dims: where each remaining input dim and each broadcast index dim goes
    if consecutive:
        before = [d for d in rest if d < positions[0]]
        out_of_rest = {d: (i if d < positions[0] else i + s_rank) for i, d in enumerate(rest)}
        s_offset = len(before)
    else:
        out_of_rest = {d: s_rank + i for i, d in enumerate(rest)}
        s_offset = 0
    index_dims, layouts, sample_index_dim = set(), [], None
    for p, v in zip(positions, index_vals, strict=True):
        f = an.fact(indices[p])
        if isinstance(f, Pooled):
            return f if not an.batch.is_batched(node) else _raise_pooled(f)
        if isinstance(f, PerSample):
            index_dims.add(s_offset + f.dim + s_rank - v.dim())
            layouts.append(f.layout)
        elif isinstance(f, SampleIndex):
            if not (isinstance(fact, PerSample) and p == fact.dim and _one_sample_per_position(an, x, fact)
                    and f.stride == 1):
                _no_sample_index([f])
            sample_index_dim = s_offset + f.dim + s_rank - v.dim()
    if isinstance(fact, PerSample):
        if fact.dim in positions:
            if sample_index_dim is None:
                raise _mix("it indexes the batch dimension, so a sample reads other samples' values "
                           "(x[perm], x[(arange(n) + 1) % n])", "index only the dimensions after the batch, or "
                           "pair each sample with itself with torch.arange(n)")
            if index_dims - {sample_index_dim}:
                raise _mix("its indices pair samples with other samples")
            return PerSample(sample_index_dim, (1, 1))
        if index_dims or sample_index_dim is not None:
            raise _mix("its per-sample indices pick from every sample's values, pairing samples",
                       "use torch.gather to pick within each sample")
        return PerSample(out_of_rest[fact.dim], fact.layout)
    if isinstance(fact, Pooled):
        if index_dims:
            _raise_pooled(fact)
        return fact
    if sample_index_dim is not None:
        _no_sample_index([SampleIndex(0)])
    if not index_dims:
        return SHARED
    if len(index_dims) > 1:
        raise _mix("its indices pair samples with other samples")
    return PerSample(index_dims.pop(), _merge_layouts(layouts))


def _one_sample_per_position(an: Analysis, x: fx.Node, fact: PerSample) -> bool:
    """Position ``b`` of ``fact.dim`` holds sample ``b``, as ``arange(n)`` pairs it: layout ``(1, 1)``, or no layout
    (the same for every sample, ``torch.zeros(n, d)``) on a dimension that is exactly the batch."""
    return fact.layout == (1, 1) or (fact.layout is None and an.batch.is_whole(value_of(x), fact.dim))


def _raise_pooled(f: Pooled):
    raise _Refuse(f"{f.why}, and its result flows back into per-sample values",
                  "reduce over non-batch dimensions only, or move batch statistics out of the loss function",
                  node=f.origin)


@_handles(ops._overloads("index_select"))
def _index_select(an: Analysis, node: fx.Node) -> Fact:
    x, dim, idx = node.args[:3]
    rank = _rank(x)
    k = _norm_dim(dim, rank)
    fx_, fi = an.fact(x), an.fact(idx)
    if isinstance(fx_, PerSample):
        if fx_.dim == k:
            if isinstance(fi, SampleIndex) and fi.stride == 1 and _one_sample_per_position(an, x, fx_):
                return fx_
            raise _mix("it selects along the batch dimension, so a sample reads other samples' values", _FIX_DIM)
        if not isinstance(fi, Shared):
            raise _mix("its per-sample indices pick from every sample's values, pairing samples",
                       "use torch.gather to pick within each sample")
        return fx_
    _no_sample_index([fi])
    if isinstance(fi, PerSample):
        if isinstance(fx_, Pooled):
            _raise_pooled(fx_)
        return PerSample(k, fi.layout)
    return _pooled([fx_, fi]) or SHARED


@_handles(ops._overloads("gather"))
def _gather(an: Analysis, node: fx.Node) -> Fact:
    x, dim, idx = node.args[:3]
    k = _norm_dim(dim, _rank(x))
    fx_, fi = an.fact(x), an.fact(idx)
    _no_sample_index([fx_, fi])
    if isinstance(fx_, PerSample):
        if fx_.dim == k or not isinstance(fi, PerSample) or fi.dim != fx_.dim:
            raise _mix("it gathers along (or across) the batch dimension, so a sample reads other samples' "
                       "values", _FIX_DIM)
        return PerSample(fx_.dim, _merge_layouts([fx_.layout, fi.layout]))
    if isinstance(fi, PerSample):
        if isinstance(fx_, Pooled):
            _raise_pooled(fx_)
        return fi
    return _pooled([fx_, fi]) or SHARED


_SCATTERS = ops._overloads("scatter.src", "scatter.value", "scatter_add", "scatter_reduce.two", "index_add",
                           "index_copy", "index_fill.int_Scalar", "index_fill.int_Tensor")


_INDEX_FILLS = ops._overloads("index_fill.int_Scalar", "index_fill.int_Tensor")


def _fills_own_positions(an: Analysis, node: fx.Node, k: int) -> bool:
    """``x.index_fill(k, arange(n), v)`` with ``k`` the batch dimension and ``v`` shared: every sample fills its
    own position, as in a batch of its own (torch 2.15 traces ``h[torch.arange(n), j] = v`` so; earlier versions
    trace it as ``index_put``). The same condition as ``index_select``'s."""
    if node.target not in _INDEX_FILLS:
        return False
    x, _, idx, value = node.args[:4]
    fx_, fi = an.fact(x), an.fact(idx)
    fv = an.fact(value) if isinstance(value, fx.Node) else SHARED
    return (isinstance(fx_, PerSample) and fx_.dim == k and _one_sample_per_position(an, x, fx_)
            and isinstance(fi, SampleIndex) and fi.stride == 1 and isinstance(fv, Shared))


@_handles(_SCATTERS)
def _scatter(an: Analysis, node: fx.Node) -> Fact:
    """Writes along ``dim``: per sample when the batch is elsewhere and every operand holds it alike, or when an
    ``index_fill`` fills each sample's own position (``_fills_own_positions``)."""
    x, dim = node.args[:2]
    k = _norm_dim(dim, _rank(x))
    if _fills_own_positions(an, node, k):
        return an.fact(x)
    facts = _tensor_facts(an, node)
    name = node.target.overloadpacket.__name__
    if isinstance(facts.get(node.args[2]), SampleIndex) and isinstance(facts[x], PerSample) and facts[x].dim == k:
        # index_add(0, arange(n), v) into zeros(n, d): the index_put form proves it
        raise _mix(f"{name} writes at batch positions (an index made from torch.arange(n)), which compiled_psg "
                   "accepts in the indexing form only", "write h[torch.arange(n)] = v, or h.index_put("
                   "(torch.arange(n),), v, accumulate=True) for an accumulation (index_add, scatter_add): each "
                   "sample then writes its own position")
    _no_sample_index(facts.values())
    fx_ = facts[x]
    rest = [(a, f) for a, f in facts.items() if a is not x]
    if isinstance(fx_, PerSample):
        if fx_.dim == k:
            raise _mix("it writes along the batch dimension, moving values between samples", _FIX_DIM)
        layouts = [fx_.layout]
        for a, f in rest:
            one_d_index = name.startswith("index_") and a is node.args[2]
            if one_d_index:
                if not isinstance(f, Shared):
                    raise _mix("its per-sample indices write into every sample's values")
                continue
            if isinstance(f, PerSample) and f.dim == fx_.dim:
                layouts.append(f.layout)
            elif not (isinstance(f, Shared) and value_of(a).dim() == 0):
                raise _mix("it writes values of some samples into others (its operands do not hold the batch "
                           "alike)", _FIX_DIM)
        return PerSample(fx_.dim, _merge_layouts(layouts))
    if any(isinstance(f, PerSample) for _, f in rest):
        if isinstance(fx_, Pooled):
            _raise_pooled(fx_)
        return Pooled(node, "it accumulates several samples' values into one tensor")
    return _pooled(facts.values()) or SHARED


@_handles(ops._overloads("index_put", "_unsafe_index_put"))
def _index_put(an: Analysis, node: fx.Node) -> Fact:
    """``x[indices] = values``: the positions written are those ``x[indices]`` reads, so the write is per sample
    exactly when that read is, and the values hold the samples where the read's result does."""
    x, indices, values = node.args[:3]
    fx_, fv = an.fact(x), an.fact(values)
    _no_sample_index([fv])
    read = _index_read(an, node, x, list(indices))  # the fact x[indices] would have (raises on mixing)
    if isinstance(fx_, PerSample):
        # the result holds the samples as x does, where x has a layout, else as the positions written
        # (``torch.zeros(n * t, d)`` has none: after the write it is no longer the same for every sample)
        layouts = [fx_.layout, read.layout]
        if isinstance(fv, PerSample):
            rank = value_of(node.args[0]).dim()
            positions = [p for p, i in enumerate(indices) if i is not None]
            s_rank = max(value_of(indices[p]).dim() for p in positions)
            read_rank = rank - len(positions) + s_rank
            if not isinstance(read, PerSample) or fv.dim + read_rank - _rank(values) != read.dim:
                raise _mix("it writes values of some samples into other samples' positions")
            layouts.append(fv.layout)
        elif isinstance(fv, Pooled):
            _raise_pooled(fv)
        return PerSample(fx_.dim, _merge_layouts(layouts))
    index_facts = [an.fact(i) for i in indices if i is not None]
    if any(isinstance(f, PerSample) for f in index_facts + [fv]):
        if isinstance(fx_, Pooled):
            _raise_pooled(fx_)
        return Pooled(node, "it accumulates several samples' values into one tensor")
    return _pooled([fx_, fv, *index_facts]) or SHARED


@_handles(ops._overloads("bucketize.Tensor", "searchsorted.Tensor"))
def _bucketize(an: Analysis, node: fx.Node) -> Fact:
    kw = _kwargs(node)
    boundaries = kw.get("boundaries", kw.get("sorted_sequence"))
    values = kw.get("input", kw.get("self"))
    fb, fv = an.fact(boundaries), an.fact(values)
    _no_sample_index([fb, fv])
    if isinstance(fb, Shared):
        return fv
    if _rank(boundaries) > 1 and isinstance(fb, PerSample) and isinstance(fv, PerSample) and fb.dim == fv.dim \
            and fb.dim < _rank(boundaries) - 1:
        return PerSample(fv.dim, _merge_layouts([fb.layout, fv.layout]))
    raise _mix("it searches boundaries made from several samples")


@_handles(ops.BATCH_FIRST)
def _batch_first(an: Analysis, node: fx.Node) -> Fact:
    """Ops whose tensors all hold independent rows in dimension 0 (the batch of the op)."""
    facts = _tensor_facts(an, node)
    _no_sample_index(facts.values())
    layouts = []
    for f in facts.values():
        if isinstance(f, PerSample):
            if f.dim != 0:
                raise _mix("it mixes the dimension that holds the batch", _FIX_DIM)
            layouts.append(f.layout)
        elif isinstance(f, Pooled):
            _raise_pooled(f)
    if not layouts:
        return SHARED
    fact = PerSample(0, _merge_layouts(layouts))
    out = value_of(node)
    if isinstance(out, (tuple, list)):
        return tuple(fact if isinstance(o, torch.Tensor) and an.batch.dims(o) else SHARED for o in out)
    return fact


@_handles(ops._overloads("_weight_norm_interface", "_weight_norm_interface_backward"))
def _shared_only(an: Analysis, node: fx.Node) -> Fact:
    facts = _tensor_facts(an, node)
    if any(not isinstance(f, Shared) for f in facts.values()):
        raise _unknown(_op_name(node), " on per-sample values")
    return SHARED


@_handles(ops.VIEW_BACKWARDS)
def _view_backward(an: Analysis, node: fx.Node) -> Fact:
    """``select_backward(g, input_sizes, dim, index)`` and ``slice_backward(g, input_sizes, dim, start, end,
    step)`` (inner gradients of ``out[:, k]``): the output is zeros shaped ``input_sizes`` with ``g`` written at
    the picked positions of ``dim``. Per sample when ``dim`` is not the batch dimension (the samples of ``g`` stay
    in their rows), or, for a slice, when it keeps the whole batch."""
    kw = _kwargs(node)
    fact = an.fact(node.args[0])
    _no_sample_index([fact])
    rank = len(kw["input_sizes"])
    k = _norm_dim(kw["dim"], rank)
    select = node.target.overloadpacket.__name__ == "select_backward"
    if isinstance(fact, Shared | Pooled):
        return fact if not an.batch.is_batched(node) else _from_shape(an, node)
    dim = fact.dim + (select and fact.dim >= k)
    if dim == k and (select or not _whole_slice_backward(kw)):
        raise _mix("it writes the gradient of a slice along the batch dimension back into some samples only",
                   _FIX_DIM)
    return PerSample(dim, fact.layout)


def _whole_slice_backward(kw: dict) -> bool:
    start, end, step = kw.get("start"), kw.get("end"), kw.get("step", 1)
    end = value_of(end) if isinstance(end, fx.Node) else end
    size = kw["input_sizes"][_norm_dim(kw["dim"], len(kw["input_sizes"]))]
    size = value_of(size) if isinstance(size, fx.Node) else size
    return start in (None, 0) and step == 1 and (
        end is None or (isinstance(end, int) and end >= 2 ** 62) or same_size(end, size))


@_handles(ops.SPATIAL_BACKWARDS)
def _spatial_backward(an: Analysis, node: fx.Node) -> Fact:
    """Backward of pooling or padding (inner gradients): per sample when no tensor holds the batch in the
    dimensions the forward op mixes."""
    facts = _tensor_facts(an, node)
    _no_sample_index(facts.values())
    out_rank = value_of(node).dim()
    result = _aligned([(f, _rank(a)) for a, f in facts.items()], out_rank)
    if isinstance(result, Shared):
        return _pooled(facts.values()) or SHARED
    if result.dim >= out_rank - ops.SPATIAL_BACKWARDS[node.target]:
        raise _mix("it mixes the dimension that holds the batch (the backward of pooling or padding over the "
                   "samples)", _FIX_DIM)
    return result


@_handles(ops.LAYER_NORM_BACKWARDS)
def _layer_norm_backward(an: Analysis, node: fx.Node) -> Fact:
    """``native_layer_norm_backward`` (inner gradients): the input gradient is per sample when the batch is not
    normalized over; the weight and bias gradients sum over the batch."""
    kw = _kwargs(node)
    for name in ("weight", "bias"):
        if isinstance(kw.get(name), fx.Node) and not isinstance(an.fact(kw[name]), Shared):
            raise _unknown(_op_name(node), " with per-sample weights")
    tensors = [kw["grad_out"], kw["input"], kw["mean"], kw["rstd"]]
    facts = [an.fact(t) for t in tensors]
    _no_sample_index(facts)
    rank = _rank(kw["input"])
    result = _aligned([(f, _rank(t)) for t, f in zip(tensors, facts, strict=True)], rank)
    if not isinstance(result, PerSample):
        shared = _pooled(facts) or SHARED
        return (shared, shared, shared)
    if result.dim >= rank - len(kw["normalized_shape"]):
        raise _mix("it normalizes over the dimension that holds the batch", _FIX_DIM)
    summed = Pooled(node, "it sums a LayerNorm's weight or bias gradient over the batch")
    return (result, summed, summed)


@_handles(ops.CONV_BACKWARDS)
def _convolution_backward(an: Analysis, node: fx.Node) -> Fact:
    """``convolution_backward`` (inner gradients): the input gradient is per sample when the batch is the
    convolution's dimension 0; the weight and bias gradients sum over the batch."""
    kw = _kwargs(node)
    if not isinstance(an.fact(kw["weight"]), Shared):
        raise _mix("the convolution's weight depends on the samples")
    facts = [an.fact(kw["grad_output"]), an.fact(kw["input"])]
    _no_sample_index(facts)
    per_sample = [f for f in facts if isinstance(f, PerSample)]
    if not per_sample:
        shared = _pooled(facts) or SHARED
        return (shared, shared, shared)
    if any(f.dim != 0 for f in per_sample):
        raise _mix("the convolution slides over, or sums over, the dimension that holds the batch",
                   "keep the batch in dimension 0 of the convolution's input (pass in_dims to name it)")
    summed = Pooled(node, "it sums a convolution's weight or bias gradient over the batch")
    return (PerSample(0, _merge_layouts(f.layout for f in per_sample)), summed, summed)


def analyze_facts(graph: fx.Graph, batch: BatchDims) -> tuple[dict[fx.Node, Fact], list[MixingSite]]:
    """Every node's fact, and the refused sites (for tests and inspection)."""
    analysis = Analysis(graph, batch)
    sites = analysis.run()
    return analysis.facts, sites


__all__ = ["MixingSite", "find_mixing", "analyze_facts", "batch_length_values", "PerSample", "Pooled", "SampleIndex",
           "SHARED"]
