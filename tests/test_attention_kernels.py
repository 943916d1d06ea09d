"""Per-sample gradients through every fused attention kernel that ``F.scaled_dot_product_attention`` can pick.

On CPU the kernels are the math form and the CPU flash kernel (decomposed at capture). On CUDA they are the
efficient (memory-efficient), flash and cuDNN kernels, which stay fused ops in the joint graph, with their own
backward ops; these cases exist only where CUDA does (``DEVICE_KERNELS``), and were run on a lent GPU
(docs/benchmarks-gpu.md says which). The reference is the loop over samples with the same kernel, and a float64
math-kernel loop on the CPU for the low-precision kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from reference import reference_per_sample
from torch.nn.attention import SDPBackend, sdpa_kernel

from compiled_psg import per_sample
from compiled_psg._capture.retrace import forward_slice

D, HEADS, L = 32, 2, 8

# (device, kernel, dtype, backend): CUDA's flash and cuDNN kernels take half precision only
DEVICE_KERNELS = [("cpu", SDPBackend.MATH, torch.float64, "eager"),
                  ("cpu", SDPBackend.FLASH_ATTENTION, torch.float64, "eager")]
if torch.cuda.is_available():
    DEVICE_KERNELS += [("cuda", SDPBackend.MATH, torch.float32, "eager"),
                       ("cuda", SDPBackend.EFFICIENT_ATTENTION, torch.float32, "eager"),
                       ("cuda", SDPBackend.EFFICIENT_ATTENTION, torch.float32, "inductor"),
                       ("cuda", SDPBackend.FLASH_ATTENTION, torch.bfloat16, "eager"),
                       ("cuda", SDPBackend.CUDNN_ATTENTION, torch.bfloat16, "eager")]


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x, mask=None, causal=False):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return self.out(y.transpose(1, 2).reshape(b, t, D))


def _case(device, dtype, masking, n=4, seed=0):
    torch.manual_seed(seed)  # every draw on the CPU: the same case on every device
    model = SelfAttention().to(device, dtype)
    x = torch.randn(n, L, D).to(device, dtype)
    target = torch.randn(n, L, D).to(device, dtype)
    if masking == "causal":
        def loss(x, target):
            return (model(x, causal=True) - target).float().pow(2).mean()
        return model, loss, (x, target)
    if masking == "shared_bias":
        bias = torch.randn(L, L).to(device, dtype)
        def loss(x, target):
            return (model(x, mask=bias) - target).float().pow(2).mean()
        return model, loss, (x, target)
    keep = (torch.rand(n, 1, L, L) > 0.3).to(device)  # a padding-style mask per sample
    keep[..., 0] = True  # every query sees at least one key
    def loss(x, target, keep):
        return (model(x, mask=keep) - target).float().pow(2).mean()
    return model, loss, (x, target, keep)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("masking", ["causal", "shared_bias", "per_sample_mask"])
@pytest.mark.parametrize("device,kernel,dtype,backend", DEVICE_KERNELS,
                         ids=[f"{d}-{k.name.lower()}-{b}" for d, k, _, b in DEVICE_KERNELS])
def test_per_sample_gradients_through_attention_kernel(device, kernel, dtype, backend, masking):
    if kernel in (SDPBackend.FLASH_ATTENTION,) and masking != "causal" and device == "cuda":
        kernel = SDPBackend.EFFICIENT_ATTENTION  # CUDA's flash kernel takes no mask: SDPA would refuse
    model, loss, args = _case(device, dtype, masking)
    params = dict(model.named_parameters())
    with sdpa_kernel([kernel]):
        got = per_sample(model, backend=backend)(loss)(*args)
        same_kernel = reference_per_sample(loss, params, args)
    low = dtype in (torch.float16, torch.bfloat16)
    for name in params:
        # the batched kernel and the batch-of-one kernel round alike up to the kernel's precision
        assert _relative(got[name], same_kernel[name]) < (2e-2 if low else 1e-5 if dtype == torch.float32
                                                           else 1e-12), name
    if low:  # and against a float64 loop through the math kernel on the CPU
        model64, loss64, args64 = _case("cpu", torch.float64, masking)
        model64.load_state_dict({k: v.double().cpu() for k, v in model.state_dict().items()})  # bf16-rounded
        args64 = tuple(a.double().cpu() if a.is_floating_point() else a.cpu() for a in args)
        with sdpa_kernel([SDPBackend.MATH]):
            exact = reference_per_sample(loss64, dict(model64.named_parameters()), args64)
        for name in params:
            assert _relative(got[name].cpu(), exact[name]) < 3e-2, name


@pytest.mark.parametrize("marked", [True, False], ids=["meta", "no_meta"])
def test_forward_slice_drops_unused_backward_nodes_even_when_impure(marked):
    """CUDA's efficient and cuDNN attention backwards are tagged nondeterministic_seeded, so plain DCE keeps them
    in the forward slice (unused), where the mixing analysis would read them as consumers of the loss's batch
    mean. The slice drops nodes that serve only the gradients (found from the joint's gradient outputs, and by
    the ``autograd_backward`` meta where torch sets it), and keeps unused impure nodes of the forward and every
    placeholder."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    scale = graph.placeholder("scale")  # read by the gradient only: a placeholder stays all the same
    loss = graph.call_function(torch.ops.aten.sum.default, (x,))
    forward_draw = graph.call_function(torch.ops.aten.rand_like.default, (x,))
    backward_draw = graph.call_function(torch.ops.aten.rand_like.default, (x,))
    grad = graph.call_function(torch.ops.aten.mul.Tensor, (backward_draw, scale))
    if marked:
        backward_draw.meta["autograd_backward"] = True
        graph.output((loss,))
    else:
        graph.output((loss, grad))
    sliced, _ = forward_slice(fx.GraphModule(torch.nn.Module(), graph), 0)
    kept = {n.name for n in sliced.graph.nodes}
    assert forward_draw.name in kept and backward_draw.name not in kept
    assert [n.name for n in sliced.graph.nodes if n.op == "placeholder"] == ["x", "scale"]
