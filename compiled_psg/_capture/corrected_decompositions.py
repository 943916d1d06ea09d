"""Torch decompositions that trace to other values than the eager op, or do not trace, replaced while capturing.

torch registers some decompositions as Python kernels of the ``Autograd`` dispatch key (``py_impl``). Every trace
of such an op (AOT autograd's, so ``torch.compile``'s and the capture's) then records the decomposition, never
the op: no rule sees it, and a wrong decomposition gives wrong losses and gradients with no error. Each entry of
``CORRECTED`` names the op, what goes wrong in torch's trace of it, and a decomposition that matches the eager
kernel (``tests/test_edge_cases.py`` and ``tests/test_traced_decompositions.py`` check each against it, and
the per-sample gradients against the loop).

``TRACEABLE`` holds the ops whose own trace would stop the capture, each replaced, the same way, by ops that
compute the same values and trace with a symbolic batch size: the linear algebra that raises on a singular
matrix (its check, ``aten._linalg_check_errors``, reaches the graph as an effect token that no per-sample program
carries: the ``_ex`` twin and an assertion of our own instead, ``_assert_ok``), ``sgn`` (its backward on real
tensors builds zeros from the input's concrete sizes, fixing the batch size), ``kron`` and ``take_along_dim``
(their C++ decompositions read concrete sizes), ``fractional_max_pool2d`` (its backward's meta function reads
the batch size) and ``affine_grid_generator`` (its backward's C++ kernel takes the batch size as an integer).
``tests/test_linalg_stacks.py``, ``tests/test_op_db.py`` and ``tests/test_refusal_causes.py`` check them against
the loop.

``corrected()`` installs both tables for one capture, under the capture lock, and restores torch's own afterwards
(the switch list in ``dynamo.py``). Another thread's trace of the op in that window gets the replacement.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from torch._C import DispatchKey
from torch._prims_common import infer_size_shapes

from .._errors import UnsupportedError
from . import patches

aten = torch.ops.aten


def multilabel_margin_loss_forward(input: torch.Tensor, target: torch.Tensor,
                                   reduction: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.multilabel_margin_loss``'s kernel: ``sum_{j < end} sum_{i not a target} max(0, 1 - x[y_j] + x[i]) / C``
    per sample (``end``: the first -1 in the sample's targets), then the reduction.

    torch 2.13's decomposition gathers class 0 for the target slots after the first -1 (``gather`` takes no -1)
    and never masks those slots out of the loss, so class 0 counts once more per such slot whenever a sample has
    fewer targets than classes. This is that decomposition with the mask applied (``slot_used``)."""
    orig_input_shape, orig_target_shape = input.shape, target.shape
    input, target = torch.atleast_2d(input), torch.atleast_2d(target)
    classes = input.shape[1]
    torch._check(len(orig_input_shape) <= 2 and classes != 0,
                 lambda: f"Expected non-empty vector or matrix with optional 0-dim batch size, but got: "
                         f"{orig_input_shape}")
    torch._check(len(orig_target_shape) <= 2 and orig_target_shape == orig_input_shape,
                 lambda: f"inconsistent target size: {orig_target_shape} for input of size: {orig_input_shape}")
    idx = torch.arange(classes, device=target.device)
    end = torch.amin(torch.where(target == -1, idx, classes), dim=-1, keepdim=True)  # [n, 1]
    slot_used = idx < end  # [n, slots]: the slots before the first -1
    u = torch.gather(input, -1, torch.where(slot_used, target, 0))  # x[y_j], [n, slots]
    is_target = torch.any(idx == torch.where(slot_used, target, -1).unsqueeze(-1), dim=1)  # [n, classes]
    z = (1.0 - u.T.unsqueeze(-1) + input).clamp_min(0) / classes  # [slots, n, classes]
    z = torch.where(is_target, 0, z)
    z = torch.where(slot_used.T.unsqueeze(-1), z, 0)
    if reduction == 1:  # mean
        loss = z.sum(dim=(0, -1)).mean()
    elif reduction == 2:  # sum
        loss = z.sum()
    else:
        loss = z.sum(dim=(0, -1))
    return loss, is_target.to(input.dtype).reshape(orig_target_shape)


