"""Losses that differentiate inside themselves (issue 11): gradient penalties, Jacobian norms, Laplacians.

``torch.autograd.grad(..., create_graph=True)`` on the batch inputs (or on an activation) inside the loss is
captured as ordinary ATen ops in the forward graph; every program here is exact against the naive loop (float64,
tight tolerances) or refused by name: a gradient that mixes samples with ``SampleMixingError``, an inner
gradient that is a constant to the loss (no ``create_graph``) with ``UnsupportedError``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from reference import ref_clip_sum, ref_norms, reference_per_sample

import compiled_psg as psg
from compiled_psg import compile_step

THIS = Path(__file__)
F64 = torch.float64
B, D, H = 5, 3, 6
TOL = dict(rtol=1e-9, atol=1e-10)


def line_of(marker: str) -> int:
    hits = [i + 1 for i, text in enumerate(THIS.read_text().splitlines()) if text.rstrip().endswith(f"# <{marker}>")]
    assert len(hits) == 1, f"marker {marker!r} found on lines {hits}"
    return hits[0]


def mlp(act: nn.Module, dtype=F64, out: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), act, nn.Linear(H, H), act, nn.Linear(H, out)).to(dtype)


def grad_x(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad(out.sum(), x, create_graph=True)[0]


# --------------------------------------------------------------- losses (each takes the model first)


def gradient_penalty(net, x):
    x = x.detach().requires_grad_(True)
    out = net(x)
    g = grad_x(out[:, 0], x)
    return ((g.norm(dim=1) - 1) ** 2).mean() + out.pow(2).mean()


def jacobian_norm(net, x):
    x = x.detach().requires_grad_(True)
    out = net(x)
    penalty = 0
    for k in range(out.shape[1]):
        penalty = penalty + grad_x(out[:, k], x).pow(2).sum(1)
    return (out.pow(2).sum(1) + 0.1 * penalty).mean()


def laplacian(net, x):
    """A physics-informed residual: (Laplacian of u - f(u))^2, the trace of the input Hessian by a loop."""
    x = x.detach().requires_grad_(True)
    u = net(x)[:, 0]
    g = grad_x(u, x)
    lap = 0
    for i in range(x.shape[1]):
        lap = lap + torch.autograd.grad(g[:, i].sum(), x, create_graph=True)[0][:, i]
    return ((lap - u.sin()) ** 2).mean()


def wrt_activation(net, x):
    h = net[0](x)
    out = net[2:](net[1](h))
    (g,) = torch.autograd.grad(out.sum(), h, create_graph=True)
    return out.sum() + g.pow(2).sum()


def grad_of_batch_mean(net, x):
    """The gradient of a batch mean carries 1/B: each sample alone sees 1/1, as the per-sample loss defines."""
    x = x.detach().requires_grad_(True)
    g = torch.autograd.grad(net(x).mean(), x, create_graph=True)[0]
    return g.pow(2).sum()


def live_grad_outputs(net, x):
    x = x.detach().requires_grad_(True)
    out = net(x)
    g = torch.autograd.grad(out, x, grad_outputs=out, create_graph=True)[0]
    return g.pow(2).sum() + out.sum()


def detached_inside(net, x):
    """The user's own detaches stay detached (only autograd's saved-result detaches are reconnected)."""
    x = x.detach().requires_grad_(True)
    h = torch.tanh(net[0](x))
    out = net[2](h.detach() * h)
    g = torch.autograd.grad(out, x, grad_outputs=out.detach(), create_graph=True)[0]
    return g.pow(2).sum() + out.sum()


def parameter_gradient_norm(net, x):
    """An inner gradient w.r.t. the parameters, used only on the way to the loss: per sample, it is the gradient
    of that sample's own loss (the loss-head pass lifts it)."""
    out = net(x)
    grads = torch.autograd.grad(out.pow(2).mean(), list(net.parameters()), create_graph=True)
    return out.mean() + sum(g.pow(2).sum() for g in grads)


def functorch_inside(net, x):
    """torch.func inside the loss: each sample's input gradient by vmap over grad."""
    g = torch.func.vmap(torch.func.grad(lambda xi: net(xi).sum()))(x)
    return g.pow(2).sum() + net(x).sum()


