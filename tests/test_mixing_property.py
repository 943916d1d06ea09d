"""Random programs from a grammar of ops, some keeping samples apart and some mixing them (hypothesis).

For every program exactly one of these holds:
- it contains an op that mixes samples, and compiled_psg refuses it with ``SampleMixingError``;
- it keeps samples apart, and compiled_psg accepts it: its per-sample gradients match the naive loop, and removing
  any one sample (one of them an outlier scaled by 1e3) moves ``clip_sum(C)`` by at most ``C``.

The grammar is seeded with every example of issue 10. ``pytest -m deep`` runs it deeper (200 programs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference_per_sample

import compiled_psg as psg

F64 = torch.float64
B, D = 4, 6
PERM = torch.tensor([3, 0, 5, 1, 4, 2])


def _halves(h):
    return h.view(2, -1, h.shape[1]).flip(0).reshape(h.shape[0], -1)


def _shift_index(h):
    n = h.shape[0]
    return h[(torch.arange(n) + 1) % n]


def _index_add_shift(h):
    n = h.shape[0]
    return torch.zeros_like(h).index_add(0, (torch.arange(n) + 1) % n, h)


def _train_batchnorm(h):
    return F.batch_norm(h, None, None, training=True)


# name -> (function of h [n, D] giving [n, D], mixes samples?)
OPS = {
    # keep samples apart
    "tanh": (torch.tanh, False),
    "affine": (lambda h: 1.5 * h + 0.1, False),
    "softmax_features": (lambda h: h.softmax(1), False),
    "cumsum_features": (lambda h: 0.3 * h.cumsum(1), False),
    "flip_features": (lambda h: h.flip(1), False),
    "roll_features": (lambda h: h.roll(2, 1), False),
    "shared_permutation": (lambda h: h[:, PERM], False),
    "center_features": (lambda h: h - h.mean(1, keepdim=True), False),
    "reshape_transpose": (lambda h: h.view(h.shape[0], 2, 3).transpose(1, 2).reshape(h.shape[0], D), False),
    "rotate_features": (lambda h: torch.cat([h[:, 3:], h[:, :3]], 1), False),
    "sort_features": (lambda h: h.sort(1).values, False),
    "layer_norm": (lambda h: F.layer_norm(h, (D,)), False),
    "gather_own_order": (lambda h: h.gather(1, h.argsort(1)), False),
    "index_with_arange": (lambda h: h[torch.arange(h.shape[0])], False),
    "cat_batch_fold": (lambda h: torch.cat([h, 2 * h], 0).view(2, h.shape[0], D).sum(0), False),
    "expand_and_sum": (lambda h: h.unsqueeze(1).expand(h.shape[0], 2, D).sum(1), False),
    "batch_size_scalar": (lambda h: h * (2.0 / h.shape[0]), False),
    "scatter_within_sample": (lambda h: torch.zeros_like(h).scatter(1, h.argsort(1), h), False),
    # mix samples
    "flip_batch": (lambda h: h.flip(0), True),
    "roll_batch": (lambda h: h.roll(1, 0), True),
    "mixup_randperm": (lambda h: 0.7 * h + 0.3 * h[torch.randperm(h.shape[0])], True),
    "shift_index": (_shift_index, True),
    "index_add_shift": (_index_add_shift, True),
    "center_batch": (lambda h: h - h.mean(0), True),
    "cumsum_batch": (lambda h: h.cumsum(0), True),
    "softmax_batch": (lambda h: h.softmax(0), True),
    "sort_batch": (lambda h: h.sort(0).values, True),
    "reinterpret_view": (lambda h: h.t().flatten().view(h.shape[0], D), True),
    "rotate_batch": (lambda h: torch.cat([h[1:], h[:1]], 0), True),
    "add_first_sample": (lambda h: h + h[0], True),
    "gram_product": (lambda h: h @ (h.T @ h) / 10, True),
    "halves_swapped": (_halves, True),
    "scale_by_batch_std": (lambda h: h * h.std(0), True),
    "add_batch_total": (lambda h: h + h.sum(), True),
    "gather_batch_order": (lambda h: h.gather(0, h.argsort(0)), True),
    "batchnorm_training": (_train_batchnorm, True),
    "difference": (lambda h: torch.cat([h[:1], h[1:] - h[:-1]], 0), True),
}
SAFE = sorted(k for k, (_, mixes) in OPS.items() if not mixes)
MIXING = sorted(k for k, (_, mixes) in OPS.items() if mixes)


def build(program):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, D), nn.Linear(D, 3)).double()

    def loss(x, y):
        h = model[0](x)
        for name in program:
            h = OPS[name][0](h)
        return F.cross_entropy(model[1](h), y)

    return model, loss


def data(outlier: int):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(B, 5, generator=g, dtype=F64)
    x[outlier] *= 1e3
    return x, torch.randint(0, 3, (B,), generator=g)


def check(program, outlier: int = 1, max_norm: float = 0.5):
    model, loss = build(program)
    x, y = data(outlier)
    mixes = any(OPS[name][1] for name in program)
    fn = psg.per_sample(model, backend="eager")(loss)
    if mixes:
        with pytest.raises(psg.SampleMixingError):
            fn(x, y)
        return
    got = fn(x, y)
    params = dict(model.named_parameters())
    ref = reference_per_sample(loss, params, (x, y))
    for name, r in ref.items():
        torch.testing.assert_close(got[name], r, rtol=1e-8, atol=1e-9, msg=lambda m, n=name: f"{program} {n}: {m}")
    clipped = psg.per_sample(model, reduce=psg.clip_sum(max_norm), backend="eager")(loss)
    full = clipped(x, y)
    for j in range(B):
        keep = [i for i in range(B) if i != j]
        without = clipped(x[keep], y[keep])
        moved = torch.cat([(full[n] - without[n]).flatten() for n in full]).norm()
        assert moved <= max_norm * (1 + 1e-9), f"{program}: removing sample {j} moved clip_sum by {moved}"


@pytest.mark.parametrize("name", MIXING)
def test_every_mixing_op_alone_is_refused(name):
    check([name])


programs = st.lists(st.sampled_from(SAFE + MIXING), min_size=1, max_size=3)
QUICK = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow])
DEEP = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@QUICK
@given(programs, st.integers(0, B - 1))
def test_random_programs(program, outlier):
    check(program, outlier)


@pytest.mark.deep
@DEEP
@given(programs, st.integers(0, B - 1))
def test_random_programs_deep(program, outlier):
    check(program, outlier)
