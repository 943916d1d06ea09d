"""``python -m benchmarks.gpu_correctness``: the CUDA-only code paths against the naive loop, on a lent GPU
(the test suite runs on CPU, where these paths are forced, not taken): the GEMM form of per-sample Conv2d
weight gradients, the one-buffer noise draw, a ``memory_budget=0`` step and the clip plan under TF32. Prints
one JSON line."""

from __future__ import annotations

import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import compiled_psg as psg
from compiled_psg._train import dp


def conv_gemm_form(device: str, dtype: torch.dtype = torch.float64, backend: str = "eager") -> float:
    """The largest error, relative to the float64 loop's largest entry, of per-sample gradients of a strided,
    padded, dilated CNN with a 1x1 and a 7x7 kernel, computed in ``dtype`` on ``backend``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 7, stride=2, padding=3), nn.GroupNorm(2, 8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=2, dilation=2), nn.ReLU(), nn.Conv2d(8, 4, 1, stride=2),
                          nn.Flatten(), nn.LazyLinear(5)).double().to(device)
    x = torch.randn(5, 3, 17, 15, dtype=torch.float64, device=device)
    y = torch.randint(0, 5, (5,), device=device)
    model(x)

    def loss(x, y):
        return F.cross_entropy(model(x), y)

    wants = [torch.autograd.grad(loss(x[i:i + 1], y[i:i + 1]), list(model.parameters())) for i in range(5)]
    model.to(dtype)
    got = psg.per_sample(model, backend=backend)(loss)(x.to(dtype), y)
    worst = 0.0
    for i in range(5):
        for (name, _), want in zip(model.named_parameters(), wants[i], strict=True):
            error = (got[name][i].double() - want).abs().max()
            worst = max(worst, float(error / want.abs().max().clamp_min(1e-300)))
    return worst


def conv_gemm_precision(device: str) -> dict:
    """Float32 on Inductor, with cuDNN's TF32 on (the default: the GEMM rounds in TF32, as the convolution it
    replaces) and off (float32 throughout), against the float64 loop; cuBLAS's flag is untouched after."""
    out = {}
    saved = torch.backends.cudnn.allow_tf32
    try:
        for allowed in (True, False):
            torch.backends.cudnn.allow_tf32 = allowed
            out[f"cudnn_tf32_{allowed}"] = conv_gemm_form(device, torch.float32, "inductor")
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    out["cublas_tf32_after"] = torch.backends.cuda.matmul.allow_tf32
    return out


def noise_draw(device: str) -> dict:
    likes = [torch.zeros(300, 700, device=device), torch.zeros(5000, device=device)] * 100
    draws = dp.gaussian_many(likes, 2.0)
    flat = torch.cat([d.flatten() for d in draws])
    shared = all(d._base is draws[0]._base for d in draws)
    return {"n": flat.numel(), "mean": float(flat.mean()), "std": float(flat.std()), "one_buffer": shared}


def budget_step(device: str) -> float:
    results = []
    for budget in (None, 0):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 3)).double().to(device)
        x = torch.randn(6, 64, 16, dtype=torch.float64, device=device)
        y = torch.randint(0, 3, (6,), device=device)
        step = psg.compile_step(lambda x, y, model=model: F.cross_entropy(model(x).mean(1), y), model,
                                torch.optim.SGD(model.parameters(), lr=0.5), max_grad_norm=0.05, backend="eager",
                                memory_budget=budget)
        step(x, y)
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return float((results[0] - results[1]).abs().max())


def tf32_plan(device: str) -> list[str]:
    """The clip norm strategies of a float32 token MLP (t = 64) while TF32 matmuls are allowed: neither the
    ghost norm nor the bounded materialized norm may be among them (``strategies.rounds_in_tf32``)."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 3)).to(device)
    x, y = torch.randn(6, 64, 16, device=device), torch.randint(0, 3, (6,), device=device)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        fn = psg.per_sample(model, reduce=psg.clip_sum(1.0, memory_budget=0), backend="eager")(
            lambda x, y: F.cross_entropy(model(x).mean(1), y))
        fn(x, y)
        report = psg.explain(fn, x, y)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return [c.method for r in report.rewrites for c in r.choices if c.quantity == "sq_norm"]


def main() -> None:
    device = "cuda"
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "conv_gemm_form_rel_error": conv_gemm_form(device), "conv_gemm_float32": conv_gemm_precision(device),
           "noise": noise_draw(device),
           "memory_budget_step_max_diff": budget_step(device), "tf32_plan": tf32_plan(device)}
    f32 = out["conv_gemm_float32"]
    out["ok"] = (out["conv_gemm_form_rel_error"] < 1e-10 and out["noise"]["one_buffer"]
                 and f32["cudnn_tf32_True"] < 1e-2 and f32["cudnn_tf32_False"] < 1e-5 and not f32["cublas_tf32_after"]
                 and abs(out["noise"]["std"] - 2.0) < 0.01 and abs(out["noise"]["mean"]) < 0.01
                 and out["memory_budget_step_max_diff"] < 1e-12 and not math.isnan(out["noise"]["std"])
                 and not {"ghost", "materialize, bounded"} & set(out["tf32_plan"]))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
