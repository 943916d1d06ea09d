"""Reductions are small values: pass one as ``reduce=`` and it is emitted into the rewritten graph.

Each is a frozen dataclass with ``emit(ctx)``, which builds graph nodes through a ``ReduceContext`` and returns
a pytree of nodes (the result the user gets), and ``empty(shapes)``, the result for a batch of zero samples.
The math lives in ``ReduceContext``; a reduction only says which quantities to combine.
"""

from __future__ import annotations

import functools
import math
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from .._analyze.batch_dims import value_of
from .._analyze.layout import weighted_batch_sum
from .._capture.backward_semantics import names_read_from_outside
from .._errors import BatchInputError, PerSampleError, is_number, require_flag
from .context import ReduceContext

Shapes = Mapping[str, tuple[torch.Size, torch.dtype, torch.device]]


class Reduction:
    """Base class. Subclass it (a dataclass with ``emit`` and ``empty``) to add a reduction."""

    def emit(self, ctx: ReduceContext):
        raise BatchInputError(f"reduce={type(self).__name__}(): a Reduction subclass must define emit(ctx); "
                              "see compiled_psg.custom for a reduction made of plain tensor functions")

    def empty(self, shapes: Shapes):
        raise BatchInputError(f"reduce={type(self).__name__}() has no result for an empty batch: define "
                              "empty(shapes) on the subclass")


def _sum_of(parts) -> torch.Tensor:
    """The sum of per-parameter values, in the dtype they promote to (a bfloat16 layer beside a float32 head)."""
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in parts))
    return torch.stack([t if t.dtype == dtype else t.to(dtype) for t in parts]).sum(0)


def _sqrt_of_sum(ctx: ReduceContext, parts):
    return ctx.emit(lambda *sq: _sum_of(sq).sqrt(), parts, "norm")


@dataclass(frozen=True)
class PerSampleGrads(Reduction):
    """No reduction: ``{name: Tensor[B, *param.shape]}``."""

    def emit(self, ctx):
        return {p.name: ctx.per_sample(p) for p in ctx.params}

    def empty(self, shapes):
        return {n: torch.zeros((0, *s), dtype=d, device=dev) for n, (s, d, dev) in shapes.items()}


@dataclass(frozen=True)
class Norms(Reduction):
    """``Tensor[B]`` of per-sample L2 norms over all parameters; ``per_parameter=True``: ``{name: Tensor[B]}``."""

    per_parameter: bool = False

    def emit(self, ctx):
        squares = {p.name: ctx.sq_norms(p) for p in ctx.params}
        if self.per_parameter:
            return {n: ctx.emit(lambda s: s.sqrt(), [sq], "norm") for n, sq in squares.items()}
        return _sqrt_of_sum(ctx, list(squares.values()))

    def empty(self, shapes):
        dtype, device = next(iter(shapes.values()))[1:]
        if self.per_parameter:
            return {n: torch.zeros(0, dtype=d, device=dev) for n, (_, d, dev) in shapes.items()}
        return torch.zeros(0, dtype=dtype, device=device)


@dataclass(frozen=True)
class ClipSum(Reduction):
    """``{name: sum_i min(1, max_norm / ||g_i||) g_i}``, the DP-SGD aggregate, in one backward pass.

    With ``return_norms=True`` the result is ``(sums, norms)`` with the unclipped per-sample norms ``[B]``.
    A sample with zero gradient has factor 1 (no division by zero). ``memory_budget``: see ``DPClip``.
    """

    max_norm: float
    return_norms: bool = False
    memory_budget: float | None = None

    def emit(self, ctx):
        ctx.fit_memory("clip_sq_norm", ctx.params, self.memory_budget)
        norms = _sqrt_of_sum(ctx, [ctx.clip_sq_norms(p) for p in ctx.params])
        max_norm = float(self.max_norm)
        factors = ctx.emit(lambda n: clip_factor(n, max_norm), [norms], "clip_factors")
        sums = {p.name: ctx.weighted_sum(p, factors) for p in ctx.params}
        return (sums, norms) if self.return_norms else sums

    def empty(self, shapes):
        sums = {n: torch.zeros(s, dtype=d, device=dev) for n, (s, d, dev) in shapes.items()}
        if not self.return_norms:
            return sums
        dtype, device = next(iter(shapes.values()))[1:]
        return sums, torch.zeros(0, dtype=dtype, device=device)


