"""compile_step on a fully_shard (FSDP2) model: two gloo processes (three for one test) against one process on the
union, float64: flat clipping, the clipping variants, save and resume."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import assert_numbers_close
from spawn_ranks import WORLD, gloo_group, run_ranks
from torch.utils import _pytree as pytree

from compiled_psg import compile_step, explain
from compiled_psg._errors import DPConfigError, UnsupportedError

BATCHES = (7, 12, 1, 0, 5)  # odd sizes, a batch that leaves rank 1 empty, an empty batch
C, SIGMA = 0.3, 0.8
VARIANTS = {
    "per_layer": dict(clipping="per_layer", max_grad_norm=[0.2, 0.1],
                      clip_groups=[["0.weight", "0.bias"], ["2.weight", "2.bias"]]),
    "automatic": dict(clipping="automatic", max_grad_norm=0.3),
    "adaptive": dict(clipping="adaptive", max_grad_norm=0.3, unclipped_num_std=2.0, target_unclipped_quantile=0.3),
}


def model_for(seed: int = 0, hidden: int = 5) -> nn.Module:
    """Odd widths: FSDP shards 5 rows as 3 + 2 and 3 rows as 2 + 1 (uneven, padded shards)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 3)).double()


def by_columns(p: torch.Tensor):
    """The first layer's weight is sharded along its columns (FSDP's ``shard_placement_fn``; FSDP shards other
    dims than 0 only evenly)."""
    from torch.distributed.tensor import Shard

    return Shard(p.dim() - 1)


def shard_model(model: nn.Module, **options) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[0], shard_placement_fn=by_columns, **options)
    fully_shard(model[2], **options)
    return fully_shard(model, **options)


def shards(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """FSDP's shards of a full parameter: rows, or columns for the first layer's weight."""
    return t.chunk(WORLD, dim=1 if t.dim() == 2 and t.shape[1] == 4 else 0)


def data():
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))
            for n in BATCHES]


def train(model, shards, sigma, rank=0, world=1, **options):
    """The run both sides do: momentum SGD, clipping on, noise from a seeded generator (drawn on rank 0)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, opt, max_grad_norm=C,
                        noise_multiplier=sigma, backend="eager", generator=torch.Generator().manual_seed(5),
                        **options)
    for k, (x, y) in enumerate(shards):
        step(x[rank::world], y[rank::world])
        if k == 1:
            with torch.no_grad():
                model(x)  # an evaluation between steps: FSDP's own forward (lazy init, its hooks) runs
    return step


def full(model: nn.Module) -> list[torch.Tensor]:
    """The unsharded parameters (an all-gather: every rank calls it)."""
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def clipped_sums(model, x, y, rank) -> dict:
    """``p.grad`` (full) after steps of SGD(lr=0) with loss 'sum': the clipped sum of the union's gradients
    without and with a planted outlier, and a step on an empty batch: the noise alone."""
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y, reduction="sum"), model,
                        torch.optim.SGD(model.parameters(), lr=0.0), max_grad_norm=C, loss_reduction="sum",
                        backend="eager", generator=torch.Generator().manual_seed(100 + rank))  # ranks differ
    grads = lambda: torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])  # noqa: E731
    out = {}
    step(x[:5][rank::WORLD], y[:5][rank::WORLD])
    out["without"] = grads()
    x_out = x.clone()
    x_out[5] *= 1e3  # sample 5 is rank 1's (5 = 1 mod 2); its gradient's norm is far above C
    step(x_out[rank::WORLD], y[rank::WORLD])
    out["with"] = grads()
    step.noise_multiplier = 4.0
    step(x[:0], y[:0])
    out["noise"] = grads()
    out["captures"] = step.captures
    return out


def _refusals(rank: int) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    out = {}
    loss = F.cross_entropy
    model = shard_model(model_for(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
    with pytest.raises(UnsupportedError, match="MixedPrecisionPolicy") as e:
        compile_step(lambda x, y: loss(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.1))
    out["mixed"] = str(e.value)
    model = shard_model(model_for(), offload_policy=CPUOffloadPolicy(pin_memory=False))
    with pytest.raises(UnsupportedError, match="CPUOffloadPolicy") as e:
        compile_step(lambda x, y: loss(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.1))
    out["offload"] = str(e.value)
    model = model_for()
    fully_shard(model[0])  # model[2] left unsharded: its update would need an all-reduce
    with pytest.raises(UnsupportedError, match="not sharded") as e:
        compile_step(lambda x, y: loss(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.1))
    out["partial"] = str(e.value)
    model = shard_model(model_for())
    with pytest.raises(DPConfigError, match="distributed=False") as e:
        compile_step(lambda x, y: loss(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.1),
                     distributed=False)
    out["local"] = str(e.value)
    import compiled_psg as psg

    with pytest.raises(DPConfigError, match="custom reduction") as e:
        compile_step(lambda x, y: loss(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.1),
                     reduce=psg.custom(lambda n, g: g.sum(0)))
    out["variant"] = str(e.value)
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = FullyShardedDataParallel(model_for(), device_id=torch.device("cpu"))
    with pytest.raises(UnsupportedError, match="FSDP1") as e:
        compile_step(lambda x, y: loss(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.1))
    out["fsdp1"] = str(e.value)
    return out


def swapped(rank: int = 0, world: int = 1) -> dict:
    """Two steps with the activation swapped in between (Tanh for ReLU): the changed submodule of the sharded
    model is seen (Dynamo guards FSDP-managed modules only with ``skip_fsdp_guards=False``) and recaptured."""
    model = model_for()
    if world > 1:
        model = shard_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, opt, max_grad_norm=C, backend="eager")
    (x, y), (x2, y2) = data()[:2]
    step(x[rank::world], y[rank::world])
    model[1] = nn.ReLU()
    step(x2[rank::world], y2[rank::world])
    params = full(model) if world > 1 else [p.detach().clone() for p in model.parameters()]
    return dict(params=params, captures=step.captures)


def build(name: str, seed: int = 0, world: int = 1, adam: bool = False):
    """A clipping variant's step with seeded noise: momentum SGD, or Adam (whose update amplifies the rounding
    of the sums' order, 1e-6 after five steps: compared bit for bit with itself only)."""
    model = model_for(seed)
    if world > 1:
        model = shard_model(model)
    opt = (torch.optim.Adam(model.parameters(), lr=0.05) if adam
           else torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, opt, noise_multiplier=0.7,
                        backend="eager", generator=torch.Generator().manual_seed(5), **VARIANTS[name])
    return model, step


