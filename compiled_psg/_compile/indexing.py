"""Simplify Inductor's index expressions where the batch size is a symbol, so its CPU kernels vectorize.

A per-sample program is compiled once for every batch size, so ``B`` is a symbol (``ks0``) in Inductor's loops.
A view that merges the batch with another dimension and splits it again (``nn.MultiheadAttention``'s
``[T, B * H, D]``) leaves indices such as ``((x3 + 128*x0) // 32 % (4*ks0)) % 4``. They equal ``x3 // 32``, but
Inductor's simplifier bounds a loop variable by its numeric range only; ``x0 < ks0`` gives it no bound, so the
modulus stays, and the C++ kernel computes it for every element, unvectorized (on the benchmark transformer the
kernel stacking the attention's q, k, v gradients: docs/benchmarks-probes.md, "Index simplification").

:func:`simplified_indexing` adds two rules, applied before and after Inductor's own, that bound an index by symbolic
interval arithmetic over the loop ranges (``0 <= x0 <= ks0 - 1``, shape symbols positive):

- ``ModularIndexing(b, d, m)`` (``b // d % m``) is ``b // d`` when ``0 <= b`` and ``b < d * m``;
- ``FloorDiv(d * q + r, d)`` is ``q`` when ``0 <= r < d`` (``d * q`` the terms that are ``d`` times a polynomial
  with integer coefficients; ``q`` may be 0; ``d`` a positive number or shape expression).

Both are exact identities on integers under those bounds; an index they cannot bound is left as it was. The
rules are in force only while compiled_psg compiles, in the compiling thread (a class attribute swapped under a lock
and restored, which applies the rules only where a thread-local flag is set), so a user's own ``torch.compile`` is
untouched. A no-op post-grad pass whose ``uuid`` is this file's hash puts the rules
into the key of Inductor's FX graph cache: a program compiled under other rules (an earlier version of this file)
is compiled again rather than loaded.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import sympy
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.sizevars import SizeVarAllocator
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from .._capture import patches
from .._compat import as_pass_config, configured_passes

_lock = threading.Lock()
_depth = 0  # contexts open in all threads: the method is swapped while > 0
_active = threading.local()  # contexts open in this thread: the rules apply only there
_inductor_simplify = SizeVarAllocator._simplify_with_ranges  # the method found when the first context opens
_SOURCE_HASH = get_hash_for_files((__file__,))  # the rules loaded, not a later edit of the file


class _RulesInCacheKey(CustomGraphPass):
    """Changes no graph; its ``uuid`` keys Inductor's FX graph cache by the rules' source."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> bytes:
        return _SOURCE_HASH


RULES_IN_CACHE_KEY = _RulesInCacheKey()


@contextlib.contextmanager
def simplified_indexing() -> Iterator[None]:
    """Inductor simplifies index expressions with the rules above while this is entered (re-entrant), and keys
    its FX graph cache by them (after any post-grad passes already configured)."""
    global _depth, _inductor_simplify
    passes = configured_passes(torch._inductor.config.post_grad_custom_post_pass)
    if RULES_IN_CACHE_KEY not in passes:
        passes = (*passes, RULES_IN_CACHE_KEY)
    with _lock:
        if _depth == 0:
            _inductor_simplify = SizeVarAllocator._simplify_with_ranges
            SizeVarAllocator._simplify_with_ranges = _simplify_with_ranges
        _depth += 1
    _active.depth = getattr(_active, "depth", 0) + 1
    try:
        with torch._inductor.config.patch(post_grad_custom_post_pass=as_pass_config(passes)):
            yield
    finally:
        _active.depth -= 1
        with _lock:
            _depth -= 1
            if _depth == 0:
                SizeVarAllocator._simplify_with_ranges = _inductor_simplify


def _simplify_with_ranges(self: SizeVarAllocator, expr: sympy.Expr, var_ranges: dict) -> sympy.Expr:
    ranges = self.shape_env.var_to_range
    if not getattr(_active, "depth", 0) or any(  # another thread's compile, or a size symbol that may be 0
            s not in var_ranges and (s not in ranges or ranges[s].lower < 1) for s in expr.free_symbols):
        return _inductor_simplify(self, expr, var_ranges)
    expr = _inductor_simplify(self, simplify_index(expr, var_ranges), var_ranges)
    return simplify_index(expr, var_ranges)


def simplify_index(expr: sympy.Expr, var_ranges: dict) -> sympy.Expr:
    """``expr`` with the two rules applied bottom-up; ``var_ranges`` maps each loop variable to its size. An index
    the rules cannot reason about (a divisor not known positive, a symbol not known integer, sympy failing) is
    returned as it was."""
    try:
        return _simplify_index(expr, var_ranges)
    except Exception:  # noqa: BLE001 - a rule that cannot decide must not fail the user's compile
        return expr


