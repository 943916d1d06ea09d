"""compile_step: limit cases against a plain optimizer step, clipping bound, noise statistics, recompiles."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import check_gaussian, ref_clip_sum, reference_per_sample
from torch.utils import _pytree as pytree

from compiled_psg import compile_step
from compiled_psg._errors import DPConfigError
from compiled_psg._train import dp, native_noise
from compiled_psg._train.dp import gaussian_many, secure_gaussian

OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(64, 10))


def batch(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def plain_step(model, optimizer, loss_fn, x, y):
    optimizer.zero_grad()
    loss_fn(model, x, y).backward()
    optimizer.step()


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def ce_mean(model, x, y):
    return F.cross_entropy(model(x), y)


def ce_sum(model, x, y):
    return F.cross_entropy(model(x), y, reduction="sum")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("max_grad_norm", [1e6, None])
def test_sigma_zero_huge_clip_is_plain_step(name, max_grad_norm):
    """sigma=0 and C -> infinity: the step is the optimizer's ordinary step on the mean loss."""
    ours, ref = small_cnn(), small_cnn()
    opt_ours, opt_ref = OPTIMIZERS[name](ours.parameters()), OPTIMIZERS[name](ref.parameters())
    step = compile_step(lambda x, y: ce_mean(ours, x, y), ours, opt_ours, max_grad_norm=max_grad_norm,
                        backend="eager")
    for n in (16, 9, 5):  # several sizes: also exercises the optimizer state (momentum, Adam moments)
        x, y = batch(n, seed=n)
        with torch.no_grad():
            expected = ce_mean(ref, x, y)
        loss = step(x, y)
        assert torch.allclose(loss, expected, atol=1e-4)
        plain_step(ref, opt_ref, ce_mean, x, y)
    assert max_diff(ours, ref) < 1e-6
    assert step.per_sample.captures == 1 and step.program_builds == 1 and step.fused


def test_sum_reduction_is_plain_step_of_sum_loss():
    ours, ref = small_cnn(), small_cnn()
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.01)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.01)
    step = compile_step(lambda x, y: ce_sum(ours, x, y), ours, opt_ours, loss_reduction="sum",
                        backend="eager")
    x, y = batch(12)
    step(x, y)
    plain_step(ref, opt_ref, ce_sum, x, y)
    assert max_diff(ours, ref) < 1e-6


def test_expected_batch_size_divides_the_sum():
    """loss_reduction="mean" with expected_batch_size: the gradient is the sum over expected_batch_size."""
    ours, ref = small_cnn(), small_cnn()
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1 / 20)
    step = compile_step(lambda x, y: ce_mean(ours, x, y), ours, opt_ours, expected_batch_size=20,
                        backend="eager")
    x, y = batch(7)
    step(x, y)
    plain_step(ref, opt_ref, ce_sum, x, y)
    assert max_diff(ours, ref) < 1e-6


def test_no_sample_contributes_more_than_C():
    """Plant one sample with a huge gradient: its share of the clipped sum has norm exactly C, no more."""
    C = 0.5
    torch.manual_seed(0)
    base = nn.Linear(6, 3)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    x[3] *= 1e4

    def delta(rows):
        model = copy.deepcopy(base)
        sgd = torch.optim.SGD(model.parameters(), lr=1.0)
        step = compile_step(lambda a, b: F.mse_loss(model(a), b), model, sgd,
                            max_grad_norm=C, loss_reduction="sum", backend="eager")
        step(x[rows], y[rows])
        moved = [(p - q).flatten() for p, q in zip(base.parameters(), model.parameters(), strict=True)]
        return torch.cat(moved), step

    everything, step = delta(list(range(8)))
    assert step.last_norms[3] > 1e3 * C  # the planted sample really is huge
    others, _ = delta([i for i in range(8) if i != 3])
    planted = (everything - others).norm()
    assert planted <= C * (1 + 1e-5)
    assert planted >= C * (1 - 1e-3)  # clipped to the bound, not dropped
    for i in range(8):  # and each sample alone
        alone, _ = delta([i])
        assert alone.norm() <= C * (1 + 1e-5)


