"""A DP step happens completely or not at all, and the accountant counts exactly the steps whose noisy update
reached the parameters: a refused step changes nothing and counts nothing; a step whose update was applied is
counted even when what follows it (adaptive clipping's next bound) goes wrong; a resumed run takes the same
program path as the uninterrupted one."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from compiled_psg import DPConfigError, compile_step, make_private


def _data(n: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _private(model, x, y, generator, **options):
    """make_private on an SGD optimizer, batches of 8, noise multiplier 1, the eager backend."""
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(TensorDataset(x, y),
                        batch_size=8), lambda x, y: F.cross_entropy(model(x), y), noise_multiplier=1.0,
                        backend="eager", generator=generator, poisson_sampling=False, **options)


def _snapshot(model, generator):
    return [p.detach().clone() for p in model.parameters()], generator.get_state().clone()


def _unchanged(model, generator, snapshot) -> bool:
    params, state = snapshot
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True)) and torch.equal(
        generator.get_state(), state)


def test_adaptive_bound_past_the_float_range_counts_the_step_and_refuses_the_next():
    """clipbound_learning_rate=1000 makes the next bound exp(1000) times the last: the step whose update was
    applied is counted (no OverflowError after the update), and the next step, whose noise would be infinite, is
    refused before anything changes."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    gen = torch.Generator().manual_seed(1)
    x, y = _data()
    private = _private(model, x, y, gen, max_grad_norm=0.01, clipping="adaptive", target_unclipped_quantile=1.0,
                       clipbound_learning_rate=1000.0, unclipped_num_std=2.0)
    before = _snapshot(model, gen)
    private.step(x[:8], y[:8])
    assert not _unchanged(model, gen, before)
    assert private.dp_step.steps_taken == 1 and private.accountant.steps == 1
    assert private.dp_step.max_grad_norm == 0.01  # the bound the step used: the next one overflowed
    after_one = _snapshot(model, gen)
    with pytest.raises(DPConfigError, match="max_clipbound"):
        private.step(x[8:], y[8:])
    assert _unchanged(model, gen, after_one)
    assert private.dp_step.steps_taken == 1 and private.accountant.steps == 1
    private.dp_step.max_grad_norm = 0.5  # the user's fix named in the message
    private.step(x[8:], y[8:])
    assert private.dp_step.steps_taken == 2 and private.accountant.steps == 2


def test_a_bound_past_float32_refuses_the_next_step_and_a_new_config_lifts_it():
    """lr=100 gives a next bound of about 1e40: finite in float64, infinite as float32 noise. Assigning a config
    with a finite max_clipbound (the fix the message names) lets training go on."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = _data()
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.1),
                        max_grad_norm=0.01, noise_multiplier=1.0, clipping="adaptive", target_unclipped_quantile=1.0,
                        clipbound_learning_rate=100.0, unclipped_num_std=2.0, backend="eager",
                        generator=torch.Generator().manual_seed(1))
    step(x[:8], y[:8])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with pytest.raises(DPConfigError, match="max_clipbound"):
        step(x[8:], y[8:])
    assert step.steps_taken == 1
    step.config = step.config.replace(max_clipbound=5.0)
    step(x[8:], y[8:])
    assert step.steps_taken == 2 and all(torch.isfinite(p).all() for p in model.parameters())


def test_a_finite_max_clipbound_keeps_adaptive_clipping_going():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = _data()
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.1),
                        max_grad_norm=0.01, noise_multiplier=1.0, clipping="adaptive", target_unclipped_quantile=1.0,
                        clipbound_learning_rate=1000.0, unclipped_num_std=2.0, max_clipbound=5.0, backend="eager",
                        generator=torch.Generator().manual_seed(1))
    step(x[:8], y[:8])
    assert step.max_grad_norm == 5.0
    step(x[8:], y[8:])
    assert step.steps_taken == 2


def test_a_step_refused_under_autocast_counts_nothing():
    """The refusal comes before anything is released: the accountant must not count the previous step again."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    gen = torch.Generator().manual_seed(1)
    x, y = _data()
    private = _private(model, x, y, gen, max_grad_norm=1.0)
    private.step(x[:8], y[:8])
    history = list(private.accountant.history)
    snapshot = _snapshot(model, gen)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(DPConfigError, match="autocast"):
        private.step(x[8:], y[8:])
    assert private.accountant.history == history and private.dp_step.steps_taken == 1
    assert _unchanged(model, gen, snapshot)


@pytest.mark.inductor
def test_resumed_plain_sgd_takes_the_compiled_program_bit_for_bit():
    """Plain SGD keeps no optimizer state: a resumed step must still run the compiled program, as the
    uninterrupted run's second step does (the eager update differs in the last bits)."""
    x, y = _data(24)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 24, 8)]

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model,
                            torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0, noise_multiplier=1.0,
                            generator=torch.Generator().manual_seed(3))
        return model, step

    model_a, step_a = build()
    for b in batches:
        step_a(*b)
    model_b, step_b = build()
    step_b(*batches[0])
    state = {k: v for k, v in step_b.state_dict().items()}
    model_c, step_c = build()
    step_c.load_state_dict(state)
    for b in batches[1:]:
        step_c(*b)
    for p, q in zip(model_a.parameters(), model_c.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.inductor
def test_batches_sliced_from_one_tensor_run_on_one_capture():
    """``x[8:16]`` starts inside its storage: Dynamo would make the offset a symbol of its own, an input of the
    program that no batch size determines (the compiled step crashed on it). The first batch is such a slice, so
    the capture itself sees it; the steps equal those on contiguous copies."""
    x, y = _data(32)
    results = []

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        return model, compile_step(lambda x, y: F.cross_entropy(model(x), y), model,
                                   torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0,
                                   noise_multiplier=1.0, generator=torch.Generator().manual_seed(3))

    for copies in (False, True):
        model, step = build()
        for i in range(8, 32, 8):
            xb, yb = x[i:i + 8], y[i:i + 8]
            assert xb.storage_offset() > 0
            step(*((xb.clone(), yb.clone()) if copies else (xb, yb)))
        assert (step.captures, step.compiles, step.steps_taken) == (1, 1, 3)
        results.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*results, strict=True):
        assert torch.equal(p, q)
