"""Settings changed between steps take effect (clipping bound, noise, divisor); the accountant records the noise
multiplier each step used; noise schedules; refusals of invalid settings."""

from __future__ import annotations

import copy
import itertools
import math

import dp_accounting
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from dp_accounting import rdp
from torch.utils.data import DataLoader, TensorDataset

import compiled_psg as psg
from compiled_psg import compile_step
from compiled_psg._errors import DPConfigError, PerSampleError
from compiled_psg._train.config import DPConfig
from compiled_psg._train.private import make_private
from compiled_psg._train.schedulers import ExponentialNoise, LambdaNoise, StepNoise

DELTA = 1e-5


def _moved(before: list[torch.Tensor], model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.detach() - b).flatten() for b, p in zip(before, model.parameters(), strict=True)])


def test_new_clipping_bound_applies_at_the_next_step():
    """After max_grad_norm goes from 1 to 0.1 mid-training, a planted outlier (gradient ~1e3 times the others)
    moves the update by the NEW bound: its share is exactly 0.1 (with the old baked-in bound it would be 1)."""
    torch.manual_seed(0)
    base = nn.Linear(6, 3)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    x[3] *= 1e3

    def last_update(rows):
        model = copy.deepcopy(base)
        step = compile_step(lambda a, b: F.mse_loss(model(a), b), model, torch.optim.SGD(model.parameters(), lr=1.0),
                            max_grad_norm=1.0, loss_reduction="sum", backend="eager")
        step(x[:5], y[:5])
        step(x[2:7], y[2:7])  # the fused program, built for C = 1
        step.max_grad_norm = 0.1
        before = [p.detach().clone() for p in model.parameters()]
        step(x[rows], y[rows])
        return _moved(before, model), step

    everything, step = last_update(list(range(8)))
    others, _ = last_update([i for i in range(8) if i != 3])
    planted = (everything - others).norm().item()
    assert step.last_norms[3] > 1e2 and step.last_config.max_grad_norm == 0.1
    assert 0.1 * (1 - 1e-3) <= planted <= 0.1 * (1 + 1e-5)
    assert step.captures == 2  # C is a constant of the per-sample graph: one capture per bound
    step.max_grad_norm = 1.0
    step(x[:4], y[:4])
    assert step.captures == 2  # back to a bound seen before: reused


def _zero_gradient_step(backend: str = "eager", **kw):
    """A loss whose per-sample gradients are exactly zero (inputs 0, no bias): an SGD step with lr 1 and no
    scaling moves every one of the 10,000 weights by minus the noise, through the fused program."""
    torch.manual_seed(0)
    model = nn.Linear(100, 100, bias=False)
    step = compile_step(lambda x: model(x).sum(), model, torch.optim.SGD(model.parameters(), lr=1.0),
                        loss_reduction="sum", backend=backend, generator=torch.Generator().manual_seed(1), **kw)
    x = torch.zeros(4, 100)

    def noise():
        before = [p.detach().clone() for p in model.parameters()]
        step(x)
        return -_moved(before, model).double()

    return step, noise


def _assert_std(noise: torch.Tensor, std: float) -> None:
    """Empirical std within 5 standard errors (se of a std estimate from n normals: std / sqrt(2n))."""
    n = noise.numel()
    assert abs(noise.pow(2).mean().sqrt().item() - std) < 5 * std / math.sqrt(2 * n), (noise.std().item(), std)
    assert abs(noise.mean().item()) < 5 * std / math.sqrt(n)


def test_noise_std_follows_the_current_sigma_and_C():
    step, noise = _zero_gradient_step(max_grad_norm=1.0, noise_multiplier=0.5)
    _assert_std(noise(), 0.5)  # the eager first step
    _assert_std(noise(), 0.5)  # the fused program
    step.noise_multiplier, step.max_grad_norm = 1.3, 0.7
    assert step.noise_std == pytest.approx(0.91)
    _assert_std(noise(), 0.91)
    assert step.last_noise_multiplier == 1.3 and step.last_config.max_grad_norm == 0.7
    step.noise_multiplier = 0.0
    assert noise().abs().max().item() == 0.0  # back to the program without noise input
    assert step.last_noise_multiplier == 0.0