def _noise_of_empty_step(secure: bool, generator=None, seed: int = 0, width: int = 100):
    """An empty batch has a zero clipped sum: an SGD step with lr 1 and no scaling moves by exactly -noise."""
    torch.manual_seed(seed)
    model = nn.Linear(width, width)  # 10,100 coordinates at width 100
    before = [p.detach().clone() for p in model.parameters()]
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    step = compile_step(lambda x, y: F.mse_loss(model(x), y), model, sgd,
                        max_grad_norm=0.7, noise_multiplier=1.3, loss_reduction="sum", secure_rng=secure,
                        generator=generator, backend="eager")
    step(torch.zeros(0, width), torch.zeros(0, width))
    assert step.last_batch_size == 0
    moved = [(b - p.detach()).flatten() for b, p in zip(before, model.parameters(), strict=True)]
    return torch.cat(moved).double(), 0.7 * 1.3


@pytest.mark.parametrize("source", ["default", "generator", "secure"])
def test_noise_std_is_sigma_C(source):
    """The noise added once per step is N(0, sigma^2 C^2) per coordinate (chi-square and KS tests)."""
    generator = torch.Generator().manual_seed(3) if source == "generator" else None
    noise, std = _noise_of_empty_step(secure=source == "secure", generator=generator)
    # seeded sources are deterministic; the secure one is not: a threshold that fails once in 10^7 runs
    check_gaussian(noise, std, p_min=1e-3 if source != "secure" else 1e-7)
    assert not torch.allclose(noise.std(), torch.tensor(std * math.sqrt(2), dtype=torch.float64), rtol=0.05)


def test_secure_gaussian_moments():
    z = secure_gaussian((200_000,), 2.0, dtype=torch.float64)
    assert z.dtype == torch.float64 and z.shape == (200_000,)
    check_gaussian(z, 2.0, p_min=1e-7)
    assert not torch.equal(secure_gaussian((8,)), secure_gaussian((8,)))


def test_generator_makes_noise_reproducible():
    a, _ = _noise_of_empty_step(False, torch.Generator().manual_seed(5), seed=0)
    b, _ = _noise_of_empty_step(False, torch.Generator().manual_seed(5), seed=1)  # other model init
    c, _ = _noise_of_empty_step(False, torch.Generator().manual_seed(6), seed=0)
    assert torch.allclose(a, b, atol=1e-5) and not torch.allclose(a, c, atol=1e-2)


@pytest.mark.parametrize("source", ["native", "torch"])
def test_a_draw_is_gaussian_reproducible_and_streams_one_tensor_at_a_time(source, monkeypatch):
    """Both sources (the native AES-CTR stream, and torch's generator tensor by tensor where the native one
    cannot run): N(0, std^2), the same numbers from the same generator state, other numbers from another, and
    ``gaussian_stream`` (the sharded step's draw, one parameter at a time) equal to ``gaussian_many``."""
    if source == "torch":
        monkeypatch.setattr(native_noise, "available", lambda: False)
    likes = [torch.zeros(300, 700), torch.zeros(300), torch.zeros(40_000)]
    one = gaussian_many(likes, 1.5, generator=torch.Generator().manual_seed(7))
    assert [t.shape for t in one] == [t.shape for t in likes]
    check_gaussian(torch.cat([t.flatten() for t in one]), 1.5, p_min=1e-3)
    streamed = dp.gaussian_stream(likes, 1.5, generator=torch.Generator().manual_seed(7))
    for a, b in zip(one, streamed, strict=True):
        assert torch.equal(a, b)
    if source == "torch":
        want = torch.randn(300, 700, generator=torch.Generator().manual_seed(7)).mul_(1.5)
        assert torch.equal(one[0], want)
    other = gaussian_many(likes, 1.5, generator=torch.Generator().manual_seed(8))
    assert not torch.allclose(one[0], other[0], atol=1e-2)