def local_state(step) -> dict:
    """This rank's optimizer state, sharded entries as their local tensors (copies)."""
    return {i: {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in entries.items()}
            for i, entries in step.optimizer.state_dict()["state"].items()}


def run_steps(model, step, batches, rank: int, world: int, bounds: list | None = None) -> dict:
    for x, y in batches:
        step(x[rank::world], y[rank::world])
        if bounds is not None:
            bounds.append(step.max_grad_norm)
    local = [(p.to_local() if world > 1 else p.detach()).clone() for p in model.parameters()]
    return dict(local=local, state=local_state(step), bound=step.max_grad_norm, steps=step.steps_taken)


def variant(name: str, rank: int = 0, world: int = 1) -> dict:
    """Five steps of a clipping variant, sharded over ``world`` ranks or not."""
    model, step = build(name, world=world)
    bounds = []
    run_steps(model, step, data(), rank, world, bounds)
    params = full(model) if world > 1 else [p.detach().clone() for p in model.parameters()]
    return dict(params=params, bounds=bounds, sharded=getattr(step, "sharded", False))


def resume(rank: int, out: str) -> dict:
    """Adaptive clipping (the moving bound, the count's noise) and Adam (sharded moments, a plain ``step``): five
    steps without a break; and two steps, a save of each rank's state to its own file, fresh objects from
    another initialization, a load and the three steps left."""
    batches = data()
    want = run_steps(*build("adaptive", world=WORLD, adam=True), batches, rank, WORLD)
    model, step = build("adaptive", world=WORLD, adam=True)
    run_steps(model, step, batches[:2], rank, WORLD)
    path = f"{out}/step_rank{rank}.pt"
    saved = step.state_dict()
    plain = not any(hasattr(t, "device_mesh") for t in pytree.tree_leaves(saved))
    torch.save(saved, path)
    del model, step, saved
    model, step = build("adaptive", seed=1, world=WORLD, adam=True)
    fresh = [p.to_local().clone() for p in model.parameters()]
    state = torch.load(path)
    with pytest.raises(DPConfigError, match="each rank loads its own shards") as e:
        step.load_state_dict({**state, "shards": {**state["shards"], "rank": 1 - rank}})
    with pytest.raises(DPConfigError, match=r"DPStep.load_state_dict takes a DPStep's state_dict\(\), got NoneType"):
        step.load_state_dict(None)  # raised AttributeError 'get'
    step.load_state_dict(state)
    return dict(got=run_steps(model, step, batches[2:], rank, WORLD), want=want, plain=plain, fresh=fresh,
                refused=str(e.value))


