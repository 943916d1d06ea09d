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
from compiled_psg._errors import BatchInputError, DPConfigError
from compiled_psg._train.private import make_private
from compiled_psg._train.sampling import PoissonBatchSampler, poisson_loader
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
    secure.load_state_dict({"epoch_state": None, "drawn": 3, "sample_rate": 0.2, "num_samples": 50})
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


@pytest.mark.parametrize("mismatch", ["wider_model", "other_groups", "other_optimizer", "adam_into_adamax",
                                      "other_order", "other_dtype"])
def test_a_state_of_another_model_or_optimizer_loads_nothing(mismatch):
    """``nn.Module.load_state_dict`` copies the entries that fit before it raises: everything is checked first, so
    a refused load leaves the settings, the parameters, the optimizer and the generator as they were. A state
    saved with Adam loaded into SGD's step raised torch's KeyError after loading the parameters; red team N:
    Adam's into Adamax was loaded (KeyError 'exp_inf' at every later step), and a state over the parameters in
    another order was loaded (a raw size mismatch at the next step; equal shapes trained on other moments), and a
    float64 run's state was cast into a float32 model (the run went on in another precision and noise)."""
    def built(width, groups, adam=False, adamax=False, reverse=False, dtype=torch.float32):
        torch.manual_seed(width)
        model = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3)).to(dtype)
        params = [{"params": list(m.parameters())} for m in (model[0], model[2])] if groups else model.parameters()
        params = list(params)[::-1] if reverse else params
        optimizer = (torch.optim.Adam(params, lr=0.1) if adam else torch.optim.Adamax(params, lr=0.1) if adamax
                     else torch.optim.SGD(params, lr=0.1, momentum=0.9))
        step = compile_step(lambda x: model(x).pow(2).sum(), model, optimizer,
                            max_grad_norm=1.0, noise_multiplier=1.0, backend="eager",
                            generator=torch.Generator().manual_seed(0))
        step(torch.randn(5, 4, dtype=dtype))
        return model, step

    _, saved = built(16 if mismatch == "wider_model" else 8, groups=mismatch == "other_groups",
                     adam=mismatch in ("other_optimizer", "adam_into_adamax"),
                     dtype=torch.float64 if mismatch == "other_dtype" else torch.float32)
    saved.noise_multiplier, saved.max_grad_norm = 3.0, 0.5
    state = saved.state_dict()
    model, step = built(8, groups=False, adamax=mismatch == "adam_into_adamax", reverse=mismatch == "other_order")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer_before, generator_before = repr(step.optimizer.state_dict()), step.noise.generator.get_state()
    with pytest.raises(DPConfigError, match="Nothing was loaded") as refused:
        step.load_state_dict(state)
    if mismatch == "other_dtype":
        assert "0.weight: saved torch.float64, model torch.float32" in str(refused.value)
    assert (step.noise_multiplier, step.max_grad_norm, step.steps_taken) == (1.0, 1.0, 1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert repr(step.optimizer.state_dict()) == optimizer_before
    assert torch.equal(step.noise.generator.get_state(), generator_before)


@pytest.mark.parametrize("corruption", ["generator_bytes", "generator_dtype", "model_entry", "optimizer_state",
                                        "owner_rule", "moment_shape", "lr_string",
                                        "sampler_bytes"])
def test_a_corrupted_state_loads_nothing(corruption):
    """Red team O: a state whose generator entry had the right shape but bytes torch refuses, or a model entry
    that is no tensor, passed the checks and raised torch's raw error after the model (and the settings) were
    loaded: a "resume, else start afresh" loop trained on the saved weights with epsilon counted from 0. A
    momentum of another shape, a string lr, or a sampler's generator bytes loaded, and the next step or
    batch raised torch's raw error. A state breaking the PrivateTraining's rules (no noise) was refused after the
    optimizer's state was loaded. Every entry is checked before anything is loaded."""
    data = TensorDataset(torch.randn(40, 6), torch.randint(0, 3, (40,)))

    def built(seed):
        torch.manual_seed(seed)
        model = nn.Linear(6, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, make_private(model, optimizer, DataLoader(data, batch_size=10),
                                   lambda x, y: F.cross_entropy(model(x), y), noise_multiplier=1.0,
                                   backend="eager", generator=torch.Generator().manual_seed(seed))

    _, saved = built(0)
    for x, y in saved.data_loader:
        saved.step(x, y)
    saved.dp_step.noise_multiplier = 2.0
    state = copy.deepcopy(saved.state_dict())
    step_state = state["step"]
    if corruption == "generator_bytes":
        step_state["generator"].fill_(255)
    elif corruption == "generator_dtype":
        step_state["generator"] = step_state["generator"].float()
    elif corruption == "model_entry":
        step_state["model"]["bias"] = [0.0, 0.0, 0.0]
    elif corruption == "optimizer_state":
        step_state["optimizer"]["state"] = [0.0]
    elif corruption == "owner_rule":
        step_state["config"]["noise_multiplier"] = 0.0
    elif corruption == "moment_shape":
        step_state["optimizer"]["state"][0]["momentum_buffer"] = torch.zeros(2)
    elif corruption == "lr_string":
        step_state["optimizer"]["param_groups"][0]["lr"] = "0.1"
    else:
        state["sampler"]["epoch_state"].fill_(255)
    model, private = built(1)
    sampler_before = repr(private.data_loader.batch_sampler.state_dict())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    generator_before = private.dp_step.noise.generator.get_state()
    targets = [(private, state)] + ([] if corruption == "sampler_bytes" else [(private.dp_step, step_state)])
    for target, whole in targets:
        with pytest.raises(DPConfigError, match="Nothing was loaded|needs noise_multiplier > 0"):
            target.load_state_dict(whole)
        assert repr(private.data_loader.batch_sampler.state_dict()) == sampler_before
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert (private.steps, private.epsilon(), private.dp_step.noise_multiplier) == (0, 0.0, 1.0)
        assert not private.dp_step.optimizer.state
        assert torch.equal(private.dp_step.noise.generator.get_state(), generator_before)


_OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), "Adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01), "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
    "Adagrad": lambda p: torch.optim.Adagrad(p), "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.01), "Adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.05, t0=2), "Rprop": lambda p: torch.optim.Rprop(p),
    "Adadelta": lambda p: torch.optim.Adadelta(p)}