def test_noise_on_an_accelerator_is_one_draw_over_one_buffer():
    """Off the CPU (here the meta device, which has no numbers) the tensors' noise is drawn with one ``normal_``
    over one flat buffer, of which each tensor is a view; mixed dtypes and secure noise go tensor by tensor."""
    likes = [torch.zeros(3, 4, device="meta"), torch.zeros(5, device="meta")]
    reuse: dict = {}
    got = gaussian_many(likes, 2.0, reuse=reuse)
    assert [t.shape for t in got] == [(3, 4), (5,)]
    assert reuse["flat"].shape == (17,) and all(t._base is reuse["flat"] for t in got)
    mixed = gaussian_many([likes[0], torch.zeros(5, device="meta", dtype=torch.float64)], 2.0, reuse={})
    assert all(t._base is None for t in mixed) and mixed[1].dtype == torch.float64


def test_a_reused_noise_buffer_is_filled_again_with_the_same_numbers():
    """``reuse``: the second draw fills the first draw's buffer in place, with the numbers a fresh buffer gets
    from the same generator state; a draw of another size allocates anew."""
    likes = [torch.zeros(300, 700), torch.zeros(40_000)]
    reuse: dict = {}
    gen, fresh_gen = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    first = gaussian_many(likes, 2.0, generator=gen, reuse=reuse)
    first_values = [t.clone() for t in first]
    second = gaussian_many(likes, 2.0, generator=gen, reuse=reuse)
    assert second[0].data_ptr() == first[0].data_ptr() == reuse["flat"].data_ptr()
    for want, got in zip(gaussian_many(likes, 2.0, generator=fresh_gen), first_values, strict=True):
        assert torch.equal(want, got)
    for want, got in zip(gaussian_many(likes, 2.0, generator=fresh_gen), second, strict=True):
        assert torch.equal(want, got)
    assert not torch.allclose(first_values[0], second[0], atol=1e-2)
    other = gaussian_many([torch.zeros(200_000)], 2.0, generator=gen, reuse=reuse)
    assert other[0].data_ptr() == reuse["flat"].data_ptr() != first[0].data_ptr()


def test_a_step_with_a_large_noise_draw_adds_sigma_C():
    """The step's noise in one large draw (360,600 coordinates): N(0, sigma^2 C^2), reproducible."""
    a, std = _noise_of_empty_step(False, torch.Generator().manual_seed(5), width=600)
    b, _ = _noise_of_empty_step(False, torch.Generator().manual_seed(5), seed=1, width=600)
    assert a.numel() > 300_000 and torch.allclose(a, b, atol=1e-5)
    check_gaussian(a, std, p_min=1e-3)


def test_every_batch_size_one_graph_each():
    """Batch sizes 0, 1 and any other reuse the same capture and the same compiled update."""
    model = small_cnn()
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = compile_step(lambda x, y: ce_mean(model, x, y), model, adam,
                        max_grad_norm=1.0, noise_multiplier=0.5, backend="eager")
    for n in (8, 3, 0, 1, 13):
        step(*batch(n))
        assert step.last_batch_size == n
    assert step.per_sample.captures == 1
    assert step.program_builds == 1 and step.programs == 1


@pytest.mark.parametrize("momentum, python_updates", [(0.0, 0), (0.9, 1)])
def test_a_stateless_update_runs_in_the_program_from_the_first_step(momentum, python_updates, monkeypatch):
    """Plain SGD keeps no state: its first step runs the program (no eager step over the rewritten graph op by
    op); with momentum the first step's update runs in Python to create the momentum buffers. Both equal the
    non-private step where clipping and noise are off."""
    model = small_cnn()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=momentum)
    calls = []
    real = opt.step
    monkeypatch.setattr(opt, "step", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    step = compile_step(lambda x, y: ce_mean(model, x, y), model, opt, max_grad_norm=1e6, noise_multiplier=0.0,
                        backend="eager")
    for n in (8, 5):
        x, y = batch(n, seed=n)
        step(x, y)
        plain_step(ref, opt_ref, lambda m, a, b: ce_mean(m, a, b), x, y)
        assert max_diff(model, ref) < 1e-5
    assert len(calls) == python_updates
    assert step.program_builds == 1


@pytest.mark.inductor
def test_inductor_no_recompile_across_batch_sizes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
    ref = copy.deepcopy(model)
    opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, ref))
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, opt, max_grad_norm=1e6)
    for n in (9, 4, 1, 17, 2, 0):
        x, y = torch.randn(n, 10), torch.randint(0, 3, (n,))
        step(x, y)
        if n:
            plain_step(ref, opt_ref, lambda m, a, b: F.cross_entropy(m(a), b), x, y)
        else:  # an empty batch is a step with a zero gradient
            for p in ref.parameters():
                p.grad = torch.zeros_like(p)
            opt_ref.step()
    assert max_diff(model, ref) < 2e-5
    assert step.per_sample.captures == 1 and step.program_builds == 1 and step.programs == 1
    assert step.compiles == 2  # the program for every batch size from 2 up, and for a batch of one
    assert step.compile_seconds > 0


