"""Accounting (against the libraries called directly), calibration, Poisson sampling, make_private."""

from __future__ import annotations

import dp_accounting
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from dp_accounting import pld, rdp
from torch.utils.data import DataLoader, TensorDataset

import compiled_psg as psg
from compiled_psg._errors import BatchInputError, DPConfigError
from compiled_psg._train.accounting import Accountant, calibrate_noise, epsilon
from compiled_psg._train.private import make_private
from compiled_psg._train.sampling import PoissonBatchSampler, poisson_loader

SIGMA, Q, STEPS, DELTA = 1.1, 0.02, 500, 1e-5


def direct_dp_accounting(accountant, history):
    for sigma, q, steps in history:
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps))
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("mechanism", ["rdp", "pld"])
def test_epsilon_is_dp_accounting(mechanism):
    direct = direct_dp_accounting(rdp.RdpAccountant() if mechanism == "rdp" else pld.PLDAccountant(),
                                  [(SIGMA, Q, STEPS)])
    assert epsilon(SIGMA, Q, STEPS, DELTA, mechanism) == direct
    assert 0 < direct < 10


@pytest.mark.parametrize("mechanism", ["rdp", "prv"])
def test_epsilon_is_opacus(mechanism):
    accountants = pytest.importorskip("opacus.accountants")
    direct = accountants.RDPAccountant() if mechanism == "rdp" else accountants.PRVAccountant()
    for _ in range(STEPS):
        direct.step(noise_multiplier=SIGMA, sample_rate=Q)
    assert epsilon(SIGMA, Q, STEPS, DELTA, "opacus-rdp" if mechanism == "rdp" else "prv") == pytest.approx(
        direct.get_epsilon(delta=DELTA), rel=1e-12)


def test_accountant_composes_a_changing_history():
    history = [(1.5, 0.01, 100), (0.9, 0.02, 50), (1.5, 0.01, 10)]
    acc = Accountant("rdp")
    for sigma, q, steps in history:
        for _ in range(steps):
            acc.step(sigma, q)
    assert acc.steps == 160 and acc.history == history
    assert acc.epsilon(DELTA) == direct_dp_accounting(rdp.RdpAccountant(), history)


def test_epsilon_limits():
    assert Accountant().epsilon(DELTA) == 0.0
    assert epsilon(0.0, Q, 10, DELTA) == float("inf")
    assert epsilon(SIGMA, Q, 100, DELTA) < epsilon(SIGMA, Q, 200, DELTA)
    with pytest.raises(DPConfigError, match="accountant"):
        Accountant("moments")


def test_calibrate_noise_reaches_the_target():
    sigma = calibrate_noise(3.0, DELTA, Q, STEPS, "rdp")
    assert 2.95 <= epsilon(sigma, Q, STEPS, DELTA, "rdp") <= 3.0
    assert epsilon(sigma * 0.98, Q, STEPS, DELTA, "rdp") > 3.0


@pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")  # opacus's search probes huge sigmas
def test_calibrate_noise_is_opacus():
    utils = pytest.importorskip("opacus.accountants.utils")
    direct = utils.get_noise_multiplier(target_epsilon=3.0, target_delta=DELTA, sample_rate=Q, steps=STEPS,
                                        accountant="rdp", epsilon_tolerance=0.01)
    assert calibrate_noise(3.0, DELTA, Q, STEPS, "opacus-rdp") == direct


@pytest.mark.parametrize("secure", [False, True])
def test_poisson_sampler(secure):
    generator = None if secure else torch.Generator().manual_seed(0)  # os.urandom takes no generator
    sampler = PoissonBatchSampler(1000, 0.05, steps=400, generator=generator, secure=secure)
    batches = list(sampler)
    sizes = torch.tensor([len(b) for b in batches], dtype=torch.float64)
    assert len(batches) == len(sampler) == 400
    assert abs(sizes.mean().item() - 50) < 6 * (1000 * 0.05 * 0.95 / 400) ** 0.5
    assert abs(sizes.var().item() / (1000 * 0.05 * 0.95) - 1) < 0.4  # binomial spread, not a fixed size
    assert all(len(set(b)) == len(b) and all(0 <= i < 1000 for i in b) for b in batches)
    assert len(PoissonBatchSampler(1000, 0.05)) == 20