@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_every_torch_optimizer_resumes_bit_for_bit_and_refuses_a_corrupted_moment(name):
    """Red team Q2: a valid NAdam state was refused ("Tensor.item() cannot be called on meta tensors": the trial
    step over meta tensors could not read its mu_product); ASGD's corrupted state (a moment of another shape) was
    not tried and loaded, and its next step raised torch's raw error; ASGD resumed 6e-10 off the uninterrupted run
    (torch's loader casts its float32 eta and mu to the float64 parameters' dtype)."""
    def built(seed):
        torch.manual_seed(seed)
        model = nn.Linear(5, 3).double()
        step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, _OPTIMIZERS[name](
            model.parameters()), max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8, backend="eager",
            generator=torch.Generator().manual_seed(0))
        return model, step

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 5, dtype=torch.float64, generator=g), torch.randint(0, 3, (8,), generator=g))
               for _ in range(5)]
    whole, uninterrupted = built(0)
    for b in batches:
        uninterrupted(*b)
    _, first = built(0)
    for b in batches[:2]:
        first(*b)
    state = copy.deepcopy(first.state_dict())
    resumed_model, resumed = built(7)
    resumed.load_state_dict(copy.deepcopy(state))
    for b in batches[2:]:
        resumed(*b)
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed_model.parameters(), strict=True))

    moments = state["optimizer"]["state"][0]
    moment = next(k for k, v in moments.items() if isinstance(v, torch.Tensor) and v.dim() == 2)
    moments[moment] = torch.zeros(13, dtype=torch.float64)
    fresh_model, fresh = built(3)
    before = [p.detach().clone() for p in fresh_model.parameters()]
    optimizer_before = repr(fresh.optimizer.state_dict())  # Adagrad makes its state when built
    with pytest.raises(DPConfigError, match=rf"the saved optimizer state does not step this {name}.*Nothing was "
                                            r"loaded"):
        fresh.load_state_dict(state)
    assert repr(fresh.optimizer.state_dict()) == optimizer_before and fresh.steps_taken == 0
    assert all(torch.equal(a, b) for a, b in zip(before, fresh_model.parameters(), strict=True))


def test_a_loaded_state_kept_in_memory_is_not_written_by_the_training():
    """Red team O: torch's optimizer loader keeps the saved tensors (same device and dtype), so training after
    ``load_state_dict(best)`` wrote its momentum into ``best``; loading ``best`` again resumed the saved weights
    with a later step's momentum."""
    model, private, _ = build()
    batches = iter(private.data_loader)
    private.step(*next(batches))
    best = copy.deepcopy(private.state_dict())
    saved_momentum = copy.deepcopy(best["step"]["optimizer"]["state"])
    _, resumed, _ = build(seed=1)
    resumed.load_state_dict(best)
    for x, y in resumed.data_loader:
        resumed.step(x, y)
    for k, per in saved_momentum.items():
        assert all(torch.equal(v, best["step"]["optimizer"]["state"][k][name]) for name, v in per.items())


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


def _snapshot(private) -> dict:
    """Everything a load could change, copied: a refused load must leave all of it as it was."""
    sampler = private.data_loader.batch_sampler if private.poisson_sampling else None
    return {"model": copy.deepcopy(private.model.state_dict()),
            "optimizer": copy.deepcopy(private.optimizer.state_dict()),
            "history": list(private.accountant.history), "steps": private.dp_step.steps_taken,
            "config": (private.noise_multiplier, private.max_grad_norm),
            "generator": private.dp_step.noise.generator.get_state(),
            "sampler": None if sampler is None else copy.deepcopy(sampler.state_dict()),
            "sampler_generator": None if sampler is None else sampler.generator.get_state()}