def test_optimizer_with_hooks_compiles_with_graph_breaks():
    model = small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    handle = opt.register_step_post_hook(lambda *a: calls.append(1))
    step = compile_step(lambda x, y: ce_mean(model, x, y), model, opt, max_grad_norm=1.0, backend="eager")
    step(*batch(4))
    step(*batch(5))
    assert calls == [1, 1] and not step.fused and step.programs == 2 and "hooks" in step.fallback_reason
    handle.remove()  # the update is fused again (it stayed eager for good once a hook had been seen)
    step(*batch(4))
    assert step.fused and step.programs == 1 and step.fallback_reason is None and step.program_builds == 1
    opt.register_step_post_hook(lambda *a: calls.append(1))
    step(*batch(5))
    assert calls == [1, 1, 1] and not step.fused


def test_argument_errors():
    model = small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = lambda x, y: ce_mean(model, x, y)
    with pytest.raises(DPConfigError, match="clipping bound"):
        compile_step(loss, model, opt, noise_multiplier=1.0)
    with pytest.raises(DPConfigError, match="loss_reduction"):
        compile_step(loss, model, opt, loss_reduction="none")
    with pytest.raises(DPConfigError, match="max_grad_norm"):
        compile_step(loss, model, opt, max_grad_norm=0.0)


MORE_OPTIMIZERS = {
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.01),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
    "SGD-nesterov-wd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "Adam-amsgrad": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
    # tensor settings are read at their own dtype, as eager torch reads them: float64 ones for a float64 model
    "Adam-tensor-betas": lambda p: torch.optim.Adam(p, lr=0.01, betas=(torch.tensor(0.9, dtype=torch.float64),
                                                                       torch.tensor(0.99, dtype=torch.float64))),
}


@pytest.mark.parametrize("name", list(MORE_OPTIMIZERS))
def test_any_optimizer_runs_fused(name):
    """The optimizer's own step, captured into the program, equals the optimizer run eagerly (float64)."""
    ours, ref = small_cnn().double(), small_cnn().double()
    opt_ours, opt_ref = MORE_OPTIMIZERS[name](ours.parameters()), MORE_OPTIMIZERS[name](ref.parameters())
    step = compile_step(lambda x, y: ce_mean(ours, x, y), ours, opt_ours, backend="eager")
    for n in (6, 11, 3):
        x, y = batch(n, seed=n)
        step(x.double(), y)
        plain_step(ref, opt_ref, ce_mean, x.double(), y)
    assert step.fused and step.programs == 1
    # the step-count terms (Adagrad's lr decay, bias corrections) in float64, as eager code computes them
    assert max_diff(ours, ref) < 1e-12 * max_diff(ref, small_cnn().double())


class _DecayingSGD(torch.optim.Optimizer):
    """Keeps its step count as a Python int in the state, as several of timm's optimizers do."""

    def __init__(self, params, lr=1.0):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["t"] = state.get("t", 0) + 1
                    p.add_(p.grad, alpha=-group["lr"] / state["t"])