def _simplify_index(expr: sympy.Expr, var_ranges: dict) -> sympy.Expr:
    if not expr.has(ModularIndexing, FloorDiv):
        return expr
    if not all(s.is_integer for s in expr.free_symbols) or not all(
            all(a.is_integer and _known(a > 0) for a in e.args[1:]) for e in expr.atoms(ModularIndexing, FloorDiv)):
        return expr  # torch folds FloorDiv(FloorDiv(x, a), b) as FloorDiv(x, a*b), wrong for b < 0: left alone

    def rule(e: sympy.Expr) -> sympy.Expr:
        if isinstance(e, ModularIndexing):
            base, divisor, modulus = e.args
            if _below(base, divisor * modulus, var_ranges):
                return FloorDiv(base, divisor)
        elif isinstance(e, FloorDiv):
            base, divisor = e.args
            whole, rest = [], []
            for term in sympy.Add.make_args(sympy.expand(base)):
                (whole if _integer_polynomial(term / divisor) else rest).append(term)
            if _below(sympy.Add(*rest), divisor, var_ranges):
                return sympy.expand(sympy.Add(*whole) / divisor)
        return e

    for _ in range(4):  # a rewrite can build new FloorDivs (sympy folds nested ones): to a fixed point
        simpler = expr.replace(lambda e: isinstance(e, (ModularIndexing, FloorDiv)), rule)
        if simpler == expr:
            break
        expr = simpler
    return expr


def _integer_polynomial(e: sympy.Expr) -> bool:
    """Whether ``e`` is a polynomial with integer coefficients, so integer-valued at integer points."""
    e = sympy.cancel(e)
    if not e.free_symbols:
        return bool(e.is_Integer)
    try:
        poly = sympy.Poly(e, *sorted(e.free_symbols, key=str))
    except sympy.PolynomialError:
        return False
    return all(c.is_Integer for c in poly.coeffs())


def _below(e: sympy.Expr, limit: sympy.Expr, var_ranges: dict) -> bool:
    """Whether ``0 <= e < limit`` for every value of the loop variables."""
    bounds = _bounds(e, var_ranges)
    return bounds is not None and _known(bounds[0] >= 0) and _known(bounds[1] < limit)


def _bounds(e: sympy.Expr, var_ranges: dict) -> tuple[sympy.Expr, sympy.Expr] | None:
    """A lower and an upper bound of the integer expression ``e`` over the loop ranges (real-valued, possibly
    symbolic in the shape symbols), or None where none is known."""
    if e.free_symbols.isdisjoint(var_ranges):
        return e, e  # shape symbols and numbers: exactly itself
    if e.is_Symbol:
        return sympy.S.Zero, var_ranges[e] - 1
    if e.is_Add:
        parts = [_bounds(a, var_ranges) for a in e.args]
        if any(p is None for p in parts):
            return None
        return sympy.Add(*(p[0] for p in parts)), sympy.Add(*(p[1] for p in parts))
    if e.is_Mul:
        coeff, factors = sympy.S.One, []
        for f in e.args:
            if f.free_symbols.isdisjoint(var_ranges):
                coeff *= f
            else:
                factors.append(_bounds(f, var_ranges))
        if any(f is None or not _known(f[0] >= 0) for f in factors):
            return None  # products bounded only where every varying factor is nonnegative
        low, high = sympy.Mul(*(f[0] for f in factors)), sympy.Mul(*(f[1] for f in factors))
        if _known(coeff >= 0):
            return coeff * low, coeff * high
        if _known(coeff <= 0):
            return coeff * high, coeff * low
        return None
    if isinstance(e, FloorDiv) and e.args[1].is_Integer and e.args[1] > 0:
        inner, divisor = _bounds(e.args[0], var_ranges), e.args[1]
        if inner is None:
            return None  # floor(x / d) lies in (x / d - 1, x / d]
        low = sympy.S.Zero if _known(inner[0] >= 0) else inner[0] / divisor - 1
        return low, inner[1] / divisor
    if isinstance(e, ModularIndexing):
        base, _, modulus = e.args
        inner = _bounds(base, var_ranges)
        if inner is not None and _known(inner[0] >= 0) and modulus.is_integer and _known(modulus > 0):
            return sympy.S.Zero, modulus - 1
    return None


def _known(relation: sympy.Basic) -> bool:
    """Whether ``relation`` holds for every value of the (positive) shape symbols in it."""
    if relation in (sympy.true, sympy.false):
        return bool(relation)
    difference = sympy.expand(relation.lhs - relation.rhs)
    if difference.has(ModularIndexing, FloorDiv):
        return False  # torch's sign assumptions on these are not reliable
    if isinstance(relation, sympy.GreaterThan):
        return bool(difference.is_nonnegative)
    if isinstance(relation, sympy.StrictLessThan):
        return bool(difference.is_negative)
    if isinstance(relation, sympy.LessThan):
        return bool(difference.is_nonpositive)
    if isinstance(relation, sympy.StrictGreaterThan):
        return bool(difference.is_positive)
    return False


patches.register(patches.Patch(
    "index simplification", "torch._inductor.sizevars.SizeVarAllocator._simplify_with_ranges, "
    "torch._inductor.config.post_grad_custom_post_pass",
    "Inductor leaves modulus and floor-division index expressions it cannot bound where the batch size is a "
    "symbol, and the CPU kernels then do not vectorize (this module); the rules key the FX graph cache",
    ("compile",), "the method is swapped process-wide but applies the rules only on the compiling thread; the "
    "config is process-wide (another thread's torch.compile waits on Dynamo's compile lock)",
    "the original method restored when the last context closes; config.patch restores the passes",
    enter=simplified_indexing, current=lambda: (SizeVarAllocator._simplify_with_ranges,
                                                torch._inductor.config.post_grad_custom_post_pass)))
