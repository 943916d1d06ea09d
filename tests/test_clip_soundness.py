"""The clip bound against adversarial inputs: a norm used for clipping never underestimates a sample's gradient.

Ghost norms sum t^2 signed terms; a sample whose tokens contribute large, nearly opposite gradients cancels
them, and in the input's precision the norm came out 0, negative or NaN, which let that sample's whole gradient
into the clipped sum (found by an adversarial review: an update of norm 5321 for a bound B*C = 4)."""

import copy

import pytest
import torch
import torch.nn as nn
from reference import ref_clip_sum, ref_norms, reference_per_sample

import compiled_psg as psg
from compiled_psg._reduce import strategies

B, T, F_IN, F_OUT, C = 4, 2, 8, 4, 1.0


def cancelling_batch(dtype: torch.dtype, scale: float):
    """Token 1 = token 2 + a small delta, opposite output gradients: each sample's gradient is v delta^T, small
    against its tokens' parts."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(B, 1, F_IN, generator=g, dtype=dtype) * scale
    delta = torch.randn(B, 1, F_IN, generator=g, dtype=dtype)
    v1 = torch.randn(B, 1, F_OUT, generator=g, dtype=dtype) * 1e3
    exact = torch.stack([v1[i, 0].double()[:, None] * delta[i, 0].double()[None, :] for i in range(B)])
    return torch.cat([base + delta, base], 1), torch.cat([v1, -v1], 1), exact.flatten(1).norm(dim=1)


def linear(dtype):
    torch.manual_seed(0)
    return nn.Linear(F_IN, F_OUT, bias=False).to(dtype)


def test_float32_ghost_norms_survive_cancellation():
    lin = linear(torch.float32)
    x, v, _ = cancelling_batch(torch.float32, 1e4)

    def loss(x, v):
        return (lin(x) * v).sum()

    ours = psg.per_sample(lin, backend="eager", reduce=psg.norms())(loss)(x, v)
    ref = reference_per_sample(loss, dict(lin.named_parameters()), (x, v))
    torch.testing.assert_close(ours.double(), ref_norms(ref).double(), rtol=1e-3, atol=0)
    # the sum itself is float32 arithmetic on entries of 1e7 (ours and the loop's alike): compared loosely on the
    # plan that sums the materialized values as the loop does; the other plans recompute the sum (their rounding
    # differs by up to 1.5e-2 here), and every plan's update stays within the bound
    for plan in [s.name for s in strategies.STRATEGIES["clip_sq_norm"]]:
        with strategies.preferred("clip_sq_norm", plan):
            clipped = psg.per_sample(lin, backend="eager", reduce=psg.clip_sum(C))(loss)(x, v)["weight"]
        if plan == "materialize":
            torch.testing.assert_close(clipped, ref_clip_sum(ref, C)["weight"], rtol=0, atol=5e-3)
        assert clipped.norm() <= B * C * (1 + 1e-6), plan


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_compile_step_update_is_bounded_under_cancellation(clipping):
    lin = linear(torch.float32)
    x, v, _ = cancelling_batch(torch.float32, 1e4)
    before = lin.weight.detach().clone()
    step = psg.compile_step(lambda x, v: (lin(x) * v).sum(), lin, torch.optim.SGD(lin.parameters(), lr=1.0),
                            max_grad_norm=C, clipping=clipping, loss_reduction="sum", backend="eager")
    step(x, v)
    assert (lin.weight.detach() - before).norm() <= B * C * (1 + 1e-6)


def test_float64_ghost_norms_are_upper_bounds_where_precision_runs_out():
    """Activations of 1e8 need more than float64's digits: the norm is then an upper bound (the sample is clipped
    more than needed), never below the exact norm."""
    lin = linear(torch.float64)
    x, v, exact = cancelling_batch(torch.float64, 1e8)
    ours = psg.per_sample(lin, backend="eager", reduce=psg.norms())(lambda x, v: (lin(x) * v).sum())(x, v)
    assert torch.isfinite(ours).all() and (ours >= exact * (1 - 1e-12)).all(), (ours, exact)


def test_embedding_with_padding_and_frequency_scaling_is_clipped():
    """A padding token counts 0 times: its 0/0 made every norm NaN, and NaN norms left samples unclipped."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 6, padding_idx=0, scale_grad_by_freq=True).double()
    head = nn.Linear(6, 1).double()
    params = nn.ModuleDict({"emb": emb, "head": head})
    ids = torch.randint(1, 10, (5, 7))
    ids[:, -2:] = 0  # padding
    ids[:, 1] = ids[:, 0]  # a repeated token: frequency 2

    def loss(ids):
        return head(emb(ids)).pow(2).sum()

    ref = reference_per_sample(loss, dict(params.named_parameters()), (ids,))
    norms = psg.per_sample(params, backend="eager", reduce=psg.norms())(loss)(ids)
    torch.testing.assert_close(norms, ref_norms(ref), rtol=1e-10, atol=0)
    clipped = psg.per_sample(params, backend="eager", reduce=psg.clip_sum(0.5))(loss)(ids)
    for name, want in ref_clip_sum(ref, 0.5).items():
        torch.testing.assert_close(clipped[name], want, rtol=1e-9, atol=1e-12)