def _assert_same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert repr(a["optimizer"]) == repr(b["optimizer"])
    assert (a["history"], a["steps"], a["config"]) == (b["history"], b["steps"], b["config"])
    assert torch.equal(a["generator"], b["generator"])
    if a["sampler"] is None:
        assert b["sampler"] is None
    else:
        assert a["sampler"]["drawn"] == b["sampler"]["drawn"]
        assert torch.equal(a["sampler"]["epoch_state"], b["sampler"]["epoch_state"])
        assert torch.equal(a["sampler_generator"], b["sampler_generator"])


@pytest.mark.parametrize("k", [4, 6])  # mid-epoch, and exactly at the end of the first epoch
def test_a_state_saved_right_after_a_load_resumes_where_the_loaded_one_does(k, tmp_path, uninterrupted):
    """A checkpoint saved after a load and before the loader was iterated (a hook at the start of a job) held
    drawn=0 and the fresh generator's state: resuming from it repeated the epoch's first batches, the same Poisson
    coins used twice while the accountant counted them as independent. It is the loaded state, however often it
    is saved."""
    model, private = uninterrupted
    _, private_a, scheduler_a = build()
    train(private_a, scheduler_a, EPOCHS, stop_after=k)
    first = private_a.state_dict()
    torch.save({"training": first, "scheduler": scheduler_a.state_dict()}, tmp_path / "first.pt")

    _, private_b, scheduler_b = build(seed=1)
    checkpoint = torch.load(tmp_path / "first.pt")
    private_b.load_state_dict(checkpoint["training"])
    again, twice = private_b.state_dict(), private_b.state_dict()
    for state in (again, twice):
        assert state["sampler"]["drawn"] == first["sampler"]["drawn"] == k % 6
        assert torch.equal(state["sampler"]["epoch_state"], first["sampler"]["epoch_state"])
    torch.save({"training": again, "scheduler": checkpoint["scheduler"]}, tmp_path / "again.pt")

    model_c, private_c, scheduler_c = build(seed=2)
    checkpoint = torch.load(tmp_path / "again.pt")
    private_c.load_state_dict(checkpoint["training"])
    scheduler_c.load_state_dict(checkpoint["scheduler"])
    if k < 6:
        for x, y in private_c.data_loader:
            private_c.step(x, y)
    scheduler_c.step()
    train(private_c, scheduler_c, EPOCHS - 1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model_c.parameters(), strict=True))
    assert private_c.accountant.history == private.accountant.history


def test_a_sampler_state_round_trips_through_load_and_save():
    """At every position (before an epoch, in it, at its end, after a load, saved twice) the sampler's state
    loaded into a fresh sampler and saved again is the same state, and the batches that follow are the same."""
    def fresh(seed=99):
        return PoissonBatchSampler(40, 0.25, generator=torch.Generator().manual_seed(seed))

    sampler = fresh(0)
    iterator = iter(sampler)
    positions = [sampler.state_dict()]
    for _ in range(4):
        next(iterator)
        positions.append(sampler.state_dict())
    for state in positions:
        resumed = fresh()
        resumed.load_state_dict(state)
        for saved in (resumed.state_dict(), resumed.state_dict()):
            assert saved["drawn"] == state["drawn"] and torch.equal(saved["epoch_state"], state["epoch_state"])
        replay, reference = fresh(), fresh(1)
        replay.load_state_dict(resumed.state_dict())
        reference.load_state_dict(state)
        assert list(replay) == list(reference) and list(replay) == list(reference)
    secure = PoissonBatchSampler(40, 0.25, secure=True)
    iterator = iter(secure)
    next(iterator), next(iterator)
    assert secure.state_dict() == {"epoch_state": None, "drawn": 2, "sample_rate": 0.25,
                                    "num_samples": 40}  # it said drawn=0: a whole epoch again
    resumed = PoissonBatchSampler(40, 0.25, secure=True)
    resumed.load_state_dict(secure.state_dict())
    assert resumed.state_dict() == secure.state_dict() and len(list(resumed)) == 2


def test_a_sampler_state_it_cannot_resume_is_refused():
    seeded = PoissonBatchSampler(40, 0.25, generator=torch.Generator().manual_seed(0))
    secure = PoissonBatchSampler(40, 0.25, secure=True)
    with pytest.raises(DPConfigError, match=r"from a generator, this one from os.urandom"):
        secure.load_state_dict(seeded.state_dict())
    with pytest.raises(DPConfigError, match=r"from os.urandom \(secure_rng=True\), this one from a generator"):
        seeded.load_state_dict(secure.state_dict())
    with pytest.raises(DPConfigError, match="had drawn 4 batches of an epoch of 4"):
        seeded.load_state_dict({**seeded.state_dict(), "drawn": 4})
    assert seeded.state_dict()["drawn"] == 0 and seeded._resume is None


def _seeded(num_samples: int = 40, rate: float = 0.25, seed: int = 0) -> PoissonBatchSampler:
    return PoissonBatchSampler(num_samples, rate, generator=torch.Generator().manual_seed(seed))