def failed_update(rank: int) -> dict:
    """Adam, sharded: the second step fails after torch's ``optimizer.step()`` has written the shards (an
    interrupt, say), then training goes on; beside it the uninterrupted run."""
    batches = data()
    model, step = build("automatic", world=WORLD, adam=True)
    x, y = batches[0]
    step(x[rank::WORLD], y[rank::WORLD])
    before = dict(local=[p.to_local().clone() for p in model.parameters()], state=local_state(step),
                  steps=step.steps_taken)
    real = step._sharded_update

    def failing(*args, **kwargs):  # not in optimizer.step: code of the user's there would release the update
        real(*args, **kwargs)
        raise KeyboardInterrupt

    step._sharded_update = failing
    x, y = batches[1]
    with pytest.raises(KeyboardInterrupt):
        step(x[rank::WORLD], y[rank::WORLD])
    del step._sharded_update
    after = dict(local=[p.to_local().clone() for p in model.parameters()], state=local_state(step),
                 steps=step.steps_taken)
    got = run_steps(model, step, batches[1:3], rank, WORLD)
    want = run_steps(*build("automatic", world=WORLD, adam=True), batches[:3], rank, WORLD)
    return dict(before=before, after=after, got=got, want=want)


def _worker(rank: int, port: int, out: str) -> None:
    with gloo_group(rank, port):
        results = {}
        # micro-batches of at most 4: the second batch's 6 local samples run as 4 + 2 on each rank
        model = shard_model(model_for())  # FSDP: every rank builds the same model, then keeps its shards
        step = train(model, data(), SIGMA, rank, WORLD, max_physical_batch_size=4)
        results["whole"] = dict(params=full(model), sharded=step.sharded, fused=step.fused, captures=step.captures,
                                last_batch_size=step.last_batch_size,
                                local=[p.to_local().clone() for p in model.parameters()],
                                forward=model(data()[0][0]).detach())  # FSDP's own forward still works
        # float32: the noise is the native stream where it runs, drawn parameter by parameter on rank 0
        model = shard_model(model_for().float())
        train(model, _float32(data()), SIGMA, rank, WORLD)
        results["float32"] = full(model)
        # the clip bound and the noise: SGD(lr=0) leaves the parameters as they are and the sums in .grad
        g = torch.Generator().manual_seed(3)
        x, y = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)
        results["sums"] = clipped_sums(shard_model(model_for(hidden=64)), x, y, rank)
        # make_private builds its step with compile_step: a sharded one, with the global sampling rate
        from torch.utils.data import DataLoader, TensorDataset

        from compiled_psg._train.distributed import shard
        from compiled_psg._train.private import make_private

        union = TensorDataset(torch.randn(40, 4, dtype=torch.float64), torch.randint(0, 3, (40,)))
        model = shard_model(model_for())
        private = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               DataLoader(shard(union), batch_size=4), lambda x, y: F.cross_entropy(model(x), y),
                               max_grad_norm=C, noise_multiplier=1.0, backend="eager")
        for _, (xb, yb) in zip(range(2), private.data_loader, strict=False):  # every rank: the same step count
            private.step(xb, yb)
        xs, ys = union.tensors  # a batch that is never empty (the last Poisson batch can be)
        report = explain(private, xs[:4], ys[:4])  # the per-sample graph on the unsharded parameters, as captured
        results["private"] = dict(sharded=private.dp_step.sharded, steps=private.steps,
                                  sample_rate=private.sample_rate, epsilon=private.epsilon(),
                                  explained=[(r.name, tuple(r.shape)) for r in report.rewrites],
                                  captures=private.dp_step.captures)
        results["swapped"] = swapped(rank, WORLD)
        results["variants"] = {name: variant(name, rank, WORLD) for name in VARIANTS}
        results["resume"] = resume(rank, out)
        results["refusals"] = _refusals(rank)
        results["failed_update"] = failed_update(rank)
        torch.save(results, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_worker, tmp_path_factory, "fsdp")


