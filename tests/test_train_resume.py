"""Save and resume: a run interrupted after k steps and resumed in fresh objects equals the uninterrupted run bit
for bit (seeded noise, seeded Poisson sampling), with the same accountant history and epsilon."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from compiled_psg import compile_step
from compiled_psg._errors import DPConfigError
from compiled_psg._train.private import make_private
from compiled_psg._train.sampling import PoissonBatchSampler
from compiled_psg._train.schedulers import ExponentialNoise

EPOCHS = 2


def build(seed: int = 0):
    """Everything built the same way in every process: model, optimizer, make_private, noise scheduler."""
    torch.manual_seed(seed)  # the model's initialization: overwritten on resume anyway
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    data_gen = torch.Generator().manual_seed(123)
    data = TensorDataset(torch.randn(60, 4, generator=data_gen), torch.randint(0, 3, (60,), generator=data_gen))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    private = make_private(model, opt, DataLoader(data, batch_size=10), lambda x, y: F.cross_entropy(model(x), y),
                           noise_multiplier=1.5, max_grad_norm=0.5, backend="eager",
                           generator=torch.Generator().manual_seed(7))
    return model, private, ExponentialNoise(private, gamma=0.9)


def train(private, scheduler, epochs, stop_after=None):
    """Epoch loop; returns early (mid-epoch) after ``stop_after`` steps of this call."""
    taken = 0
    for _ in range(epochs):
        for x, y in private.data_loader:
            private.step(x, y)
            taken += 1
            if taken == stop_after:
                return
        scheduler.step()


@pytest.fixture(scope="module")
def uninterrupted():
    model, private, scheduler = build()
    train(private, scheduler, EPOCHS)
    return model, private


@pytest.mark.parametrize("k", [4, 6])  # mid-epoch, and exactly at the end of the first epoch
def test_interrupted_and_resumed_run_is_bit_identical(k, tmp_path, uninterrupted):
    model, private = uninterrupted

    model_a, private_a, scheduler_a = build()
    train(private_a, scheduler_a, EPOCHS, stop_after=k)
    path = tmp_path / "checkpoint.pt"
    torch.save({"training": private_a.state_dict(), "scheduler": scheduler_a.state_dict()}, path)
    del model_a, private_a, scheduler_a

    model_b, private_b, scheduler_b = build(seed=1)  # fresh objects, another initialization
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), model_b.parameters(), strict=True))
    checkpoint = torch.load(path)
    private_b.load_state_dict(checkpoint["training"])
    scheduler_b.load_state_dict(checkpoint["scheduler"])
    assert private_b.accountant.steps == k and private_b.dp_step.steps_taken == k
    # finish the interrupted epoch (the loader resumes it), then the remaining epochs
    first_epoch_rest = 6 - k
    if first_epoch_rest:
        for x, y in private_b.data_loader:
            private_b.step(x, y)
        scheduler_b.step()
        train(private_b, scheduler_b, EPOCHS - 1)
    else:
        scheduler_b.step()  # the interrupted loop stopped before its end-of-epoch scheduler step
        train(private_b, scheduler_b, EPOCHS - 1)

    for p, q in zip(model.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(p, q)
    for s, t in zip(private.optimizer.state.values(), private_b.optimizer.state.values(), strict=True):
        assert all(torch.equal(s[name], t[name]) for name in s)
    assert private_b.accountant.history == private.accountant.history
    assert len(private.accountant.history) == EPOCHS  # one sigma per epoch, as scheduled
    assert private_b.epsilon() == private.epsilon()


def test_sampler_resumes_the_epoch():
    sampler = PoissonBatchSampler(50, 0.2, generator=torch.Generator().manual_seed(0))
    first, second = list(sampler), list(sampler)
    again = PoissonBatchSampler(50, 0.2, generator=torch.Generator().manual_seed(0))
    iterator = iter(again)
    head = [next(iterator) for _ in range(2)]
    state = again.state_dict()
    resumed = PoissonBatchSampler(50, 0.2, generator=torch.Generator().manual_seed(99))
    resumed.load_state_dict(state)
    assert head + list(resumed) == first and list(resumed) == second
    secure = PoissonBatchSampler(50, 0.2, secure=True)
    secure.load_state_dict({"epoch_state": None, "drawn": 3})
    assert len(list(secure)) == len(secure) - 3  # the rest of the epoch, freshly drawn


def test_step_state_dict_restores_settings_and_refuses_a_mismatch():
    model = nn.Linear(3, 2)
    step = compile_step(lambda x: model(x).sum(), model, torch.optim.SGD(model.parameters(), lr=0.1),
                        max_grad_norm=1.0, noise_multiplier=1.0, backend="eager",
                        generator=torch.Generator().manual_seed(0))
    step(torch.randn(4, 3))
    step.noise_multiplier, step.max_grad_norm = 0.5, 2.0
    state = step.state_dict()
    other = nn.Linear(3, 2)
    fresh = compile_step(lambda x: other(x).sum(), other, torch.optim.SGD(other.parameters(), lr=0.1),
                         max_grad_norm=1.0, noise_multiplier=1.0, backend="eager",
                         generator=torch.Generator().manual_seed(0))
    fresh.load_state_dict(state)
    assert (fresh.noise_multiplier, fresh.max_grad_norm, fresh.steps_taken) == (0.5, 2.0, 1)
    assert torch.equal(other.weight, model.weight)
    unseeded = compile_step(lambda x: other(x).sum(), other, torch.optim.SGD(other.parameters(), lr=0.1),
                            max_grad_norm=1.0, noise_multiplier=1.0, backend="eager")
    with pytest.raises(DPConfigError, match="generator"):
        unseeded.load_state_dict(state)


@pytest.mark.parametrize("mismatch", ["wider_model", "other_groups", "other_optimizer"])
def test_a_state_of_another_model_or_optimizer_loads_nothing(mismatch):
    """``nn.Module.load_state_dict`` copies the entries that fit before it raises: everything is checked first, so
    a refused load leaves the settings, the parameters, the optimizer and the generator as they were. A state
    saved with Adam loaded into SGD's step raised torch's KeyError after loading the parameters."""
    def built(width, groups, adam=False):
        torch.manual_seed(width)
        model = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3))
        params = [{"params": list(m.parameters())} for m in (model[0], model[2])] if groups else model.parameters()
        optimizer = torch.optim.Adam(params, lr=0.1) if adam else torch.optim.SGD(params, lr=0.1, momentum=0.9)
        step = compile_step(lambda x: model(x).pow(2).sum(), model, optimizer,
                            max_grad_norm=1.0, noise_multiplier=1.0, backend="eager",
                            generator=torch.Generator().manual_seed(0))
        step(torch.randn(5, 4))
        return model, step

    _, saved = built(16 if mismatch == "wider_model" else 8, groups=mismatch == "other_groups",
                     adam=mismatch == "other_optimizer")
    saved.noise_multiplier, saved.max_grad_norm = 3.0, 0.5
    state = saved.state_dict()
    model, step = built(8, groups=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer_before, generator_before = repr(step.optimizer.state_dict()), step.noise.generator.get_state()
    with pytest.raises(DPConfigError, match="Nothing was loaded"):
        step.load_state_dict(state)
    assert (step.noise_multiplier, step.max_grad_norm, step.steps_taken) == (1.0, 1.0, 1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert repr(step.optimizer.state_dict()) == optimizer_before
    assert torch.equal(step.noise.generator.get_state(), generator_before)


def test_copying_or_pickling_a_training_points_to_state_dict():
    """copy.deepcopy of a step or a PrivateTraining raised torch's "Cannot access data pointer of Tensor" and
    pickle an AttributeError on a lambda; both are a DPConfigError saying to save state_dict() instead."""
    model = nn.Linear(4, 3)
    data = TensorDataset(torch.randn(12, 4), torch.randint(0, 3, (12,)))
    private = make_private(model, torch.optim.Adam(model.parameters()), DataLoader(data, batch_size=4),
                           lambda x, y: F.cross_entropy(model(x), y), noise_multiplier=1.0, backend="eager")
    private.step(*data[:4])
    for training in (private, private.dp_step):
        for copy_it in (copy.deepcopy, pickle.dumps, copy.copy):
            with pytest.raises(DPConfigError, match=f"a {type(training).__name__} cannot be copied .* state_dict"):
                copy_it(training)
    assert private.steps == 1


# ----- the whole config, and the settings fixed when a step is built ------------------------------------------


def _mechanism_step(clipping: str = "flat", bound=1.0, seed: int = 0, backend: str = "eager", **kw):
    """A two-layer MLP's step with seeded noise; ``seed`` its initialization."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if clipping == "adaptive":
        kw.setdefault("unclipped_num_std", 2.0)
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, optimizer, max_grad_norm=bound,
                        noise_multiplier=1.0, expected_batch_size=8, clipping=clipping, backend=backend,
                        generator=torch.Generator().manual_seed(0), **kw)
    return model, step


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)) for _ in range(n)]


