"""The index rules compiled_psg adds to Inductor under a symbolic batch: exact, in force only while it compiles,
and they take the batch modulus out of attention's kernels."""

from __future__ import annotations

import random
import re

import pytest
import sympy
import torch
import torch.nn as nn
from reference import reference_per_sample
from torch._inductor.sizevars import SizeVarAllocator
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

import compiled_psg as psg
from compiled_psg._compile.indexing import simplified_indexing, simplify_index

X0, X1, X2 = (sympy.Symbol(n, integer=True, nonnegative=True) for n in ("x0", "x1", "x2"))
BATCH = sympy.Symbol("s0", integer=True, positive=True)
RANGES = {X0: BATCH, X1: 4, X2: 6}


def _random_index(rng: random.Random, depth: int = 0) -> sympy.Expr:
    """Sums of loop variables times small numbers or the batch, nested in FloorDiv and ModularIndexing with
    numeric or batch-sized divisors: the shapes of the indices views of a merged batch produce."""
    terms = [rng.choice([1, 2, 3, 4, 6, 8]) * rng.choice([1, BATCH]) * v for v in RANGES if rng.random() < 0.7]
    terms.append(rng.choice([0, 1, 5]) * rng.choice([1, BATCH]))
    if depth < 2 and rng.random() < 0.6:
        terms.append(rng.choice([1, 4]) * _random_index(rng, depth + 1))
    base = sympy.Add(*terms)
    divisor = rng.choice([1, 2, 4, 8]) * rng.choice([1, 1, BATCH])
    if rng.random() < 0.5:
        return FloorDiv(base, divisor)
    return ModularIndexing(base, divisor, rng.choice([2, 3, 4, 6]) * rng.choice([1, BATCH]))


def _view_index(rng: random.Random) -> sympy.Expr:
    """A view's index: loop variables merged into one flat position (row-major, in a random order), which is
    then split at random strides, each split ``flat // stride % size``, as Inductor composes views."""
    order = rng.sample(list(RANGES), k=rng.choice([2, 3]))
    flat, stride = sympy.S.Zero, sympy.S.One
    for v in reversed(order):
        flat, stride = flat + stride * v, stride * RANGES[v]
    splits, inner = [], sympy.S.One
    for size in rng.sample([2, 3, 4, 6, BATCH, 2 * BATCH], k=2):
        splits.append(rng.choice([1, 7]) * ModularIndexing(flat, inner, size))
        inner = inner * size
    return sympy.Add(*splits, rng.choice([0, 1]) * FloorDiv(flat, inner))


def _values(expr: sympy.Expr, batch: int) -> list[int]:
    points = [(a, b, c) for a in range(batch) for b in range(4) for c in range(6)]
    return [int(expr.xreplace({BATCH: batch, X0: a, X1: b, X2: c})) for a, b, c in points]


def test_simplified_indices_equal_the_originals_at_every_point():
    rng = random.Random(0)
    changed = 0
    for i in range(200):
        expr = (_random_index if i % 2 else _view_index)(rng)
        simpler = simplify_index(expr, RANGES)
        changed += simpler != expr
        for batch in (2, 3, 5):
            assert _values(simpler, batch) == _values(expr, batch), (expr, simpler, batch)
    assert changed >= 30  # the rules do fire on these shapes, so the equality above is tested


def test_the_attention_index_loses_its_batch_modulus():
    # MultiheadAttention's [T, B * H, D] view, as Inductor composes it for the stacked q, k, v gradient
    x0, x1, x3 = X0, sympy.Symbol("x3", integer=True, nonnegative=True), X1
    ranges = {x0: BATCH, x1: 64, x3: 128}
    merged = ModularIndexing(x3 + 128 * x0, 32, 4 * BATCH)
    index = 32 * ModularIndexing(merged, 1, 4) + 128 * x1 + 8192 * ModularIndexing(FloorDiv(merged, 4), 1, BATCH)
    simpler = simplify_index(index, ranges)
    assert BATCH not in simpler.free_symbols
    assert simpler == 8192 * x0 + 128 * x1 + 32 * FloorDiv(x3, 32)


def test_an_index_that_can_reach_the_modulus_keeps_it():
    for expr in (ModularIndexing(X0, 1, BATCH - 1), FloorDiv(X0 + 1, BATCH), ModularIndexing(X2 + 4 * X1, 2, 8),
                 FloorDiv(2 * X0 - 1, 2)):
        assert simplify_index(expr, RANGES) == expr


def test_the_rules_are_in_force_only_while_compiling():
    inductor_own = SizeVarAllocator._simplify_with_ranges
    with simplified_indexing():
        ours = SizeVarAllocator._simplify_with_ranges
        assert ours is not inductor_own
        with simplified_indexing():  # re-entrant
            assert SizeVarAllocator._simplify_with_ranges is ours
        assert SizeVarAllocator._simplify_with_ranges is ours
    assert SizeVarAllocator._simplify_with_ranges is inductor_own


@pytest.mark.inductor
def test_attention_kernels_do_not_compute_the_batch_modulus():
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(4, 5, 16)

    def loss(x):
        return attention(x, x, x, need_weights=False)[0].square().mean()

    from torch._inductor.utils import run_and_get_code

    fn = psg.per_sample(attention, backend="inductor")(loss)
    with torch._inductor.config.patch(fx_graph_cache=False):  # generate the code, not a cached copy
        got, code = run_and_get_code(fn, x)
    modulo_by_batch = re.findall(r"%\s*static_cast<int64_t>\([^;]*?ks\d", "\n".join(code))
    # one is real: the [T, B] -> [B, T] transpose of the output projection's input; 82 without the rules
    assert len(modulo_by_batch) <= 1, modulo_by_batch
    assert SizeVarAllocator._simplify_with_ranges.__module__.startswith("torch.")
    assert torch._inductor.config.post_grad_custom_post_pass is None
    ref = reference_per_sample(loss, dict(attention.named_parameters()), (x,))
    for name, r in ref.items():
        torch.testing.assert_close(got[name], r, rtol=1e-4, atol=1e-6)


def test_the_rules_key_inductors_cache_after_the_users_own_passes():
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    import compiled_psg._compile.indexing as indexing

    class UserPass(CustomGraphPass):
        def __call__(self, graph):
            return None

        def uuid(self):
            return "the user's"

    mine = UserPass()
    with torch._inductor.config.patch(post_grad_custom_post_pass=mine):
        with simplified_indexing():
            passes = torch._inductor.config.post_grad_custom_post_pass
            assert passes == (mine, indexing.RULES_IN_CACHE_KEY)
            assert indexing.RULES_IN_CACHE_KEY.uuid() == get_hash_for_files((indexing.__file__,))
            with simplified_indexing():  # re-entered: still one key
                assert torch._inductor.config.post_grad_custom_post_pass == passes
        assert torch._inductor.config.post_grad_custom_post_pass is mine
    assert torch._inductor.config.post_grad_custom_post_pass is None


def test_an_index_with_a_divisor_not_known_positive_is_left_alone():
    # torch folds FloorDiv(FloorDiv(x, a), b) into FloorDiv(x, a * b), which is wrong for b < 0: a rule that made
    # the inner FloorDiv would change the value (x = s0 = 2: 0 before, -1 after)
    x = X0 + BATCH - 1
    expr = FloorDiv(ModularIndexing(x, BATCH, 2), -2)
    assert simplify_index(expr, RANGES) == expr
    assert _values(simplify_index(expr, RANGES), 2) == _values(expr, 2)
