"""``compile_step(..., batch_buckets=...)``: each (micro-)batch padded to a bucket with copies of a real sample
weighted 0 in the backward's seed. The padded step equals the unpadded step and the naive float64 loop: the
parameters, the loss, the norms, the batch size, with noise (seeded) too; the option is validated at build."""

from __future__ import annotations

import copy
import math
import re

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from compiled_psg import BatchInputError, DPConfigError, compile_step
from tests.reference import reference_per_sample

BUCKETS = (4, 8, 16)
SIZES = (5, 1, 9, 8)  # across the three buckets, exactly a bucket (8) and a batch of one
LR, C = 0.1, 1.8


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 25, 3)).double()


MODELS = {"mlp": (mlp, (6,), 1.8), "cnn": (cnn, (1, 5, 5), 2.8)}  # with a bound that clips some samples


def batch(n: int, shape: tuple, seed: int = 0):
    g = torch.Generator().manual_seed(1000 * seed + n)
    return torch.randn(n, *shape, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def build(model: nn.Module, buckets, reduction: str = "mean", **kw):
    m = copy.deepcopy(model)
    loss = lambda x, y: F.cross_entropy(m(x), y, reduction=reduction)  # noqa: E731
    step = compile_step(loss, m, torch.optim.SGD(m.parameters(), lr=LR), loss_reduction=reduction,
                        batch_buckets=buckets, **kw)
    return m, step


def loop_step(model: nn.Module, x, y, reduction: str, divisor: float | None, bounds=None,
              bound: float = C) -> torch.Tensor:
    """Clipped-sum DP-SGD without noise by a loop over samples, float64; returns the norms. ``bounds``: per-layer
    bounds by parameter name (None: flat clipping at ``C``)."""
    params = dict(model.named_parameters())
    per = reference_per_sample(lambda xi, yi: F.cross_entropy(model(xi), yi, reduction=reduction), params, (x, y))
    n = len(x)
    norms = torch.stack([torch.stack([per[k][i].norm() for k in params]).norm() for i in range(n)])
    with torch.no_grad():
        for k, p in params.items():
            if bounds is None:
                factors = torch.clamp(bound / norms, max=1.0)
            else:
                own = torch.stack([per[k][i].norm() for i in range(n)])
                factors = torch.clamp(bounds[k] / own, max=1.0)
            s = (per[k] * factors.view(-1, *[1] * p.dim())).sum(0)
            p -= LR * (s / divisor if divisor is not None else s)
    return norms


def assert_params(a: nn.Module, b: nn.Module, tol: float = 1e-12) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol)