@dataclass(frozen=True)
class SumSquares(Reduction):
    """``{name: sum_i g_i ** 2}``: BackPACK's SumGradSquared, the empirical Fisher diagonal."""

    def emit(self, ctx):
        return {p.name: ctx.sum_squares(p) for p in ctx.params}

    def empty(self, shapes):
        return {n: torch.zeros(s, dtype=d, device=dev) for n, (s, d, dev) in shapes.items()}


@dataclass(frozen=True)
class Variance(Reduction):
    """``{name: mean_i (g_i - mean_j g_j) ** 2}``, the per-coordinate population variance (BackPACK's Variance)."""

    def emit(self, ctx):
        return {p.name: ctx.variance(p) for p in ctx.params}

    def empty(self, shapes):
        # a mean over no samples, as torch's var(0, unbiased=False) of an empty batch: undefined, NaN
        return {n: torch.full(s, math.nan, dtype=d, device=dev) for n, (s, d, dev) in shapes.items()}


@dataclass(frozen=True)
class Gram(Reduction):
    """``Tensor[B, B]`` with entries ``<g_i, g_j>`` over all parameters (torchjd's Gramian)."""

    def emit(self, ctx):
        parts = [ctx.gram(p) for p in ctx.params]
        return ctx.emit(lambda *g: _sum_of(g), parts, "gram")

    def empty(self, shapes):
        dtype, device = next(iter(shapes.values()))[1:]
        return torch.zeros(0, 0, dtype=dtype, device=device)


@dataclass(frozen=True)
class Custom(Reduction):
    """A user reduction fused into the graph: ``combine({name: per_param(name, g[B, *shape])})``.

    ``per_param`` and ``combine`` are plain tensor functions; both are traced, so no Python side effects.
    """

    per_param: Callable[[str, torch.Tensor], object]
    combine: Callable[[dict], object] = lambda d: d
    empty_result: Callable[[Shapes], object] | None = None

    def emit(self, ctx):
        names = [p.name for p in ctx.params]
        nodes = [ctx.per_sample(p) for p in ctx.params]
        calling = ["per_param"]  # the user function being traced, for the error

        def run(*grads):
            results = {}
            for n, g in zip(names, grads, strict=True):
                calling[0] = f"per_param({n!r}, g)"
                results[n] = self.per_param(n, g)
            calling[0] = "combine(results)"
            return self.combine(results)

        try:
            out = ctx.emit(run, nodes, "custom")
        except PerSampleError:
            raise
        except Exception as e:
            raise _custom_failure(calling[0], e) from e
        env = getattr(detect_fake_mode([value_of(n) for n in nodes]), "shape_env", None)
        if env is not None and ctx.batch.symbol in env.replacements:
            fixed = env.replacements[ctx.batch.symbol]
            met = self._tensors_of_size(int(fixed))
            if met:
                raise BatchInputError(
                    f"the custom reduction meets the per-sample values with {met[0]}, whose size {fixed} is this "
                    "batch's: it is traced once for every batch size, and a tensor of a fixed size cannot follow the "
                    "batch's. Fix: weight each sample in the loss instead (per-sample weights are a batched "
                    "argument of the loss), or reduce over the samples first (g.sum(0), g.mean(0))")
            raise BatchInputError(
                f"the custom reduction turned the batch size into the Python number {fixed} "
                "(len(g), int(g.shape[0]), range(g.shape[0])): it is traced once for every batch size. Fix: "
                "keep the batch size a tensor size, g.shape[0] (or g.sum(0), g.mean(0) over the samples)")
        return out

    def _tensors_of_size(self, size: int) -> list[str]:
        """The tensors ``per_param`` and ``combine`` read from outside (closures, globals) with a dimension of
        ``size``, named: met with the per-sample values, they fixed the batch size."""
        return [f"`{name}` (a tensor of shape {tuple(value.shape)} that {what} reads from outside)"
                for what, fn in (("per_param", self.per_param), ("combine", self.combine))
                for name, value in names_read_from_outside(fn).items()
                if isinstance(value, torch.Tensor) and size in value.shape]

    def empty(self, shapes):
        if self.empty_result is None:
            raise BatchInputError("this custom reduction has no result for an empty batch; pass empty_result= to "
                                  "psg.custom(...)")
        return self.empty_result(shapes)