@pytest.fixture(scope="module")
def one_process():
    """One process, the unsharded model, the union of the batches, the same noise generator."""
    model = model_for()
    step = train(model, data(), SIGMA)
    return model, step


def test_two_sharded_ranks_equal_one_process_on_the_union(ranks, one_process):
    model, step = one_process
    expected = [p.detach() for p in model.parameters()]
    for rank, r in enumerate(ranks):
        got = r["whole"]
        assert got["sharded"] and not got["fused"] and got["last_batch_size"] == step.last_batch_size == BATCHES[-1]
        assert got["captures"] == 1  # the unsharded parameters are the same tensors every step: no recapture
        for g, want, local in zip(got["params"], expected, got["local"], strict=True):
            # the same generator draws the same noise, added once (on rank 0) before the reduce-scatter; the
            # sums differ from one process's only in their order
            torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12)
            assert torch.equal(local, shards(g)[rank])  # the shard is FSDP's rows (columns) of the full tensor
        torch.testing.assert_close(got["forward"], model(data()[0][0]).detach(), rtol=1e-10, atol=1e-12)


def _float32(batches):
    return [(x.float(), y) for x, y in batches]


def test_float32_sharded_ranks_draw_the_noise_one_process_draws(ranks):
    """In float32 one process draws all the noise at once (the native AES-CTR stream where it runs) and the
    sharded step one parameter at a time (``gaussian_stream``): the same numbers, so the same parameters up to
    the order of float32 sums (noise of std sigma C = 0.24 would show far above that)."""
    model = model_for().float()
    train(model, _float32(data()), SIGMA)
    for r in ranks:
        for got, want in zip(r["float32"], model.parameters(), strict=True):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)


def test_shards_are_the_rows_fsdp_holds(ranks):
    """The first weight's 4 columns as 2 + 2; uneven rows: 5 as 3 + 2 and 3 as 2 + 1."""
    got = [[tuple(t.shape) for t in r["whole"]["local"]] for r in ranks]
    assert got == [[(5, 2), (3,), (2, 5), (2,)], [(5, 2), (2,), (1, 5), (1,)]]


def test_a_planted_outlier_moves_the_sum_by_at_most_C(ranks):
    for r in ranks:
        assert r["sums"]["captures"] == 1
        moved = (r["sums"]["with"] - r["sums"]["without"]).norm()
        # the outlier's gradient is clipped to norm C exactly (unclipped, it is ~1e3 times larger)
        assert moved <= C * (1 + 1e-9)
        assert moved > 0.99 * C


def test_noise_is_added_once(ranks):
    """An empty global batch: the sum is the noise alone, std sigma C: once, not sqrt(2) times (both ranks'),
    although the ranks' generators differ; every rank holds the same update."""
    torch.testing.assert_close(ranks[0]["sums"]["noise"], ranks[1]["sums"]["noise"], rtol=0, atol=0)
    noise = ranks[0]["sums"]["noise"]
    assert noise.numel() > 400
    std = noise.std().item()
    assert 0.85 * 4.0 * C < std < 1.15 * 4.0 * C, std


def test_unsupported_shardings_are_refused_with_the_fix(ranks):
    for r in ranks:
        assert all("Fix:" in r["refusals"][k] for k in ("mixed", "offload", "partial", "fsdp1"))
        assert "Fix:" in r["refusals"]["local"] and "Fix:" in r["refusals"]["variant"]


def test_make_private_on_a_sharded_model(ranks):
    for r in ranks:
        got = r["private"]
        assert got["sharded"] and got["steps"] == 2
        assert got["sample_rate"] == pytest.approx(4 / 20)  # each rank: 20 examples, batches of 4
        assert 0 < got["epsilon"] < float("inf")
        full_shapes = [(n, tuple(p.shape)) for n, p in model_for().named_parameters()]
        assert got["explained"] == full_shapes and got["captures"] == 1  # explain reused the steps' capture