PROGRAMS = {
    "gp_tanh": (gradient_penalty, nn.Tanh),
    "gp_softplus": (gradient_penalty, nn.Softplus),
    "gp_relu": (gradient_penalty, nn.ReLU),
    "jacobian_tanh": (jacobian_norm, nn.Tanh),
    "laplacian_softplus": (laplacian, nn.Softplus),
    "wrt_activation": (wrt_activation, nn.Tanh),
    "grad_of_batch_mean": (grad_of_batch_mean, nn.Tanh),
    "live_grad_outputs": (live_grad_outputs, nn.Tanh),
    "detached_inside": (detached_inside, nn.Tanh),
    "parameter_gradient_norm": (parameter_gradient_norm, nn.Tanh),
    "functorch_inside": (functorch_inside, nn.Tanh),
}


def data(dtype=F64, seed=1):
    return (torch.randn(B, D, generator=torch.Generator().manual_seed(seed), dtype=dtype),)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_exact_against_the_loop(name):
    program, act = PROGRAMS[name]
    net = mlp(act())
    loss = lambda x: program(net, x)  # noqa: E731
    args = data()
    got = psg.per_sample(net, backend="eager")(loss)(*args)
    ref = reference_per_sample(loss, dict(net.named_parameters()), args)
    for key, r in ref.items():
        torch.testing.assert_close(got[key], r, **TOL, msg=lambda m, k=key: f"{name} {k}: {m}")


def wgan_gp(critic, real, fake, alpha):
    inter = (alpha * real + (1 - alpha) * fake).detach().requires_grad_(True)
    (g,) = torch.autograd.grad(critic(inter).sum(), inter, create_graph=True)
    penalty = ((g.flatten(1).norm(dim=1) - 1) ** 2).mean()
    return critic(fake).mean() - critic(real).mean() + 10 * penalty


def test_wgan_gp_layer_norm_critic_with_norms():
    """WGAN-GP on interpolates (the mixing weights given per sample), a LayerNorm critic; the per-sample
    gradients and their norms."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.LeakyReLU(0.2), nn.Linear(6, 1)).double()
    g = torch.Generator().manual_seed(2)
    real, fake = torch.randn(B, 4, generator=g, dtype=F64), torch.randn(B, 4, generator=g, dtype=F64)
    alpha = torch.rand(B, 1, generator=g, dtype=F64)
    loss = lambda r, f, a: wgan_gp(critic, r, f, a)  # noqa: E731
    args = (real, fake, alpha)
    ref = reference_per_sample(loss, dict(critic.named_parameters()), args)
    got = psg.per_sample(critic, backend="eager")(loss)(*args)
    for key, r in ref.items():
        torch.testing.assert_close(got[key], r, **TOL)
    norms = psg.per_sample(critic, backend="eager", reduce=psg.norms())(loss)(*args)
    torch.testing.assert_close(norms, ref_norms(ref), **TOL)


def test_wgan_gp_conv_critic_with_clip_sum():
    """A DCGAN-style critic: the double backward of the convolution contracts the batch as channels
    (``convolution_over_channels``); clip_sum goes through that rule's book-keeping form."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.LeakyReLU(0.2), nn.Conv2d(3, 4, 3),
                           nn.Tanh(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4, 1)).double()
    g = torch.Generator().manual_seed(2)
    real, fake = torch.randn(B, 2, 8, 8, generator=g, dtype=F64), torch.randn(B, 2, 8, 8, generator=g, dtype=F64)
    alpha = torch.rand(B, 1, 1, 1, generator=g, dtype=F64)
    loss = lambda r, f, a: wgan_gp(critic, r, f, a)  # noqa: E731
    args = (real, fake, alpha)
    ref = reference_per_sample(loss, dict(critic.named_parameters()), args)
    sums, norms = psg.per_sample(critic, backend="eager", reduce=psg.clip_sum(0.5, return_norms=True))(loss)(*args)
    want_sums, want_norms = ref_clip_sum(ref, 0.5, return_norms=True)
    torch.testing.assert_close(norms, want_norms, **TOL)
    for key, r in want_sums.items():
        torch.testing.assert_close(sums[key], r, **TOL, msg=lambda m, k=key: f"{k}: {m}")


