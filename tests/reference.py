"""The one reference every test compares against: a naive loop over samples with plain autograd.

Entry ``i`` is autograd's gradient of the SAME loss function called on the batch made of sample ``i`` alone
(sliced with its batch dimension kept, size 1; unbatched arguments, ``in_dims`` None, passed whole). A loss
returning per-sample losses ``[1]`` for that batch of one is summed (it has a single entry).

The noise of a DP step has its reference too: N(0, std^2) per coordinate (``check_gaussian``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch


def _dims(in_dims, n_args: int) -> tuple:
    if isinstance(in_dims, tuple):
        assert len(in_dims) == n_args, "reference: in_dims tuple must have one entry per argument"
        return in_dims
    return (in_dims,) * n_args


def batch_size_of(args: tuple, in_dims) -> int:
    sizes = {a.shape[d] for a, d in zip(args, _dims(in_dims, len(args)), strict=True) if d is not None}
    assert len(sizes) == 1, f"reference: batched arguments disagree on the batch size: {sizes}"
    return sizes.pop()


def sample(args: tuple, in_dims, i: int) -> tuple:
    """The batch made of sample ``i`` alone (batch dimension kept, size 1)."""
    dims = _dims(in_dims, len(args))
    return tuple(a if d is None else a.narrow(d, i, 1) for a, d in zip(args, dims, strict=True))


def reference_per_sample(loss_fn: Callable, params: Mapping[str, torch.Tensor], args: tuple,
                         in_dims=0) -> dict[str, torch.Tensor]:
    """``{name: Tensor[B, *param.shape]}`` by looping over samples; unused parameters get zeros."""
    names = list(params)
    tensors = [params[n] for n in names]
    batch = batch_size_of(args, in_dims)
    rows: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for i in range(batch):
        loss = loss_fn(*sample(args, in_dims, i))
        assert loss.numel() == 1, f"reference: loss of a batch of one has shape {tuple(loss.shape)}"
        grads = torch.autograd.grad(loss.sum(), tensors, allow_unused=True)
        for n, p, g in zip(names, tensors, grads, strict=True):
            rows[n].append(torch.zeros_like(p) if g is None else g.detach())
    return {n: torch.stack(rows[n]) if rows[n] else params[n].new_zeros((0, *params[n].shape)) for n in names}


def reference_losses(loss_fn: Callable, args: tuple, in_dims=0) -> torch.Tensor:
    """Each sample's batch-of-one loss, ``[B]``."""
    batch = batch_size_of(args, in_dims)
    with torch.no_grad():
        return torch.stack([loss_fn(*sample(args, in_dims, i)).sum() for i in range(batch)])


# ---------------------------------------------------------------- reductions of the stacked per-sample grads


def _rows(g: torch.Tensor) -> torch.Tensor:
    """``[B, numel]`` (also for 0-dim parameters, whose stacked gradient is ``[B]``)."""
    return g.reshape(g.shape[0], -1)


def _flat(grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([_rows(g) for g in grads.values()], dim=1)


def ref_norms(grads: Mapping[str, torch.Tensor], per_parameter: bool = False):
    if per_parameter:
        return {n: _rows(g).pow(2).sum(1).sqrt() for n, g in grads.items()}
    return _flat(grads).pow(2).sum(1).sqrt()


def ref_clip_sum(grads: Mapping[str, torch.Tensor], max_norm: float, return_norms: bool = False):
    norms = ref_norms(grads)
    factors = torch.where(norms > 0, (max_norm / norms).clamp(max=1.0), torch.ones_like(norms))
    sums = {n: (g * factors.view(-1, *([1] * (g.dim() - 1)))).sum(0) for n, g in grads.items()}
    return (sums, norms) if return_norms else sums


def ref_sum_squares(grads: Mapping[str, torch.Tensor]):
    return {n: g.pow(2).sum(0) for n, g in grads.items()}


def ref_variance(grads: Mapping[str, torch.Tensor]):
    return {n: g.var(0, unbiased=False) for n, g in grads.items()}


def ref_gram(grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
    flat = _flat(grads)
    return flat @ flat.T


def ref_cosine(grads: Mapping[str, torch.Tensor], direction: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Per-sample cosine between the whole gradient vector and a fixed direction."""
    flat = _flat(grads)
    d = torch.cat([direction[n].flatten() for n in grads])
    return (flat @ d) / (flat.norm(dim=1) * d.norm())


def check_gaussian(noise: torch.Tensor, std: float, p_min: float) -> None:
    """``noise`` passes as iid N(0, std^2): the chi-square test of its sum of squares, the mean within 6 standard
    errors and the Kolmogorov-Smirnov test, each at significance ``p_min``."""
    from scipy import stats

    n = noise.numel()
    noise = noise.double().flatten()
    chi2 = float((noise / std).pow(2).sum())
    p_two_sided = 2 * min(stats.chi2.cdf(chi2, n), stats.chi2.sf(chi2, n))
    assert p_two_sided > p_min, (chi2, n, noise.std().item(), std)
    assert abs(noise.mean().item()) < 6 * std / math.sqrt(n)
    assert stats.kstest((noise / std).numpy(), "norm").pvalue > p_min


def assert_numbers_close(got, want, rel: float) -> None:
    """Nested lists or tuples of numbers (per-layer clip bounds: one tuple per step) equal in structure and
    within ``rel``; ``pytest.approx`` takes no nested sequences from pytest 9.2 on."""
    if isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), (got, want)
        for g, w in zip(got, want, strict=True):
            assert_numbers_close(g, w, rel)
    elif want is None:
        assert got is None, (got, want)
    else:
        assert math.isclose(got, want, rel_tol=rel, abs_tol=0.0), (got, want)