def test_an_optimizer_that_changes_python_numbers_in_its_state_runs_eagerly_and_exactly():
    """A graph would hold ``state["t"]`` as the constant it was when traced, so every later step would divide by
    the same t: the update runs eagerly, and says why."""
    ours, ref = small_cnn().double(), small_cnn().double()
    opt_ours, opt_ref = _DecayingSGD(ours.parameters()), _DecayingSGD(ref.parameters())
    step = compile_step(lambda x, y: ce_mean(ours, x, y), ours, opt_ours, max_grad_norm=None, backend="eager")
    for n in (6, 11, 3, 6):
        x, y = batch(n, seed=n)
        step(x.double(), y)
        plain_step(ref, opt_ref, ce_mean, x.double(), y)
    assert not step.fused and "Python numbers" in step.fallback_reason and "state['t']" in step.fallback_reason
    assert [s["t"] for s in opt_ours.state.values()] == [4] * len(opt_ours.state)
    assert max_diff(ours, ref) < 1e-14


BIAS_CORRECTED = {
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "Adam-amsgrad-foreach": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True, foreach=True),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "NAdam-foreach-decoupled": lambda p: torch.optim.NAdam(p, lr=0.01, weight_decay=0.1, decoupled_weight_decay=True,
                                                           foreach=True),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.01),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "Adagrad-lr-decay": lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.01, t0=3),
    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01),
}


def tiny_mlp() -> nn.Module:
    torch.manual_seed(0)  # two Linear(6, 6): parameters of one kind, whose update is traced once and copied
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(),
                         nn.Linear(6, 3)).double()


def reference_dp_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, batch: tuple, bound: float,
                      expected_batch_size: int) -> None:
    """The noiseless DP step by hand: the loop's per-sample gradients clipped to ``bound`` and summed, divided by
    ``expected_batch_size`` into ``.grad``, then the optimizer's own step."""
    params = dict(model.named_parameters())
    grads = reference_per_sample(lambda *b: loss_fn(model, *b), params, batch)
    for name, clipped_sum in ref_clip_sum(grads, bound).items():
        params[name].grad = clipped_sum / expected_batch_size
    optimizer.step()


@pytest.mark.parametrize("name", list(BIAS_CORRECTED))
def test_float64_step_count_terms_equal_the_eager_optimizer(name):
    """Eager torch computes the bias corrections (RAdam's rectification, NAdam's mu, ASGD's eta) from the float32
    ``step`` counter as Python floats; the fused program computes them in float64 too, so that the step equals
    torch's own step on the loop's clipped sum to float64 rounding (float32 terms were 1e-5 of the update off,
    RAdam's 1e-3). Seven steps: RAdam's rectification turns on at the sixth."""
    ours = tiny_mlp()
    ref = copy.deepcopy(ours)
    start = copy.deepcopy(ours)
    opt_ours, opt_ref = BIAS_CORRECTED[name](ours.parameters()), BIAS_CORRECTED[name](ref.parameters())
    loss_fn = lambda model, x, y: F.cross_entropy(model(x), y)
    step = compile_step(lambda x, y: loss_fn(ours, x, y), ours, opt_ours, max_grad_norm=0.5, noise_multiplier=0.0,
                        expected_batch_size=8, backend="eager")
    gen = torch.Generator().manual_seed(1)
    for n in (8, 5, 8, 3, 8, 8, 6):
        x, y = torch.randn(n, 4, generator=gen, dtype=torch.float64), torch.randint(0, 3, (n,), generator=gen)
        step(x, y)
        reference_dp_step(ref, opt_ref, loss_fn, (x, y), 0.5, 8)
    assert step.fused, step.fallback_reason
    assert max_diff(ours, ref) < 1e-12 * max_diff(ref, start)