def test_float32_laplacian_with_clip_sum():
    net = mlp(nn.Tanh(), dtype=torch.float32)
    loss = lambda x: laplacian(net, x)  # noqa: E731
    args = data(torch.float32)
    ref = reference_per_sample(loss, dict(net.named_parameters()), args)
    got = psg.per_sample(net, backend="eager", reduce=psg.clip_sum(0.1, return_norms=True))(loss)(*args)
    sums, norms = got
    want_sums, want_norms = ref_clip_sum(ref, 0.1, return_norms=True)
    torch.testing.assert_close(norms, want_norms, rtol=1e-4, atol=1e-5)
    for key, r in want_sums.items():
        torch.testing.assert_close(sums[key], r, rtol=1e-4, atol=1e-5)


@pytest.mark.inductor
def test_conv_critic_clip_sum_on_inductor():
    """The per-sample conv weight gradient of the double backward is an opaque op for Inductor (a convolution
    grouped by sample): exact at two batch sizes, one compile."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 36, 1)).double()
    loss = lambda r, f, a: wgan_gp(critic, r, f, a)  # noqa: E731
    fn = psg.per_sample(critic, reduce=psg.clip_sum(0.5, return_norms=True))(loss)
    for n in (5, 7):
        g = torch.Generator().manual_seed(n)
        args = (torch.randn(n, 2, 8, 8, generator=g, dtype=F64), torch.randn(n, 2, 8, 8, generator=g, dtype=F64),
                torch.rand(n, 1, 1, 1, generator=g, dtype=F64))
        sums, norms = fn(*args)
        want_sums, want_norms = ref_clip_sum(reference_per_sample(loss, dict(critic.named_parameters()), args), 0.5,
                                             return_norms=True)
        torch.testing.assert_close(norms, want_norms, **TOL)
        for key, r in want_sums.items():
            torch.testing.assert_close(sums[key], r, **TOL, msg=lambda m, k=key: f"{k}: {m}")
    assert fn.captures == 1 and fn.compiles == 1


@pytest.mark.usefixtures("eager_first_step")
def test_dp_step_with_gradient_penalty():
    """One clipped DP-SGD step (no noise) equals clipping the loop's per-sample gradients by hand."""
    ours, ref_net = mlp(nn.Tanh()), mlp(nn.Tanh())
    lr, clip = 0.1, 0.05
    opt = torch.optim.SGD(ours.parameters(), lr=lr)
    step = compile_step(lambda x: gradient_penalty(ours, x), ours, opt, max_grad_norm=clip, backend="eager")
    for seed in (1, 2):  # the first step runs eagerly, the second the fused program
        args = data(seed=seed)
        ref = reference_per_sample(lambda x: gradient_penalty(ref_net, x), dict(ref_net.named_parameters()), args)
        step(*args)
        with torch.no_grad():
            for name, s in ref_clip_sum(ref, clip).items():
                ref_net.get_parameter(name).sub_(lr * s / B)
        for (name, p), q in zip(ours.named_parameters(), ref_net.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12, msg=lambda m, n=name, s=seed: f"step {s} {n}: {m}")


# --------------------------------------------------------------- refused, never a wrong number


def gradient_of_pooled(net, x):
    x = x.detach().requires_grad_(True)
    out = net(x)
    g = torch.autograd.grad(out.sum(0).pow(2).sum(), x, create_graph=True)[0]  # <pooled_grad>
    return g.pow(2).sum()


def constant_inner_gradient(net, x):
    x = x.detach().requires_grad_(True)
    out = net(x)
    g = torch.autograd.grad(out.sum(), x, retain_graph=True)[0]  # <no_create_graph>
    return (g * out[:, :1]).sum() + out.pow(2).sum()


def lookahead(net, x):
    """A step along the batch's parameter gradient, then the loss at the moved weights: every sample's loss
    depends on the other samples through the step."""
    out = net(x)
    grads = torch.autograd.grad(out.pow(2).mean(), list(net.parameters()), create_graph=True)  # <lookahead>
    w = net[0].weight - 0.1 * grads[0]
    return torch.tanh(x @ w.t()).sum()


def test_gradient_of_a_sum_of_squares_over_the_batch_mixes():
    """d/dx of (sum_i out_i)^2 reads every sample: refused where the sum flows back into per-sample values."""
    net = mlp(nn.Tanh())
    with pytest.raises(psg.SampleMixingError) as info:
        psg.per_sample(net, backend="eager")(lambda x: gradient_of_pooled(net, x))(*data())
    assert f"{THIS.name}:{line_of('pooled_grad')}" in str(info.value)


