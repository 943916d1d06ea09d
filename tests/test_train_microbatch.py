"""Logical batches split into physical micro-batches: the same step as the whole batch (float64, seeded noise),
no recompiles across micro-batch sizes, one accounted step per logical batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from compiled_psg import compile_step
from compiled_psg._train.private import make_private

SIZES = (23, 9, 2)  # with micro-batches of 8: remainders 7, 1, none (2 <= 8)


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 36, 4)).double()


def batch(n: int):
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (n,), generator=g)


def two_steps(backend: str, model: nn.Module, **kw):
    steps = []
    for physical in (None, 8):
        m = copy.deepcopy(model)
        steps.append((m, compile_step(lambda x, y, m=m: F.cross_entropy(m(x), y), m,
                                      torch.optim.Adam(m.parameters(), lr=0.05), max_grad_norm=0.3,
                                      noise_multiplier=0.7, expected_batch_size=20, backend=backend,
                                      generator=torch.Generator().manual_seed(3),
                                      max_physical_batch_size=physical, **kw)))
    return steps


def test_micro_batches_equal_the_whole_batch():
    (whole, step_whole), (split, step_split) = two_steps("eager", cnn())
    for n in SIZES:
        loss_whole, loss_split = step_whole(*batch(n)), step_split(*batch(n))
        torch.testing.assert_close(loss_split, loss_whole, rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(step_split.last_norms, step_whole.last_norms, rtol=1e-13, atol=1e-13)
        assert step_split.last_batch_size == n
        for p, q in zip(whole.parameters(), split.parameters(), strict=True):
            torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-13)
    moved = max((p - q).abs().max().item() for p, q in zip(whole.parameters(), cnn().parameters(), strict=True))
    assert moved > 1e-2  # the steps did move the parameters (with clipping and noise)
    assert (step_whole.last_norms > 0.3).any()  # and some samples were clipped
    assert step_split.captures == 1 and step_split.program_builds == 1


def test_per_sample_losses_come_back_whole():
    """A loss returning ``[B]`` losses: the step returns the whole batch's ``[B]``, with micro-batches too (they
    were stacked, which failed after the update for uneven micro-batches)."""
    model = cnn()
    steps = []
    for physical in (None, 8):
        m = copy.deepcopy(model)
        steps.append((m, compile_step(lambda x, y, m=m: F.cross_entropy(m(x), y, reduction="none"), m,
                                      torch.optim.SGD(m.parameters(), lr=0.05), max_grad_norm=0.3,
                                      expected_batch_size=20, backend="eager", max_physical_batch_size=physical)))
    (whole, step_whole), (split, step_split) = steps
    for n in (23, 16):  # uneven (8, 8, 7) and even (8, 8) micro-batches
        x, y = batch(n)
        got, want = step_split(x, y), step_whole(x, y)
        assert got.shape == want.shape == (n,)
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
        for p, q in zip(whole.parameters(), split.parameters(), strict=True):
            torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-13)


@pytest.mark.usefixtures("eager_first_step")
@pytest.mark.inductor
def test_micro_batches_do_not_recompile():
    """Inductor: the per-sample graph (earlier micro-batches) and the step program (the last one) compile once
    each for every size from 2 up; new logical and micro-batch sizes add nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.1),
                        max_grad_norm=0.3, noise_multiplier=0.7, expected_batch_size=20,
                        max_physical_batch_size=8)
    data = lambda n: (torch.randn(n, 5), torch.randint(0, 2, (n,)))  # noqa: E731
    step(*data(12))  # eager first step; the program compiles at its end
    step(*data(12))  # micro-batches 8 + 4: the per-sample graph compiles for the first
    assert step.compiles == 2
    for n in (21, 30, 3, 18):  # micro-batches (8, 8, 5), (8, 8, 8, 6), (3), (8, 8, 2)
        step(*data(n))
        assert step.last_batch_size == n
    assert step.compiles == 2 and step.captures == 1 and step.program_builds == 1


def test_make_private_accounts_logical_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    data = TensorDataset(torch.randn(90, 4), torch.randint(0, 3, (90,)))
    private = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=30),
                           lambda x, y: F.cross_entropy(model(x), y), noise_multiplier=1.0, backend="eager",
                           max_physical_batch_size=4, generator=torch.Generator().manual_seed(0))
    sizes = []
    for x, y in private.data_loader:
        private.step(x, y)
        sizes.append(len(y))
    assert max(sizes) > 4  # really split
    assert private.accountant.steps == len(sizes) == 3 and private.dp_step.steps_taken == 3


