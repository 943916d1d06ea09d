"""compile_step: limit cases against a plain optimizer step, clipping bound, noise statistics, recompiles."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy import stats

from compiled_psg._train.dp import secure_gaussian
from compiled_psg._train.step import compile_step

OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(64, 10))


def batch(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def plain_step(model, optimizer, loss_fn, x, y):
    optimizer.zero_grad()
    loss_fn(model, x, y).backward()
    optimizer.step()


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def ce_mean(model, x, y):
    return F.cross_entropy(model(x), y)


def ce_sum(model, x, y):
    return F.cross_entropy(model(x), y, reduction="sum")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("max_grad_norm", [1e6, None])
def test_sigma_zero_huge_clip_is_plain_step(name, max_grad_norm):
    """sigma=0 and C -> infinity: the step is the optimizer's ordinary step on the mean loss."""
    ours, ref = small_cnn(), small_cnn()
    opt_ours, opt_ref = OPTIMIZERS[name](ours.parameters()), OPTIMIZERS[name](ref.parameters())
    step = compile_step(lambda x, y: ce_mean(ours, x, y), ours, opt_ours, max_grad_norm=max_grad_norm,
                        backend="eager", update_backend="eager")
    for n in (16, 9, 5):  # several sizes: also exercises the optimizer state (momentum, Adam moments)
        x, y = batch(n, seed=n)
        with torch.no_grad():
            expected = ce_mean(ref, x, y)
        loss = step(x, y)
        assert torch.allclose(loss, expected, atol=1e-4)
        plain_step(ref, opt_ref, ce_mean, x, y)
    # SGD matches to rounding; compiled Adam keeps its step count in float32 for the bias correction
    assert max_diff(ours, ref) < (1e-6 if name == "SGD" else 2e-5)
    assert step.per_sample.captures == 1 and step.update_compiles == 1


def test_sum_reduction_is_plain_step_of_sum_loss():
    ours, ref = small_cnn(), small_cnn()
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.01)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.01)
    step = compile_step(lambda x, y: ce_sum(ours, x, y), ours, opt_ours, loss_reduction="sum",
                        backend="eager", update_backend="eager")
    x, y = batch(12)
    step(x, y)
    plain_step(ref, opt_ref, ce_sum, x, y)
    assert max_diff(ours, ref) < 1e-6


def test_expected_batch_size_divides_the_sum():
    """loss_reduction="mean" with expected_batch_size: the gradient is the sum over expected_batch_size."""
    ours, ref = small_cnn(), small_cnn()
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1 / 20)
    step = compile_step(lambda x, y: ce_mean(ours, x, y), ours, opt_ours, expected_batch_size=20,
                        backend="eager", update_backend="eager")
    x, y = batch(7)
    step(x, y)
    plain_step(ref, opt_ref, ce_sum, x, y)
    assert max_diff(ours, ref) < 1e-6


def test_no_sample_contributes_more_than_C():
    """Plant one sample with a huge gradient: its share of the clipped sum has norm exactly C, no more."""
    C = 0.5
    torch.manual_seed(0)
    base = nn.Linear(6, 3)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    x[3] *= 1e4

    def delta(rows):
        model = copy.deepcopy(base)
        sgd = torch.optim.SGD(model.parameters(), lr=1.0)
        step = compile_step(lambda a, b: F.mse_loss(model(a), b), model, sgd,
                            max_grad_norm=C, loss_reduction="sum", backend="eager", update_backend="eager")
        step(x[rows], y[rows])
        moved = [(p - q).flatten() for p, q in zip(base.parameters(), model.parameters(), strict=True)]
        return torch.cat(moved), step

    everything, step = delta(list(range(8)))
    assert step.last_norms[3] > 1e3 * C  # the planted sample really is huge
    others, _ = delta([i for i in range(8) if i != 3])
    planted = (everything - others).norm()
    assert planted <= C * (1 + 1e-5)
    assert planted >= C * (1 - 1e-3)  # clipped to the bound, not dropped
    for i in range(8):  # and each sample alone
        alone, _ = delta([i])
        assert alone.norm() <= C * (1 + 1e-5)


def _noise_of_empty_step(secure: bool, generator=None, seed: int = 0):
    """An empty batch has a zero clipped sum: an SGD step with lr 1 and no scaling moves by exactly -noise."""
    torch.manual_seed(seed)
    model = nn.Linear(100, 100)  # 10,100 coordinates
    before = [p.detach().clone() for p in model.parameters()]
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    step = compile_step(lambda x, y: F.mse_loss(model(x), y), model, sgd,
                        max_grad_norm=0.7, noise_multiplier=1.3, loss_reduction="sum", secure_rng=secure,
                        generator=generator, backend="eager", update_backend="eager")
    step(torch.zeros(0, 100), torch.zeros(0, 100))
    assert step.last_batch_size == 0
    moved = [(b - p.detach()).flatten() for b, p in zip(before, model.parameters(), strict=True)]
    return torch.cat(moved).double(), 0.7 * 1.3


