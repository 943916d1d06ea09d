"""Torch decompositions that trace to other values than the eager op, or do not trace, replaced while capturing.

torch registers some decompositions as Python kernels of the ``Autograd`` dispatch key (``py_impl``). Every trace
of such an op (AOT autograd's, so ``torch.compile``'s and the capture's) then records the decomposition, never
the op: no rule sees it, and a wrong decomposition gives wrong losses and gradients with no error. Each entry of
``CORRECTED`` names the op, what goes wrong in torch's trace of it, and a decomposition that matches the eager
kernel (``tests/test_edge_cases.py`` and ``tests/test_traced_decompositions.py`` check each against it, and
the per-sample gradients against the loop).

``corrected()`` installs them for one capture, under the capture lock, and restores torch's own afterwards (the
switch list in ``dynamo.py``). Another thread's trace of the op in that window gets the correct decomposition.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch._C import DispatchKey

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


@contextlib.contextmanager
def corrected() -> Iterator[None]:
    """``CORRECTED`` as the ops' ``Autograd`` Python kernels, torch's own restored on exit."""
    saved = [(op, op.py_kernels.get(DispatchKey.Autograd)) for op in CORRECTED]
    try:
        for op, decomposition in CORRECTED.items():
            op.py_kernels[DispatchKey.Autograd] = decomposition
            op._dispatch_cache.clear()  # the dispatcher caches the kernel it picked per key
        yield
    finally:
        for op, before in saved:
            if before is None:
                op.py_kernels.pop(DispatchKey.Autograd, None)
            else:
                op.py_kernels[DispatchKey.Autograd] = before
            op._dispatch_cache.clear()


patches.register(patches.Patch(
    "corrected decompositions", "OpOverload.py_kernels[DispatchKey.Autograd] of " + ", ".join(
        str(op) for op in CORRECTED),
    "torch's decompositions of these ops trace to other values than the eager kernel (see each function)",
    ("capture",), "process-wide: another thread's trace of the op in that window gets the correct decomposition",
    "torch's kernel put back (or the entry removed) and the dispatch cache cleared, on exit", enter=corrected,
    current=lambda: tuple(op.py_kernels.get(DispatchKey.Autograd) for op in CORRECTED)))