@pytest.mark.usefixtures("eager_first_step")
def test_a_forward_that_writes_buffers_writes_them_once_per_logical_step():
    """``spectral_norm``'s power iteration writes ``weight_u`` in every forward: each micro-batch starts from the
    buffers as the step found them, so the step (eager first step and fused program) equals the whole batch's."""
    results = []
    for physical in (None, 3):
        torch.manual_seed(0)
        model = nn.Sequential(nn.utils.spectral_norm(nn.Linear(5, 7)), nn.Tanh(), nn.Linear(7, 3)).double()
        step = compile_step(lambda x, y, m=model: F.cross_entropy(m(x), y), model,
                            torch.optim.SGD(model.parameters(), lr=0.5), max_grad_norm=1.0, noise_multiplier=0.0,
                            expected_batch_size=8, backend="eager", max_physical_batch_size=physical)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            step(torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g))
        results.append({k: v.clone() for k, v in model.state_dict().items()})
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, rtol=1e-12, atol=1e-13)


@pytest.mark.usefixtures("eager_first_step")
@pytest.mark.parametrize("physical", [None, 3, 5], ids=["whole", "micro3", "micro5"])
def test_a_failing_sample_is_named_at_its_position_in_the_users_batch(physical):
    """Sample 6 of 8 fails cholesky: the refusal names position 6 and the loss's line whether the batch runs whole
    or in micro-batches (6 is the first sample of the third micro-batch of 3, in the eager first step and in the
    fused program of a later one; with micro-batches of 5, in the fused program's last piece), and the refused
    step changes nothing: parameters, grads, optimizer state, buffers, generator, steps taken."""
    from test_step_transaction import _same_state, _state

    import compiled_psg as psg

    torch.manual_seed(0)
    lin = nn.Linear(16, 3).double()
    gen = torch.Generator().manual_seed(2)

    def loss_fn(x, y):
        a = x[:, :, None] * x[:, None, :] + 0.1 * torch.eye(4, dtype=torch.float64)
        return F.cross_entropy(lin(torch.linalg.cholesky(a).flatten(1)), y)  # the failing line

    step = compile_step(loss_fn, lin, torch.optim.Adam(lin.parameters(), lr=0.1), max_grad_norm=1.0,
                        noise_multiplier=1.0, expected_batch_size=8, backend="eager", generator=gen,
                        max_physical_batch_size=physical)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)
    bad = x.clone()
    bad[6] = float("nan")
    for first in (True, False):  # the eager first step, then the fused program
        before = _state(lin, step, gen)
        with pytest.raises(psg.BatchInputError, match=r"torch.linalg.cholesky raises at \S*test_train_microbatch"
                                                      r".py:\d+ in loss_fn: .*# the failing line.*positions \[6\] "
                                                      r"of the batch"):
            step(bad, y)
        assert _same_state(before, _state(lin, step, gen)), "a refused step changed the state"
        step(x, y)
        assert step.steps_taken == (1 if first else 2)


@pytest.mark.parametrize(("physical", "named"), [
    (None, r"positions \[1, 5\] of the batch \(counting from 0\) fail it, the others pass"),
    (3, r"positions \[1\] of the batch \(counting from 0\) fail it, the others before position 3 pass, and the "
        r"samples from position 3 on were not checked"),
    (4, r"positions \[1\] .* before position 4 pass, and the samples from position 4 on were not checked")],
    ids=["whole", "micro3", "micro4"])
def test_failing_samples_in_two_micro_batches_name_what_was_checked(physical, named):
    """Samples 1 and 5 fail: the step stops at the first micro-batch that fails, so the refusal names the failing
    samples it saw and says which samples were not checked, not that the others pass."""
    import compiled_psg as psg

    torch.manual_seed(0)
    lin = nn.Linear(16, 3).double()

    def loss_fn(x, y):
        a = x[:, :, None] * x[:, None, :] + 0.1 * torch.eye(4, dtype=torch.float64)
        return F.cross_entropy(lin(torch.linalg.cholesky(a).flatten(1)), y)

    step = compile_step(loss_fn, lin, torch.optim.SGD(lin.parameters(), lr=0.1), max_grad_norm=1.0,
                        noise_multiplier=1.0, expected_batch_size=8, backend="eager",
                        generator=torch.Generator().manual_seed(2), max_physical_batch_size=physical)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)
    x[1] = x[5] = float("nan")
    with pytest.raises(psg.BatchInputError, match=named):
        step(x, y)
