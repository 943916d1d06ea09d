"""compile_step under torch.distributed (gloo, two local processes) against one process on the union."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from spawn_ranks import WORLD, gloo_group, run_ranks
from torch.utils.data import DataLoader, TensorDataset

from compiled_psg import compile_step

pytestmark = pytest.mark.long  # two rank processes per module: CI runs them once (.ci/run)

BATCHES = (7, 12, 1, 0, 5)  # odd sizes, a batch that leaves rank 1 empty, an empty batch
C, SIGMA = 0.3, 0.8


def model_for(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(48, 4))


def data():
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 4, (n,), generator=g)) for n in BATCHES]


def train(model, shards, sigma, rank=0, world=1, backend="eager"):
    """The run both sides do: momentum SGD, clipping on, noise from a seeded generator (drawn on rank 0)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, opt, max_grad_norm=C,
                        noise_multiplier=sigma, backend=backend,
                        generator=torch.Generator().manual_seed(5))
    for x, y in shards:
        step(x[rank::world], y[rank::world])
    return step


def _worker(rank: int, port: int, out: str) -> None:
    with gloo_group(rank, port):
        results = {}
        for sigma in (0.0, SIGMA):
            model = model_for(seed=rank)  # rank 1 starts elsewhere: the step broadcasts rank 0's parameters
            step = train(model, data(), sigma, rank, WORLD)
            results[sigma] = dict(params=[p.detach().clone() for p in model.parameters()],
                                  distributed=step.distributed, last_batch_size=step.last_batch_size,
                                  programs=step.programs)
        # Inductor: the all-reduce is a functional collective inside the compiled step program
        model = model_for(seed=rank)
        step = train(model, data(), 0.0, rank, WORLD, backend="inductor")
        results["inductor"] = dict(params=[p.detach().clone() for p in model.parameters()],
                                   programs=step.programs, compiles=step.compiles)
        from compiled_psg._train.distributed import shard
        from compiled_psg._train.private import make_private

        full = TensorDataset(torch.randn(40, 1, 4, 4), torch.randint(0, 4, (40,)))
        model = model_for(seed=0)
        private = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               DataLoader(shard(full), batch_size=4),
                               lambda x, y: F.cross_entropy(model(x), y),
                               noise_multiplier=1.0, backend="eager")
        results["private"] = dict(sample_rate=private.sample_rate, expected=private.expected_batch_size)
        torch.save(results, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_worker, tmp_path_factory, "ddp")


@pytest.mark.parametrize("sigma", [0.0, SIGMA])
def test_two_ranks_equal_one_process_on_the_union(ranks, sigma):
    model = model_for(seed=0)
    step = train(model, data(), sigma)
    expected = [p.detach() for p in model.parameters()]
    for r in ranks:
        assert r[sigma]["distributed"] and r[sigma]["last_batch_size"] == step.last_batch_size == BATCHES[-1]
        assert r[sigma]["programs"] == 1
        for got, want in zip(r[sigma]["params"], expected, strict=True):
            # sigma > 0: the same generator draws the same noise, added once (on rank 0) to the global sum
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(ranks[0][sigma]["params"], ranks[1][sigma]["params"], strict=True):
        assert torch.equal(a, b)  # the replicas stay identical


def test_inductor_program_equals_one_process(ranks):
    model = model_for(seed=0)
    train(model, data(), 0.0)
    for rank, r in enumerate(ranks):
        # compiled for B >= 2, and for B = 1 on rank 0 (rank 1's shards: 3, 6, 0, 0, 2)
        assert r["inductor"]["programs"] == 1 and r["inductor"]["compiles"] == (2 if rank == 0 else 1)
        for got, want in zip(r["inductor"]["params"], model.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def test_noise_is_added_once(ranks):
    """The noisy run differs from the noiseless one by about sigma*C per coordinate, as in one process."""
    diff = torch.cat([(a - b).flatten() for a, b in zip(ranks[0][SIGMA]["params"], ranks[0][0.0]["params"],
                                                                 strict=True)])
    assert diff.abs().max() > 1e-3


def test_make_private_uses_the_global_batch(ranks):
    for r in ranks:
        assert r["private"]["sample_rate"] == pytest.approx(4 / 20)  # each rank: 20 examples, batches of 4
        assert r["private"]["expected"] == pytest.approx(4 / 20 * 40)  # q times the union's size