def test_inner_gradient_without_create_graph_is_refused():
    net = mlp(nn.Tanh())
    with pytest.raises(psg.UnsupportedError) as info:
        psg.per_sample(net, backend="eager")(lambda x: constant_inner_gradient(net, x))(*data())
    message = str(info.value)
    assert "torch.autograd.grad" in message and "create_graph=True" in message
    assert f"{THIS.name}:{line_of('no_create_graph')}" in message


def test_lookahead_step_on_the_batch_gradient_mixes():
    net = mlp(nn.Tanh())
    with pytest.raises(psg.SampleMixingError) as info:
        psg.per_sample(net, backend="eager")(lambda x: lookahead(net, x))(*data())
    assert f"{THIS.name}:{line_of('lookahead')}" in str(info.value)


def backward_inside(net, x):
    x = x.detach().requires_grad_(True)
    out = net(x)
    out.sum().backward(create_graph=True)
    return (x.grad * out[:, :1]).sum()


def test_backward_call_inside_the_loss_is_refused():
    net = mlp(nn.Tanh())
    with pytest.raises(psg.UnsupportedError) as info:
        psg.per_sample(net, backend="eager")(lambda x: backward_inside(net, x))(*data())
    assert "torch.autograd.grad(..., create_graph=True)" in str(info.value) and ".backward()" in str(info.value)


@pytest.mark.parametrize("through", ["linear_on_tokens", "embedding_output"])
def test_a_gradient_penalty_through_a_linear_on_tokens_is_exact(through):
    """``autograd.grad(lin(h).sum(1).sum(), h, create_graph=True)`` with ``h`` ``[B, T, F]``: the inner gradient
    is the loss's ones expanded to every token and reshaped to ``[B*T, O]``, the same for every sample; it was
    refused as a reshape that moves values between samples."""
    torch.manual_seed(0)
    lin, emb = nn.Linear(3, 2).double(), nn.Embedding(7, 3).double()
    if through == "linear_on_tokens":
        params, batch = dict(lin.named_parameters()), torch.randn(4, 5, 3, dtype=F64)
        first = lambda x: x.detach().requires_grad_(True)  # noqa: E731
    else:
        params = {"lin.weight": lin.weight, "lin.bias": lin.bias, "emb.weight": emb.weight}
        batch, first = torch.randint(0, 7, (4, 5)), emb

    def loss(x):
        h = first(x)
        (g,) = torch.autograd.grad(lin(h).sum(1).sum(), h, create_graph=True)
        return g.pow(2).sum() + lin(h).pow(2).sum()

    got = psg.per_sample(params, backend="eager")(loss)(batch)
    for name, p in params.items():
        want = torch.stack([torch.autograd.grad(loss(batch[i:i + 1]), p)[0] for i in range(4)])
        torch.testing.assert_close(got[name], want, rtol=1e-10, atol=1e-12)


def test_vmap_of_jacrev_inside_the_loss_is_exact_and_a_diagonal_across_the_batch_is_refused():
    """``vmap(jacrev(f))(x)`` builds each sample's Jacobian with ``diagonal_scatter`` on the sample's own rows:
    exact. A diagonal written across the batch dimension reaches sample ``k`` at its position ``k`` in the
    batch, which is 0 when the sample is alone: refused at the diagonal_scatter."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(4, 3, dtype=F64)

    def loss(x):
        return torch.func.vmap(torch.func.jacrev(net))(x).pow(2).sum() + net(x).pow(2).sum()

    got = psg.per_sample(net, backend="eager")(loss)(x)
    for name, p in net.named_parameters():
        want = torch.stack([torch.autograd.grad(loss(x[i:i + 1]), p)[0] for i in range(4)])
        torch.testing.assert_close(got[name], want, rtol=1e-10, atol=1e-12)

    def across(x):
        scores = net(x).T  # [2, B]
        return torch.diagonal_scatter(scores, torch.zeros(2, dtype=x.dtype)).pow(2).sum()

    with pytest.raises(psg.SampleMixingError, match="diagonal_scatter"):
        psg.per_sample(net, backend="eager")(across)(x)