def _check_gaussian(noise: torch.Tensor, std: float, p_min: float):
    n = noise.numel()
    chi2 = float((noise / std).pow(2).sum())
    p_two_sided = 2 * min(stats.chi2.cdf(chi2, n), stats.chi2.sf(chi2, n))
    assert p_two_sided > p_min, (chi2, n, noise.std().item(), std)
    assert abs(noise.mean().item()) < 6 * std / math.sqrt(n)
    assert stats.kstest((noise / std).numpy(), "norm").pvalue > p_min


@pytest.mark.parametrize("source", ["default", "generator", "secure"])
def test_noise_std_is_sigma_C(source):
    """The noise added once per step is N(0, sigma^2 C^2) per coordinate (chi-square and KS tests)."""
    generator = torch.Generator().manual_seed(3) if source == "generator" else None
    noise, std = _noise_of_empty_step(secure=source == "secure", generator=generator)
    # seeded sources are deterministic; the secure one is not: a threshold that fails once in 10^7 runs
    _check_gaussian(noise, std, p_min=1e-3 if source != "secure" else 1e-7)
    assert not torch.allclose(noise.std(), torch.tensor(std * math.sqrt(2), dtype=torch.float64), rtol=0.05)


def test_secure_gaussian_moments():
    z = secure_gaussian((200_000,), 2.0, dtype=torch.float64)
    assert z.dtype == torch.float64 and z.shape == (200_000,)
    _check_gaussian(z, 2.0, p_min=1e-7)
    assert not torch.equal(secure_gaussian((8,)), secure_gaussian((8,)))


def test_generator_makes_noise_reproducible():
    a, _ = _noise_of_empty_step(False, torch.Generator().manual_seed(5), seed=0)
    b, _ = _noise_of_empty_step(False, torch.Generator().manual_seed(5), seed=1)  # other model init
    c, _ = _noise_of_empty_step(False, torch.Generator().manual_seed(6), seed=0)
    assert torch.allclose(a, b, atol=1e-5) and not torch.allclose(a, c, atol=1e-2)


def test_every_batch_size_one_graph_each():
    """Batch sizes 0, 1 and any other reuse the same capture and the same compiled update."""
    model = small_cnn()
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = compile_step(lambda x, y: ce_mean(model, x, y), model, adam,
                        max_grad_norm=1.0, noise_multiplier=0.5, backend="eager", update_backend="eager")
    for n in (8, 3, 0, 1, 13):
        step(*batch(n))
        assert step.last_batch_size == n
    assert step.per_sample.captures == 1
    assert step.update_compiles == 1 and step.update_fullgraph


@pytest.mark.inductor
def test_inductor_no_recompile_across_batch_sizes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
    ref = copy.deepcopy(model)
    opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, ref))
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, opt, max_grad_norm=1e6)
    for n in (9, 4, 17, 2, 0):
        x, y = torch.randn(n, 10), torch.randint(0, 3, (n,))
        step(x, y)
        if n:
            plain_step(ref, opt_ref, lambda m, a, b: F.cross_entropy(m(a), b), x, y)
        else:  # an empty batch is a step with a zero gradient
            for p in ref.parameters():
                p.grad = torch.zeros_like(p)
            opt_ref.step()
    assert max_diff(model, ref) < 2e-5
    assert step.per_sample.captures == 1 and step.update_compiles == 1 and step.update_fullgraph
    assert step.compile_seconds > 0


def test_optimizer_with_hooks_compiles_with_graph_breaks():
    model = small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    opt.register_step_post_hook(lambda *a: calls.append(1))
    step = compile_step(lambda x, y: ce_mean(model, x, y), model, opt, max_grad_norm=1.0, backend="eager",
                        update_backend="eager")
    step(*batch(4))
    step(*batch(5))
    assert calls == [1, 1] and not step.update_fullgraph


def test_argument_errors():
    model = small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = lambda x, y: ce_mean(model, x, y)
    with pytest.raises(ValueError, match="clipping bound"):
        compile_step(loss, model, opt, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="loss_reduction"):
        compile_step(loss, model, opt, loss_reduction="none")
    with pytest.raises(ValueError, match="max_grad_norm"):
        compile_step(loss, model, opt, max_grad_norm=0.0)
