"""torch's OpInfo database, each op posed as a per-sample problem (as ``test_module_db.py`` does with modules).

For an op with a float64 sample input ``x`` (and its other arguments ``a``): a batch ``X [B, *x.shape]`` around
``x``, a shared parameter ``P`` of ``x``'s shape, and the loss ``sum_k <op(X * P, *a)_k, W_k>`` over the op's
floating outputs with fixed weights ``W_k``. The op is posable when it keeps the leading dimension as a batch:
``op(X * P)[i] == op(X[i] * P)`` for every sample, each output shaped ``[B, ...]`` (the first sample input that
is, else the op is skipped). Each posable op must be exact against the loop (autograd on the batch of sample
``i`` alone, NaN where the loop's is NaN) or refused with one of compiled_psg's errors that says why; an
``InternalError``, a torch exception escaping, or a wrong value fails. A refusal fails too where
``vmap(grad)`` over the samples matches the loop, unless ``CORRECT_REFUSALS`` names the op with the reason the
refusal is right there; ops whose ``vmap(grad)`` fails (a random op under ``randomness="error"``, an op without a
batching rule) may stay refused by name.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.testing._internal import common_methods_invocations
from torch.testing._internal.common_methods_invocations import op_db

import compiled_psg as psg
from compiled_psg._compat import item_of_a_constant_tensor_is_a_size

B = 3
# posable ops that must be exact, not refused: op facts added for this sweep (a regression to a refusal fails)
MUST_BE_EXACT = {"alias_copy", "diag_embed", "narrow_copy", "split_with_sizes_copy", "squeeze_copy",
                 "transpose_copy", "unbind_copy", "unsqueeze_copy", "zero_", "fft.hfft", "fft.hfft2", "fft.irfft",
                 "fft.irfftn", "stft", "nn.functional.hardswish", "rsub", "linalg.det", "linalg.slogdet",
                 "linalg.eigh", "linalg.svdvals", "linalg.qr", "cdist",
                 # exact where vmap(grad) over the samples fails, so that the rule below does not witness them
                 "linalg.solve", "nn.functional.rrelu", "svd_lowrank", "pca_lowrank"}

# Refusals that are right although vmap(grad) over the samples matches the loop on the sweep's loss: op -> why.
CORRECT_REFUSALS = {
    # the batched loss depends on B: squeeze() also drops the batch dimension of a batch of one, so a sample's own
    # loss sees other shapes than its part of the batch's (the sweep's weighted sum hides that; a loss reducing
    # over dimension 0 afterwards does not)
    "squeeze": "squeeze() without a dim",
}
if not item_of_a_constant_tensor_is_a_size():
    # the sample's number of sections is a 0-d tensor: the output's shapes depend on its value, which torch 2.13's
    # graph cannot hold (vmap runs eagerly and reads it); 2.14 and later read it as a size guarded on the value, and
    # Python ints are exact everywhere (tests/test_refusal_causes.py)
    CORRECT_REFUSALS["tensor_split"] = "computes a shape from a tensor's values"


@pytest.fixture(autouse=True)
def _unseeded(monkeypatch):
    """OpInfo wraps its random ops (dropout, rrelu, the low-rank SVDs, attention) in ``wrapper_set_seed``, whose
    ``freeze_rng_state`` enters C++ context managers (``torch._C._DisableFuncTorch()``): a graph break in any
    traced loss, of the test's harness, not of the op. The sweep calls the ops directly; the samples it poses draw
    nothing (``p=0``, eval mode) or give values that do not depend on the draws, so the loop and the batch agree
    without a seed."""
    monkeypatch.setattr(common_methods_invocations, "wrapper_set_seed", lambda op, *args, **kwargs: op(*args, **kwargs))


def _key(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


OPS = [op for op in op_db if op.supports_autograd and torch.float64 in op.supported_dtypes("cpu")]


def _floating(out) -> list[torch.Tensor]:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point() and o.layout == torch.strided]


def _pose(op):
    """``(loss, X, P)`` for the op's first sample input that keeps a leading batch apart, or None."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        samples = list(op.sample_inputs("cpu", torch.float64, requires_grad=False))
    for sample in samples:
        x = sample.input
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float64 or x.dim() < 1 or x.numel() == 0 \
                or x.layout != torch.strided:
            continue
        g = torch.Generator().manual_seed(0)
        batch = x.unsqueeze(0) + 0.1 * torch.randn((B, *x.shape), generator=g, dtype=torch.float64)
        p = torch.nn.Parameter(1 + 0.1 * torch.randn(x.shape, generator=g, dtype=torch.float64))

        def outputs(inp, sample=sample):
            return _floating(op(inp, *sample.args, **sample.kwargs))

        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                together = outputs(batch * p)
                alone = [outputs(batch[i] * p) for i in range(B)]
        except Exception:  # noqa: BLE001 - this sample does not take a leading batch dimension
            continue
        if not together or any(len(a) != len(together) for a in alone):
            continue
        if not all(t.shape[:1] == (B,) and all(alone[i][k].shape == t.shape[1:] and torch.allclose(
                t[i], alone[i][k], rtol=1e-9, atol=1e-9, equal_nan=True) for i in range(B))
                for k, t in enumerate(together)):
            continue
        weights = [torch.randn(t.shape[1:], generator=g, dtype=torch.float64) for t in together]

        def loss(inp, p=p, outputs=outputs, weights=weights):
            return sum((o * w).sum() for o, w in zip(outputs(inp * p), weights, strict=True))

        return loss, batch, p
    return None


