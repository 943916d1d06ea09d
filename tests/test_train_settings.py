"""Settings changed between steps take effect (clipping bound, noise, divisor); the accountant records the noise
multiplier each step used; noise schedules; refusals of invalid settings."""

from __future__ import annotations

import copy
import io
import itertools
import math

import dp_accounting
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from dp_accounting import rdp
from torch.utils.data import DataLoader, TensorDataset

import compiled_psg as psg
from compiled_psg import compile_step
from compiled_psg._errors import DPConfigError, PerSampleError
from compiled_psg._train.accounting import epsilon
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


@pytest.mark.usefixtures("eager_first_step")
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
    step.max_grad_norm = float("inf")  # no clipping, no noise: red team M read noise_std as 0 * inf = NaN
    assert step.noise_std == 0.0


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
    with pytest.raises(DPConfigError, match=r"shaped like the parameter\} .* got weight: shape \(\), the "
                                            r"parameter's \(2, 3\); bias: shape \(\)"):
        bad(torch.randn(4, 3))
    for dtype in (torch.int64, torch.bool, torch.complex64):  # .grad would hold them only by dropping values
        cast = compile_step(loss, model, opt, reduce=psg.custom(lambda n, g, d=dtype: g.sum(0).to(d)),
                            backend="eager")
        with pytest.raises(DPConfigError, match=f"weight: dtype {dtype}, not floating"):
            cast(torch.randn(4, 3))
    for call in (lambda: compile_step(loss, model, opt, noise_multiplier=1.0),
                 lambda: compile_step(loss, model, opt, max_physical_batch_size=0),
                 lambda: psg.Accountant("moments"),
                 lambda: psg.poisson_loader(TensorDataset(torch.zeros(3)), 0.0),
                 lambda: psg.calibrate_noise(-1.0, DELTA, 0.1, 10)):
        with pytest.raises(PerSampleError):
            call()