@pytest.mark.inductor
def test_noise_switched_on_after_a_noiseless_start_inductor():
    """Built with sigma = 0 (the program has no noise input), then sigma = 1: the next step adds N(0, C^2)."""
    step, noise = _zero_gradient_step(backend="inductor", max_grad_norm=0.8)
    assert noise().abs().max().item() == 0.0
    assert noise().abs().max().item() == 0.0
    step.noise_multiplier = 1.0
    _assert_std(noise(), 0.8)
    _assert_std(noise(), 0.8)
    assert step.last_noise_multiplier == 1.0 and step.program_builds == 2 and step.fused


def test_expected_batch_size_applies_at_the_next_step():
    torch.manual_seed(0)
    ours, ref = nn.Linear(5, 2), nn.Linear(5, 2)
    ref.load_state_dict(ours.state_dict())
    step = compile_step(lambda a, b: (ours(a) - b).pow(2).sum(1).mean(), ours,
                        torch.optim.SGD(ours.parameters(), lr=0.1), expected_batch_size=10, backend="eager")
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1)
    for k, divisor in enumerate((10, 10, 4, None, 7)):
        step.expected_batch_size = divisor
        x, y = torch.randn(6, 5), torch.randn(6, 2)
        step(x, y)
        sgd.zero_grad()
        ((ref(x) - y).pow(2).sum() / (divisor or 6)).backward()
        sgd.step()
        moved = zip(ours.parameters(), ref.parameters(), strict=True)
        assert max((p - q).abs().max().item() for p, q in moved) < 1e-6, k


def test_invalid_settings_are_refused_on_assignment():
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = compile_step(lambda x: model(x).sum(), model, opt, max_grad_norm=1.0, noise_multiplier=1.0,
                        backend="eager")
    for name, value, match in (("noise_multiplier", -1.0, "noise_multiplier"), ("max_grad_norm", 0.0, "positive"),
                               ("max_grad_norm", None, "clipping bound"), ("expected_batch_size", -2, "positive")):
        with pytest.raises(DPConfigError, match=match):
            setattr(step, name, value)
    assert step.config == DPConfig(1.0, 1.0)  # unchanged by the refused assignments
    with pytest.raises(AttributeError):
        step.loss_reduction = "sum"  # read-only: a constant of how the loss was written
    custom = compile_step(lambda x: model(x).sum(), model, opt, reduce=psg.custom(lambda n, g: g.sum(0)),
                          backend="eager")
    with pytest.raises(DPConfigError, match="custom reduce"):
        custom.max_grad_norm = 1.0
    with pytest.raises(DPConfigError, match="clipping mode"):
        step.config = DPConfig(clipping="custom")


def test_every_refusal_is_a_per_sample_error():
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = lambda x: model(x).sum()  # noqa: E731
    with pytest.raises(DPConfigError, match="no gradient per parameter"):
        compile_step(loss, model, opt, reduce=psg.norms())
    with pytest.raises(DPConfigError, match="no gradient per parameter"):
        compile_step(loss, model, opt, reduce=psg.gram())
    bad = compile_step(loss, model, opt, reduce=psg.custom(lambda n, g: g.sum()), backend="eager")
    with pytest.raises(DPConfigError, match="shaped like the parameter"):
        bad(torch.randn(4, 3))
    for call in (lambda: compile_step(loss, model, opt, noise_multiplier=1.0),
                 lambda: compile_step(loss, model, opt, max_physical_batch_size=0),
                 lambda: psg.Accountant("moments"),
                 lambda: psg.poisson_loader(TensorDataset(torch.zeros(3)), 0.0),
                 lambda: psg.calibrate_noise(-1.0, DELTA, 0.1, 10)):
        with pytest.raises(PerSampleError):
            call()