@pytest.fixture
def float64_default_dtype():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def test_float64_step_counters_advance(float64_default_dtype):
    """Under a float64 default dtype the optimizers make float64 ``step`` counters, on which Dynamo dropped
    Adafactor's ``step += 1`` (its ``step.item()`` read it): every fused step counted step 1 again."""
    ours = tiny_mlp()
    ref = copy.deepcopy(ours)
    opt_ours, opt_ref = (torch.optim.Adafactor(m.parameters(), lr=0.01) for m in (ours, ref))
    step = compile_step(lambda x, y: ce_sum(ours, x, y), ours, opt_ours, loss_reduction="sum", backend="eager")
    gen = torch.Generator().manual_seed(1)
    for n in (8, 5, 8):
        x, y = torch.randn(n, 4, generator=gen), torch.randint(0, 3, (n,), generator=gen)
        step(x, y)
        plain_step(ref, opt_ref, ce_sum, x, y)
    assert step.fused, step.fallback_reason
    assert [s["step"].item() for s in opt_ours.state.values()] == [3.0] * len(opt_ours.state)
    assert max_diff(ours, ref) < 1e-12


@pytest.mark.inductor
def test_an_update_that_reads_a_number_runs_eagerly_beside_the_inductor_program():
    """Adafactor's step reads its step count as a Python number (``step_t.item()``): traced whole (one parameter of
    each kind), the fused program held it as an unbacked symbol, on which Inductor failed (torch 2.13: "'NoneType'
    object has no attribute 'lower'"), a CompileError at every step. The update runs eagerly after the compiled
    per-sample graph, and equals torch's own step on the loop's clipped sum."""
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(5, 3))
    ref, start = copy.deepcopy(ours), copy.deepcopy(ours)
    opt_ours, opt_ref = (torch.optim.Adafactor(m.parameters(), lr=0.01) for m in (ours, ref))
    loss_fn = lambda model, x, y: F.cross_entropy(model(x), y)
    step = compile_step(lambda x, y: loss_fn(ours, x, y), ours, opt_ours, max_grad_norm=1.0, noise_multiplier=0.0,
                        expected_batch_size=4)
    gen = torch.Generator().manual_seed(1)
    for n in (4, 3, 4):
        x, y = torch.randn(n, 5, generator=gen), torch.randint(0, 3, (n,), generator=gen)
        step(x, y)
        reference_dp_step(ref, opt_ref, loss_fn, (x, y), 1.0, 4)
    assert not step.fused and "Adafactor.step reads a tensor's value as a Python number" in step.fallback_reason
    assert step.steps_taken == 3
    assert max_diff(ours, ref) < 1e-5 * max_diff(ref, start)


def test_an_optimizer_setting_its_parameters_cannot_hold_is_refused_before_the_step():
    """``lr=1e308`` cannot multiply a float32 gradient: torch's SGD raised its own RuntimeError ("value cannot be
    converted to type float without overflow") out of the DP step, halfway through its update. The setting is
    refused before the step, naming it; the step did not happen (parameters as before, not counted)."""
    model = small_cnn()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=1e308)
    step = compile_step(lambda x, y: ce_mean(model, x, y), model, opt, max_grad_norm=1.0, backend="eager")
    with pytest.raises(DPConfigError, match=r"param_groups\[0\]\['lr'\] of the SGD is 1e\+308, beyond the largest "
                       r"torch.float32 number"):
        step(*batch(6, seed=0))
    assert step.steps_taken == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_only_the_settings_that_scale_tensors_are_held_to_the_parameters_dtype():
    """ASGD's ``t0=1e6`` (a step count compared in Python) is beyond float16's largest number and is fine; a
    learning rate beyond it is not."""
    from compiled_psg._train.binding import check_optimizer_scalars

    half = [nn.Parameter(torch.zeros(3, dtype=torch.float16))]
    check_optimizer_scalars(torch.optim.ASGD(half, lr=0.01))
    with pytest.raises(DPConfigError, match=r"param_groups\[0\]\['lr'\] of the SGD is 100000, beyond the largest "
                                            r"torch.float16 number \(65504\)"):
        check_optimizer_scalars(torch.optim.SGD(half, lr=1e5))