def test_a_nan_norm_fails_closed_in_clip_sum_and_is_dropped_by_a_dp_step():
    """``psg.clip_sum``: a NaN norm gives a NaN factor (the sum is NaN), never the factor 1 of an unclipped sample.
    A DP step's factor is 0 for a norm that is not finite (the sample adds nothing), since a NaN in the released
    sum would tell that the sample is in the batch, whatever the noise. A zero gradient keeps factor 1."""
    from compiled_psg._reduce.reductions import automatic_clip_factor, clip_factor, dropping_clip_factor

    n = torch.tensor([float("nan"), 0.0, 0.5, 2.0, float("inf")], dtype=torch.float64)
    got = clip_factor(n, 1.0)
    assert torch.isnan(got[0])
    torch.testing.assert_close(got[1:], torch.tensor([1.0, 1.0, 0.5, 0.0], dtype=torch.float64))
    torch.testing.assert_close(dropping_clip_factor(n, 1.0),
                               torch.tensor([0.0, 1.0, 1.0, 0.5, 0.0], dtype=torch.float64))
    torch.testing.assert_close(automatic_clip_factor(n, 1.0, 0.5),
                               torch.tensor([0.0, 2.0, 1.0, 0.4, 0.0], dtype=torch.float64))


def token_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


@pytest.mark.usefixtures("eager_first_step")
@pytest.mark.parametrize("budget", [None, 0], ids=["fastest", "bounded"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer", "automatic"])
def test_a_sample_whose_gradient_is_not_finite_adds_nothing_to_the_step(clipping, budget):
    """One record with a NaN feature: the step equals the step on the batch without it (same divisor, no noise),
    in the materialized sums and in the book-keeping ones; its norm is reported as what it is. (With ``per_layer``
    each group is dropped alone: an infinite feature after which ``tanh`` saturates leaves the last layer's
    gradient finite, and it is clipped and kept.)"""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 4, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)
    x[2, 1, 3] = float("nan")
    results = []
    for keep in (list(range(6)), [0, 1, 3, 4, 5]):
        model = token_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        step = psg.compile_step(lambda x, y, m=model: nn.functional.cross_entropy(m(x).mean(1), y), model, opt,
                                max_grad_norm=0.2, clipping=clipping, noise_multiplier=0.0, expected_batch_size=6,
                                backend="eager", memory_budget=budget)
        for _ in range(2):  # the eager first step and the fused program
            step(x[keep], y[keep])
        results.append([p.detach().clone() for p in model.parameters()])
        if len(keep) == 6:
            assert not torch.isfinite(step.last_norms[2]) and torch.isfinite(step.last_norms[[0, 1, 3]]).all()
    for got, want in zip(*results, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(("dtype", "big"), [(torch.float32, 3e19), (torch.float64, 1e160)])
def test_a_saturated_layer_after_a_huge_input_keeps_its_sample_in_the_clipped_sum(dtype, big):
    """An input of 3e19 (float32) before a saturated tanh: the first layer's per-sample gradient is exactly 0, but
    its ghost norm ||x||^2 ||dL/dh||^2 was inf * 0 = NaN, and the sample (finite gradient, norm 3.3 through the
    other layer) was dropped from the clipped sum. Its norm and clip_sum now equal the loop's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
    x, y = torch.randn(8, 4, dtype=dtype), torch.randint(0, 3, (8,))
    x[3, 1] = big

    def loss(x, y):
        return nn.functional.cross_entropy(model(x), y)

    params = dict(model.named_parameters())
    ref = reference_per_sample(loss, params, (x, y))
    norms = psg.per_sample(model, reduce=psg.norms(), backend="eager")(loss)(x, y)
    assert torch.isfinite(norms).all() and ref["0.weight"][3].abs().sum() == 0
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(norms, ref_norms(ref), **tol)
    got = psg.per_sample(model, reduce=psg.clip_sum(0.7), backend="eager")(loss)(x, y)
    for name, value in ref_clip_sum(ref, 0.7).items():
        torch.testing.assert_close(got[name], value, **tol)


@pytest.mark.usefixtures("eager_first_step")
@pytest.mark.parametrize("budget", [None, 0], ids=["fastest", "bounded"])
def test_an_infinite_input_before_a_saturated_layer_drops_its_sample(budget):
    """An input of inf before a saturated tanh: the loss is finite, and autograd's gradient of the first weight is
    0 * inf = NaN (the loop's norm is NaN). The ghost norm's zero-factor rule, meant for finite factors whose
    squares overflow (the test above), gave that sample a finite norm, and the book-keeping sum wrote NaN into the
    update (round K). The sample is dropped: the step equals the step without it, and its norm is not finite."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    x[2, 0] = float("inf")
    model0 = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    ref = reference_per_sample(lambda x, y: nn.functional.cross_entropy(model0(x), y),
                               dict(model0.named_parameters()), (x[2:3], y[2:3]))
    assert not torch.isfinite(ref["0.weight"]).all()
    results = []
    for keep in (list(range(6)), [0, 1, 3, 4, 5]):
        model = copy.deepcopy(model0)
        step = psg.compile_step(lambda x, y, m=model: nn.functional.cross_entropy(m(x), y), model,
                                torch.optim.SGD(model.parameters(), lr=0.5), max_grad_norm=1.0, expected_batch_size=6,
                                backend="eager", memory_budget=budget)
        for _ in range(2):  # the eager first step and the fused program
            step(x[keep], y[keep])
        if len(keep) == 6:
            assert not torch.isfinite(step.last_norms[2]) and torch.isfinite(step.last_norms[[0, 1, 3]]).all()
        results.append([p.detach().clone() for p in model.parameters()])
    for got, want in zip(*results, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