def _private(noise_multiplier=1.0, max_grad_norm=0.5, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    data = TensorDataset(torch.randn(60, 4), torch.randint(0, 3, (60,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    private = make_private(model, opt, DataLoader(data, batch_size=10), lambda x, y: F.cross_entropy(model(x), y),
                           noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, backend="eager",
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
    for owner in (private, private.dp_step):  # the step keeps its owner's rules, however it is reached
        with pytest.raises(DPConfigError, match="noise_multiplier > 0"):
            owner.noise_multiplier = 0.0
        with pytest.raises(DPConfigError, match="clipping bound"):
            owner.max_grad_norm = None
    # round M, privacy: dividing by the actual Poisson batch size revealed it through the update's norm
    with pytest.raises(DPConfigError, match=r"expected_batch_size=None divides by the actual size of the Poisson "
                                            r"batch.*Fix: keep a fixed expected_batch_size"):
        private.dp_step.expected_batch_size = None
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


def test_a_refused_scheduler_load_changes_nothing():
    """A load_state_dict with a negative base noise was refused by the training only after the state was assigned:
    the scheduler was left at the refused position, and every later step() failed; a missing key raised KeyError.
    Each refusal is a DPConfigError naming the scheduler and the key; the scheduler and the training stay as they
    were, and the schedule goes on from its own position."""
    _, private = _private(noise_multiplier=1.0)
    scheduler = ExponentialNoise(private, gamma=0.5)
    scheduler.step()
    scheduler.step()
    saved = scheduler.state_dict()
    assert saved == {"base_noise_multiplier": 1.0, "last_epoch": 2} and private.noise_multiplier == 0.25
    for state, match in (
            ({"base_noise_multiplier": -1.0, "last_epoch": 7}, "base_noise_multiplier must be a finite number >= 0, "
                                                                "got -1.0"),
            ({"base_noise_multiplier": math.inf, "last_epoch": 7}, "base_noise_multiplier must be a finite number"),
            ({"base_noise_multiplier": "1.0", "last_epoch": 2}, "base_noise_multiplier must be a number, got str"),
            ({"base_noise_multiplier": 1.0}, r"missing \['last_epoch'\]"),
            ({**saved, "gamma": 0.5}, r"unknown \['gamma'\]"),
            ([1.0, 2], "must be a dict .*, got list"),
            ({"base_noise_multiplier": 1.0, "last_epoch": 2.5}, "last_epoch must be an int >= 0, got float 2.5"),
            ({"base_noise_multiplier": 1.0, "last_epoch": True}, "last_epoch must be an int >= 0, got bool True"),
            ({"base_noise_multiplier": 1.0, "last_epoch": -1}, "last_epoch must be an int >= 0, got int -1"),
            ({"base_noise_multiplier": 0.0, "last_epoch": 3}, "noise_multiplier > 0")):  # the training's refusal
        with pytest.raises(DPConfigError, match=match) as info:
            scheduler.load_state_dict(state)
        assert str(info.value).startswith("ExponentialNoise")
        assert scheduler.state_dict() == saved and private.noise_multiplier == 0.25
    scheduler.step()
    assert private.noise_multiplier == 0.125 and scheduler.last_epoch == 3
    scheduler.load_state_dict({"base_noise_multiplier": np.float32(2.0), "last_epoch": np.int64(1)})
    state = scheduler.state_dict()
    assert state == {"base_noise_multiplier": 2.0, "last_epoch": 1} and private.noise_multiplier == 1.0
    assert type(state["base_noise_multiplier"]) is float and type(state["last_epoch"]) is int


def _sigma_step(noise_multiplier=1.0):
    model = nn.Linear(3, 2)
    return compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.1),
                        max_grad_norm=1.0, noise_multiplier=noise_multiplier, expected_batch_size=4.0,
                        backend="eager")


@pytest.mark.parametrize(("make", "match"), [
    (lambda t: LambdaNoise(t, lambda e: None), r"LambdaNoise: noise_lambda\(0\) must return a number, got NoneType"),
    (lambda t: LambdaNoise(t, lambda e: "half"), r"LambdaNoise: noise_lambda\(0\) must return a number, got str"),
    (lambda t: LambdaNoise(t, lambda e: True), r"LambdaNoise: noise_lambda\(0\) must return a number, got bool"),
    (lambda t: LambdaNoise(t, lambda e: torch.tensor(0.5)), r"got Tensor tensor\(0.5000\): pass float\(t\)"),
    (lambda t: LambdaNoise(t, lambda e: -0.5), r"LambdaNoise gave noise_multiplier=-0.5 at epoch 0"),
    (lambda t: ExponentialNoise(t, gamma="0.9"), "ExponentialNoise: gamma must be a number, got str '0.9'"),
    (lambda t: ExponentialNoise(t, gamma=None), "ExponentialNoise: gamma must be a number, got NoneType"),
    (lambda t: ExponentialNoise(t, gamma=math.nan), "ExponentialNoise: gamma must be a positive finite number"),
    (lambda t: ExponentialNoise(t, gamma=0.9, last_epoch="3"), "ExponentialNoise: last_epoch must be an int >= -1"),
    (lambda t: StepNoise(t, 1, gamma=None), "StepNoise: gamma must be a number, got NoneType"),
    (lambda t: StepNoise(t, 1, gamma=0.0), "StepNoise: gamma must be a positive finite number, got 0.0"),
    (lambda t: StepNoise(t, True), "StepNoise: step_size must be a positive int, got bool True"),
    (lambda t: StepNoise(t, 2.0), "StepNoise: step_size must be a positive int, got float 2.0"),
], ids=["lambda_none", "lambda_str", "lambda_bool", "lambda_tensor", "lambda_negative", "gamma_str", "gamma_none",
        "gamma_nan", "last_epoch_str", "step_gamma_none", "step_gamma_zero", "step_size_bool", "step_size_float"])
def test_scheduler_settings_of_the_wrong_kind_are_refused_naming_them(make, match):
    """Each raised a raw TypeError or ValueError (or, a bool step size, was taken as 1); each is a DPConfigError
    naming the scheduler and the setting, and the step's noise stays as it was."""
    step = _sigma_step()
    with pytest.raises(DPConfigError, match=match):
        make(step)
    assert step.noise_multiplier == 1.0


def test_a_refused_schedule_step_leaves_the_epoch_and_the_noise():
    """A lambda that gives no number at a later epoch: that step() is refused, the schedule stays at its epoch and
    the step at its noise; a numpy number is taken, as the Python float the step stores."""
    step = _sigma_step()
    schedule = LambdaNoise(step, lambda e: np.float32(0.5) if e < 2 else None)
    schedule.step()
    assert schedule.last_epoch == 1 and step.noise_multiplier == 0.5 and type(step.noise_multiplier) is float
    with pytest.raises(DPConfigError, match=r"LambdaNoise: noise_lambda\(2\) must return a number, got NoneType"):
        schedule.step()
    assert schedule.last_epoch == 1 and step.noise_multiplier == 0.5


def test_epsilon_without_poisson_sampling_warns():
    _, private = _private(poisson_sampling=False)
    for x, y in private.data_loader:
        private.step(x, y)
    with pytest.warns(UserWarning, match="assumes Poisson sampling"):
        private.epsilon()


def _untouched(model: nn.Module, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_noise_that_overflows_is_refused_before_any_step():
    """Infinite sigma, or a flat bound whose noise std sigma * C is past float32's range, made every parameter
    inf/NaN (and epsilon() report 0). Both are refused, by make_private, compile_step and the setters, before a
    step runs: parameters untouched, nothing counted."""
    for kw, match in (({"noise_multiplier": math.inf}, "finite number >= 0, got inf"),
                      ({"noise_multiplier": math.nan}, "finite number >= 0, got nan"),
                      ({"max_grad_norm": 1e39}, "past the range of torch.float32")):
        with pytest.raises(DPConfigError, match=match):
            _private(**kw)
    model, private = _private()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(DPConfigError, match="finite number >= 0, got inf"):
        private.noise_multiplier = math.inf
    with pytest.raises(DPConfigError, match=r"1 \* 1e\+39: .*past the range of torch.float32"):
        private.max_grad_norm = 1e39
    with pytest.raises(DPConfigError, match="1e\\+308 \\* 0.5: .*past the range"):
        ExponentialNoise(private, gamma=1e308).step()  # a schedule that explodes
    assert private.dp_step.config == DPConfig(0.5, 1.0, 10.0) and private.steps == 0 and _untouched(model, before)
    double = nn.Linear(3, 2).double()  # float64 noise reaches 1e39 * sigma
    compile_step(lambda x: double(x).sum(), double, torch.optim.SGD(double.parameters(), lr=0.1),
                 max_grad_norm=1e39, noise_multiplier=1.0, backend="eager")


def test_noise_too_small_to_account_gives_infinite_epsilon():
    """dp-accounting's RDP overflows below sigma ~1e-150: it reported epsilon 0 at 1e-154 (a false guarantee) and
    raised ZeroDivisionError at 1e-200 on every epsilon() call. Such noise is accounted as none: infinite."""
    for sigma in (1e-154, 1e-200, 1e-300):
        assert epsilon(sigma, 0.25, 1, DELTA) == math.inf
    assert epsilon(1e-10, 0.25, 1, DELTA) > 1e19  # still dp-accounting's own number
    _, private = _private()
    private.noise_multiplier = 1e-300
    x, y = next(iter(private.data_loader))
    private.step(x, y)
    assert private.epsilon() == math.inf


def test_sampling_rate_and_calibration_inputs_are_refused_naming_the_argument():
    """A zero sampling rate divided by zero; a rate above 1 without Poisson sampling was taken and counted, and
    then every epsilon() raised; epochs <= 0, steps <= 0, an infinite target or one that no noise >= 0.01 misses
    raised dp-accounting's own errors. Each is a DPConfigError naming the argument, before anything runs."""
    cases = (({"sample_rate": 0.0}, "sample_rate must be a number in \\(0, 1\\], got 0.0"),
             ({"sample_rate": 2.0, "poisson_sampling": False}, "sample_rate must .* got 2.0"),
             ({"noise_multiplier": None, "target_epsilon": 1.0, "epochs": 0}, "epochs must be a positive int, got 0"),
             ({"noise_multiplier": None, "target_epsilon": 1.0, "epochs": -1}, "epochs must .* got -1"),
             ({"noise_multiplier": None, "target_epsilon": math.inf, "epochs": 1}, "target_epsilon must be .* inf"),
             # red team Q2: taken and ignored (nothing is calibrated with noise_multiplier given)
             ({"epochs": -5}, r"epochs=-5 is used only with target_epsilon.*Fix: drop epochs"),
             ({"epochs": "abc"}, r"epochs='abc' is used only with target_epsilon"))
    for kw, match in cases:
        with pytest.raises(DPConfigError, match=match):
            _private(**kw)
    for args, match in (((1.0, DELTA, 0.1, 0), "steps must be a positive int, got 0"),
                        ((1.0, DELTA, 1.5, 10), "sample_rate must .* got 1.5"),
                        ((1e9, DELTA, 0.1, 10), "target_epsilon=1000000000.0 is met even with noise_multiplier=0.01")):
        with pytest.raises(DPConfigError, match=match):
            psg.calibrate_noise(*args)
    with pytest.raises(DPConfigError, match="sample_rate must .* got 2.0"):
        psg.Accountant().step(1.0, 2.0)


def test_what_make_private_fixed_cannot_be_assigned_and_a_step_takes_no_keywords():
    """Red team O: ``private.sample_rate = 0.001`` was taken, and the accountant recorded every step at 0.001
    while the loader sampled at 0.2 (epsilon 0.61 reported, 4.54 spent); so were the dataset size, the delta,
    the loader and the accountant. ``private.step(x, y=y)`` raised Python's TypeError."""
    _, private = _private()
    x, y = next(iter(private.data_loader))
    private.step(x, y)
    fixed = {"sample_rate": 0.001, "dataset_size": 10**6, "target_delta": 1e-9, "poisson_sampling": False,
             "accountant": psg.Accountant(), "data_loader": None, "dp_step": None}
    for name, value in fixed.items():
        before = getattr(private, name)
        with pytest.raises(DPConfigError, match=f"a PrivateTraining's {name} is fixed when make_private builds it"):
            setattr(private, name, value)
        with pytest.raises(DPConfigError, match=f"{name} is fixed"):
            delattr(private, name)
        assert getattr(private, name) is before
    private.noise_multiplier = 2.0  # the settings a training may change between steps
    private.max_grad_norm = 0.25
    with pytest.raises(psg.BatchInputError, match="keyword"):
        private.step(x, y=y)
    assert private.steps == 1 and private.epsilon() == epsilon(1.0, 1 / 6, 1, DELTA, "rdp")


def test_a_private_training_is_built_by_make_private_only():
    """Red team Q2: ``psg.PrivateTraining(...)`` checked none of its parts: one at sample_rate=0.001 over a loader
    sampling at 0.2 reported the epsilon of 0.001; one at 1.5 applied each noisy update, then its accountant
    refused to count it."""
    model, private = _private()
    with pytest.raises(DPConfigError, match=r"a PrivateTraining is built by make_private.*Fix: psg.make_private"):
        psg.PrivateTraining(model, private.optimizer, private.data_loader, private.dp_step, psg.Accountant(),
                            sample_rate=0.001, target_delta=1e-5)
    assert private.dp_step.accounted_by == "PrivateTraining" and private.steps == 0


def test_what_the_accountant_counted_and_whose_step_it_counts_cannot_be_changed():
    """Red team Q2: ``private.accountant.history = []`` (or ``.history.clear()``) took epsilon from 4.54 to 0 after
    five steps; ``private.dp_step.accounted_by = None`` lifted the training's rules, and the step then divided by
    the actual Poisson batch size; ``del sampler.sample_rate`` let a new rate be set."""
    _, private = _private()
    x, y = next(iter(private.data_loader))
    private.step(x, y)
    history, spent = private.accountant.history, private.epsilon()
    with pytest.raises(DPConfigError, match="an Accountant's history is what it counted"):
        private.accountant.history = []
    private.accountant.history.clear()  # a copy
    assert private.accountant.history == history and private.epsilon() == spent > 0
    with pytest.raises(DPConfigError, match="accountant must be one of"):
        private.accountant.mechanism = "moments"
    for change in (lambda step: setattr(step, "accounted_by", None), lambda step: delattr(step, "accounted_by")):
        with pytest.raises(DPConfigError, match="this step belongs to a PrivateTraining"):
            change(private.dp_step)
        assert private.dp_step.accounted_by == "PrivateTraining"
    with pytest.raises(DPConfigError, match="expected_batch_size=None divides by the actual size"):
        private.dp_step.expected_batch_size = None
    sampler = private.data_loader.batch_sampler
    for name in ("sample_rate", "num_samples", "steps", "generator", "secure"):
        with pytest.raises(DPConfigError, match=f"a PoissonBatchSampler's {name} is fixed"):
            delattr(sampler, name)
    assert sampler.sample_rate == private.sample_rate


def test_objects_of_the_wrong_kind_are_refused_naming_the_argument():
    """An optimizer of None, an int as the generator, a list as the loader, an empty dataset, None as
    poisson_loader's data or as a scheduler's training ended in AttributeError, TypeError or ZeroDivisionError
    from deep inside; each is a DPConfigError that names the argument and what it must be."""
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = lambda x, y: F.cross_entropy(model(x), y)  # noqa: E731
    batch = (torch.randn(6, 4), torch.randint(0, 3, (6,)))
    for kw, match in (({"optimizer": None}, "optimizer must be a torch.optim.Optimizer.*got NoneType"),
                      ({"generator": 42}, "generator must be a torch.Generator.*got int 42")):
        with pytest.raises(DPConfigError, match=match):
            compile_step(loss, model, **{"optimizer": opt, **kw}, noise_multiplier=1.0, max_grad_norm=1.0)
    empty = TensorDataset(torch.randn(0, 4), torch.zeros(0, dtype=torch.long))
    for loader, match in (([batch], "data_loader must be a torch.utils.data.DataLoader, got a list"),
                          (DataLoader(empty, batch_size=5), "the dataset of data_loader is empty")):
        with pytest.raises(DPConfigError, match=match):
            make_private(model, opt, loader, loss, noise_multiplier=1.0)
    with pytest.raises(DPConfigError, match="data must be a DataLoader .* got a NoneType"):
        psg.poisson_loader(None, 0.1)
    with pytest.raises(DPConfigError, match="ExponentialNoise: training must be .* got NoneType"):
        ExponentialNoise(None, gamma=0.9)


def test_numbers_of_numpy_types_are_taken_as_python_numbers():
    """numpy's scalars are real numbers (``numbers.Real``): np.float32 noise and an np.int64 divisor were refused as
    "not a finite number". Each is taken and stored as Python's float or int, so that no numpy scalar reaches the
    step's program, the accountant or the saved state; the step equals the one built from Python numbers."""
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))

    def run(**kw):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        step = compile_step(lambda a, b: F.cross_entropy(model(a), b), model,
                            torch.optim.SGD(model.parameters(), lr=0.1), backend="eager",
                            generator=torch.Generator().manual_seed(0), **kw)
        step(x, y)
        return model, step

    numpy_model, step = run(max_grad_norm=np.float32(0.5), noise_multiplier=np.float32(1.0),
                            expected_batch_size=np.int64(4), automatic_gamma=np.float16(0.5), clipping="automatic")
    python_model, _ = run(max_grad_norm=0.5, noise_multiplier=1.0, expected_batch_size=4, automatic_gamma=0.5,
                          clipping="automatic")
    assert all(torch.equal(p, q) for p, q in zip(numpy_model.parameters(), python_model.parameters(), strict=True))
    config = step.last_config
    assert (type(config.max_grad_norm), type(config.noise_multiplier), type(config.expected_batch_size),
            type(config.automatic_gamma)) == (float, float, int, float)
    step.noise_multiplier = np.float64(2.0)
    step.max_grad_norm = np.int32(2)
    assert type(step.noise_multiplier) is float and type(step.max_grad_norm) is float
    per_layer = DPConfig([np.float32(1.0), np.int64(2)], clipping="per_layer")
    assert per_layer.max_grad_norm == (1.0, 2.0) and {type(b) for b in per_layer.max_grad_norm} == {float}

    _, private = _private(noise_multiplier=np.float32(1.0))
    private.noise_multiplier = np.float32(0.5)
    private.step(*next(iter(private.data_loader)))
    assert private.accountant.history == [(0.5, 1 / 6, 1)] and type(private.accountant.history[0][0]) is float
    with pytest.raises(DPConfigError, match="noise_multiplier > 0, got 0.0"):
        private.noise_multiplier = np.float32(0.0)  # a private training needs noise, whatever the number's type
    assert private.noise_multiplier == 0.5
    accountant = psg.Accountant()
    accountant.step(np.float32(2.0), np.float64(0.5), np.int64(2))
    assert [type(v) for v in accountant.history[0]] == [float, float, int]


def test_the_other_numeric_settings_take_numpy_numbers_too():
    """``clip_sum(np.float32(1))``, ``memory_budget``, ``sample_rate``, ``target_delta``, ``epochs`` and
    ``max_physical_batch_size`` of numpy types were refused as "must be a number"; each is kept as a Python number
    (a numpy scalar in a saved state would not load under ``torch.load(weights_only=True)``)."""
    assert psg.clip_sum(np.float32(1.0), memory_budget=np.int64(0)) == psg.clip_sum(1.0, memory_budget=0)
    _, private = _private(noise_multiplier=None, target_epsilon=np.float32(8.0), epochs=np.int64(1),
                          target_delta=np.float32(1e-5), sample_rate=np.float64(0.2),
                          max_physical_batch_size=np.int64(4))
    assert (type(private.sample_rate), type(private.target_delta), type(private.dp_step.max_physical_batch_size)) \
        == (float, float, int)
    private.step(*next(iter(private.data_loader)))
    state = private.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    torch.load(buffer, weights_only=True)  # plain Python numbers throughout


@pytest.mark.parametrize(("setting", "value", "match"), [
    ("noise_multiplier", torch.tensor(1.0), r"noise_multiplier must be a number, got Tensor tensor\(1.\): pass "
                                            r"float\(t\)"),
    ("expected_batch_size", torch.tensor(4), r"expected_batch_size must be a number or None, got Tensor "
                                             r"tensor\(4\): pass float\(t\)"),
    ("max_grad_norm", torch.tensor(1.0), r"max_grad_norm must be a number.*got Tensor tensor\(1.\): pass "
                                         r"float\(t\)"),
    ("noise_multiplier", np.True_, "noise_multiplier must be a number, got bool"),
    ("expected_batch_size", np.True_, "expected_batch_size must be a number or None, got bool"),
    ("noise_multiplier", np.float32("nan"), r"noise_multiplier must be a finite number >= 0, got np.float32\(nan\)"),
    ("noise_multiplier", 1 + 0j, "noise_multiplier must be a number, got complex"),
], ids=["tensor_sigma", "tensor_divisor", "tensor_bound", "numpy_bool_sigma", "numpy_bool_divisor", "nan_float32",
        "complex_sigma"])
def test_numbers_that_are_not_real_numbers_are_refused_naming_their_type(setting, value, match):
    """A one-element tensor was refused as "must be a finite number >= 0"; the refusal names its type and the fix."""
    model = nn.Linear(3, 2)
    options = {"max_grad_norm": 1.0, "noise_multiplier": 1.0, setting: value}
    with pytest.raises(DPConfigError, match=match):
        compile_step(lambda x: model(x).sum(), model, torch.optim.SGD(model.parameters(), lr=0.1), backend="eager",
                     **options)


def _wide_step(dtype: torch.dtype, bound: float, lr: float = 1e-30, **kw):
    torch.manual_seed(0)
    model = nn.Linear(50, 20).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    kw = {"noise_multiplier": 1.0, "expected_batch_size": 8, **kw}
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, optimizer, max_grad_norm=bound, **kw)
    return model, step


@pytest.mark.parametrize(("dtype", "bound", "kw", "match"), [
    # sigma * C = 1e38 passed the check (below float32's 3.4e38), and the draws beyond 3.4 std were inf
    (torch.float32, 1e38, {}, r"1 \* 1e\+38: .*past the range of torch.float32"),
    (torch.float32, 1e37, {}, r"1 \* 1e\+37: .*past the range of torch.float32"),
    # the noisy sum is multiplied by 1 / expected_batch_size in float32
    (torch.float32, 1e35, {"expected_batch_size": 1e-3}, r"times 1/expected_batch_size = 1e\+03"),
    # the sensitivity sqrt(C^2) overflowed to inf and the message named it so
    (torch.float64, 1e307, {}, r"1 \* 1e\+307: .*past the range of torch.float64"),
    # float16 parameters: the noisy sum is float32, the .grad it is written into float16
    (torch.float16, 2e3, {"loss_reduction": "sum"}, r"1 \* 2e\+03: .*torch.float16 .*the dtype of the parameters'"),
    # adaptive: C is a float32 input of the graph, and its noise std 0.5 * 3e38 was accepted
    (torch.float32, 3e38, {"clipping": "adaptive", "noise_multiplier": 0.5, "unclipped_num_std": 1.0},
     r"past the range of torch.float32"),
])
def test_noise_range_leaves_room_for_the_largest_draw(dtype, bound, kw, match):
    """The noise std sigma * C just under a dtype's largest value passed, and the draws past it (4 of 1020 at
    C = 1e38 in float32) made parameters inf. The check requires the largest plausible draw, 40 std, plus one
    sample's clipped contribution to be finite in the dtype the noise is added in (and, scaled, in the
    parameters' .grad): refused at build, and on assignment with nothing changed."""
    with pytest.raises(DPConfigError, match=match) as refused:
        _wide_step(dtype, bound, **kw)
    assert "largest plausible draw (40 std" in str(refused.value)
    model, step = _wide_step(dtype, 1.0, **kw)
    before, config = [p.detach().clone() for p in model.parameters()], step.config
    with pytest.raises(DPConfigError, match=match):
        step.max_grad_norm = bound
    assert step.config == config and step.steps_taken == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize(("dtype", "bound", "kw"), [
    (torch.float32, 5e36, {}), (torch.float32, 1e30, {"loss_reduction": "sum"}),
    (torch.float64, 1e200, {}),  # was refused: sqrt(C * C) overflowed Python's float
    (torch.float64, 1e300, {"clipping": "per_layer"}), (torch.float16, 1e2, {"loss_reduction": "sum"}),
])
def test_noise_range_takes_large_bounds_that_stay_finite(dtype, bound, kw):
    model, step = _wide_step(dtype, bound, lr=1e-300 if dtype == torch.float64 else 1e-30, **kw)
    g = torch.Generator().manual_seed(1)
    step(torch.randn(8, 50, generator=g).to(dtype), torch.randint(0, 20, (8,), generator=g))
    assert all(torch.isfinite(p.grad).all() and torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(("name", "value", "match"), [
    # -inf * 0 = nan when the unclipped fraction met the target: the stall then said "moved the clip bound to nan"
    ("clipbound_learning_rate", math.inf, "clipbound_learning_rate must be a finite number >= 0, got inf"),
    ("clipbound_learning_rate", math.nan, "clipbound_learning_rate must be a finite number >= 0, got nan"),
    # C g / (||g|| + inf) is 0 for every sample: no gradient at all
    ("automatic_gamma", math.inf, "automatic_gamma must be a positive finite number, got inf"),
    # the count noise, drawn in float64, came out as -inf
    ("unclipped_num_std", 1e308, r"unclipped_num_std=1e\+308 .*40 std.*float64"),
    ("min_clipbound", math.nan, "min_clipbound"),
    ("target_unclipped_quantile", math.inf, "target_unclipped_quantile"),
])
def test_clipping_options_that_are_not_finite_are_refused(name, value, match):
    """Refused by the constructor and by ``config.replace`` (the step keeps its config), naming the option."""
    clipping = "automatic" if name == "automatic_gamma" else "adaptive"

    def build(**options):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        if clipping == "adaptive":
            options = {"unclipped_num_std": 1.0, **options}
        step = compile_step(lambda x: model(x).pow(2).sum(), model, torch.optim.SGD(model.parameters(), lr=0.1),
                            max_grad_norm=1.0, noise_multiplier=1.0, clipping=clipping,
                            generator=torch.Generator().manual_seed(0), **options)
        return model, step

    with pytest.raises(DPConfigError, match=match):
        build(**{name: value})
    model, step = build()
    step(torch.randn(4, 3))
    config, before = step.config, [p.detach().clone() for p in model.parameters()]
    with pytest.raises(DPConfigError, match=match):
        step.config = step.config.replace(**{name: value})
    assert step.config == config and step.steps_taken == 1
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_adaptive_noise_multipliers_are_computed_without_overflow():
    """sigma_g = (sigma^-2 - (2 sigma_b)^-2)^-1/2 raised OverflowError for sigma below 1e-154 (sigma^-2 past
    Python's float), in the constructor's range check; it is computed as sigma / sqrt(1 - (sigma / 2 sigma_b)^2)."""
    config = DPConfig(1.0, 1e-200, clipping="adaptive", unclipped_num_std=1.0)
    assert config.gradient_noise_multiplier == 1e-200 and config.accounted_noise_multiplier == 1e-200
    config = DPConfig(1.0, 1.0, clipping="adaptive", unclipped_num_std=2.0)
    assert config.gradient_noise_multiplier == pytest.approx((1 - 1 / 16) ** -0.5, rel=1e-15)
    assert config.accounted_noise_multiplier == pytest.approx(1.0, rel=1e-15)


def test_distributed_without_a_process_group_is_refused():
    """Red team Q2: ``compile_step(..., distributed=True)`` with no process group raised torch's raw "Default
    process group has not been initialized"."""
    model = nn.Linear(4, 3)
    with pytest.raises(DPConfigError, match=r"distributed=True needs an initialized torch.distributed process "
                                            r"group.*Fix: call torch.distributed.init_process_group"):
        psg.compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.1),
                         max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4.0, distributed=True,
                         backend="eager")


