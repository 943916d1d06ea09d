"""Random small MLP and CNN stacks (eager backend, float64) against the naive-loop reference."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference_per_sample

import compiled_psg as psg

ACTIVATIONS = {
    "relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "gelu": nn.GELU, "softplus": nn.Softplus,
    "leaky_relu": lambda: nn.LeakyReLU(0.1), "elu": nn.ELU, "silu": nn.SiLU,
}
SETTINGS = settings(max_examples=15, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
TOL = dict(rtol=1e-9, atol=1e-10)


@st.composite
def mlp_specs(draw):
    return dict(
        n_in=draw(st.integers(1, 6)),
        hidden=draw(st.lists(st.integers(1, 6), min_size=0, max_size=3)),
        n_out=draw(st.integers(2, 4)),
        activation=draw(st.sampled_from(sorted(ACTIVATIONS))),
        bias=draw(st.booleans()),
        loss=draw(st.sampled_from(["ce", "mse"])),
        reduction=draw(st.sampled_from(["mean", "sum"])),
        batch=draw(st.integers(1, 5)),
        seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def cnn_specs(draw):
    channels = draw(st.integers(1, 3))
    size = draw(st.integers(4, 8))
    convs, spatial, c = [], size, channels
    for _ in range(draw(st.integers(1, 2))):
        padding = draw(st.integers(0, 1))
        kernel = draw(st.integers(1, min(3, spatial + 2 * padding)))
        stride = draw(st.integers(1, 2))
        out = draw(st.integers(1, 4))
        convs.append(dict(c_in=c, c_out=out, kernel=kernel, stride=stride, padding=padding))
        spatial = (spatial + 2 * padding - kernel) // stride + 1
        c = out
    return dict(
        channels=channels, size=size, convs=convs,
        pool=draw(st.booleans()) and spatial >= 2,
        activation=draw(st.sampled_from(sorted(ACTIVATIONS))),
        n_out=draw(st.integers(2, 4)),
        loss=draw(st.sampled_from(["ce", "mse"])),
        reduction=draw(st.sampled_from(["mean", "sum"])),
        batch=draw(st.integers(1, 5)),
        seed=draw(st.integers(0, 2**16)),
    )


def build_mlp(spec):
    torch.manual_seed(spec["seed"])
    widths = [spec["n_in"], *spec["hidden"], spec["n_out"]]
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(nn.Linear(a, b, bias=spec["bias"]))
        if i < len(widths) - 2:
            layers.append(ACTIVATIONS[spec["activation"]]())
    return nn.Sequential(*layers).double(), (spec["n_in"],)


def build_cnn(spec):
    torch.manual_seed(spec["seed"])
    layers = []
    for conv in spec["convs"]:
        layers += [nn.Conv2d(conv["c_in"], conv["c_out"], conv["kernel"], stride=conv["stride"],
                             padding=conv["padding"]), ACTIVATIONS[spec["activation"]]()]
    if spec["pool"]:
        layers.append(nn.MaxPool2d(2))
    layers.append(nn.Flatten())
    in_shape = (spec["channels"], spec["size"], spec["size"])
    with torch.no_grad():
        flat = nn.Sequential(*layers)(torch.zeros(1, *in_shape)).shape[1]
    layers.append(nn.Linear(flat, spec["n_out"]))
    return nn.Sequential(*layers).double(), in_shape


def check(model, in_shape, spec):
    def loss(x, y):
        out = model(x)
        if spec["loss"] == "ce":
            return F.cross_entropy(out, y, reduction=spec["reduction"])
        return F.mse_loss(out, y, reduction=spec["reduction"])

    g = torch.Generator().manual_seed(spec["seed"] + 1)
    B = spec["batch"]
    x = torch.randn(B, *in_shape, generator=g, dtype=torch.float64)
    if spec["loss"] == "ce":
        y = torch.randint(0, spec["n_out"], (B,), generator=g)
    else:
        y = torch.randn(B, spec["n_out"], generator=g, dtype=torch.float64)
    got = psg.per_sample(model, backend="eager")(loss)(x, y)
    ref = reference_per_sample(loss, dict(model.named_parameters()), (x, y))
    assert set(got) == set(ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], **TOL, msg=lambda m, n=name: f"{spec}\n{n}: {m}")


@SETTINGS
@given(mlp_specs())
def test_random_mlp(spec):
    check(*build_mlp(spec), spec)


@SETTINGS
@given(cnn_specs())
def test_random_cnn(spec):
    check(*build_cnn(spec), spec)
