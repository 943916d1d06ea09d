"""Save and resume: a run interrupted after k steps and resumed in fresh objects equals the uninterrupted run bit
for bit (seeded noise, seeded Poisson sampling), with the same accountant history and epsilon."""

from __future__ import annotations

import copy
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