def test_a_float32_program_holds_no_float64_arithmetic():
    """The float64 reading of the step counters is for float64 parameters only: a float32 model's program (its
    update traced from float32 counters, as torch.compile traces it) stays float32, as fast as before."""
    model = small_cnn()
    opt = torch.optim.NAdam(model.parameters(), lr=0.01)
    step = compile_step(lambda x, y: ce_mean(model, x, y), model, opt, max_grad_norm=1.0, backend="eager")
    for n in (6, 5):
        step(*batch(n, seed=n))
    assert step.fused
    dtypes = {value.dtype for node in step.graph.graph.nodes
              for value in pytree.tree_leaves(node.meta.get("val")) if isinstance(value, torch.Tensor)}
    assert torch.float32 in dtypes and torch.float64 not in dtypes, dtypes


def test_step_program_holds_forward_backward_clipping_and_update():
    model = small_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = compile_step(lambda x, y: ce_mean(model, x, y), model, opt, max_grad_norm=1.0, noise_multiplier=1.0,
                        backend="eager")
    assert step.graph is None  # built at the end of the first step
    step(*batch(4))
    targets = [n.target for n in step.graph.graph.nodes if n.op == "call_function"]
    placeholders = [n.name for n in step.graph.graph.nodes if n.op == "placeholder"]
    assert torch.ops.aten.convolution.default in targets  # forward
    assert torch.ops.compiled_psg.conv_weight_per_sample.default in targets  # rewritten backward
    assert torch.ops.aten.sqrt.default in targets  # per-sample norms for clipping (and Adam)
    # the update computes the 4 parameters, their .grad and Adam's step, exp_avg and exp_avg_sq; the program
    # returns them (committed after it has run) and writes none of its inputs
    assert torch.ops.aten.copy_.default not in targets
    assert len(step.program_cache.current.commits) == 4 * 5
    assert sum(name.startswith("commit_") for name in step.program_cache.current.outputs) == 4 * 5
    assert sum(name.startswith("step_") and "noise" in name for name in placeholders) == 4


def test_reduce_argument():
    """reduce=psg.clip_sum(C) is max_grad_norm=C; a custom reduction giving one tensor per parameter works."""
    import compiled_psg as psg

    a, b, c = small_cnn(), small_cnn(), small_cnn()
    steps = [compile_step(lambda x, y, m=m: ce_mean(m, x, y), m, torch.optim.SGD(m.parameters(), lr=0.1),
                          backend="eager", **kw)
             for m, kw in ((a, dict(reduce=psg.clip_sum(0.05))), (b, dict(max_grad_norm=0.05)),
                           (c, dict(reduce=psg.custom(lambda name, g: 0.5 * g.sum(0)))))]
    for n in (5, 8):
        for s in steps:
            s(*batch(n, seed=n))
    assert max_diff(a, b) == 0.0
    half_lr = small_cnn()
    ref_step = compile_step(lambda x, y: ce_mean(half_lr, x, y), half_lr,
                            torch.optim.SGD(half_lr.parameters(), lr=0.05), backend="eager")
    for n in (5, 8):
        ref_step(*batch(n, seed=n))
    assert max_diff(c, half_lr) < 1e-7
    model = small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(DPConfigError, match="contradicts"):
        compile_step(lambda x, y: ce_mean(model, x, y), model, opt, reduce=psg.clip_sum(1.0), max_grad_norm=2.0)
    with pytest.raises(DPConfigError, match="reduce must be"):
        compile_step(lambda x, y: ce_mean(model, x, y), model, opt, reduce="clip")
    with pytest.raises(DPConfigError, match="clipping bound"):
        compile_step(lambda x, y: ce_mean(model, x, y), model, opt, noise_multiplier=1.0,
                     reduce=psg.custom(lambda name, g: g.sum(0)))
    # a bound beside a custom reduction: nothing would clip to it (it was dropped, and the step did not clip)
    for noise in (0.0, 1.0):
        with pytest.raises(DPConfigError, match=r"max_grad_norm=0.01 applies to the default clip_sum .* would not "
                                                r"clip to it"):
            compile_step(lambda x, y: ce_mean(model, x, y), model, opt, max_grad_norm=0.01, noise_multiplier=noise,
                         reduce=psg.custom(lambda name, g: g.sum(0)))