GROUPS = [["0.weight", "0.bias"], ["2.weight", "2.bias"]]


@pytest.mark.parametrize(("saved", "live", "setting"), [
    (dict(clipping="flat"), dict(clipping="per_layer", bound=0.3), "clipping: saved 'flat', this step 'per_layer'"),
    (dict(clipping="flat"), dict(clipping="automatic", bound=0.3), "clipping: saved 'flat', this step 'automatic'"),
    (dict(clipping="flat"), dict(clipping="adaptive", bound=0.3), "clipping: saved 'flat', this step 'adaptive'"),
    (dict(clipping="per_layer", bound=[0.5] * 4), dict(clipping="flat"),
     "clipping: saved 'per_layer', this step 'flat'"),
    (dict(loss_reduction="sum"), dict(), "loss_reduction: saved 'sum', this step 'mean'"),
    (dict(clipping="per_layer", clip_groups=GROUPS), dict(clipping="per_layer"),
     r"clip_groups: saved \(\('0.weight', '0.bias'\), \('2.weight', '2.bias'\)\), this step None"),
])
def test_a_state_of_another_clipping_mechanism_loads_nothing(saved, live, setting):
    """The clipping mode, the loss reduction and the clip groups define the mechanism and are fixed when a step is
    built: a state saved by a step built otherwise is refused, naming the saved and the live setting (a flat
    state loaded silently into a per_layer step, whose C then meant C / sqrt(K) per group; a per_layer state into
    a flat step was refused as 'a list of bounds needs clipping=per_layer'). Nothing changes."""
    _, source = _mechanism_step(**saved)
    source(*_batches(1)[0])
    state = source.state_dict()
    model, step = _mechanism_step(seed=1, **live)
    step(*_batches(1)[0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config, optimizer_before = step.config, repr(step.optimizer.state_dict())
    generator_before = step.noise.generator.get_state()
    with pytest.raises(DPConfigError, match=f"built otherwise.*{setting}.*Nothing was loaded"):
        step.load_state_dict(state)
    assert step.config == config and step.steps_taken == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert repr(step.optimizer.state_dict()) == optimizer_before
    assert torch.equal(step.noise.generator.get_state(), generator_before)


def test_a_state_without_the_mechanism_settings_loads_nothing():
    """A state whose config lacks the settings that define the mechanism cannot be checked against this step."""
    model, step = _mechanism_step()
    state = step.state_dict()
    state["config"] = {k: state["config"][k] for k in ("max_grad_norm", "noise_multiplier", "expected_batch_size")}
    with pytest.raises(DPConfigError, match=r"has no \[.*'clip_groups', .*'clipping', .*Nothing was loaded"):
        step.load_state_dict(state)


@pytest.mark.parametrize(("clipping", "changes"), [
    ("adaptive", dict(target_unclipped_quantile=0.9, clipbound_learning_rate=1.0, unclipped_num_std=3.0,
                      min_clipbound=0.05, max_clipbound=40.0, memory_budget=1e6)),
    ("automatic", dict(automatic_gamma=0.5, max_grad_norm=0.7, expected_batch_size=6.0)),
])
def test_settings_changed_during_the_run_are_resumed(clipping, changes):
    """``step.config = step.config.replace(...)`` between steps (the documented way to change the clipping
    variants' options) is part of the saved state: the resumed run equals the uninterrupted one bit for bit
    (the resumed adaptive run went back to the options the step was built with: final C 0.94 instead of 2.02)."""
    batches = _batches(6)
    model, step = _mechanism_step(clipping, bound=0.5)
    for batch in batches[:2]:
        step(*batch)
    step.config = step.config.replace(**changes)
    buffer = io.BytesIO()
    torch.save(step.state_dict(), buffer)
    for batch in batches[2:]:
        step(*batch)
    resumed_model, resumed = _mechanism_step(clipping, bound=0.5, seed=1)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer))
    for batch in batches[2:]:
        resumed(*batch)
    assert resumed.config == step.config
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.inductor
def test_adaptive_options_changed_during_the_run_are_resumed_inductor():
    batches = _batches(5)
    model, step = _mechanism_step("adaptive", bound=0.5, backend="inductor")
    for batch in batches[:2]:
        step(*batch)
    step.config = step.config.replace(target_unclipped_quantile=0.9, clipbound_learning_rate=1.0)
    state = copy.deepcopy(step.state_dict())
    for batch in batches[2:]:
        step(*batch)
    resumed_model, resumed = _mechanism_step("adaptive", bound=0.5, seed=1, backend="inductor")
    resumed.load_state_dict(state)
    for batch in batches[2:]:
        resumed(*batch)
    assert resumed.max_grad_norm == step.max_grad_norm
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_stalled_adaptive_bound_is_resumed():
    """Adaptive clipping that moved its bound past the noise's range refuses the next step until the user sets a
    bound; the saved state keeps that (the resumed step took the step the saved one refused)."""
    _, step = _mechanism_step("adaptive", bound=0.5, target_unclipped_quantile=1.0, clipbound_learning_rate=1e4)
    x, y = _batches(1)[0]
    step(x, y)
    with pytest.raises(DPConfigError, match="moved the clip bound to inf") as stalled:
        step(x, y)
    state = step.state_dict()
    model, resumed = _mechanism_step("adaptive", bound=0.5, target_unclipped_quantile=1.0,
                                     clipbound_learning_rate=1e4, seed=1)
    resumed.load_state_dict(state)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(DPConfigError) as again:
        resumed(x, y)
    assert str(again.value) == str(stalled.value) and resumed.steps_taken == 1
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    resumed.max_grad_norm = 0.5  # the user's bound: the training goes on
    resumed(x, y)
    assert resumed.steps_taken == 2