def _untouched(sampler: PoissonBatchSampler, seed: int) -> bool:
    """Nothing was loaded into ``sampler``: it draws the epochs a fresh sampler of its seed draws."""
    fresh = _seeded(sampler.num_samples, sampler.sample_rate, seed)
    return sampler._resume is None and sampler.state_dict()["drawn"] == 0 and list(sampler) == list(fresh)


def test_a_sampler_state_records_its_rate_and_dataset_size():
    sampler = _seeded()
    next(iter(sampler))
    state = sampler.state_dict()
    assert state["sample_rate"] == 0.25 and state["num_samples"] == 40 and state["drawn"] == 1
    secure = PoissonBatchSampler(40, 0.25, secure=True)
    assert secure.state_dict() == {"epoch_state": None, "drawn": 0, "sample_rate": 0.25, "num_samples": 40}


@pytest.mark.parametrize(("num_samples", "rate"), [(40, 0.2), (50, 0.25), (50, 0.2)],
                         ids=["another rate", "another dataset size", "both"])
def test_a_sampler_state_of_another_rate_or_dataset_size_is_refused_naming_both(num_samples, rate):
    """The saved position is a count of batches drawn from the saved generator state at the saved rate over the
    saved dataset: replayed at another rate or over another dataset size it yields other batches than the saved
    run's, and its accounting assumed the saved rate. It loaded silently."""
    saved = _seeded()
    iterator = iter(saved)
    next(iterator), next(iterator)
    other = _seeded(num_samples, rate, seed=3)
    with pytest.raises(DPConfigError, match=rf"saved Poisson sampler drew from 40 examples at sample_rate 0\.25, "
                                            rf"this one from {num_samples} examples at sample_rate {rate}.*Nothing "
                                            r"was loaded. Fix: build the loader"):
        other.load_state_dict(saved.state_dict())
    assert _untouched(other, seed=3)


def test_a_poisson_loader_over_another_dataset_refuses_the_state():
    small = TensorDataset(torch.randn(40, 2))
    loader = poisson_loader(small, 0.25, generator=torch.Generator().manual_seed(0))
    next(iter(loader))
    bigger = poisson_loader(TensorDataset(torch.randn(80, 2)), 0.25, generator=torch.Generator().manual_seed(0))
    with pytest.raises(DPConfigError, match=r"from 40 examples at sample_rate 0\.25, this one from 80 examples"):
        bigger.batch_sampler.load_state_dict(loader.batch_sampler.state_dict())
    assert bigger.batch_sampler._resume is None


def test_a_sampler_state_without_its_rate_is_refused():
    """A state of two keys, ``{"epoch_state", "drawn"}``, cannot show that it was drawn at this rate over this
    dataset: refused, naming what it lacks and how to add it, as a step state without the settings that define
    the mechanism is. With them added, it resumes the saved position."""
    saved = _seeded()
    next(iter(saved))
    state = saved.state_dict()
    old = {k: v for k, v in state.items() if k in ("epoch_state", "drawn")}
    sampler = _seeded(seed=3)
    with pytest.raises(DPConfigError, match=r"records no sample_rate or num_samples.*Nothing was loaded. Fix: .*"
                                            r"state.update\(sample_rate=0\.25, num_samples=40\)"):
        sampler.load_state_dict(old)
    assert _untouched(sampler, seed=3)
    old.update(sample_rate=0.25, num_samples=40)  # the fix the message gives: the saved run's values
    sampler.load_state_dict(old)
    reference = _seeded(seed=9)
    reference.load_state_dict(state)
    assert list(sampler) == list(reference)


def test_a_training_over_another_dataset_size_refuses_the_sampler_state():
    """Same sampling rate (batch 10 of 60, batch 20 of 120), another dataset: the saved position's batches are
    indices into 60 examples. The training's check of its dataset size refuses it first, naming both sizes (the
    sampler's own check, for ``poisson_loader`` alone, is tested above)."""
    model, private, _ = build()
    next(iter(private.data_loader))
    state = copy.deepcopy(private.state_dict())
    torch.manual_seed(0)
    model_b = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    data = TensorDataset(torch.randn(120, 4), torch.randint(0, 3, (120,)))
    private_b = make_private(model_b, torch.optim.Adam(model_b.parameters(), lr=0.01), DataLoader(data, batch_size=20),
                             lambda x, y: F.cross_entropy(model_b(x), y), noise_multiplier=1.5, max_grad_norm=0.5,
                             backend="eager", generator=torch.Generator().manual_seed(7))
    assert private_b.sample_rate == private.sample_rate
    before = [p.detach().clone() for p in model_b.parameters()]
    with pytest.raises(DPConfigError, match=r"dataset of 60 samples.*120"):
        private_b.load_state_dict(state)
    assert all(torch.equal(a, p) for a, p in zip(before, model_b.parameters(), strict=True))
    assert private_b.data_loader.batch_sampler._resume is None and private_b.steps == 0