@pytest.mark.parametrize("sampler", ["subset", "custom_batches"])
def test_a_loader_sampling_part_of_its_dataset_is_refused(sampler):
    """Red team N: with ``sampler=SubsetRandomSampler(range(100))`` over 1000 rows, make_private's Poisson loader
    drew from all 1000 (595 of 655 rows outside the user's split) at the rate of the subset's batches (10x)."""
    from torch.utils.data import BatchSampler, SequentialSampler, SubsetRandomSampler

    data = TensorDataset(torch.randn(1000, 3), torch.randint(0, 2, (1000,)))
    if sampler == "subset":
        loader = DataLoader(data, batch_size=10, sampler=SubsetRandomSampler(range(100)))
    else:
        class EveryOther(BatchSampler):
            def __iter__(self):
                return (b for i, b in enumerate(super().__iter__()) if i % 2 == 0)

        loader = DataLoader(data, batch_sampler=EveryOther(SequentialSampler(data), 10, False))
    model = nn.Linear(3, 2)
    with pytest.raises(DPConfigError, match=r"Poisson sampling draws from every index of its dataset \(1000\).*"
                                            r"Fix: .*Subset\(dataset, indices\)"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                     lambda x, y: F.cross_entropy(model(x), y), noise_multiplier=1.0, backend="eager")
    with pytest.raises(DPConfigError, match="draws from every index"):
        poisson_loader(loader)
    kept = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                        lambda x, y: F.cross_entropy(model(x), y), noise_multiplier=1.0, backend="eager",
                        poisson_sampling=False)  # the loader as it is: its sampler is the user's
    assert kept.data_loader is loader
    for shuffle in (False, True):  # the whole dataset, in order or shuffled: sampled as it is
        poisson_loader(DataLoader(data, batch_size=10, shuffle=shuffle))


@pytest.mark.parametrize("outcome", ["refused", "kept_loader", "unknown_accountant", "refused_after_the_draw"])
def test_make_private_leaves_the_users_generators_as_they_were(outcome, monkeypatch):
    """Red team M: a refused make_private had advanced torch's global generator (its peek at the loader drew the
    workers' base seed and the shuffling sampler's seed); red team O: ``accountant="gdp"`` was refused after the
    sampler's seed was drawn from the global generator or the user's ``generator=``. Neither a refusal nor a run
    that keeps the user's loader may move the streams the user seeded: the global one, the loader's, the sampler's
    and the noise generator."""
    data = TensorDataset(torch.randn(40, 3), torch.randint(0, 2, (40,)))
    loader_generator, sampler_generator = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    noise_generator = torch.Generator().manual_seed(3)
    if outcome == "refused_after_the_draw":  # the last thing built after the seed's draw fails
        def failing_training(*args, **kwargs):
            raise DPConfigError("simulated")
        monkeypatch.setattr("compiled_psg._train.private.PrivateTraining._built", failing_training)
    loaders = [DataLoader(data, batch_size=8, shuffle=True),  # draws from the global generator
               DataLoader(data, batch_size=8, shuffle=True, generator=loader_generator),
               DataLoader(data, batch_size=8, sampler=torch.utils.data.RandomSampler(data,
                                                                                     generator=sampler_generator))]
    model = nn.Linear(3, 2)
    for loader in loaders:
        torch.manual_seed(0)
        streams = (torch.random, loader_generator, sampler_generator, noise_generator)
        expected = [g.get_rng_state() if g is torch.random else g.get_state() for g in streams]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for generator in (None, noise_generator):
            options = dict(noise_multiplier=1.0, backend="eager", generator=generator)
            if outcome == "refused":
                with pytest.raises(psg.SampleMixingError):
                    make_private(model, optimizer, loader, lambda x, y: F.cross_entropy(model(x - x.mean(0)), y),
                                 **options)
            elif outcome == "kept_loader":
                make_private(model, optimizer, loader, lambda x, y: F.cross_entropy(model(x), y),
                             poisson_sampling=False, **options)
            else:
                with pytest.raises(DPConfigError, match="accountant must be one of" if outcome ==
                                   "unknown_accountant" else "simulated"):
                    make_private(model, optimizer, loader, lambda x, y: F.cross_entropy(model(x), y),
                                 accountant="gdp" if outcome == "unknown_accountant" else "rdp", **options)
        after = [g.get_rng_state() if g is torch.random else g.get_state() for g in streams]
        assert all(torch.equal(a, b) for a, b in zip(after, expected, strict=True))