def upsample_bicubic2d_aa(input: torch.Tensor, output_size: list[int], align_corners: bool,
                          scales_h: float | None = None, scales_w: float | None = None) -> torch.Tensor:
    """``F.interpolate(mode="bicubic", antialias=True)`` as ``out[n, c] = R^T x[n, c] C`` (index letters: h, w
    in; o, p out).

    torch 2.13 traces the op itself, and the meta kernel of its backward fails on a symbolic batch size (an
    INTERNAL ASSERT, "Expected IntList but got GenericList"), so no loss with it could be captured. The op is
    separable and linear: ``R [h, o]`` and ``C [w, p]`` are the op applied to identity images, one spatial axis at
    a time (the other axis kept at 2 samples, 2 -> 2 being the identity), so the batch only meets an einsum.
    Equal to the eager kernel within float rounding, except for an output width of 1 with the height changed:
    there the eager forward gives every output row one value while its backward is the true adjoint, so no
    function's gradient matches the loop's: refused."""
    op = aten._upsample_bicubic2d_aa.default
    (h, w), (o, p) = input.shape[-2:], output_size
    if p == 1 and o != h:
        raise UnsupportedError(
            "F.interpolate(mode='bicubic', antialias=True) to an output width of 1 with the height changed: torch's "
            "kernel cannot be traced with a symbolic batch size, and its eager forward there is not what its "
            "backward differentiates, so no traced form matches it. Fix: antialias=False, or mode='bilinear' with "
            "antialias=True")
    eye_h = torch.eye(h, dtype=input.dtype, device=input.device).view(h, 1, h, 1).expand(h, 1, h, 2)
    eye_w = torch.eye(w, dtype=input.dtype, device=input.device).view(w, 1, 1, w).expand(w, 1, 2, w)
    with torch._C._AutoDispatchBelowAutograd():  # constants (no gradient): the op itself, not this kernel again
        rows = op(eye_h.contiguous(), [o, 2], align_corners, scales_h, None)[:, 0, :, 0]
        cols = op(eye_w.contiguous(), [2, p], align_corners, None, scales_w)[:, 0, 0, :]
    return torch.einsum("...hw,ho,wp->...op", input, rows, cols)


#: op -> the decomposition traced in place of torch's while capturing.
CORRECTED: dict[torch._ops.OpOverload, Callable] = {
    aten.multilabel_margin_loss_forward.default: multilabel_margin_loss_forward,
    aten._upsample_bicubic2d_aa.default: upsample_bicubic2d_aa,
}

#: How the message of a failed ``_assert_ok`` starts: ``_compile/run.py`` raises it as a ``BatchInputError``.
FAILED_CHECK = "compiled_psg: the batch fails a check of the loss:"


def _assert_ok(info: torch.Tensor, api: str, failure: str, fix: str) -> None:
    """What eager ``api`` raises on a nonzero ``info`` (one per matrix), as an assertion in the graph: a plain op,
    kept where the effect token of ``aten._linalg_check_errors`` would stop the capture."""
    torch._assert_async((info == 0).all(), f"{FAILED_CHECK} {api} raises here, as it does on this batch in eager "
                                           f"mode: the matrix of at least one sample {failure}. Fix: {fix}")


_EX_FIX = "use the _ex twin ({}), which returns an info tensor instead of raising, and handle info in the loss"


def linalg_inv(A: torch.Tensor) -> torch.Tensor:
    """``torch.linalg.inv``: ``linalg.inv_ex`` and its check, as torch's own composite kernel."""
    inverse, info = torch.linalg.inv_ex(A)
    _assert_ok(info, "torch.linalg.inv", "is singular", "regularize it (A + eps * I), or "
               + _EX_FIX.format("torch.linalg.inv_ex"))
    return inverse


def linalg_cholesky(A: torch.Tensor, *, upper: bool = False) -> torch.Tensor:
    """``torch.linalg.cholesky``: ``linalg.cholesky_ex`` and its check."""
    factor, info = torch.linalg.cholesky_ex(A, upper=upper)
    _assert_ok(info, "torch.linalg.cholesky", "is not positive-definite", "add a multiple of the identity, or "
               + _EX_FIX.format("torch.linalg.cholesky_ex"))
    return factor


