"""Torch decompositions that trace to other values than the eager op, replaced by correct ones while capturing.

torch registers some decompositions as Python kernels of the ``Autograd`` dispatch key (``py_impl``). Every trace
of such an op (AOT autograd's, so ``torch.compile``'s and the capture's) then records the decomposition, never
the op: no rule sees it, and a wrong decomposition gives wrong losses and gradients with no error. Each entry of
``CORRECTED`` names the op, what torch's decomposition gets wrong, and a decomposition that matches the eager
kernel (``tests/test_review_findings.py`` checks each against it, and the per-sample gradients against the loop).

``corrected()`` installs them for one capture, under the capture lock, and restores torch's own afterwards (the
switch list in ``dynamo.py``). Another thread's trace of the op in that window gets the correct decomposition.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch._C import DispatchKey

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


#: op -> the decomposition traced in place of torch's while capturing.
CORRECTED: dict[torch._ops.OpOverload, Callable] = {
    aten.multilabel_margin_loss_forward.default: multilabel_margin_loss_forward,
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