def test_an_in_memory_state_of_an_earlier_step_is_refused():
    """``best = private.state_dict()`` kept in memory follows the training (its tensors are the live ones):
    loading it after 5 more steps set the accountant and the step count back to 3 while the weights and Adam's
    moments stayed those after 8 steps, so epsilon covered 3 steps of a model trained for 8. Refused, changing
    nothing; a deep copy is a rollback past released steps there, refused too, and resumes in a fresh training."""
    model, private, _ = build()
    batches = iter(private.data_loader)
    for _ in range(3):
        private.step(*next(batches))
    best, kept = private.state_dict(), copy.deepcopy(private.state_dict())
    weights_at_best = [p.detach().clone() for p in model.parameters()]
    private.load_state_dict(private.state_dict())  # the live state at its own step: nothing to refuse
    for _ in range(2):
        private.step(*next(batches))
    before = _snapshot(private)
    with pytest.raises(DPConfigError, match=r"saved at step 3 but holds the live model's and optimizer's tensors.*"
                                            r"after step 5.*Nothing was loaded.*copy.deepcopy\(private.state_dict"):
        private.load_state_dict(best)
    _assert_same(before, _snapshot(private))
    with pytest.raises(DPConfigError, match="belongs to a PrivateTraining, whose accountant"):
        private.dp_step.load_state_dict(kept["step"])  # the accountant's history would stay this run's
    _assert_same(before, _snapshot(private))
    # a copy of step 3 into the training that released steps 4 and 5: a rollback past released updates (epsilon
    # would forget them, and the seeded generator would draw their noise again), refused
    with pytest.raises(DPConfigError, match=r"reached step 5 \(by its own steps or by a load\), and the state is of "
                                            r"step 3: .*Nothing was loaded"):
        private.load_state_dict(kept)
    _assert_same(before, _snapshot(private))
    fresh_model, fresh, _ = build()  # a training built afresh resumes the copy
    fresh.load_state_dict(kept)
    assert fresh.steps == fresh.dp_step.steps_taken == 3
    assert all(torch.equal(p, q) for p, q in zip(weights_at_best, fresh_model.parameters(), strict=True))


@pytest.mark.parametrize("saved_poisson", [True, False])
def test_a_state_of_the_other_sampling_is_refused(saved_poisson):
    """A poisson_sampling=True state loaded into a poisson_sampling=False training (or the reverse) was accepted,
    the sampler's position ignored."""
    def built(poisson):
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        data = TensorDataset(torch.randn(30, 4), torch.randint(0, 3, (30,)))
        return make_private(model, torch.optim.Adam(model.parameters(), lr=0.01), DataLoader(data, batch_size=10),
                            lambda x, y: F.cross_entropy(model(x), y), noise_multiplier=1.0, backend="eager",
                            generator=torch.Generator().manual_seed(0), poisson_sampling=poisson)

    saved = built(saved_poisson)
    for x, y in saved.data_loader:
        saved.step(x, y)
        break
    state = copy.deepcopy(saved.state_dict())
    other = built(not saved_poisson)
    other.step(*next(iter(other.data_loader)))
    other.step(*next(iter(other.data_loader)))
    before = _snapshot(other)
    with pytest.raises(DPConfigError, match=rf"make_private\(poisson_sampling={saved_poisson}\), this one with "
                                            rf"poisson_sampling={not saved_poisson}.*Nothing was loaded"):
        other.load_state_dict(state)
    _assert_same(before, _snapshot(other))


def test_a_poisson_loader_without_a_generator_resumes_exactly_beside_dropout():
    """poisson_loader without generator= drew its coins from torch's global generator, which dropout draws from
    between batches: a resume (sampler state, step state and torch.get_rng_state) gave other batches, and loading
    the sampler rewound the global generator. The sampler has its own generator, seeded by one draw at
    construction, and the loader draws nothing from the global one when an epoch starts."""
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(80, 6, generator=g), torch.randint(0, 3, (80,), generator=g))

    def built():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.3), nn.Linear(8, 3))
        step = compile_step(lambda a, b: F.cross_entropy(model(a), b), model,
                            torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0, noise_multiplier=1.0,
                            expected_batch_size=8.0, backend="eager", generator=torch.Generator().manual_seed(1))
        return model, step, poisson_loader(data, 0.1)

    torch.manual_seed(42)
    model_a, step_a, loader_a = built()
    reference = []
    for x, y in loader_a:
        step_a(x, y)
        reference.append(x.clone())
    model_b, step_b, loader_b = built()
    for k, (x, y) in enumerate(loader_b):
        step_b(x, y)
        if k == 2:
            state = copy.deepcopy({"sampler": loader_b.batch_sampler.state_dict(), "step": step_b.state_dict(),
                                   "rng": torch.get_rng_state()})
            break
    model_c, step_c, loader_c = built()
    step_c.load_state_dict(state["step"])
    torch.set_rng_state(state["rng"])
    loader_c.batch_sampler.load_state_dict(state["sampler"])
    assert torch.equal(torch.get_rng_state(), state["rng"])  # the load does not touch the global generator
    resumed = []
    for x, y in loader_c:
        step_c(x, y)
        resumed.append(x.clone())
    assert len(resumed) == len(reference) - 3
    assert all(torch.equal(a, b) for a, b in zip(resumed, reference[3:], strict=True))
    assert all(torch.equal(p, q) for p, q in zip(model_a.parameters(), model_c.parameters(), strict=True))
    rng = torch.get_rng_state()
    loader = poisson_loader(data, 0.1)
    after_construction = torch.get_rng_state()
    assert not torch.equal(rng, after_construction)  # the one draw that seeds the sampler
    assert len(list(loader)) == len(list(loader)) == 10
    assert torch.equal(torch.get_rng_state(), after_construction)  # epochs draw nothing from the global generator