def linalg_lu_factor(A: torch.Tensor, *, pivot: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.lu_factor``: ``linalg.lu_factor_ex`` and its check (a zero on ``U``'s diagonal)."""
    lu, pivots, info = torch.linalg.lu_factor_ex(A, pivot=pivot)
    _assert_ok(info, "torch.linalg.lu_factor", "is singular (a zero on U's diagonal)",
               _EX_FIX.format("torch.linalg.lu_factor_ex"))
    return lu, pivots


def linalg_solve(A: torch.Tensor, B: torch.Tensor, *, left: bool = True) -> torch.Tensor:
    """``torch.linalg.solve``: ``linalg.solve_ex`` and its check."""
    result, info = torch.linalg.solve_ex(A, B, left=left)
    _assert_ok(info, "torch.linalg.solve", "is singular", "regularize it (A + eps * I), or "
               + _EX_FIX.format("torch.linalg.solve_ex"))
    return result


def sgn(x: torch.Tensor) -> torch.Tensor:
    """``torch.sgn``: on real tensors ``torch.sign`` (the same values; both gradients are zero), whose backward
    traces with a symbolic batch size where sgn's builds its zeros from the input's concrete sizes. On complex
    tensors ``x / |x|`` and 0 at 0, differentiated by autograd (sgn's backward there is the same formula)."""
    if not x.is_complex():
        return torch.sign(x)
    magnitude = x.abs()
    zero = magnitude == 0
    return torch.where(zero, 0, x / torch.where(zero, 1, magnitude))


def kron(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.kron``: ``out[i * m + j] = a[i] * b[j]`` along every dimension (the lower rank padded with leading
    ones), as one broadcast product of ``a`` and ``b`` interleaved with size-1 dimensions, the eager kernel's
    values. torch's own decomposition reads the sizes as integers, which fixes a symbolic batch size."""
    rank = max(a.dim(), b.dim())
    a = a.reshape((1,) * (rank - a.dim()) + tuple(a.shape))
    b = b.reshape((1,) * (rank - b.dim()) + tuple(b.shape))
    spread_a = a.reshape([s for d in a.shape for s in (d, 1)])  # [a0, 1, a1, 1, ...]
    spread_b = b.reshape([s for d in b.shape for s in (1, d)])  # [1, b0, 1, b1, ...]
    return (spread_a * spread_b).reshape([p * q for p, q in zip(a.shape, b.shape, strict=True)])


def take_along_dim(input: torch.Tensor, indices: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``torch.take_along_dim``: both operands broadcast against each other except along ``dim``, then ``gather``
    (the flattened input and indices when ``dim`` is None), as the eager kernel does. Its C++ decomposition reads
    the sizes as integers, which fixes the batch size. (torch's Python reference also wraps negative indices,
    which the eager kernel's gather refuses: not used.)"""
    torch._check(input.dim() == indices.dim(), lambda: "torch.take_along_dim(): input and indices should have the "
                 f"same number of dimensions, but got {input.dim()} dimensions for input, and {indices.dim()} "
                 "dimensions for indices")
    torch._check(indices.dtype == torch.long, lambda: "torch.take_along_dim(): dtype of indices should be Long but "
                 f"got {indices.dtype}")
    if dim is None:
        return input.view(-1).gather(0, indices.view(-1))
    dim %= max(input.dim(), 1)
    sizes = list(input.shape)
    sizes[dim] = indices.shape[dim]
    indices = indices.expand(infer_size_shapes(sizes, indices.shape))  # torch's shape code: its size decisions
    sizes = list(indices.shape)                                        # are layouts, not the program's branches
    sizes[dim] = input.shape[dim]
    return input.expand(infer_size_shapes(sizes, input.shape)).gather(dim, indices)


def fractional_max_pool2d(input: torch.Tensor, kernel_size: list[int], output_size: list[int],
                           random_samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.fractional_max_pool2d``: the op itself for the positions of the maxima (``indices``, flat over each
    plane), and the values gathered there, so that autograd differentiates a gather (its backward: a scatter-add
    into zeros of the input's shape). torch's own backward (``fractional_max_pool2d_backward``) reads the batch
    size as an integer in its C++ meta function, which fixes it. The same values and gradients: each output is
    the input at its index, and the backward kernel adds each output's gradient there. (``fractional_max_pool3d``
    has no Python meta function: its forward fixes the batch size, and it stays refused.)"""
    with torch._C._AutoDispatchBelowAutograd():  # the positions: no gradient flows through them
        _, indices = aten.fractional_max_pool2d.default(input.detach(), kernel_size, output_size, random_samples)
    return input.flatten(-2).gather(-1, indices.flatten(-2)).view(indices.shape), indices


def _linspace_from_neg_one(theta: torch.Tensor, steps: int, align_corners: bool) -> torch.Tensor:
    """The eager kernel's sample positions along one axis: ``linspace(-1, 1)``, scaled to pixel centers unless
    ``align_corners``, ``[0]`` for one step (``aten/src/ATen/native/AffineGridGenerator.cpp``)."""
    if steps <= 1:
        return torch.zeros(1, dtype=theta.dtype, device=theta.device)
    positions = torch.linspace(-1, 1, steps, dtype=theta.dtype, device=theta.device)
    return positions if align_corners else positions * (steps - 1) / steps


def affine_grid_generator(theta: torch.Tensor, size: list[int], align_corners: bool) -> torch.Tensor:
    """``F.affine_grid``: ``grid[n] = base @ theta[n].T`` (index letters: n batch; base ``[H*W, 3]`` holds
    ``(x, y, 1)`` per output pixel, ``[D*H*W, 4]`` in 3-d), one ``bmm`` per sample as the eager kernel computes
    it, so the values are the kernel's. ``size`` holds the batch size (``list(x.shape)``) and torch's backward
    (``affine_grid_generator_backward``) reads it as integers, which stops the capture; autograd differentiates
    this ``bmm`` instead, and the batch only sizes the expanded base grid."""
    torch._check(len(size) in (4, 5), lambda: "affine_grid_generator needs 4d (spatial) or 5d (volumetric) inputs.")
    n, spatial = size[0], list(size[2:])
    axes = [_linspace_from_neg_one(theta, s, align_corners) for s in reversed(spatial)]  # x, y(, z)
    coords = []
    for k, axis in enumerate(axes):  # axis k varies along spatial dimension -1 - k
        view = [1] * len(spatial)
        view[len(spatial) - 1 - k] = axis.shape[0]
        coords.append(axis.view(view).expand(spatial))
    coords.append(torch.ones(spatial, dtype=theta.dtype, device=theta.device))
    points = math.prod(spatial)
    base = torch.stack(coords, -1).view(1, points, len(coords)).expand(n, points, len(coords))
    return base.bmm(theta.transpose(1, 2)).view(n, *spatial, len(spatial))


#: op -> a decomposition that traces, with the same values, where torch's own stops the capture.
TRACEABLE: dict[torch._ops.OpOverload, Callable] = {
    aten.linalg_inv.default: linalg_inv,
    aten.linalg_cholesky.default: linalg_cholesky,
    aten.linalg_lu_factor.default: linalg_lu_factor,
    aten.linalg_solve.default: linalg_solve,
    aten.sgn.default: sgn,
    aten.kron.default: kron,
    aten.fractional_max_pool2d.default: fractional_max_pool2d,
    aten.take_along_dim.default: take_along_dim,
    aten.affine_grid_generator.default: affine_grid_generator,
}


def key_of(op: torch._ops.OpOverload) -> DispatchKey:
    """The key whose Python kernel a trace takes for ``op``: ``CompositeImplicitAutograd`` for an op torch
    decomposes in C++ (it comes before ``Autograd``), else ``Autograd``."""
    implicit = DispatchKey.CompositeImplicitAutograd
    return implicit if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), implicit) else DispatchKey.Autograd


@contextlib.contextmanager
def installed(table: dict[torch._ops.OpOverload, Callable]) -> Iterator[None]:
    """``table``'s decompositions as the ops' Python kernels (at ``key_of(op)``), torch's own restored on exit."""
    saved = [(op, key_of(op), op.py_kernels.get(key_of(op))) for op in table]
    try:
        for op, key, _ in saved:
            op.py_kernels[key] = table[op]
            op._dispatch_cache.clear()  # the dispatcher caches the kernel it picked per key
        yield
    finally:
        for op, key, before in saved:
            if before is None:
                op.py_kernels.pop(key, None)
            else:
                op.py_kernels[key] = before
            op._dispatch_cache.clear()


def corrected() -> contextlib.AbstractContextManager:
    return installed(CORRECTED)


def traceable() -> contextlib.AbstractContextManager:
    return installed(TRACEABLE)


patches.register(patches.Patch(
    "corrected decompositions", "OpOverload.py_kernels[DispatchKey.Autograd] of " + ", ".join(
        str(op) for op in CORRECTED),
    "torch's decompositions of these ops trace to other values than the eager kernel (see each function)",
    ("capture",), "process-wide: another thread's trace of the op in that window gets the correct decomposition",
    "torch's kernel put back (or the entry removed) and the dispatch cache cleared, on exit", enter=corrected,
    current=lambda: tuple(op.py_kernels.get(key_of(op)) for op in CORRECTED)))
patches.register(patches.Patch(
    "traceable decompositions", "OpOverload.py_kernels[CompositeImplicitAutograd or Autograd] of " + ", ".join(
        str(op) for op in TRACEABLE),
    "torch's trace of these ops stops the capture: the checked linear algebra records an effect token (its "
    "_ex twin and an assertion instead), the backwards of sgn, fractional_max_pool2d and affine_grid_generator "
    "and the decompositions of kron and take_along_dim fix the batch size (see each function)", ("capture",),
    "process-wide: another thread's trace of the op in that window gets the replacement (the same values)",
    "torch's kernel put back (or the entry removed) and the dispatch cache cleared, on exit", enter=traceable,
    current=lambda: tuple(op.py_kernels.get(key_of(op)) for op in TRACEABLE),
    checked_on=("2.13.0", "2.14.1", "2.15.0")))
