"""The GEMM form of per-sample Conv2d weight gradients (``rules.conv.conv2d_weight_gemm``), taken on
CUDA, forced here on the CPU: every Conv2d zoo case against the naive loop, and the rewrite's op checked."""

from __future__ import annotations

import pytest
import torch
from test_zoo import check_case
from zoo import BY_ID

import compiled_psg as psg
from compiled_psg._rewrite.rules import conv

CONV2D_CASES = ["simple_cnn", "conv2d_reflect", "conv2d_replicate", "conv2d_depthwise",
                "conv2d_stride_pad_dilation_groups"]


@pytest.fixture
def gemm_form(monkeypatch):
    monkeypatch.setattr(conv, "gemm_form_on", lambda device, patchify=False: True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case_id", CONV2D_CASES)
def test_gemm_form_matches_the_loop(gemm_form, case_id, dtype):
    check_case(BY_ID[case_id], dtype, "eager", batch=3)


@pytest.mark.parametrize("shape", [dict(kernel_size=1, stride=2), dict(kernel_size=(3, 2), stride=(2, 1),
                                   padding=(1, 2), dilation=(2, 1)), dict(kernel_size=7, stride=2, padding=3)],
                         ids=["1x1_stride2", "3x2_mixed", "7x7_stem"])
def test_gemm_form_of_strided_padded_dilated_kernels(gemm_form, shape):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 5, **shape), torch.nn.Flatten(), torch.nn.LazyLinear(2)).double()
    x = torch.randn(4, 3, 11, 9, dtype=torch.float64)
    model(x)  # materializes the lazy layer
    y = torch.tensor([0, 1, 1, 0])

    def loss(x, y):
        return torch.nn.functional.cross_entropy(model(x), y)

    fn = psg.per_sample(model, backend="eager")(loss)
    got = fn(x, y)
    for i in range(4):
        model.zero_grad()
        loss(x[i:i + 1], y[i:i + 1]).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(got[name][i], p.grad, rtol=1e-10, atol=1e-12)
    graph = psg.explain(fn, x, y).after.code
    assert "conv2d_weight_gemm" in graph and "conv_weight_per_sample" not in graph


def test_the_gemm_rounds_as_cudnn_and_restores_the_flag(monkeypatch):
    """Where cuDNN rounds in TF32 the GEMM runs with cuBLAS TF32 allowed, and the flag is back after it, also
    when the GEMM raises; a CPU tensor never asks for TF32. Replicas (r = 2) sum into one sample's gradient."""
    torch.manual_seed(0)
    gs, xs = torch.randn(2, 2, 4, 3, 3, dtype=torch.float64), torch.randn(2, 2, 3, 5, 5, dtype=torch.float64)
    want = torch.stack([sum(torch.ops.aten.convolution_backward(
        gs[n, k:k + 1], xs[n, k:k + 1], torch.empty(4, 3, 3, 3, dtype=torch.float64), None, [2, 2], [1, 1],
        [1, 1], False, [0, 0], 1, [False, True, False])[1] for k in range(2)) for n in range(2)])
    assert not conv.rounds_as_cudnn(gs)
    seen = []
    real_bmm = torch.bmm

    def recording_bmm(*args):
        seen.append(torch._C._get_cublas_allow_tf32())
        if len(seen) == 2:
            raise RuntimeError("GEMM failed")
        return real_bmm(*args)

    monkeypatch.setattr(conv, "rounds_as_cudnn", lambda x: True)
    monkeypatch.setattr(torch, "bmm", recording_bmm)
    before = torch._C._get_cublas_allow_tf32()
    args = ([4, 3, 3, 3], [2, 2], [1, 1], [1, 1])
    torch.testing.assert_close(conv.conv2d_weight_gemm(gs, xs, *args), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match="GEMM failed"):
        conv.conv2d_weight_gemm(gs, xs, *args)
    assert seen == [True, True] and torch._C._get_cublas_allow_tf32() is before


def test_a_patch_embedding_takes_the_gemm_form_on_the_cpu():
    """A ViT's patch embedding (stride = kernel, no padding): its patches do not overlap, so the GEMM form takes it
    on every device; an overlapping kernel on the CPU keeps the grouped convolution."""
    torch.manual_seed(0)
    for conv2d, form in ((torch.nn.Conv2d(3, 4, 4, stride=4), "conv2d_weight_gemm"),
                         (torch.nn.Conv2d(3, 4, 4, stride=2), "conv_weight_per_sample")):
        model = torch.nn.Sequential(conv2d, torch.nn.Flatten()).double()
        x = torch.randn(3, 3, 8, 8, dtype=torch.float64)

        def loss(x, model=model):
            return model(x).tanh().square().sum()

        fn = psg.per_sample(model, backend="eager")(loss)
        got = fn(x)
        for i in range(3):
            model.zero_grad()
            loss(x[i:i + 1]).backward()
            torch.testing.assert_close(got["0.weight"][i], model[0].weight.grad, rtol=1e-10, atol=1e-12)
        assert form in psg.explain(fn, x).after.code


@pytest.mark.parametrize("kernel, dilation, padding, stride", [
    ((3, 3), [1, 1], [1, 1], [1, 1]), ((1, 1), [1, 1], [0, 0], [1, 1]), ((1, 1), [1, 1], [0, 0], [2, 2]),
    ((3, 2), [2, 1], [1, 2], [2, 1]), ((7, 7), [1, 1], [3, 3], [2, 2]), ((4, 4), [1, 1], [0, 0], [4, 4]),
    ((2, 3), [1, 3], [0, 1], [3, 2])], ids=["3x3", "1x1", "1x1_stride2", "3x2_mixed", "7x7_stem", "patchify", "odd"])
def test_the_patches_are_unfold_in_one_gather(kernel, dilation, padding, stride):
    """``conv2d_patches`` is ``F.unfold`` (which launches one kernel per sample on CUDA), also for a strided input;
    a 1x1 convolution of stride 1 reads the input itself."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, 13, 11, dtype=torch.float64)
    for source in (x, x.transpose(2, 3).contiguous().transpose(2, 3)):
        got = conv.conv2d_patches(source, kernel, dilation, padding, stride)
        want = torch.nn.functional.unfold(source, kernel, dilation, padding, stride)
        assert got.shape == want.shape
        assert torch.equal(got, want)
    if kernel == (1, 1) and stride == [1, 1]:
        assert conv.conv2d_patches(x, kernel, dilation, padding, stride).data_ptr() == x.data_ptr()