@pytest.mark.parametrize("secure", [False, True])
def test_what_a_checkpoint_reveals(secure):
    """docs/training.md, "A checkpoint is as secret as the training data": a seeded checkpoint holds the noise
    generator's seed and the sampler's epoch state (its batches can be drawn again); a secure one holds neither."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    data = TensorDataset(torch.randn(30, 4), torch.randint(0, 3, (30,)))
    private = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=10),
                           lambda x, y: F.cross_entropy(model(x), y), noise_multiplier=1.0, backend="eager",
                           secure_rng=secure, generator=None if secure else torch.Generator().manual_seed(1234))
    members = []
    for x, _ in private.data_loader:
        members.append(x.clone())
        private.step(x, _)
        if len(members) == 2:
            break
    state = private.state_dict()
    if secure:
        assert state["step"]["generator"] is None and state["sampler"] == {
            "epoch_state": None, "drawn": 2, "sample_rate": private.sample_rate, "num_samples": 30}
        return
    noise = torch.Generator()
    noise.set_state(state["step"]["generator"])
    assert noise.initial_seed() == 1234
    sampler = PoissonBatchSampler(30, private.sample_rate, generator=torch.Generator())
    sampler.generator.set_state(state["sampler"]["epoch_state"])
    redrawn = [data.tensors[0][batch] for batch in list(sampler)[:2]]
    assert all(torch.equal(a, b) for a, b in zip(redrawn, members, strict=True))


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


def test_the_loading_step_keeps_its_own_memory_budget():
    """``memory_budget`` describes the machine the step runs on, not the run: a resumed step keeps its own."""
    model, step = _mechanism_step()
    step.config = step.config.replace(memory_budget=1e6)
    state = copy.deepcopy(step.state_dict())
    _, resumed = _mechanism_step(seed=1)
    resumed.config = resumed.config.replace(memory_budget=0)
    resumed.load_state_dict(state)
    assert resumed.config.memory_budget == 0
    assert resumed.config.replace(memory_budget=1e6) == step.config


@pytest.mark.parametrize(("clipping", "changes"), [
    ("adaptive", dict(target_unclipped_quantile=0.9, clipbound_learning_rate=1.0, unclipped_num_std=3.0,
                      min_clipbound=0.05, max_clipbound=40.0)),
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


# ----- what a load refuses: a rollback by any route, a state of another kind, an inconsistent history, another
# dataset size ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["live_state", "copy_of_the_same_step", "refused_step", "later_then_earlier"])
def test_no_load_lowers_the_step_count_a_training_reached(route):
    """Round J: loading a state of the training's own step count (its live ``state_dict()``, which changes
    nothing) reset the count of steps released "since the last load", so the copy of step 1 loaded next: epsilon
    forgot the 2 released steps and the seeded generator drew their noise again. A training never takes a state
    below the highest step count it released or loaded, whatever was loaded in between."""
    _, private, _ = build()
    batches = iter(private.data_loader)
    private.step(*next(batches))
    best = copy.deepcopy(private.state_dict())
    if route == "later_then_earlier":  # nothing released here: a state of step 3 loaded, then one of step 1
        _, source, _ = build()
        for _, batch in zip(range(3), source.data_loader, strict=False):
            source.step(*batch)
        later = copy.deepcopy(source.state_dict())
        _, private, _ = build()
        private.load_state_dict(later)
    else:
        private.step(*next(batches))
        private.step(*next(batches))
        if route == "refused_step":  # a step refused before its update: nothing released, nothing counted
            with pytest.raises(BatchInputError):
                private.step(torch.randn(4, 7), torch.zeros(4, dtype=torch.long))
        same = private.state_dict() if route != "copy_of_the_same_step" else copy.deepcopy(private.state_dict())
        private.load_state_dict(same)
    before = _snapshot(private)
    with pytest.raises(DPConfigError, match=r"reached step 3 .*the state is of step 1: .*Nothing was loaded.*"
                                            r"training built afresh"):
        private.load_state_dict(best)
    _assert_same(before, _snapshot(private))
    assert private.steps == private.dp_step.steps_taken == 3
    _, fresh, _ = build()  # a training built afresh resumes the copy
    fresh.load_state_dict(best)
    assert fresh.steps == 1


def test_a_step_refuses_a_rollback_and_a_jump_past_its_released_steps_after_any_load():
    """The same on a ``DPStep`` (round J's probe p1c), and a later state of another run after this step released
    steps of its own: the same-count load in between no longer makes them "not released since the last load"."""
    model, step = _mechanism_step()
    batches = _batches(5)
    step(*batches[0])
    best = copy.deepcopy(step.state_dict())
    step(*batches[1])
    step(*batches[2])
    step.load_state_dict(step.state_dict())
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(DPConfigError, match=r"reached step 3 .*the state is of step 1: .*Nothing was loaded"):
        step.load_state_dict(best)
    _, other = _mechanism_step(seed=1)
    for batch in batches:
        other(*batch)
    with pytest.raises(DPConfigError, match=r"released 3 step\(s\) of its own .*the state is of step 5.*"
                                            r"Nothing was loaded"):
        step.load_state_dict(copy.deepcopy(other.state_dict()))
    assert step.steps_taken == 3
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    _, fresh = _mechanism_step(seed=2)
    fresh.load_state_dict(best)
    assert fresh.steps_taken == 1


def _kinds():
    """A PrivateTraining and a DPStep after one step each, with copies of their states."""
    _, private, _ = build()
    private.step(*next(iter(private.data_loader)))
    model, step = _mechanism_step()
    step(*_batches(1)[0])
    return private, step, model, copy.deepcopy(private.state_dict()), copy.deepcopy(step.state_dict())


@pytest.mark.parametrize(("case", "message"), [
    ("step_into_training", r"PrivateTraining.load_state_dict takes a PrivateTraining's state_dict\(\), got a "
                           r"DPStep's state.*Nothing was loaded.*compile_step"),
    ("training_into_step", r"DPStep.load_state_dict takes a DPStep's state_dict\(\), got a PrivateTraining's "
                           r"state.*Nothing was loaded.*PrivateTraining.load_state_dict"),
    ("model_into_step", r"DPStep.load_state_dict takes a DPStep's state_dict\(\), got a dict with keys "
                        r"\['0.bias', '0.weight', '2.bias', '2.weight'\].*model.load_state_dict"),
    ("none_into_step", r"DPStep.load_state_dict takes a DPStep's state_dict\(\), got NoneType"),
    ("none_into_training", r"PrivateTraining.load_state_dict takes a PrivateTraining's state_dict\(\), got "
                           "NoneType"),
    ("old_step_into_training", r"PrivateTraining.load_state_dict takes a PrivateTraining's state_dict\(\), got a "
                               r"DPStep's state_dict\(\).*Nothing was loaded"),
    ("training_without_accountant", r"PrivateTraining.load_state_dict takes a PrivateTraining's state_dict\(\), "
                                    r"got a dict with keys \['dataset_size', 'kind', 'poisson_sampling', "
                                    r"'sample_rate', 'sampler', 'step'\] \(no \['accountant'\]\)"),
])
def test_a_state_of_another_kind_is_refused_by_name(case, message):
    """Round J: the wrong kind of state raised KeyError 'accountant' / 'generator' or a TypeError."""
    private, step, model, training_state, step_state = _kinds()
    old_step_state = {k: v for k, v in step_state.items() if k != "kind"}
    target, state = {"step_into_training": (private, step_state), "training_into_step": (step, training_state),
                     "model_into_step": (step, copy.deepcopy(model.state_dict())), "none_into_step": (step, None),
                     "none_into_training": (private, None),
                     "old_step_into_training": (private, old_step_state),
                     "training_without_accountant": (private, {k: v for k, v in training_state.items()
                                                               if k != "accountant"})}[case]
    before, weights = _snapshot(private), [p.detach().clone() for p in model.parameters()]
    with pytest.raises(DPConfigError, match=message):
        target.load_state_dict(state)
    _assert_same(before, _snapshot(private))
    assert step.steps_taken == 1 and all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


def test_a_state_without_its_kind_marker_loads():
    """A state saved before states recorded their kind is told by its keys (as ``poisson_sampling`` is told by the
    sampler's state): it loads."""
    _, _, _, training_state, step_state = _kinds()
    _, private, _ = build(seed=1)
    private.load_state_dict({k: v for k, v in training_state.items() if k != "kind"})
    _, step = _mechanism_step(seed=1)
    step.load_state_dict({k: v for k, v in step_state.items() if k != "kind"})
    assert private.steps == step.steps_taken == 1


def _history(value):
    return lambda state: state["accountant"].update(history=value)


def _steps(value):
    return lambda state: state["step"].update(steps_taken=value)


@pytest.mark.parametrize(("change", "message"), [
    (_history([]), r"accountant's history counts 0 step\(s\), fewer than the step's steps_taken 3"),
    (_history([(1.5, 1 / 6, 2)]), r"accountant's history counts 2 step\(s\), fewer than the step's steps_taken 3"),
    (_history("x"), r"accountant's history must be a list of \(noise_multiplier, sample_rate, steps\) entries, got "
                    "str"),
    (_history([(1.5, 1 / 6)]), r"history entry 0 must be \(noise_multiplier, sample_rate, steps\), got \(1.5, "),
    (_history([(1.5, 1 / 6, "3")]), r"history entry 0 must be .*steps a positive int, got '3'"),
    (_history([(-1.0, 1 / 6, 3)]), r"history entry 0: noise_multiplier must be a finite number >= 0, got -1.0"),
    (_history([(1.5, 0.5, 3)]), r"history entry 0 has sample rate 0.5, this training's is 0.1666"),
    (_steps("3"), r"steps_taken must be an int >= 0, got '3'"),
    (_steps(True), r"steps_taken must be an int >= 0, got True"),
    (_steps(-1), r"steps_taken must be an int >= 0, got -1"),
    (lambda state: state.update(accountant=[]), r"the saved accountant must be a dict with 'mechanism' and "
                                                "'history', got list"),
])
def test_an_accountant_history_that_does_not_cover_the_steps_is_refused(change, message):
    """Round J: ``steps_taken=3`` with ``history=[]`` loaded and epsilon() returned 0.0; ``history="x"`` loaded and
    epsilon() raised a raw ValueError; ``steps_taken="3"`` loaded. Each is refused at load, naming the field."""
    _, source, _ = build()
    for _, batch in zip(range(3), source.data_loader, strict=False):
        source.step(*batch)
    state = copy.deepcopy(source.state_dict())
    change(state)
    _, private, _ = build(seed=1)
    before = _snapshot(private)
    with pytest.raises(DPConfigError, match=message + ".*Nothing was loaded"):
        private.load_state_dict(state)
    _assert_same(before, _snapshot(private))


def _sized(n: int):
    """make_private(sample_rate=0.2) over ``n`` samples: the gradient's divisor is 0.2 * n."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(n, 5), torch.randint(0, 3, (n,)))
    model = nn.Linear(5, 3)
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=8),
                        lambda x, y: F.cross_entropy(model(x), y), noise_multiplier=1.0, sample_rate=0.2,
                        generator=torch.Generator().manual_seed(0), backend="eager")


def test_a_state_of_another_dataset_size_is_refused():
    """Round J: a state of a training over 60 samples loaded into the same training over 100 and imposed its
    divisor (expected_batch_size 20 became 12). The dataset size is saved and checked; a state without it (saved
    before it was recorded) cannot be checked and is refused."""
    saved = _sized(60)
    saved.step(*next(iter(saved.data_loader)))
    state = copy.deepcopy(saved.state_dict())
    other = _sized(100)
    before = _snapshot(other)
    with pytest.raises(DPConfigError, match=r"dataset of 60 samples.*this one over 100.*expected batch size 12.0 "
                                            r"against 20.0.*Nothing was loaded"):
        other.load_state_dict(state)
    _assert_same(before, _snapshot(other))
    assert other.expected_batch_size == 20
    with pytest.raises(DPConfigError, match=r"no dataset_size.*Nothing was loaded"):
        _sized(60).load_state_dict({k: v for k, v in state.items() if k != "dataset_size"})
    resumed = _sized(60)
    resumed.load_state_dict(state)
    assert resumed.steps == 1 and resumed.expected_batch_size == 12


def test_a_peek_inside_an_epoch_makes_the_samplers_state_refuse_until_the_epoch_ends():
    """Red team Q2: a peek (``next(iter(loader))``) in the middle of an epoch drew from the sampler's generator and
    reset its epoch's position, while the running iteration went on counting: a state saved after it resumed
    other batches (sizes [.., 8, 8] for [.., 5, 8]). The state is refused while it cannot be replayed."""
    train = TensorDataset(torch.randn(40, 5, generator=torch.Generator().manual_seed(1)), torch.zeros(40))
    loader = poisson_loader(DataLoader(train, batch_size=8), generator=torch.Generator().manual_seed(0))
    sampler = loader.batch_sampler
    running = iter(loader)
    next(running)
    sampler.state_dict()  # one iteration: its position
    next(iter(loader))  # the peek
    for _ in range(2):  # right after the peek, and after the running iteration drew again
        with pytest.raises(DPConfigError, match="two iterations in this epoch.*Fix: save between epochs"):
            sampler.state_dict()
        next(running)
    for _ in running:  # the epoch ends: the next one starts from a position a state can hold
        pass
    state = sampler.state_dict()
    assert state["drawn"] == 0
    resumed = poisson_loader(DataLoader(train, batch_size=8), generator=torch.Generator().manual_seed(5))
    resumed.batch_sampler.load_state_dict(state)
    assert [len(b[0]) for b in resumed] == [len(b[0]) for b in loader]


def test_a_saved_option_of_another_clipping_mode_is_refused_as_a_load():
    """Red team S (F9): a state whose config sets ``automatic_gamma`` beside flat clipping (older code saved such
    options, which did nothing) was refused with the build's fix ("pass clipping='automatic'"), which a load
    cannot take, and without "Nothing was loaded"."""
    model, step = _mechanism_step()
    state = copy.deepcopy(step.state_dict())
    state["config"] = dict(state["config"], automatic_gamma=0.5)
    before = copy.deepcopy(step.state_dict())
    with pytest.raises(DPConfigError, match=r"the saved settings are refused: automatic_gamma=0.5 applies to "
                                            r"clipping='automatic'.*Nothing was loaded\. Fix: correct that setting "
                                            r"in the state's 'config'") as info:
        step.load_state_dict(state)
    assert "pass clipping=" not in str(info.value)
    assert step.config == _mechanism_step()[1].config and step.steps_taken == before["steps_taken"]
