"""Mixed precision: bfloat16 parameters, and CPU autocast to bfloat16 around the loss.

The contract (docs/training.md, "Mixed precision"): per-sample norms, clip factors and the clipped sum are
computed in float32 from the per-sample gradients' own low-precision values, so the clip bound holds in float32
arithmetic; the noise is added in float32; only the optimizer's update is in the parameters' dtype. The
reference is the loop over samples in the same precision (each sample's gradient in bfloat16), upcast to
float64, clipped and summed in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import reference_per_sample

from compiled_psg import compile_step, per_sample
from compiled_psg._errors import DPConfigError
from compiled_psg._reduce.reductions import DPClip

C = 0.5
# CUDA cases exist where a GPU does (run on a lent GPU; docs/training.md "Mixed precision" says which)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DEVICE_BACKENDS = [("cpu", "eager"), ("cpu", "inductor")]
if torch.cuda.is_available():
    DEVICE_BACKENDS += [("cuda", "eager"), ("cuda", "inductor")]
# float32 sums of a few terms of size <= C: rounding is a few float32 ulps of C
TOL = dict(rtol=1e-5, atol=1e-6)


def bf16_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).to(torch.bfloat16)


def data(n: int = 8, seed: int = 1, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)
    x[0] *= 30  # an outlier: clipped hard
    return x.to(device), y.to(device)


def ref_clipped_sum(loss, model, x, y, bound: float) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    grads = reference_per_sample(loss, dict(model.named_parameters()), (x, y))
    grads = {n: g.double() for n, g in grads.items()}
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()
    factors = torch.where(norms > bound, bound / norms, torch.ones_like(norms))
    return {n: torch.tensordot(factors, g, dims=1) for n, g in grads.items()}, norms


def test_bf16_parameters_clip_and_sum_in_float32():
    model = bf16_model()
    loss = lambda x, y: F.cross_entropy(model(x.bfloat16()).float(), y, reduction="sum")  # noqa: E731
    x, y = data()
    clipped = per_sample(model, reduce=DPClip("flat", (C,)), backend="eager")(loss)
    sums, norms = clipped(x, y)
    assert norms.dtype == torch.float32 and all(s.dtype == torch.float32 for s in sums.values())
    expected, ref_norms = ref_clipped_sum(loss, model, x, y, C)
    torch.testing.assert_close(norms.double(), ref_norms, **TOL)
    for n in expected:
        torch.testing.assert_close(sums[n].double(), expected[n], **TOL)
    # the clip bound in float32 terms: removing any one sample moves the float32 sum by at most C (1 + 1e-6)
    for i in range(x.shape[0]):
        keep = [j for j in range(x.shape[0]) if j != i]
        without, _ = clipped(x[keep], y[keep])
        move = math.sqrt(sum(float((sums[n] - without[n]).double().pow(2).sum()) for n in sums))
        assert move <= C * (1 + 1e-6), (i, move)
        if i == 0:
            assert move > 0.99 * C  # the outlier's contribution is clipped to C, not rounded to bfloat16 below it


def autocast_loss(model, device: str = "cpu"):
    def loss(x, y):
        with torch.autocast(device, dtype=torch.bfloat16):
            out = model(x)
        return F.cross_entropy(out.float(), y, reduction="sum")
    return loss


@pytest.mark.usefixtures("eager_first_step")
@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("clipping", ["flat", "automatic"])
def test_autocast_step_against_float64_reference(clipping, device, backend):
    """float32 parameters, bfloat16 autocast: the noiseless update (SGD lr=1 on the summed loss) is the float64
    clipped sum of the loop's autocast gradients, to float32 rounding on the eager backend and to bfloat16's on
    Inductor (which does not round between fused ops as eager does); remove-one moves it by at most C in float32
    terms on both."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).to(device)
    loss = autocast_loss(model, device)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    gamma = 0.1
    options = {"automatic_gamma": gamma} if clipping == "automatic" else {}
    step = compile_step(loss, model, opt, max_grad_norm=C, clipping=clipping, loss_reduction="sum",
                        backend=backend, **options)
    start = [p.detach().clone() for p in model.parameters()]

    def update(x, y):
        with torch.no_grad():
            for p, s in zip(model.parameters(), start, strict=True):
                p.copy_(s)
        step(x, y)
        return {n: (s - p.detach()).double() for (n, p), s in zip(model.named_parameters(), start, strict=True)}

    x, y = data(device=device)
    grads = reference_per_sample(loss, dict(model.named_parameters()), (x, y))  # at the start parameters
    full = update(x, y)  # the eager first step
    full = update(x, y)  # the fused program
    assert step.fused
    norms = torch.stack([g.double().flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()
    factors = C / (norms + gamma) if clipping == "automatic" else norms.clamp_min(C).reciprocal() * C
    for n, g in grads.items():
        expected = torch.tensordot(factors, g.double(), dims=1)
        if backend == "eager":  # the float32 update p - (p - S) adds a rounding of the parameter's size
            torch.testing.assert_close(full[n], expected, rtol=1e-5, atol=1e-6)
        else:  # Inductor computes the autocast region without eager's bfloat16 rounding between ops
            assert float((full[n] - expected).norm()) <= 2e-2 * float(expected.norm()), n
    for i in range(x.shape[0]):
        keep = [j for j in range(x.shape[0]) if j != i]
        without = update(x[keep], y[keep])
        move = math.sqrt(sum(float((full[n] - without[n]).pow(2).sum()) for n in full))
        assert move <= C * (1 + 1e-5), (i, move)  # float32 rounding of the parameters, not bfloat16's 2^-8


def test_bf16_parameters_train_with_compile_step():
    """bfloat16 parameters end to end: the update (in bfloat16) is the float64 reference's, to the last bit of
    bfloat16; the noise is drawn in float32 (the sums' dtype), then the update is cast."""
    model = bf16_model()
    loss = lambda x, y: F.cross_entropy(model(x.bfloat16()).float(), y)  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    step = compile_step(loss, model, opt, max_grad_norm=C, backend="eager", noise_multiplier=0.0)
    for seed in (1, 2):
        x, y = data(seed=seed)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        expected, _ = ref_clipped_sum(loss, model, x, y, C)
        step(x, y)
        for n, p in model.named_parameters():
            want = (before[n].double() - 0.5 * expected[n] / x.shape[0])
            torch.testing.assert_close(p.detach().double(), want, rtol=2 ** -7, atol=1e-4)
    assert step.fused and step.last_norms.dtype == torch.float32
    assert step.inputs.sum_like(0, step._acc_dtype()).dtype == torch.float32  # what the noise is drawn like


@pytest.mark.parametrize("device", DEVICES)
def test_step_inside_autocast_is_refused(device):
    """Autocast around the step call would also cover the clipping and the update: refused, with the fix."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3).to(device)
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.SGD(model.parameters(), 0.1),
                        max_grad_norm=C, backend="eager")
    x, y = data(device=device)
    with torch.autocast(device, dtype=torch.bfloat16), pytest.raises(DPConfigError, match="inside the loss"):
        step(x, y)
    step(x, y)  # outside autocast: fine
    assert step.steps_taken == 1