@pytest.mark.parametrize("op", OPS, ids=_key)
def test_op_is_exact_or_refused_by_name(op):
    posed = _pose(op)
    if posed is None:
        pytest.skip("no sample input keeps a leading batch dimension apart")
    loss, batch, p = posed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the op's own warnings (deprecations) on the eager reference
        try:
            want = torch.stack([torch.autograd.grad(loss(batch[i:i + 1]), p)[0] for i in range(B)])
        except RuntimeError as e:
            pytest.skip(f"the loop reference fails: {e}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the op's own warnings again (mse_loss's broadcast target)
            got = psg.per_sample({"p": p}, backend="eager")(loss)(batch)["p"]
    except psg.InternalError:
        raise
    except psg.PerSampleError as e:
        assert _key(op) not in MUST_BE_EXACT, f"{_key(op)} is refused: {e}"
        if isinstance(e, psg.UnsupportedError | psg.SampleMixingError):  # names the op (or its aten form)
            assert "aten." in str(e) or op.name.split(".")[-1] in str(e), f"a refusal must name the op: {e}"
        if _key(op) in CORRECT_REFUSALS:
            assert CORRECT_REFUSALS[_key(op)] in str(e), f"{_key(op)} is refused for another reason: {e}"
        else:
            assert not _vmap_matches(loss, batch, p, want), f"{_key(op)} is refused, yet vmap(grad) is exact: {e}"
        return
    assert _key(op) not in CORRECT_REFUSALS, f"{_key(op)} is exact: drop it from CORRECT_REFUSALS"
    scale = float(want.abs().nan_to_num().max().clamp_min(1))
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9 * scale, equal_nan=True)


def _vmap_matches(loss, batch: torch.Tensor, p: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether ``vmap(grad)`` over the samples (``randomness="error"``) runs and matches the loop."""
    def one(params, sample):
        return loss(sample.unsqueeze(0), p=params)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0))(p.detach(), batch)
    except Exception:  # noqa: BLE001 - no batching rule, a random op: vmap(grad) is no witness
        return False
    scale = float(want.abs().nan_to_num().max().clamp_min(1))
    return torch.allclose(got, want, rtol=1e-7, atol=1e-9 * scale, equal_nan=True)