def _private(noise_multiplier=1.0, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    data = TensorDataset(torch.randn(60, 4), torch.randint(0, 3, (60,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    private = make_private(model, opt, DataLoader(data, batch_size=10), lambda x, y: F.cross_entropy(model(x), y),
                           noise_multiplier=noise_multiplier, max_grad_norm=0.5, backend="eager",
                           generator=torch.Generator().manual_seed(0), **kw)
    return model, private


def _direct_epsilon(history) -> float:
    """dp-accounting called directly on the composition of the per-step mechanisms (runs of equal steps
    self-composed: RDP's cost per distinct mechanism is the slow part)."""
    runs = [(key, len(list(group))) for key, group in itertools.groupby(history)]
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_accounting.ComposedDpEvent([dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), n) for (sigma, q), n in runs]))
    return accountant.get_epsilon(DELTA)


def test_accountant_records_the_noise_each_step_used():
    _, private = _private()
    used = []
    for k, (x, y) in enumerate(private.data_loader):
        private.noise_multiplier = 1.0 + 0.25 * (k // 2)  # changed between steps, by hand
        private.step(x, y)
        used.append(private.dp_step.last_noise_multiplier)
    assert used == [1.0, 1.0, 1.25, 1.25, 1.5, 1.5]
    assert private.accountant.history == [(1.0, 1 / 6, 2), (1.25, 1 / 6, 2), (1.5, 1 / 6, 2)]
    assert private.epsilon() == pytest.approx(_direct_epsilon([(s, 1 / 6) for s in used]), rel=1e-9)
    with pytest.raises(DPConfigError, match="noise_multiplier > 0"):
        private.noise_multiplier = 0.0
    with pytest.raises(DPConfigError, match="clipping bound"):
        private.max_grad_norm = None
    private.max_grad_norm = 0.25
    assert private.dp_step.config == DPConfig(0.25, 1.5, 10.0)  # used from the next step on


@pytest.mark.parametrize("make", [
    lambda t: ExponentialNoise(t, gamma=0.9),
    lambda t: StepNoise(t, step_size=2, gamma=0.5),
    lambda t: LambdaNoise(t, lambda epoch: 1 + epoch),
])
def test_noise_schedule_is_accounted_exactly(make):
    """A schedule stepped once per epoch: the step uses each epoch's sigma, and epsilon is dp-accounting's epsilon
    of the composition of exactly those per-step mechanisms."""
    _, private = _private(noise_multiplier=2.0)
    scheduler = make(private)
    used, expected = [], []
    for _ in range(3):
        for x, y in private.data_loader:
            private.step(x, y)
            used.append(private.dp_step.last_noise_multiplier)
            expected.append(scheduler.get_noise_multiplier())
        scheduler.step()
    assert used == expected and len(set(used)) > 1
    assert used[0] == 2.0 and scheduler.noise_at(2) == expected[-1]
    assert private.epsilon() == pytest.approx(_direct_epsilon([(s, 1 / 6) for s in used]), rel=1e-9)


def test_schedulers_match_opacus_formulas():
    class Holder:
        noise_multiplier = 2.0

    for scheduler, formula in ((ExponentialNoise(Holder(), gamma=0.8), lambda e: 2.0 * 0.8 ** e),
                               (StepNoise(Holder(), step_size=3, gamma=0.5), lambda e: 2.0 * 0.5 ** (e // 3)),
                               (LambdaNoise(Holder(), lambda e: 1 / (1 + e)), lambda e: 2.0 / (1 + e))):
        seen = []
        for _ in range(7):
            seen.append(scheduler.training.noise_multiplier)
            scheduler.step()
        assert seen == pytest.approx([formula(e) for e in range(7)], rel=1e-15)
    with pytest.raises(DPConfigError):
        StepNoise(Holder(), step_size=0)


def test_epsilon_without_poisson_sampling_warns():
    _, private = _private(poisson_sampling=False)
    for x, y in private.data_loader:
        private.step(x, y)
    with pytest.warns(UserWarning, match="assumes Poisson sampling"):
        private.epsilon()