@pytest.mark.parametrize("kw, match", [
    ({"steps": 0}, "steps .* must be a positive int or None, got 0"),
    ({"steps": -1}, "got -1"), ({"steps": 2.5}, "got 2.5"), ({"steps": "3"}, "got '3'"), ({"steps": True}, "got True"),
    ({"generator": 42}, "generator must be a CPU torch.Generator or None.*got int 42"),
])
def test_poisson_loader_settings_are_refused_naming_them(kw, match):
    """Red team O: ``steps=0`` gave epochs of no batches, ``-1`` a raw ValueError from len(), ``2.5`` or ``"3"`` a
    raw TypeError at the first batch, ``generator=42`` torch's TypeError."""
    data = TensorDataset(torch.randn(20, 3), torch.arange(20))
    with pytest.raises(DPConfigError, match=match):
        poisson_loader(data, 0.1, **kw)
    assert len(poisson_loader(data, 0.1, steps=np.int64(3))) == 3


def test_a_samplers_rate_is_fixed():
    """Red team P: ``private.data_loader.batch_sampler.sample_rate = 0.9`` was taken: batches of 35 to 38 of 40
    while the accountant counted q = 0.2 (epsilon 4.54 reported, 11.63 spent)."""
    sampler = PoissonBatchSampler(40, 0.2, generator=torch.Generator().manual_seed(0))
    for name, value in (("sample_rate", 0.9), ("num_samples", 400), ("steps", 50), ("generator", None)):
        with pytest.raises(DPConfigError, match=f"a PoissonBatchSampler's {name} is fixed"):
            setattr(sampler, name, value)
    assert (sampler.sample_rate, sampler.num_samples, sampler.steps) == (0.2, 40, 5)


@pytest.mark.parametrize("num_samples", [0, -1, 2.5, "40", True])
def test_a_samplers_size_is_a_positive_int(num_samples):
    """Red team Q2: -1, 2.5, '40' or True raised torch.rand's raw error at the first draw; 0 drew empty batches
    forever."""
    with pytest.raises(DPConfigError, match=rf"num_samples .* must be a positive int, got {num_samples!r}"):
        PoissonBatchSampler(num_samples, 0.2)
    assert PoissonBatchSampler(np.int64(40), 0.2).num_samples == 40


def test_poisson_loader_yields_empty_batches():
    data = TensorDataset(torch.randn(5, 3), torch.arange(5))
    loader = poisson_loader(data, 0.02, steps=30, generator=torch.Generator().manual_seed(0))
    batches = list(loader)
    empty = [b for b in batches if len(b[1]) == 0]
    assert len(batches) == 30 and empty
    x, y = empty[0]
    assert x.shape == (0, 3) and x.dtype == torch.float32 and y.shape == (0,) and y.dtype == torch.long



def _sequence_first(rows):
    """Collate (T, F) samples to x of shape (T, B, F) (batch second), with y (B,) and an unbatched weight (F,)."""
    return torch.stack([r[0] for r in rows], 1), torch.stack([r[1] for r in rows]), torch.ones(4)


def test_an_empty_poisson_batch_is_cut_along_each_arguments_batch_dim():
    """``_CollateWithEmpty`` cut every tensor along dim 0: with a sequence-first collate the empty batch was x of
    shape (0, 1, F), a batch of one sample of length 0 (make_private's step refused it, "batched arguments
    disagree on the batch size"). Each argument is cut along its in_dims entry; a None entry is left whole."""
    data = TensorDataset(torch.randn(5, 6, 4), torch.arange(5))
    loader = poisson_loader(DataLoader(data, batch_size=2, collate_fn=_sequence_first), 0.02, steps=30,
                            generator=torch.Generator().manual_seed(0), in_dims=(1, 0, None))
    empty = [b for b in loader if len(b[1]) == 0]
    assert empty
    x, y, w = empty[0]
    assert x.shape == (6, 0, 4) and y.shape == (0,) and w.shape == (4,) and torch.equal(w, torch.ones(4))
    with pytest.raises(BatchInputError, match="in_dims has 2 entries but the collate function's batch is 3"):
        list(poisson_loader(DataLoader(data, batch_size=2, collate_fn=_sequence_first), 0.02, steps=30,
                            generator=torch.Generator().manual_seed(0), in_dims=(1, 0)))