def test_changed_float_hyperparameter_rebuilds_tensor_one_does_not():
    """A float lr is a constant of the program: changing it rebuilds (and takes effect); a tensor lr is an input."""
    for lr, builds in ((0.1, 2), (torch.tensor(0.1), 1)):
        ours, ref = small_cnn(), small_cnn()
        opt_ours = torch.optim.SGD(ours.parameters(), lr=lr, momentum=0.9)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        step = compile_step(lambda x, y, m=ours: ce_mean(m, x, y), ours, opt_ours, backend="eager")
        for k, n in enumerate((6, 7, 8, 9)):
            if k == 2:
                for group in (*opt_ours.param_groups, *opt_ref.param_groups):
                    if isinstance(group["lr"], torch.Tensor):
                        group["lr"].fill_(0.02)
                    else:
                        group["lr"] = 0.02
            step(*batch(n, seed=n))
            plain_step(ref, opt_ref, ce_mean, *batch(n, seed=n))
        assert step.program_builds == builds
        assert max_diff(ours, ref) < 1e-6


def test_zero_grad_between_steps_is_harmless():
    ours, ref = small_cnn(), small_cnn()
    opt_ours, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, ref))
    step = compile_step(lambda x, y: ce_mean(ours, x, y), ours, opt_ours, backend="eager")
    for n in (6, 7, 8):
        opt_ours.zero_grad()
        step(*batch(n, seed=n))
        plain_step(ref, opt_ref, ce_mean, *batch(n, seed=n))
    assert step.program_builds == 1 and max_diff(ours, ref) < 1e-6
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):  # .grad holds the applied gradient
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_optimizer_over_foreign_tensors_is_refused():
    model = small_cnn()
    opt = torch.optim.SGD([*model.parameters(), torch.zeros(3, requires_grad=True)], lr=0.1)
    with pytest.raises(DPConfigError, match=r"not parameters of the model.*Fix"):
        compile_step(lambda x, y: ce_mean(model, x, y), model, opt)


def test_optimizer_changed_midway():
    """Cleared state, a parameter frozen and a hook registered after the step was built: each still matches
    the optimizer run eagerly (the program is rebuilt, or the update falls back to eager)."""
    ours, ref = small_cnn(), small_cnn()
    opt_ours, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, ref))
    step = compile_step(lambda x, y: ce_mean(ours, x, y), ours, opt_ours, backend="eager")
    calls = []
    for k, n in enumerate((6, 7, 8, 9, 10, 11)):
        if k == 2:
            opt_ours.state.clear()
            opt_ref.state.clear()
        if k == 3:
            for m in (ours, ref):
                m[0].requires_grad_(False)
        if k == 4:
            opt_ours.register_step_post_hook(lambda *a: calls.append(1))
        step(*batch(n, seed=n))
        plain_step(ref, opt_ref, ce_mean, *batch(n, seed=n))
        assert max_diff(ours, ref) < 1e-6, k
    assert len(opt_ours.state) == len(opt_ref.state) == 4  # momentum recreated after the clear
    assert calls == [1, 1] and not step.fused and "hooks" in step.fallback_reason


def test_rebuilds_do_not_keep_copies_alive():
    """Each rebuild traces a copy of the optimizer; nothing may keep the copies' tensors."""
    import gc

    model = nn.Sequential(nn.Linear(11, 13), nn.Tanh(), nn.Linear(13, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, opt, backend="eager")
    alive = []
    for k in range(5):
        opt.param_groups[0]["lr"] = 0.01 / (k + 1)  # a float lr: every change rebuilds
        step(torch.randn(6, 11), torch.randint(0, 3, (6,)))
        gc.collect()
        # real tensors only: fake tensors (Dynamo's bookkeeping) hold no storage
        alive.append(sum(type(o) in (torch.Tensor, nn.Parameter) and o.shape == (13, 11) for o in gc.get_objects()))
    assert step.program_builds == 5
    assert alive[0] == alive[-1] >= 4  # the parameter, its .grad, Adam's two moments (+ other tests')
