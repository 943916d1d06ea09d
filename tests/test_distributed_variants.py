"""The training features beyond flat clipping under torch.distributed (2 gloo processes): clipping variants,
adaptive clipping's count, micro-batches and bf16 parameters each equal one process on the union of the batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import assert_numbers_close
from spawn_ranks import WORLD, gloo_group, run_ranks
from test_distributed import BATCHES, data, model_for

from compiled_psg import compile_step

pytestmark = pytest.mark.long  # two rank processes per module: CI runs them once (.ci/run)

SIGMA = 0.7
VARIANTS = {
    "per_layer": dict(clipping="per_layer", max_grad_norm=[0.2, 0.1],
                      clip_groups=[["0.weight", "0.bias"], ["3.weight", "3.bias"]]),
    "automatic": dict(clipping="automatic", max_grad_norm=0.3),
    "adaptive": dict(clipping="adaptive", max_grad_norm=0.3, unclipped_num_std=2.0, target_unclipped_quantile=0.3),
    "micro_batches": dict(max_grad_norm=0.3, max_physical_batch_size=2),
    "bf16": dict(max_grad_norm=0.3),
}


def train(name: str, rank: int = 0, world: int = 1):
    model = model_for(seed=rank)  # rank 1 starts elsewhere: the step broadcasts rank 0's parameters
    if name == "bf16":
        model = model.to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, opt, noise_multiplier=SIGMA,
                        backend="eager", generator=torch.Generator().manual_seed(5), **VARIANTS[name])
    bounds = []
    for x, y in data():
        x = x.to(torch.bfloat16) if name == "bf16" else x
        step(x[rank::world], y[rank::world])
        bounds.append(step.max_grad_norm)
    return dict(params=[p.detach().float().clone() for p in model.parameters()], bounds=bounds,
                distributed=step.distributed, noise=step.last_noise_multiplier)


def _worker(rank: int, port: int, out: str) -> None:
    with gloo_group(rank, port):
        torch.save({name: train(name, rank, WORLD) for name in VARIANTS}, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_worker, tmp_path_factory, "ddp_variants")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_two_ranks_equal_one_process_on_the_union(ranks, name):
    one = train(name)
    tolerance = dict(rtol=2e-2, atol=2e-2) if name == "bf16" else dict(rtol=1e-5, atol=1e-6)
    for r in ranks:
        assert r[name]["distributed"] and not one["distributed"]
        assert_numbers_close(r[name]["bounds"], one["bounds"], rel=1e-6)  # adaptive: the same C on every rank
        for got, want in zip(r[name]["params"], one["params"], strict=True):
            torch.testing.assert_close(got, want, **tolerance)
    for a, b in zip(ranks[0][name]["params"], ranks[1][name]["params"], strict=True):
        assert torch.equal(a, b), "the replicas stay identical"


def test_adaptive_bound_moves(ranks):
    """The comparison above would hold trivially if C never moved: it does, and differently from step to step."""
    bounds = ranks[0]["adaptive"]["bounds"]
    assert len(set(bounds)) == len(BATCHES)