def test_per_layer_bounds_of_the_wrong_count_are_refused_on_assignment():
    """Red team Q2: ``step.max_grad_norm = [0.1, 0.2, 0.3]`` for two groups was stored, and every later step was
    refused until it was assigned again (compile_step refuses the same list when it builds the step)."""
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    groups = [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
    step = psg.compile_step(lambda x, y: F.cross_entropy(model(x), y), model,
                            torch.optim.SGD(model.parameters(), lr=0.1), clipping="per_layer", clip_groups=groups,
                            max_grad_norm=[0.3, 0.4], noise_multiplier=1.0, expected_batch_size=8, backend="eager")
    with pytest.raises(DPConfigError, match=r"3 bounds in max_grad_norm for 2 groups"):
        step.max_grad_norm = [0.1, 0.2, 0.3]
    assert step.max_grad_norm == (0.3, 0.4)
    step(torch.randn(8, 5), torch.randint(0, 3, (8,)))
    assert step.steps_taken == 1


def _digits_like(n: int = 40):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


@pytest.mark.parametrize(("accountant", "target"), [("opacus-rdp", 0.05), ("prv", 1e-3), ("pld", 1e-3)])
def test_a_target_epsilon_out_of_the_calibrations_reach_is_refused_naming_it(accountant, target):
    """Red team R (F3): a small target raised the accounting library's own ``ValueError`` ("The privacy budget
    is too low.", a failed ``brentq`` bracket)."""
    model = nn.Linear(6, 3)
    with pytest.raises(DPConfigError, match=rf"target_epsilon={target} cannot be calibrated with "
                                            rf"accountant='{accountant}'.*Fix: a larger target_epsilon"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_digits_like(), batch_size=10),
                     lambda x, y: F.cross_entropy(model(x), y), target_epsilon=target, epochs=1,
                     accountant=accountant, backend="eager")


