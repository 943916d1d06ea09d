"""Constructs that change autograd's backward (or a batch of one's loss) without showing in the forward ATen graph:
refused with UnsupportedError naming the construct and line, or rewritten exactly. Each gave silently wrong
per-sample gradients before (found by an adversarial review; errors 0.36 to 3.0)."""

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import reference_per_sample

import compiled_psg as psg

F64 = torch.float64


class GradientReversal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a.clone()

    @staticmethod
    def backward(ctx, g):
        return -3.0 * g


class StraightThroughRound(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return torch.round(a * 3) / 3

    @staticmethod
    def backward(ctx, g):
        return g


def _setup():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    return m, torch.randn(5, 4, dtype=F64), torch.randint(0, 3, (5,))


M, X, Y = _setup()


def reversal(x, y):
    return F.cross_entropy(M[2](GradientReversal.apply(torch.tanh(M[0](x)))), y)  # <reversal>


def straight_through(x, y):
    return F.cross_entropy(M[2](StraightThroughRound.apply(torch.tanh(M[0](x)))), y)  # <ste>


def activation_hook(x, y):
    h = torch.tanh(M[0](x))
    h.register_hook(lambda g: g * 5)  # <hook>
    return F.cross_entropy(M[2](h), y)


def squeeze_without_dim(x, y):
    return (M(x)[:, :1].unsqueeze(1).squeeze() - 1).pow(2).mean(0).sum()  # <squeeze>


REFUSED = {"custom_function_reversal": (reversal, "torch.autograd.Function", "reversal"),
           "custom_function_straight_through": (straight_through, "torch.autograd.Function", "ste"),
           "register_hook_in_loss": (activation_hook, "register_hook", "hook"),
           "squeeze_without_dim": (squeeze_without_dim, "squeeze() without a dim", "squeeze")}


def _line(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i + 1 for i, line in enumerate(lines) if f"# <{marker}>" in line)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_with_construct_and_line(name):
    loss, construct, marker = REFUSED[name]
    with pytest.raises(psg.UnsupportedError) as info:
        psg.per_sample(M, backend="eager")(loss)(X, Y)
    message = str(info.value)
    assert construct in message and f"test_backward_semantics.py:{_line(marker)}" in message, message
    assert "Fix:" in message


def test_compile_step_refuses_a_custom_backward():
    opt = torch.optim.SGD(M.parameters(), lr=0.1)
    before = [p.detach().clone() for p in M.parameters()]
    step = psg.compile_step(reversal, M, opt, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=5,
                            backend="eager")
    with pytest.raises(psg.UnsupportedError):
        step(X, Y)
    assert all(torch.equal(a, p) for a, p in zip(before, M.parameters(), strict=True))


def test_parameter_hook_refused():
    m, x, y = _setup()
    handle = m[0].weight.register_hook(lambda g: g * 2)
    fn = psg.per_sample(m, backend="eager")(lambda x, y: F.cross_entropy(m(x), y))
    with pytest.raises(psg.UnsupportedError, match=r"0\.weight has a gradient hook"):
        fn(x, y)
    handle.remove()  # without the hook the same function works, and is exact
    got = fn(x, y)
    ref = reference_per_sample(lambda x, y: F.cross_entropy(m(x), y), dict(m.named_parameters()), (x, y))
    torch.testing.assert_close(got["0.weight"], ref["0.weight"])


def _zero_gradient(g):  # <param-hook>
    return g * 0


def _count_call(p):  # <post-hook>
    return None


@pytest.mark.parametrize("register", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_hook_registered_on_a_parameter_inside_the_loss_is_refused(register):
    """Dynamo keeps a hook registered inside the loss on a tensor from outside it (a parameter) as a side effect to
    replay after the frame, not as a graph node, and the capture replays none: the hook never ran, and a hook
    that zeroes layer 0's gradient left it training (round K). Refused by name, with the hook's line, for
    ``per_sample`` and for a DP step, which changes nothing."""
    m, x, y = _setup()
    hook = _zero_gradient if register == "register_hook" else _count_call

    def loss(x, y):
        getattr(m[0].weight, register)(hook)
        return F.cross_entropy(m(x), y)

    marker = "param-hook" if register == "register_hook" else "post-hook"
    expected = rf"{register} on (m\.)?0\.weight inside the loss .*test_backward_semantics\.py:{_line(marker)}.*Fix:"
    with pytest.raises(psg.UnsupportedError, match=expected):
        psg.per_sample(m, backend="eager")(loss)(x, y)
    before = [p.detach().clone() for p in m.parameters()]
    step = psg.compile_step(loss, m, torch.optim.SGD(m.parameters(), lr=1.0), max_grad_norm=10.0, backend="eager")
    with pytest.raises(psg.UnsupportedError, match=expected):
        step(x, y)
    assert step.steps_taken == 0 and all(torch.equal(a, p) for a, p in zip(before, m.parameters(), strict=True))
    assert not m[0].weight._backward_hooks and not getattr(m[0].weight, "_post_accumulate_grad_hooks", None)


def test_in_place_detach_is_exact():
    def loss(x, y):
        h = torch.tanh(M[0](x))
        h.detach_()
        return F.cross_entropy(M[2](h) + M[2](torch.tanh(M[0](x))), y)

    got = psg.per_sample(M, backend="eager")(loss)(X, Y)
    ref = reference_per_sample(loss, dict(M.named_parameters()), (X, Y))
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-10, atol=1e-12)