@pytest.mark.parametrize("clipping", ["flat", "adaptive"])
def test_an_empty_poisson_batch_with_the_batch_second_is_a_step_of_noise_alone(clipping):
    """make_private(in_dims=(1, 0, None)) over a sequence-first loader: the loader's empty batch steps (it raised
    a BatchInputError, and a single-argument version a CaptureError from a ZeroDivisionError) and moves the
    parameters by exactly what the same empty step does with the batch first (in_dims=0): noise alone."""
    options = {"unclipped_num_std": 1.0} if clipping == "adaptive" else {}
    data = TensorDataset(torch.randn(40, 5, 4), torch.randint(0, 3, (40,)))

    def built(batch_first):
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        if batch_first:
            loader = DataLoader(data, batch_size=2, collate_fn=lambda rows: tuple(
                t.transpose(0, 1) if t.dim() == 3 else t for t in _sequence_first(rows)))
            loss_fn, in_dims = (lambda x, y, w: F.cross_entropy(model(x * w).mean(1), y)), (0, 0, None)
        else:
            loader = DataLoader(data, batch_size=2, collate_fn=_sequence_first)
            loss_fn, in_dims = (lambda x, y, w: F.cross_entropy(model(x * w).mean(0), y)), (1, 0, None)
        return model, make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, loss_fn,
                                   noise_multiplier=1.0, sample_rate=0.01, backend="eager", in_dims=in_dims,
                                   generator=torch.Generator().manual_seed(0), clipping=clipping, **options)

    results = []
    for batch_first in (True, False):
        model, private = built(batch_first)
        batch = next(b for b in private.data_loader if len(b[1]) == 0)
        assert batch[0].shape == ((0, 5, 4) if batch_first else (5, 0, 4))
        private.step(*batch)
        assert private.steps == 1 and private.dp_step.last_batch_size == 0
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*results, strict=True))


def test_a_loader_of_single_samples_is_refused_for_what_it_is():
    """DataLoader(batch_size=None) yields samples, not batches: make_private raised "in_dims[1]=0 is out of range
    for argument 1 of shape ()", about an in_dims the user never passed."""
    model, optimizer, _, loss_fn = _setup()
    data = TensorDataset(torch.randn(20, 4), torch.randint(0, 3, (20,)))
    for build in (lambda: make_private(model, optimizer, DataLoader(data, batch_size=None), loss_fn,
                                       noise_multiplier=1.0, backend="eager"),
                  lambda: poisson_loader(DataLoader(data, batch_size=None))):
        with pytest.raises(DPConfigError, match=r"yields single samples.*batch_size=None.*Fix: give the loader a "
                                                r"batch size"):
            build()

def _setup(n=60, batch_size=10, model=None):
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    data = TensorDataset(torch.randn(n, 4), torch.randint(0, 3, (n,)))
    loader = DataLoader(data, batch_size=batch_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer, loader, lambda x, y: F.cross_entropy(model(x), y)


def test_make_private_with_noise_multiplier():
    model, optimizer, loader, loss_fn = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    private = make_private(model, optimizer, loader, loss_fn, noise_multiplier=1.2, max_grad_norm=0.5,
                           backend="eager",
                           generator=torch.Generator().manual_seed(0))
    assert private.sample_rate == pytest.approx(1 / 6) and private.expected_batch_size == pytest.approx(10)
    assert isinstance(private.data_loader.batch_sampler, PoissonBatchSampler)
    sizes = []
    for x, y in private.data_loader:
        private.step(x, y)
        sizes.append(len(y))
    private.step(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))  # an empty batch is a step too
    assert len(sizes) == 6 and private.accountant.steps == 7
    assert private.epsilon() == epsilon(1.2, 1 / 6, 7, 1e-5)
    assert private.epsilon(1e-3) < private.epsilon(1e-6)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert private.dp_step.per_sample.captures == 1 and private.compile_seconds > 0