def test_a_swapped_submodule_is_recaptured(ranks):
    expected = swapped()
    assert expected["captures"] == 2
    for r in ranks:
        assert r["swapped"]["captures"] == 2
        for got, want in zip(r["swapped"]["params"], expected["params"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_clipping_variants_equal_one_process_on_the_union(ranks, name):
    one = variant(name)
    for r in ranks:
        got = r["variants"][name]
        assert got["sharded"] and not one["sharded"]
        # the counts of adaptive clipping are summed over the ranks, the count's noise drawn once on rank 0
        assert_numbers_close(got["bounds"], one["bounds"], rel=1e-12)
        for g, want in zip(got["params"], one["params"], strict=True):
            torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12)
    assert ranks[0]["variants"][name]["bounds"] == ranks[1]["variants"][name]["bounds"], "the same C on every rank"


def test_clipping_variants_differ(ranks):
    """The comparisons above would also hold if the variants all clipped alike: they do not; and adaptive's C
    moves at every step."""
    runs = ranks[0]["variants"]
    for a, b in [("per_layer", "automatic"), ("per_layer", "adaptive"), ("automatic", "adaptive")]:
        assert not torch.allclose(runs[a]["params"][0], runs[b]["params"][0], rtol=1e-6, atol=1e-8)
    assert len(set(runs["adaptive"]["bounds"])) == len(BATCHES)


def test_resumed_sharded_run_is_bit_identical(ranks):
    for r in ranks:
        got, want = r["resume"], r["resume"]["want"]
        assert got["plain"], "the saved state holds local tensors, not DTensors"
        assert not all(torch.equal(a, b) for a, b in zip(got["fresh"], want["local"], strict=True))
        assert got["got"]["steps"] == want["steps"] == len(BATCHES)
        assert got["got"]["bound"] == want["bound"]
        for a, b in zip(got["got"]["local"], want["local"], strict=True):
            assert torch.equal(a, b)
        assert got["got"]["state"].keys() == want["state"].keys()
        for i, entries in want["state"].items():
            assert entries.keys() == got["got"]["state"][i].keys() == {"step", "exp_avg", "exp_avg_sq"}
            assert all(torch.equal(got["got"]["state"][i][k], v) for k, v in entries.items())
        assert "Fix:" in got["refused"]


THREE = 3


def _three_ranks_worker(rank: int, port: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    with gloo_group(rank, port, world=THREE):
        model = model_for(hidden=4)
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        step = train(model, data(), SIGMA, rank, THREE, max_physical_batch_size=3)
        torch.save(dict(params=full(model), local=[tuple(p.to_local().shape) for p in model.parameters()],
                        last_batch_size=step.last_batch_size), f"{out}/rank{rank}.pt")


def test_three_ranks_with_uneven_and_empty_shards_equal_one_process(tmp_path_factory):
    """Rows 4 as 2 + 2 + 0 (rank 2 holds nothing of the first layer) and 3 as 1 + 1 + 1; batches of 7, 12, 1, 0, 5
    over three ranks (the batch of one leaves ranks 1 and 2 empty)."""
    ranks = run_ranks(_three_ranks_worker, tmp_path_factory, "fsdp3", world=THREE)
    model = model_for(hidden=4)
    step = train(model, data(), SIGMA, max_physical_batch_size=3)
    assert [r["local"] for r in ranks] == [[(2, 4), (2,), (1, 4), (1,)], [(2, 4), (2,), (1, 4), (1,)],
                                           [(0, 4), (0,), (1, 4), (1,)]]
    for r in ranks:
        assert r["last_batch_size"] == step.last_batch_size
        for got, want in zip(r["params"], model.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)


def test_a_sharded_step_failing_after_its_update_is_undone(ranks):
    """The shards, Adam's sharded state and the count are as before the failed call, and the run that goes on
    equals the uninterrupted one bit for bit (the generator was rewound with them)."""
    for result in ranks:
        failed = result["failed_update"]
        before, after = failed["before"], failed["after"]
        assert after["steps"] == before["steps"] == 1
        assert all(torch.equal(a, b) for a, b in zip(before["local"], after["local"], strict=True))
        assert before["state"].keys() == after["state"].keys()
        for i, entries in before["state"].items():
            assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(after["state"][i][k]))
                       for k, v in entries.items())
        got, want = failed["got"], failed["want"]
        assert got["steps"] == want["steps"] == 3
        assert all(torch.equal(a, b) for a, b in zip(got["local"], want["local"], strict=True))