@pytest.mark.parametrize("rate", [1e-320, 1e-30, 2.0 ** -54])
def test_a_sampling_rate_whose_epoch_no_loader_can_count_is_refused(rate):
    """Red team R (F4): 1e-320 raised ``OverflowError`` in make_private (round of an infinite epoch), 1e-30 at
    ``len(private.data_loader)``."""
    model = nn.Linear(6, 3)
    with pytest.raises(DPConfigError, match=r"sample_rate=.* is below 1.11e-16 \(2\*\*-53\)"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_digits_like(), batch_size=10),
                     lambda x, y: F.cross_entropy(model(x), y), noise_multiplier=1.0, sample_rate=rate,
                     backend="eager")


def test_make_private_refuses_expected_batch_size_naming_who_sets_it():
    """Red team R (F8): it passed the unknown-keyword check and then raised Python's "got multiple values for
    keyword argument 'expected_batch_size'"."""
    model = nn.Linear(6, 3)
    with pytest.raises(DPConfigError, match="make_private sets the step's expected_batch_size itself"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_digits_like(), batch_size=10),
                     lambda x, y: F.cross_entropy(model(x), y), noise_multiplier=1.0, expected_batch_size=10.0,
                     backend="eager")


def test_a_gridded_accountant_below_its_smallest_noise_is_refused_before_training():
    """Red team R (F7): ``--sigma 0.005 --accountant pld`` trained a whole epoch before its first epsilon was
    refused; make_private refuses the pair before any step."""
    model = nn.Linear(6, 3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(DPConfigError, match=r"the pld accountant discretizes.*noise_multiplier=0.005"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_digits_like(), batch_size=10),
                     lambda x, y: F.cross_entropy(model(x), y), noise_multiplier=0.005, accountant="pld",
                     backend="eager")
    assert _untouched(model, before)