def test_make_private_calibrates_to_target_epsilon():
    model, optimizer, loader, loss_fn = _setup()
    private = make_private(model, optimizer, loader, loss_fn, target_epsilon=4.0, epochs=5, backend="eager")
    assert private.noise_multiplier == calibrate_noise(4.0, 1e-5, 1 / 6, 5 * 6)
    private.accountant.step(private.noise_multiplier, private.sample_rate, steps=30)
    assert 3.9 < private.epsilon() <= 4.0


def test_make_private_refuses_models_that_mix_samples():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    model, optimizer, loader, loss_fn = _setup(model=model)
    with pytest.raises(psg.SampleMixingError):
        make_private(model, optimizer, loader, loss_fn, noise_multiplier=1.0, backend="eager")


def test_make_private_argument_errors():
    model, optimizer, loader, loss_fn = _setup()
    with pytest.raises(DPConfigError, match="exactly one"):
        make_private(model, optimizer, loader, loss_fn)
    with pytest.raises(DPConfigError, match="exactly one"):
        make_private(model, optimizer, loader, loss_fn, noise_multiplier=1.0, target_epsilon=1.0, epochs=1)
    with pytest.raises(DPConfigError, match="epochs"):
        make_private(model, optimizer, loader, loss_fn, target_epsilon=1.0)


@pytest.mark.parametrize("mechanism", ["pld", "prv"])
@pytest.mark.parametrize("sigma", [1e-9, 0.001, 0.0099])
def test_an_accountant_grid_too_large_for_memory_is_refused_before_it_is_allocated(mechanism, sigma):
    """Red team P: pld at sigma 1e-8 to 1e-99 raised numpy's raw ``ValueError: Maximum allowed size exceeded``.
    Red team Q: prv at sigma 0.001, q 1 allocated a grid of 21 GB, and the kernel killed the process (no
    MemoryError to refuse). Below sigma 0.01 the gridded accountants are refused before they allocate."""
    with pytest.raises(DPConfigError, match=rf"the {mechanism} accountant discretizes .* at noise_multiplier="
                                            r".*Fix: accountant='rdp'"):
        epsilon(sigma, 1.0, 1, 1e-5, mechanism)
    assert epsilon(sigma, 1.0, 1, 1e-5, "rdp") > 100


def test_an_accountant_grid_past_numpys_largest_array_is_refused_naming_the_fix(monkeypatch):
    """Red team P: numpy's refusal of a grid past its largest array (``ValueError: Maximum allowed size
    exceeded``) is the accountant's DPConfigError; simulated where the library allocates."""
    def allocate(*args, **kwargs):
        raise ValueError("Maximum allowed size exceeded")

    monkeypatch.setattr(pld.PLDAccountant, "compose", allocate)
    with pytest.raises(DPConfigError, match=r"\(Maximum allowed size exceeded\).*Fix: accountant='rdp'"):
        epsilon(0.5, 0.2, 1, 1e-5, "pld")


def test_an_accountant_out_of_memory_is_refused_naming_the_fix(monkeypatch):
    """Red team N: pld at sigma 0.001, q 0.2 raised numpy's MemoryError (38 GiB); the grid's size is the library's,
    so the allocation failure is simulated here, where the library allocates."""
    def allocate(*args, **kwargs):
        raise MemoryError("Unable to allocate 38.0 GiB for an array")

    monkeypatch.setattr(pld.PLDAccountant, "compose", allocate)
    with pytest.raises(DPConfigError, match=r"ran out of memory \(Unable to allocate 38.0 GiB.*Fix: accountant='rdp'"):
        epsilon(0.5, 0.2, 5, 1e-5, "pld")
    with pytest.raises(DPConfigError, match="ran out of memory"):
        calibrate_noise(3.0, 1e-5, 0.2, 5, "pld")
    assert epsilon(1.0, 0.2, 5, 1e-5, "rdp") > 0  # the other accountants are untouched