def _custom_failure(calling: str, error: Exception) -> BatchInputError:
    """The error of a custom reduction whose ``calling`` function (``per_param('w', g)`` or ``combine``) raised
    ``error`` while traced: named with the user's line, and a fix for the tracing's own limits."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if "/torch/" not in f.filename and "/compiled_psg/" not in f.filename]
    at = f" at {frames[-1].filename}:{frames[-1].lineno}: {(frames[-1].line or '').strip()}" if frames else ""
    text = (str(error).strip().splitlines() or [""])[0]
    if isinstance(error, GuardOnDataDependentSymNode):
        cause = ("it reads a tensor's value as a Python value (float(t), bool(t), if t > 0: ...), but the reduction "
                 "is traced once, for every batch, with no values")
        fix = "compute with tensor ops (torch.where(t > 0, a, b) for a branch; keep values as tensors)"
    else:
        cause = f"{type(error).__name__}: {text}"
        fix = ("correct the function (g is the per-sample gradient [B, *param.shape]; combine gets the dict of "
               "per_param's results by parameter name)")
    return BatchInputError(f"the custom reduction's {calling} failed{at}: {cause}. Fix: {fix}")


def norms(per_parameter: bool = False) -> Norms:
    """Per-sample gradient L2 norms (``Tensor[B]``, or ``{name: Tensor[B]}`` with ``per_parameter``)."""
    return Norms(require_flag("norms: per_parameter", per_parameter, BatchInputError))


def clip_sum(max_norm: float, *, return_norms: bool = False, memory_budget: float | None = None) -> ClipSum:
    """The sum of per-sample gradients each clipped to ``max_norm`` (optionally with the norms), within
    ``memory_budget`` bytes of per-sample values at the peak (None: the fastest plan; see ``DPClip``)."""
    if not (is_number(max_norm) and max_norm > 0):
        raise BatchInputError(f"clip_sum: max_norm must be positive, a number, got {max_norm!r}")
    return ClipSum(float(max_norm), require_flag("clip_sum: return_norms", return_norms, BatchInputError),
                   check_memory_budget(memory_budget, BatchInputError))


def check_memory_budget(budget, error: type[Exception]) -> float | None:
    """``budget`` as a float (bytes), or None; ``error`` for anything else than a number >= 0."""
    if budget is None:
        return None
    if not (is_number(budget) and budget >= 0):
        raise error(f"memory_budget must be None or a number of bytes >= 0 (0: hold as little per sample as "
                    f"the strategies allow), got {budget!r}")
    return float(budget)


def sum_squares() -> SumSquares:
    """The sum over samples of squared per-sample gradients."""
    return SumSquares()


def variance() -> Variance:
    """The population variance over samples of each gradient coordinate."""
    return Variance()


def gram() -> Gram:
    """The ``[B, B]`` Gram matrix of per-sample gradients."""
    return Gram()


def custom(per_param: Callable[[str, torch.Tensor], object], combine: Callable[[dict], object] = lambda d: d,
           *, empty_result: Callable[[Shapes], object] | None = None) -> Custom:
    """A custom reduction: ``per_param(name, per_sample_grad)`` per parameter, then ``combine(dict)``."""
    for name, f in (("per_param", per_param), ("combine", combine)):
        if not callable(f):
            raise BatchInputError(f"psg.custom: {name} must be a function, got {type(f).__name__} {f!r}. Fix: "
                                  "psg.custom(lambda name, g: g.sum(0)) (g: the per-sample gradients [B, *shape])")
    if empty_result is not None and not callable(empty_result):
        raise BatchInputError(f"psg.custom: empty_result must be a function of the parameters' shapes or None, got "
                              f"{type(empty_result).__name__} {empty_result!r}. Fix: empty_result=lambda shapes: "
                              "{name: torch.zeros(shape, dtype=dtype, device=device) for name, (shape, dtype, "
                              "device) in shapes.items()}")
    return Custom(per_param, combine, empty_result)


LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class DPClip(Reduction):
    """The clipped sum of a DP-SGD step (``compile_step``'s reduction), for every clipping mode, with the
    unclipped per-sample norms: ``({name: S_j}, norms[B])``. Index letters: i sample, k group, j parameter.

    - ``"flat"``: ``S = sum_i min(1, C / ||g_i||) g_i``;
    - ``"per_layer"``: group ``k`` (the names in ``groups[k]``) is clipped to ``C_k`` on its own:
      ``S_j = sum_i min(1, C_k / ||g_i[k]||) g_i[j]`` for ``j`` in group ``k``;
    - ``"automatic"``: ``S = sum_i C g_i / (||g_i|| + gamma)`` (Bu et al. 2022; ``C`` scales the normalization).

    ``groups`` with ``"flat"`` or ``"automatic"``: one group, the parameters the norm covers and the sums are of
    (the optimizer's, where it trains fewer than the per-sample function has).
    ``bounds``: the ``C_k`` as constants of the graph, or None: a placeholder ``clip_bounds[K]`` (dtype
    ``acc_dtype``) after the graph's own, fed at run time (adaptive clipping changes ``C`` every step).
    ``acc_dtype``: the dtype the norms, factors and sums are computed in (float32 for bfloat16/float16).
    When any value of the graph is bfloat16/float16 (bf16 parameters, autocast), every parameter's per-sample
    gradient is materialized and upcast, so that norms, factors and the sum all use the same float32 values:
    the bound holds in float32 arithmetic, not only up to the low precision's rounding.

    ``memory_budget`` (bytes; None: the fastest plan): the per-sample values the plan may have at its peak, at
    the batch size of the capture's example: until the clip factors are known a plan holds a layer's
    materialized per-sample gradients, or for a book-keeping sum the layer's output gradient, which the plain step
    frees at the layer, and on top of that one layer at a time forms and frees values of its own (a per-sample
    gradient for its norm alone, a ghost norm's float64 Grams); within a budget, layers move to strategies that
    hold less, cheapest per byte freed first, under each cap on what one layer forms, and the cheapest plan that
    fits is taken, else the lowest peak (``strategies.fit_memory``). ``psg.explain`` shows the plan, its peak
    and its held bytes. It does not bound the low-precision path (bfloat16/float16 graphs materialize every
    parameter's gradient to upcast it).
    """

    mode: str = "flat"
    bounds: tuple[float, ...] | None = None
    groups: tuple[tuple[str, ...], ...] | None = None
    gamma: float = 0.01
    acc_dtype: torch.dtype = torch.float32
    memory_budget: float | None = None

    def _groups(self, names: list[str]) -> list[list[str]]:
        if self.groups is None:
            return [list(names)]
        return [[n for n in group if n in names] for group in self.groups]

    def emit(self, ctx):
        acc = self.acc_dtype
        ctx.drops_samples = True  # a sample whose gradient is not finite gets factor 0 and adds nothing
        names = [p.name for p in ctx.params]
        by_name = {p.name: p for p in ctx.params}
        low = holds_low_precision(ctx.graph)
        groups = self._groups(names)
        if self.mode != "per_layer" and self.groups is not None:  # one group: the norm and sums cover it alone
            names = groups[0]
        if self.bounds is None:
            bounds = ctx.input("clip_bounds", (len(groups),), acc)
        else:
            values = tuple(float(b) for b in self.bounds)
            bounds = ctx.emit(lambda r: r.new_tensor(values, dtype=acc), [ctx.batch_ref], "clip_bounds")

        def sq_norms(p):
            if low:
                ctx._note(p, "sq_norm", f"materialize ({str(acc).removeprefix('torch.')})")
                return ctx.emit(lambda g: g.to(acc).reshape(g.shape[0], -1).pow(2).sum(1), [ctx.per_sample(p)],
                                "sq_norm")
            return ctx.emit(lambda s: s.to(acc), [ctx.clip_sq_norms(p)], "sq_norm")

        def weighted_sum(p, w):
            if low and p.grad is not None:
                ctx._note(p, "weighted_sum", f"materialize ({str(acc).removeprefix('torch.')})")
                return ctx.emit(lambda g, f: weighted_batch_sum(f, g.to(acc)), [ctx.per_sample(p), w],
                                "weighted_sum")
            return ctx.emit(lambda s: s.to(acc), [ctx.weighted_sum(p, w)], "weighted_sum")

        if not low:
            ctx.fit_memory("clip_sq_norm", [by_name[n] for n in names], self.memory_budget)
        squares = {n: sq_norms(by_name[n]) for n in names}
        norms = _sqrt_of_sum(ctx, list(squares.values()))
        if self.mode == "flat":
            factors = ctx.emit(_clip_factors(0), [norms, bounds], "clip_factors")
            weights = dict.fromkeys(names, factors)
        elif self.mode == "automatic":
            gamma = float(self.gamma)
            factors = ctx.emit(lambda n, c: automatic_clip_factor(n, c[0], gamma), [norms, bounds], "clip_factors")
            weights = dict.fromkeys(names, factors)
        else:  # per_layer: one factor per group, from the group's own norm
            weights = {}
            for k, group in enumerate(groups):
                if not group:
                    continue
                group_norm = _sqrt_of_sum(ctx, [squares[n] for n in group])
                factors = ctx.emit(_clip_factors(k), [group_norm, bounds], f"clip_factors[{k}]")
                weights.update(dict.fromkeys(group, factors))
        # per_layer: parameters in no group (trainable, but not the optimizer's) get no sum
        sums = {n: weighted_sum(by_name[n], weights[n]) for n in names if n in weights}
        return sums, norms

    def empty(self, shapes):
        grouped = None if self.groups is None else {n for g in self.groups for n in g}
        sums = {n: torch.zeros(s, dtype=sum_dtype(d, self.acc_dtype), device=dev) for n, (s, d, dev) in shapes.items()
                if grouped is None or n in grouped}
        _, dtype, device = next(iter(shapes.values()))
        return sums, torch.zeros(0, dtype=sum_dtype(dtype, self.acc_dtype), device=device)


def clip_factor(n: torch.Tensor, c) -> torch.Tensor:
    """``min(1, c / n)`` per sample: 1 for a zero gradient (no division by zero), 0 for an infinite norm. Fails
    closed: a NaN norm gives a NaN factor, so the sum is NaN, never a sample's unclipped gradient
    (``psg.clip_sum``; a DP step drops such a sample instead: ``dropping_clip_factor``)."""
    return torch.where(n <= c, torch.ones_like(n), c / n)


def dropping_clip_factor(n: torch.Tensor, c) -> torch.Tensor:
    """``clip_factor``, and 0 for a gradient that is not finite (a NaN or infinite norm): a DP step's factor. Such a
    sample adds nothing: the weighted sums drop a sample of weight 0 whatever its values
    (``layout.weighted_batch_sum``, ``layout.scale_batch`` and, for book-keeping sums, ``ReduceContext.drops_samples``).
    A NaN in the released sum would tell that the sample is in the batch, whatever the noise."""
    return torch.where(torch.isfinite(n), clip_factor(n, c), torch.zeros_like(n))


def automatic_clip_factor(n: torch.Tensor, c, gamma: float) -> torch.Tensor:
    """``c / (n + gamma)`` (automatic clipping), 0 for a gradient that is not finite (as
    ``dropping_clip_factor``)."""
    return torch.where(torch.isfinite(n), c / (n + gamma), torch.zeros_like(n))


def _clip_factors(k: int):
    def factors(n, c):
        return dropping_clip_factor(n, c[k])
    return factors


def sum_dtype(dtype: torch.dtype, acc: torch.dtype) -> torch.dtype:
    """The dtype of ``DPClip``'s sum for a parameter of ``dtype``: ``acc`` for low precision, else the wider."""
    return acc if dtype in LOW_PRECISION else torch.promote_types(dtype, acc)


def holds_low_precision(graph: torch.fx.Graph) -> bool:
    """Any value of the graph is bfloat16/float16 (bf16 parameters, autocast)."""
    return any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.dtype in LOW_PRECISION for n in graph.nodes)
