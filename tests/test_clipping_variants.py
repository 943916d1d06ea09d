"""Clipping variants of compile_step / make_private: per_layer, automatic, adaptive (and flat, for comparison).

Each variant: exactness against a naive float64 loop computing the same clipped sum, and the clip bound (plant an
outlier, remove any one sample: the noiseless update moves by at most the variant's sensitivity). Adaptive
clipping: the limit case (no count noise: C settles at the target quantile of the norms), the count noise and
the gradient noise have the stds the accounting assumes, and epsilon counts both.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import assert_numbers_close, reference_per_sample
from scipy import stats

from compiled_psg import compile_step, make_private
from compiled_psg._errors import DPConfigError
from compiled_psg._train.accounting import epsilon

# variant -> (compile_step keywords, the bounds the reference clips with); names are model.named_parameters()
PER_LAYER = [0.3, 0.05, 0.2, 0.02]
GROUPS = [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
VARIANTS = {
    "flat": dict(clipping="flat", max_grad_norm=0.5),
    "per_layer": dict(clipping="per_layer", max_grad_norm=PER_LAYER),
    "per_layer_groups": dict(clipping="per_layer", max_grad_norm=[0.3, 0.1], clip_groups=GROUPS),
    "per_layer_split": dict(clipping="per_layer", max_grad_norm=0.4, clip_groups=GROUPS),
    "automatic": dict(clipping="automatic", max_grad_norm=0.5, automatic_gamma=0.05),
    "adaptive": dict(clipping="adaptive", max_grad_norm=0.5, unclipped_num_std=0.0),
}


def mlp(dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)


def data(n: int, seed: int = 1, outlier: bool = True, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 5, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g)
    if outlier:
        x[0] *= 1e3  # its gradient norm is far above every bound
    return x, y


def groups_of(kw: dict, names: list[str]) -> tuple[list[list[str]], list[float]]:
    """The reference's groups and bounds for a variant (what the docs promise)."""
    if kw["clipping"] != "per_layer":
        return [names], [kw["max_grad_norm"]]
    groups = kw.get("clip_groups") or [[n] for n in names]
    c = kw["max_grad_norm"]
    bounds = list(c) if isinstance(c, list) else [c / math.sqrt(len(groups))] * len(groups)
    return groups, bounds


def ref_clipped_sum(model, loss_fn, x, y, kw: dict, bound=None) -> dict[str, torch.Tensor]:
    """The clipped sum by a loop over samples (each sample's own autograd gradient), in float64."""
    params = dict(model.named_parameters())
    grads = reference_per_sample(loss_fn, params, (x, y))
    names = list(params)
    groups, bounds = groups_of(kw, names)
    if bound is not None:
        bounds = [bound]
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    for i in range(x.shape[0]):
        for group, c in zip(groups, bounds, strict=True):
            norm = math.sqrt(sum(float(grads[n][i].double().pow(2).sum()) for n in group))
            if kw["clipping"] == "automatic":
                factor = c / (norm + kw["automatic_gamma"])
            else:
                factor = min(1.0, c / norm) if norm > 0 else 1.0
            for n in group:
                total[n] += factor * grads[n][i].double()
    return total


def sum_step(model, **kw):
    """A noiseless step whose update is minus the clipped sum (SGD lr=1 on the summed loss)."""
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    loss = lambda x, y: F.cross_entropy(model(x), y, reduction="sum")  # noqa: E731
    return compile_step(loss, model, opt, loss_reduction="sum", backend="eager", **kw), loss