def agree_over(sizes, padded: nn.Module, step_padded, plain: nn.Module, step_plain, looped: nn.Module,
               arrange=lambda x: x) -> None:
    """Steps of mean losses over batches of ``sizes``: the padded step's loss, norms' count and parameters equal the
    unpadded step's and the loop's (``arrange``: how the step takes the features, e.g. transposed)."""
    for n in sizes:
        x, y = batch(n, (6,))
        torch.testing.assert_close(step_padded(arrange(x), y), step_plain(arrange(x), y), rtol=1e-13, atol=1e-13)
        loop_step(looped, x, y, "mean", n)
        assert step_padded.last_norms.shape == (n,)
        assert_params(padded, plain)
        assert_params(padded, looped)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_padded_step_equals_unpadded_and_loop(kind: str, reduction: str):
    make, shape, bound = MODELS[kind]
    model = make()
    padded, step_padded = build(model, BUCKETS, reduction, max_grad_norm=bound)
    plain, step_plain = build(model, None, reduction, max_grad_norm=bound)
    looped = copy.deepcopy(model)
    seen = []
    for n in SIZES:
        x, y = batch(n, shape)
        loss_padded, loss_plain = step_padded(x, y), step_plain(x, y)
        norms = loop_step(looped, x, y, reduction, n if reduction == "mean" else None, bound=bound)
        seen.append(norms)
        torch.testing.assert_close(loss_padded, loss_plain, rtol=1e-13, atol=1e-13)
        assert loss_padded.shape == ()
        assert step_padded.last_batch_size == n
        assert step_padded.last_norms.shape == (n,)
        torch.testing.assert_close(step_padded.last_norms, step_plain.last_norms, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(step_padded.last_norms, norms, rtol=1e-12, atol=1e-13)
        assert_params(padded, plain)
        assert_params(padded, looped)
    seen = torch.cat(seen)
    assert (seen > bound).any() and (seen < bound).any()  # some samples were clipped, some not
    assert step_padded.captures == 1


def test_micro_batches_with_buckets():
    """``max_physical_batch_size=8`` with buckets (4, 8): a batch of 13 is micro-batches of 8 and 5 (padded to 8),
    the divisor the expected batch size, with momentum (the first step eager, then the program)."""
    model = mlp()
    steps = []
    for buckets in ((4, 8), None):
        m = copy.deepcopy(model)
        step = compile_step(lambda x, y, m=m: F.cross_entropy(m(x), y), m,
                            torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9), max_grad_norm=C,
                            expected_batch_size=10, max_physical_batch_size=8, batch_buckets=buckets)
        steps.append((m, step))
    (padded, step_padded), (plain, step_plain) = steps
    for n in (13, 3, 17, 8):
        x, y = batch(n, (6,))
        torch.testing.assert_close(step_padded(x, y), step_plain(x, y), rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(step_padded.last_norms, step_plain.last_norms, rtol=1e-12, atol=1e-13)
        assert step_padded.last_batch_size == n
        assert_params(padded, plain)


def test_batch_larger_than_the_largest_bucket_is_split():
    """Without ``max_physical_batch_size``, a batch past the largest bucket is cut into micro-batches of it."""
    model = mlp()
    padded, step_padded = build(model, (2, 4), max_grad_norm=C)
    plain, step_plain = build(model, None, max_grad_norm=C)
    agree_over((11, 3), padded, step_padded, plain, step_plain, copy.deepcopy(model))


def test_in_dims_other_than_zero():
    """The batch along dimension 1 of ``x``: padded along it."""
    model = mlp()
    steps = []
    for buckets in (BUCKETS, None):
        m = copy.deepcopy(model)
        steps.append((m, compile_step(lambda xt, y, m=m: F.cross_entropy(m(xt.t()), y), m,
                                      torch.optim.SGD(m.parameters(), lr=LR), max_grad_norm=C, in_dims=(1, 0),
                                      batch_buckets=buckets)))
    (padded, step_padded), (plain, step_plain) = steps
    agree_over((5, 2, 11), padded, step_padded, plain, step_plain, copy.deepcopy(model), arrange=torch.t)


def test_per_layer_clipping():
    model = mlp()
    padded, step_padded = build(model, BUCKETS, clipping="per_layer", max_grad_norm=C)
    plain, step_plain = build(model, None, clipping="per_layer", max_grad_norm=C)
    looped = copy.deepcopy(model)
    names = [n for n, _ in model.named_parameters()]
    bounds = dict.fromkeys(names, C / math.sqrt(len(names)))
    for n in (6, 3, 10):
        x, y = batch(n, (6,))
        step_padded(x, y)
        step_plain(x, y)
        loop_step(looped, x, y, "mean", n, bounds=bounds)
        assert_params(padded, plain)
        assert_params(padded, looped)


def test_adaptive_clipping_counts_real_samples():
    """The unclipped count (and so the next bound) is over the real samples: a padded row's norm is 0, which
    would count as unclipped."""
    model = mlp()
    kw = dict(clipping="adaptive", max_grad_norm=0.05, noise_multiplier=0.0, unclipped_num_std=0.0,
              expected_batch_size=6)
    padded, step_padded = build(model, BUCKETS, **kw)
    plain, step_plain = build(model, None, **kw)
    for n in (5, 9, 3, 6):
        x, y = batch(n, (6,))
        step_padded(x, y)
        step_plain(x, y)
        assert step_padded.last_unclipped == step_plain.last_unclipped
        assert step_padded.max_grad_norm == pytest.approx(step_plain.max_grad_norm, rel=1e-12)
        assert_params(padded, plain)
    assert step_plain.max_grad_norm != 0.05  # the bound moved


def test_noise_does_not_depend_on_the_bucket():
    model = mlp()
    runs = []
    for buckets in (BUCKETS, None):
        m, step = build(model, buckets, max_grad_norm=C, noise_multiplier=1.3, expected_batch_size=6,
                        generator=torch.Generator().manual_seed(7))
        for n in (5, 9, 2):
            step(*batch(n, (6,)))
        runs.append(m)
    assert_params(*runs)
    assert not torch.equal(runs[0][0].weight, mlp()[0].weight)


def test_empty_batch_is_a_step_of_noise():
    model = mlp()
    runs = []
    for buckets in (BUCKETS, None):
        m, step = build(model, buckets, max_grad_norm=C, noise_multiplier=1.0, expected_batch_size=4,
                        generator=torch.Generator().manual_seed(3))
        step(*batch(3, (6,)))
        loss = step(*batch(0, (6,)))
        assert torch.isnan(loss) and step.last_batch_size == 0 and step.steps_taken == 2
        step(*batch(6, (6,)))
        runs.append(m)
    assert_params(*runs)


def test_padded_row_of_a_huge_loss_contributes_exactly_zero():
    """Sample 0 (the one copied into the padding) has inputs near float64's limit: its squared input norm
    overflows to inf, and its own clip factor is 0. A padded copy, weighted 0, has per-sample gradients exactly 0:
    norm 0, nothing added to the clipped sums (the ghost norm's zero factor wins over the inf one)."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3).double()
    x, y = batch(3, (6,))
    x[0] = 1e160
    with torch.no_grad():
        y[0] = model(x[:1]).argmin()  # its loss is about 1e160
    padded, step_padded = build(model, (8,), max_grad_norm=C)
    plain, step_plain = build(model, None, max_grad_norm=C)
    loss_padded, loss_plain = step_padded(x, y), step_plain(x, y)
    assert torch.isfinite(loss_plain) and loss_plain > 1e100  # huge, finite
    assert torch.equal(loss_padded, loss_plain)
    assert torch.equal(step_padded.last_norms, step_plain.last_norms)
    assert math.isinf(step_plain.last_norms[0])
    assert_params(padded, plain)
    for p in padded.parameters():
        assert torch.isfinite(p).all()
    # the weighted per-sample graph itself: the padded rows' norms are exactly 0
    f = step_padded.per_sample
    rows = torch.cat([x, x[:1].expand(5, -1)]), torch.cat([y, y[:1].expand(5)])
    call = f.prepare_call(*rows)
    weights = torch.tensor([1.0] * 3 + [0.0] * 5, dtype=torch.float64)
    from compiled_psg._train.paths import run_per_sample

    _, _, (sums, norms) = run_per_sample(step_padded.inputs, call.entry, step_padded.config, call.params,
                                         (*call.args, weights), call.batch_size)
    assert torch.equal(norms[3:], torch.zeros(5, dtype=torch.float64))


def test_the_steps_per_sample_function_weighs_every_sample_one():
    """``step.per_sample`` (its graph takes the seed weights) called on a batch: each sample weighs 1."""
    model = mlp()
    _, step_padded = build(model, BUCKETS, max_grad_norm=C)
    _, step_plain = build(model, None, max_grad_norm=C)
    x, y = batch(5, (6,))
    (_, got), (_, want) = step_padded.per_sample(x, y), step_plain.per_sample(x, y)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    # the weights are the graph's last input of a role, batched along their only dimension; without buckets the
    # graph takes none
    rw = step_padded.per_sample.prepare_call(x, y).entry.rewritten
    weights = [n for n in rw.graph_module.graph.nodes if n.op == "placeholder"][len(rw.roles) - 1]
    assert rw.roles[-1].batched and rw.roles[-1].key == 2 and rw.batch.is_batched(weights)
    plain = step_plain.per_sample.prepare_call(x, y).entry.rewritten
    assert plain.seed_weights is None and len(plain.roles) == len(plain.captured.roles)


class Counting(nn.Module):
    """A linear model whose forward writes buffers under ``torch.no_grad()``: from the batch (``seen``, the batch
    size; ``mean_x``, the batch's mean) and not from it (``calls``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 3).double()
        self.register_buffer("seen", torch.zeros((1,), dtype=torch.float64))
        self.register_buffer("mean_x", torch.zeros(6, dtype=torch.float64))
        self.register_buffer("calls", torch.zeros((1,), dtype=torch.float64))

    def forward(self, x, write_batch: bool = True):
        with torch.no_grad():
            self.calls.add_(1)
            if write_batch:
                self.seen.add_(x.shape[0])
                self.mean_x.copy_(x.mean(0))
        return self.lin(x)


def step_state(model: nn.Module, step, generator: torch.Generator) -> list:
    """What a refused step must leave as it was: parameters, buffers, the step count, the noise generator."""
    return [*(t.clone() for t in model.state_dict().values()), step.steps_taken, generator.get_state()]


def assert_unchanged(before: list, after: list) -> None:
    assert len(before) == len(after)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("buckets", [(4, 8), (2,)], ids=["one-piece", "micro-batches"])
def test_public_buffer_written_from_the_batch_is_refused(buckets):
    """A public buffer written from the padded batch would count the padded copies (``seen`` 4 for 3 samples,
    ``mean_x`` over the copies): refused before anything runs, naming the buffers and the fix."""
    m = Counting()
    g = torch.Generator().manual_seed(0)
    step = compile_step(lambda x, y: F.cross_entropy(m(x), y), m, torch.optim.SGD(m.parameters(), lr=LR),
                        max_grad_norm=C, noise_multiplier=1.0, expected_batch_size=4.0, generator=g,
                        public_buffers=["seen", "mean_x"], batch_buckets=buckets)
    x, y = batch(3, (6,))
    before = step_state(m, step, g)
    with pytest.raises(DPConfigError, match=r"(?s)public buffer 'seen'.*public buffer 'mean_x'.*batch_buckets=None"):
        step(x, y)
    assert_unchanged(before, step_state(m, step, g))
    # without buckets the buffers are the batch's
    m2 = Counting()
    step2 = compile_step(lambda x, y: F.cross_entropy(m2(x), y), m2, torch.optim.SGD(m2.parameters(), lr=LR),
                         max_grad_norm=C, expected_batch_size=4.0, public_buffers=["seen", "mean_x"])
    step2(x, y)
    assert m2.seen.item() == 3 and torch.equal(m2.mean_x, x.mean(0))


def test_public_buffer_written_without_the_batch_passes():
    """A write that does not read the batch (a call counter) is the same padded or not: it passes."""
    runs = []
    for buckets in ((4, 8), None):
        m = Counting()
        step = compile_step(lambda x, y, m=m: F.cross_entropy(m(x, write_batch=False), y), m,
                            torch.optim.SGD(m.parameters(), lr=LR), max_grad_norm=C, expected_batch_size=4.0,
                            public_buffers=["calls"], batch_buckets=buckets)
        for n in (3, 5):
            step(*batch(n, (6,)))
        assert m.calls.item() == 2
        runs.append(m)
    assert_params(*runs)


@pytest.mark.parametrize("buckets", [(4, 8), (2,)], ids=["one-piece", "micro-batches"])
def test_write_to_a_batched_argument_is_refused(buckets):
    """The loss runs on a padded copy of the batch: its write into ``x`` would be lost (one piece) or reach the
    first micro-batch's rows only. Refused before anything runs, naming the argument, its line and the fix."""
    m = nn.Linear(6, 3).double()
    g = torch.Generator().manual_seed(0)

    def loss(x, y):
        with torch.no_grad():
            x.mul_(2)
        return F.cross_entropy(m(x), y)

    step = compile_step(loss, m, torch.optim.SGD(m.parameters(), lr=LR), max_grad_norm=C, noise_multiplier=1.0,
                        expected_batch_size=4.0, generator=g, batch_buckets=buckets)
    x, y = batch(3, (6,))
    x_before, before = x.clone(), step_state(m, step, g)
    with pytest.raises(DPConfigError, match=r"(?s)argument 0 \(x\) of the loss, written at .*x.mul_\(2\).*"
                                            r"batch_buckets=None"):
        step(x, y)
    assert torch.equal(x, x_before)
    assert_unchanged(before, step_state(m, step, g))


def singular_loss(m: nn.Module):
    return lambda x: torch.linalg.inv(m(x).view(-1, 2, 2) * 0 + x.view(-1, 2, 2)).sum()


@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["program", "eager-first-step"])
@pytest.mark.parametrize("buckets, n, bad, named", [
    pytest.param((4,), 3, [0], "[0] of the batch (counting from 0) fail it, the others pass", id="first-copied"),
    pytest.param((2, 4), 5, [4], "[4] of the batch (counting from 0) fail it, the others pass", id="last-piece"),
    pytest.param((8,), 3, [0, 2], "[0, 2] of the batch (counting from 0) fail it, the others pass", id="two"),
    pytest.param((4,), 6, [4], "[4] of the batch (counting from 0) fail it, the others pass", id="piece-copied"),
])
def test_failing_samples_are_named_at_their_positions_in_the_batch(buckets, n, bad, named, momentum):
    """A padded copy of a failing sample is that sample: the error names the user's positions only, each once
    (a padded piece's copies map back to the sample they copy), with micro-batches offset as without buckets."""
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    step = compile_step(singular_loss(m), m, torch.optim.SGD(m.parameters(), lr=LR, momentum=momentum),
                        max_grad_norm=C, expected_batch_size=4.0, batch_buckets=buckets)
    x = torch.eye(2).flatten().repeat(n, 1)
    x[bad] = 0
    with pytest.raises(BatchInputError, match=re.escape(f"The samples at positions {named}")):
        step(x)


@pytest.mark.parametrize("buckets, why", [
    ((0, 4), "positive"), ((4, 4), "increasing"), ((8, 4), "increasing"), ((4.0, 8), "int"), ("48", "int"),
    ((), "at least one"), ((True, 4), "int"), (8, "sequence"), ((np.True_, 4), "ints, got bool"),
    ((np.float32(2), 4), "ints, got float32"), ((torch.tensor(2), 4), r"ints, got Tensor tensor\(2\)"),
])
def test_invalid_buckets_are_refused(buckets, why):
    with pytest.raises(DPConfigError, match=why):
        build(mlp(), buckets, max_grad_norm=C)


def test_buckets_of_numpy_ints_are_taken_as_python_ints():
    """numpy's integers are ints (``numbers.Integral``): np.int64 sizes were refused as "must hold ints". They are
    stored as Python ints."""
    _, step = build(mlp(), [np.int64(4), np.int32(8)], max_grad_norm=C)
    assert step.batch_buckets == (4, 8) and {type(b) for b in step.batch_buckets} == {int}


@pytest.mark.parametrize("sizes", [np.array([4, 8]), torch.tensor([4, 8])], ids=["numpy", "tensor"])
def test_buckets_given_as_an_array_are_taken_as_their_sizes(sizes):
    """Red team M: ``batch_buckets=np.array([4, 8])`` was refused as "not a sequence". A 1-D array or tensor of
    integers holds the sizes; a float array or a 2-D one is refused as any other bad value."""
    _, step = build(mlp(), sizes, max_grad_norm=C)
    assert step.batch_buckets == (4, 8) and {type(b) for b in step.batch_buckets} == {int}
    for bad, why in ((np.array([4.0, 8.0]), "ints, got float 4.0"), (np.array([[4, 8]]), "sequence"),
                     (torch.tensor([8, 4]), "increasing")):
        with pytest.raises(DPConfigError, match=why):
            build(mlp(), bad, max_grad_norm=C)


def test_buckets_larger_than_the_physical_batch_are_refused():
    with pytest.raises(DPConfigError, match="max_physical_batch_size"):
        build(mlp(), (4, 16), max_grad_norm=C, max_physical_batch_size=8)


def test_buckets_with_a_custom_reduction_are_refused():
    import compiled_psg as psg

    reduce = psg.custom(lambda g: {n: v.sum(0) for n, v in g.items()})
    with pytest.raises(DPConfigError, match="batch_buckets"):
        build(mlp(), BUCKETS, reduce=reduce)


def test_cuda_graphs_on_cpu_are_refused():
    with pytest.raises(DPConfigError, match="cpu"):
        build(mlp(), BUCKETS, max_grad_norm=C, cuda_graphs=True)
    with pytest.raises(DPConfigError, match="True or False"):
        build(mlp(), BUCKETS, max_grad_norm=C, cuda_graphs="yes")


@pytest.mark.inductor
def test_compiled_program_serves_every_bucket_with_one_compile():
    model = mlp()
    padded, step_padded = build(model, (4, 8), max_grad_norm=C, backend="inductor")
    plain, step_plain = build(model, None, max_grad_norm=C, backend="eager")
    compiles = None
    for k, n in enumerate((3, 7, 4, 5, 8, 2)):
        x, y = batch(n, (6,))
        torch.testing.assert_close(step_padded(x, y), step_plain(x, y), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(step_padded.last_norms, step_plain.last_norms, rtol=1e-12, atol=1e-12)
        assert_params(padded, plain, 1e-11)
        if k == 0:
            compiles = step_padded.compiles
    assert step_padded.compiles == compiles == 1  # the program, symbolic in the bucket
