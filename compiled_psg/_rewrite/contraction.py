"""What a rule returns: one contraction over the batch, in every form the reductions may want.

A *contraction* is a node whose tensor inputs carry the batch and whose output does not: autograd summed the
samples' contributions (``mm`` for a Linear weight, ``sum`` for a bias, ``convolution_backward`` for a conv
weight) or the loss reduced over the batch (``nll_loss_forward`` with ``reduction="mean"``). A rule describes
the same computation per sample. Index letters: n batch, t tokens (or positions), o out, i in.

Every field is plain tensor code that ``emit`` traces into the graph:

- ``per_sample(*inputs) -> [n, *out]``: required, the materialized per-sample value.
- ``rebuild(*inputs) -> out`` with ``linear_arg``/``linear_layout``: the original op, linear in
  ``inputs[linear_arg]``. Scaling that argument per sample gives any weighted sum over samples with no per-sample
  tensor: this is the book-keeping trick behind ``clip_sum``.
- ``factors(*inputs) -> (A [n, t, o], X [n, t, i])`` with ``per_sample[n] = A[n]^T X[n]`` (reshaped to ``out``):
  a low-rank form that gives norms, Gram matrices and sums of squares without materializing (ghost norms).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .._analyze.layout import Layout


@dataclass
class Contraction:
    rule: str
    node: fx.Node
    inputs: list[fx.Node]
    per_sample: Callable[..., torch.Tensor]
    linear_arg: int | None = None
    linear_layout: tuple[int, Layout] | None = None  # (dim of the batch in inputs[linear_arg], layout)
    rebuild: Callable[..., torch.Tensor] | None = None
    factors: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    factor_shape: tuple[int, int, int] | None = None  # (t, o, i) sizes of the factors, for the cost model
    sq_norms: Callable[..., torch.Tensor] | None = None  # (*inputs) -> [n], when cheaper than materializing
    notes: dict = field(default_factory=dict)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(self.node.meta["val"].shape)


# ----- the math of low-rank (factored) per-sample gradients: g[n] = A[n]^T X[n] -----

def factored_per_sample(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[n, t, o], [n, t, i] -> [n, o, i]; for t = 1 an outer product (one fused write, no GEMM)."""
    if a.shape[1] == 1:
        return a.transpose(1, 2) * x
    return torch.bmm(a.transpose(1, 2), x)


def factored_sq_norms(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """||A[n]^T X[n]||_F^2 = <A A^T, X X^T>: ``||a_n|| ||x_n||`` squared when t = 1 (the ghost norm)."""
    if a.shape[1] == 1:
        return a.pow(2).sum((1, 2)) * x.pow(2).sum((1, 2))
    return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(x, x.transpose(1, 2))).sum((1, 2))


def factored_gram(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """<g_n, g_m> = sum_ts (A_n A_m^T)_ts (X_n X_m^T)_ts: ``(A A^T) * (X X^T)`` when t = 1."""
    if a.shape[1] == 1:
        return (a[:, 0] @ a[:, 0].T) * (x[:, 0] @ x[:, 0].T)
    aa = torch.einsum("nto,mso->nmts", a, a)
    xx = torch.einsum("nti,msi->nmts", x, x)
    return (aa * xx).sum((2, 3))


def factored_sum_squares(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum_n g[n]**2 = (A*A)^T (X*X) summed over n, valid when t = 1."""
    return (a[:, 0].pow(2)).T @ x[:, 0].pow(2)