def test_a_second_make_private_on_a_trained_model_is_refused_and_one_on_an_untrained_one_replaces_it():
    """Red team R (F6): two trainings of one model each counted their own steps (the first's epsilon() read 0
    after four DP steps of the model through the second). A second make_private on a model or optimizer whose
    training took steps is refused; one whose training took none (a notebook cell run again) replaces it, and
    the first no longer steps."""
    model = nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def private():
        return make_private(model, opt, DataLoader(_digits_like(), batch_size=10),
                            lambda x, y: F.cross_entropy(model(x), y), noise_multiplier=1.0, backend="eager")

    first = private()
    second = private()  # the first took no step: replaced
    batch = next(iter(second.data_loader))
    with pytest.raises(DPConfigError, match="replaced by a later make_private on the same model"):
        first.step(*batch)
    with pytest.raises(DPConfigError, match="replaced by a later make_private"):
        first.dp_step(*batch)
    assert first.steps == 0
    second.step(*batch)
    with pytest.raises(DPConfigError, match=r"trained by an earlier make_private, whose accountant counts its 1 "
                                            r"steps.*Fix: go on with the first"):
        private()
    other = nn.Linear(6, 3)  # another model with the same optimizer: refused as well
    with pytest.raises(DPConfigError, match="trained by an earlier make_private"):
        make_private(other, opt, DataLoader(_digits_like(), batch_size=10),
                     lambda x, y: F.cross_entropy(other(x), y), noise_multiplier=1.0, backend="eager")
    wrapper = nn.Sequential(model)  # the same parameters behind another module and optimizer: refused too
    with pytest.raises(DPConfigError, match="its parameters are trained by an earlier make_private"):
        make_private(wrapper, torch.optim.SGD(wrapper.parameters(), lr=0.1), DataLoader(_digits_like(), batch_size=10),
                     lambda x, y: F.cross_entropy(wrapper(x), y), noise_multiplier=1.0, backend="eager")
    second.step(*batch)
    assert second.steps == 2