def update_of(step, model, x, y, start: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``theta_before - theta_after`` of one step from parameters ``start`` (restored first)."""
    with torch.no_grad():
        for p, s in zip(model.parameters(), start, strict=True):
            p.copy_(s)
    step(x, y)
    return {n: (s - p.detach()) for (n, p), s in zip(model.named_parameters(), start, strict=True)}


@pytest.mark.usefixtures("eager_first_step")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_exact_against_naive_loop_and_clip_bound(variant):
    """Two steps (the eager first step, then the fused program): each update equals the loop's clipped sum.
    Then the clip bound (``check_remove_one``)."""
    kw = VARIANTS[variant]
    model = mlp()
    step, loss = sum_step(model, **kw)
    for seed in (1, 2):
        x, y = data(9, seed)
        bound = step.max_grad_norm if variant == "adaptive" else None
        expected = ref_clipped_sum(model, loss, x, y, kw, bound)
        start = [p.detach().clone() for p in model.parameters()]
        got = update_of(step, model, x, y, start)
        for n in expected:
            torch.testing.assert_close(got[n], expected[n], rtol=1e-10, atol=1e-12)
    assert step.fused and step.per_sample.captures == 1
    check_remove_one(step, model, kw)  # on the same step (one capture per variant: the suite's time)


def sensitivity(kw: dict, names: list[str]) -> tuple[float, list[tuple[list[str], float]]]:
    groups, bounds = groups_of(kw, names)
    return math.sqrt(sum(c * c for c in bounds)), list(zip(groups, bounds, strict=True))


def check_remove_one(step, model, kw: dict) -> None:
    """Remove any one sample of a batch with an outlier: the noiseless update moves by at most the variant's
    sensitivity (per layer: each group's part by at most its own bound, and the whole by the joint bound)."""
    names = [n for n, _ in model.named_parameters()]
    bound, groups = sensitivity(kw, names)
    x, y = data(7)
    start = [p.detach().clone() for p in model.parameters()]
    c0 = kw["max_grad_norm"]
    step.max_grad_norm = c0  # adaptive: it moved during the earlier steps
    full = update_of(step, model, x, y, start)
    moves, tight = [], []
    for i in range(x.shape[0]):
        keep = [j for j in range(x.shape[0]) if j != i]
        step.max_grad_norm = c0  # adaptive: the bound of the first step again
        without = update_of(step, model, x[keep], y[keep], start)
        diff = {n: full[n] - without[n] for n in names}
        total = math.sqrt(sum(float(d.pow(2).sum()) for d in diff.values()))
        assert total <= bound * (1 + 1e-12), (i, total, bound)
        for group, c in groups:  # per layer: each group's part by at most its own bound
            part = math.sqrt(sum(float(diff[n].pow(2).sum()) for n in group))
            assert part <= c * (1 + 1e-12), (i, group, part, c)
            tight.append(part / c)
        moves.append(total)
    # the outlier's removal moves the update by nearly a whole bound: the test can see a missing clip (a group
    # behind the saturated tanh gets almost no gradient from the outlier, so not every group is tight)
    assert max(tight) > 0.9


def test_automatic_contribution_is_normalized():
    """Automatic clipping rescales small gradients up too: a lone sample's update has norm C n / (n + gamma)."""
    model = mlp()
    kw = VARIANTS["automatic"]
    step, loss = sum_step(model, **kw)
    x, y = data(2, outlier=False)
    start = [p.detach().clone() for p in model.parameters()]
    norms = reference_per_sample(loss, dict(model.named_parameters()), (x, y))
    n0 = math.sqrt(sum(float(g[0].pow(2).sum()) for g in norms.values()))
    got = update_of(step, model, x[:1].repeat(2, 1), y[:1].repeat(2), start)
    total = math.sqrt(sum(float(g.pow(2).sum()) for g in got.values()))
    assert total == pytest.approx(2 * kw["max_grad_norm"] * n0 / (n0 + kw["automatic_gamma"]), rel=1e-12)


def test_noise_std_is_sigma_times_joint_bound():
    """per_layer: the noise std is sigma * sqrt(sum C_k^2) (the joint sensitivity)."""
    model = mlp()
    kw = VARIANTS["per_layer"]
    sigma = 2.0
    step, _ = sum_step(model, noise_multiplier=sigma, generator=torch.Generator().manual_seed(3), **kw)
    assert step.noise_std == pytest.approx(sigma * math.sqrt(sum(c * c for c in PER_LAYER)))
    x, y = data(5)
    start = [p.detach().clone() for p in model.parameters()]
    quiet, _ = sum_step(mlp(), **kw)
    clean = update_of(quiet, quiet.model, x, y, start)
    noise = []
    for _ in range(6):
        got = update_of(step, model, x, y, start)
        noise += [(got[n] - clean[n]).flatten() for n in got]
    noise = torch.cat(noise) / step.noise_std
    assert stats.kstest(noise.numpy(), "norm").pvalue > 1e-3


def test_per_layer_settings_are_checked():
    model = mlp()
    with pytest.raises(DPConfigError, match="4 groups"):
        sum_step(model, clipping="per_layer", max_grad_norm=[1.0, 2.0])
    with pytest.raises(DPConfigError, match="missing"):
        sum_step(model, clipping="per_layer", max_grad_norm=[1.0], clip_groups=[["0.weight"]])
    with pytest.raises(DPConfigError, match="per_layer"):
        sum_step(model, clipping="flat", max_grad_norm=[1.0, 2.0])
    with pytest.raises(DPConfigError, match="one group only"):
        sum_step(model, clipping="per_layer", max_grad_norm=[1.0, 1.0], clip_groups=[["0.bias"], ["0.bias"]])
    # round L: a string was read a character at a time ("not trained parameters ['.', '0', 'e', ...]")
    with pytest.raises(DPConfigError, match="clip_groups must be a list of lists of parameter names, got str"):
        sum_step(model, clipping="per_layer", max_grad_norm=1.0, clip_groups="0.weight")
    with pytest.raises(DPConfigError, match="its group '0.weight' is a str"):
        sum_step(model, clipping="per_layer", max_grad_norm=1.0, clip_groups=["0.weight", "0.bias"])
    with pytest.raises(DPConfigError, match="must exceed"):
        sum_step(model, clipping="adaptive", max_grad_norm=1.0, noise_multiplier=1.0, unclipped_num_std=0.4)
    step, _ = sum_step(model, **VARIANTS["per_layer"])
    with pytest.raises(DPConfigError, match="fixed"):
        step.config = step.config.replace(clipping="flat", max_grad_norm=1.0)


@pytest.mark.parametrize(("clipping", "options", "mode"), [
    ("flat", dict(automatic_gamma=0.5), "automatic"),
    ("per_layer", dict(automatic_gamma=0.5), "automatic"),
    ("flat", dict(unclipped_num_std=2.0), "adaptive"),
    ("automatic", dict(target_unclipped_quantile=0.9, max_clipbound=5.0), "adaptive"),
    ("flat", dict(clipbound_learning_rate=1.0), "adaptive"),
])
def test_an_option_of_another_clipping_mode_is_refused(clipping, options, mode):
    """Round Q: ``automatic_gamma=0.5`` with ``clipping="flat"`` (or an adaptive option without adaptive
    clipping) was taken and did nothing; refused, naming the option, its mode and the step's; the option at its
    default, which changes nothing, is accepted, and so is a step of its own mode."""
    model = mlp()
    with pytest.raises(DPConfigError, match=rf"{next(iter(options))}=.*applies to clipping='{mode}'.*"
                                            rf"clipping='{clipping}', where it would do nothing"):
        sum_step(model, clipping=clipping, max_grad_norm=1.0, **options)
    sum_step(model, clipping=clipping, max_grad_norm=1.0, automatic_gamma=0.01, target_unclipped_quantile=0.5)
    step, _ = sum_step(model, clipping=mode, max_grad_norm=1.0, **options)
    with pytest.raises(DPConfigError, match=f"applies to clipping='{mode}'"):
        step.config = step.config.replace(clipping=clipping)


# ----- adaptive clipping ------------------------------------------------------------------------------------


def frozen_step(model, **kw):
    """A step that never moves the parameters (lr=0): the per-sample norms stay the same every step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loss = lambda x, y: F.cross_entropy(model(x), y)  # noqa: E731
    return compile_step(loss, model, opt, backend="eager", **kw), loss


def norms_of(model, loss, x, y) -> torch.Tensor:
    grads = reference_per_sample(loss, dict(model.named_parameters()), (x, y))
    return torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()


@pytest.mark.parametrize(("start", "quantile"), [(100.0, 0.25), (0.01, 0.8)])
def test_adaptive_without_count_noise_reaches_the_target_quantile(start, quantile):
    """sigma_b = 0: C settles between the norms around the target quantile (a fast rate gets close, then a
    slow one, set between steps, lands in the interval of the fixed points)."""
    model = mlp()
    x, y = data(20, outlier=False)
    step, loss = frozen_step(model, clipping="adaptive", max_grad_norm=start, unclipped_num_std=0.0,
                             target_unclipped_quantile=quantile, clipbound_learning_rate=1.0)
    for _ in range(40):
        step(x, y)
    step.config = step.config.replace(clipbound_learning_rate=0.02)
    for _ in range(40):
        step(x, y)
    norms = norms_of(model, loss, x, y).sort().values
    k = round(quantile * len(norms))  # the fixed points: exactly k of the norms at or below C
    low, high = float(norms[k - 1]), float(norms[k])
    assert low / 1.003 <= step.max_grad_norm <= high * 1.003, (low, step.max_grad_norm, high)
    assert abs(step.last_unclipped / len(norms) - quantile) <= 1 / len(norms)


def test_adaptive_bounds_are_clamped():
    model = mlp()
    x, y = data(8, outlier=False)
    step, _ = frozen_step(model, clipping="adaptive", max_grad_norm=1.0, unclipped_num_std=0.0,
                          target_unclipped_quantile=1.0, clipbound_learning_rate=5.0, max_clipbound=1.5)
    for _ in range(3):
        step(x, y)
    assert step.max_grad_norm == 1.5


def test_adaptive_count_noise_has_std_sigma_b():
    """The count noise, recovered from the bound updates alone (C_next / C = exp(-eta (b - target))), is
    N(0, sigma_b^2); the unclipped count itself is exact (compared with the loop's norms)."""
    model = mlp()
    x, y = data(10, outlier=False)
    sigma_b, eta, c0, m = 2.5, 0.1, 1.0, 10.0
    step, loss = frozen_step(model, clipping="adaptive", max_grad_norm=c0, unclipped_num_std=sigma_b,
                             clipbound_learning_rate=eta, expected_batch_size=m,
                             generator=torch.Generator().manual_seed(5))
    norms = norms_of(model, loss, x, y)
    count = float((norms <= c0).sum())
    recovered = []
    for _ in range(150):
        step.max_grad_norm = c0
        step(x, y)
        fraction = 0.5 - math.log(step.max_grad_norm / c0) / eta  # target quantile 0.5
        recovered.append((fraction - 0.5) * m - count + len(norms) / 2)
    recovered = torch.tensor(recovered)
    assert step.last_unclipped == count
    assert stats.kstest((recovered / sigma_b).numpy(), "norm").pvalue > 1e-3


def test_adaptive_gradient_noise_std_and_accounting():
    """The gradient's noise has std sigma_g C with sigma_g = (sigma^-2 - (2 sigma_b)^-2)^-1/2, larger than
    sigma, and the accountant records sigma, the two releases' joint noise multiplier: epsilon is that of
    plain DP-SGD at sigma, more than the gradient's noise alone would suggest."""
    sigma, sigma_b, c = 1.2, 1.0, 0.5
    sigma_g = (sigma ** -2 - (2 * sigma_b) ** -2) ** -0.5
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    dataset = torch.utils.data.TensorDataset(*data(40, outlier=False))
    loader = torch.utils.data.DataLoader(dataset, batch_size=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    private = make_private(model, opt, loader, lambda x, y: F.cross_entropy(model(x), y, reduction="sum"),
                           noise_multiplier=sigma, max_grad_norm=c, clipping="adaptive",
                           unclipped_num_std=sigma_b, clipbound_learning_rate=0.0, loss_reduction="sum",
                           backend="eager", generator=torch.Generator().manual_seed(0))
    assert private.dp_step.noise_std == pytest.approx(sigma_g * c)
    x, y = dataset.tensors
    x, y = x[:0], y[:0]  # empty batches: the update is the noise alone (in .grad, since lr=0)
    noise = []
    for _ in range(10):
        private.step(x, y)
        noise += [p.grad.flatten().clone() for p in model.parameters()]
    noise = torch.cat(noise) / (sigma_g * c)
    assert stats.kstest(noise.numpy(), "norm").pvalue > 1e-3
    (recorded, q, steps), = private.accountant.history
    assert recorded == pytest.approx(sigma, rel=1e-12) and recorded <= sigma and steps == 10
    eps = private.epsilon(1e-5)
    assert eps == pytest.approx(epsilon(sigma, q, 10, 1e-5), rel=1e-9)
    assert eps > epsilon(sigma_g, q, 10, 1e-5)


def mean_loss(model):
    return lambda x, y: F.cross_entropy(model(x), y)


def test_adaptive_on_inductor_matches_eager():
    """The one Inductor case: the bound is an input of the compiled program (no recompile as it moves)."""
    results = []
    for backend in ("eager", "inductor"):
        model = mlp(torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = compile_step(mean_loss(model), model, opt, clipping="adaptive",
                            max_grad_norm=0.5, noise_multiplier=0.5, unclipped_num_std=1.0, backend=backend,
                            generator=torch.Generator().manual_seed(0))
        bounds = []
        for seed in range(4):
            step(*data(6 + seed, seed, dtype=torch.float32))
            bounds.append(step.max_grad_norm)
        results.append((bounds, [p.detach().clone() for p in model.parameters()]))
        assert step.per_sample.captures == 1 and step.program_builds == 1 and len(set(bounds)) == 4
    (b_eager, p_eager), (b_ind, p_ind) = results
    assert b_ind == pytest.approx(b_eager, rel=1e-5)
    for a, b in zip(p_eager, p_ind, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["per_layer", "adaptive"])
def test_micro_batches_equal_the_whole_batch(variant):
    """The bounds input (adaptive) and the per-group factors are fed to every micro-batch: split logical
    batches give the same noisy steps (seeded) and the same bounds as whole ones, to float rounding."""
    kw = dict(VARIANTS[variant], noise_multiplier=0.8)
    if variant == "adaptive":
        kw["unclipped_num_std"] = 2.0
    runs = []
    for size in (None, 3):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = compile_step(mean_loss(model), model, opt, backend="eager", max_physical_batch_size=size,
                            expected_batch_size=8.0, generator=torch.Generator().manual_seed(7), **kw)
        bounds = []
        for seed in range(3):
            step(*data(8, seed))
            bounds.append(step.max_grad_norm)
        runs.append((bounds, [p.detach().clone() for p in model.parameters()]))
    (b_whole, p_whole), (b_split, p_split) = runs
    assert_numbers_close(b_split, b_whole, rel=1e-12)
    for a, b in zip(p_whole, p_split, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_adaptive_resumes_bit_for_bit():
    """The moving bound and the count noise's generator are part of the step's state."""
    def build():
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = compile_step(mean_loss(model), model, opt, backend="eager", clipping="adaptive",
                            max_grad_norm=0.5, noise_multiplier=0.8, unclipped_num_std=2.0,
                            expected_batch_size=8.0, generator=torch.Generator().manual_seed(3))
        return model, step

    model, step = build()
    for seed in range(2):
        step(*data(8, seed))
    saved = copy.deepcopy(step.state_dict())
    for seed in range(2, 4):
        step(*data(8, seed))
    model2, step2 = build()
    step2.load_state_dict(saved)
    for seed in range(2, 4):
        step2(*data(8, seed))
    assert step2.max_grad_norm == step.max_grad_norm
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_flat_clipping_follows_a_parameter_group_added_between_steps():
    """After ``add_param_group`` the next step clips the norm over the parameters the optimizer holds now (the
    first step after it raised an InternalError: the clipping was built from the old list)."""
    model = mlp()
    opt = torch.optim.SGD(model[2].parameters(), lr=1.0)
    loss = lambda x, y: F.cross_entropy(model(x), y, reduction="sum")  # noqa: E731
    with pytest.warns(UserWarning, match="require grad but the optimizer"):
        step = compile_step(loss, model, opt, loss_reduction="sum", max_grad_norm=0.05, backend="eager")
    step(*data(6, seed=2))
    opt.add_param_group({"params": list(model[0].parameters())})
    x, y = data(6)
    params = dict(model.named_parameters())
    grads = reference_per_sample(loss, params, (x, y))
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)
    factors = torch.clamp(0.05 / norms, max=1.0)
    before = {n: p.detach().clone() for n, p in params.items()}
    step(x, y)
    for n, p in params.items():
        torch.testing.assert_close(before[n] - p.detach(), torch.tensordot(factors, grads[n], dims=1),
                                   rtol=1e-10, atol=1e-12)


def test_per_layer_with_an_optimizer_on_some_parameters():
    """Trainable parameters the optimizer does not update belong to no group: they neither get a sum nor change
    another group's factor."""
    model = mlp()
    kw = dict(clipping="per_layer", max_grad_norm=[0.05, 0.02])
    opt = torch.optim.SGD(model[2].parameters(), lr=1.0)
    loss = lambda x, y: F.cross_entropy(model(x), y, reduction="sum")  # noqa: E731
    with pytest.warns(UserWarning, match=r"\['0.weight', '0.bias'\] require grad but the optimizer"):
        step = compile_step(loss, model, opt, loss_reduction="sum", backend="eager", **kw)
    x, y = data(6)
    params = dict(model.named_parameters())
    grads = reference_per_sample(loss, params, (x, y))
    expected = {}
    for n, c in zip(["2.weight", "2.bias"], kw["max_grad_norm"], strict=True):
        norms = grads[n].flatten(1).norm(dim=1)
        expected[n] = torch.tensordot(torch.clamp(c / norms, max=1.0), grads[n], dims=1)
    before = {n: p.detach().clone() for n, p in params.items()}
    step(x, y)
    for n, want in expected.items():
        torch.testing.assert_close(before[n] - params[n].detach(), want, rtol=1e-10, atol=1e-12)
    assert torch.equal(before["0.weight"], params["0.weight"].detach())


@pytest.mark.parametrize(("variant", "changes", "setting"), [
    ("flat", dict(loss_reduction="mean"), "loss_reduction"),
    ("per_layer", dict(clip_groups=GROUPS, max_grad_norm=[0.3, 0.1]), "clip_groups"),
    ("per_layer_groups", dict(clip_groups=None, max_grad_norm=PER_LAYER), "clip_groups"),
])
def test_settings_that_define_the_mechanism_are_fixed_when_built(variant, changes, setting):
    """The clipping mode, the loss reduction and the clip groups define the mechanism (what the noise is added
    to, and what a saved state means when it is loaded): ``config.replace`` cannot change them between steps."""
    step, _ = sum_step(mlp(), **VARIANTS[variant])
    config = step.config
    with pytest.raises(DPConfigError, match=f"{setting} is fixed when the step is built"):
        step.config = step.config.replace(**changes)
    assert step.config == config
