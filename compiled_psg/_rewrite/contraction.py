"""What a rule returns: one contraction over the batch, in every form the reductions may want.

A *contraction* is a node whose tensor inputs carry the batch and whose output does not: autograd summed the
samples' contributions (``mm`` for a Linear weight, ``sum`` for a bias, ``convolution_backward`` for a conv
weight) or the loss reduced over the batch (``nll_loss_forward`` with ``reduction="mean"``). A rule describes
the same computation per sample. Index letters: n batch, t tokens (or positions), o out, i in.

Every field is plain tensor code that ``emit`` traces into the graph:

- ``per_sample(*inputs) -> [n, *out]``: required, the materialized per-sample value.
- ``rebuild(*inputs) -> out`` with ``linear_arg``/``linear_layout``: the original op, linear in
  ``inputs[linear_arg]``. Scaling that argument per sample gives any weighted sum over samples with no per-sample
  tensor: this is the book-keeping trick behind ``clip_sum``. ``other_linear``: more ``(arg, (dim, layout))`` the
  op is also linear in (a product is linear in each factor); the weighted sum scales the cheapest of them
  (``strategies.scale_cost``), e.g. a Linear weight's 128-wide output gradient rather than its 9216-wide input.
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
    other_linear: tuple[tuple[int, tuple[int, Layout]], ...] = ()  # more (arg, (dim, layout)) rebuild is linear in
    rebuild: Callable[..., torch.Tensor] | None = None
    factors: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    factor_shape: tuple[int, int, int] | None = None  # (t, o, i) sizes of the factors, for the cost model
    sq_norms: Callable[..., torch.Tensor] | None = None  # (*inputs) -> [n], when cheaper than materializing
    # (*inputs) -> ([n, t], [n, t]): the norms of the factors' rows ||A[n, t]||, ||X[n, t]||, where the factors
    # are too big to form (a convolution's patches) but a book-keeping sum rounds as they would
    token_norms: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    # (*inputs) -> (ids [n, t], weight [n, t], X [n, t, i]): factors whose ``A`` selects rows, ``A[n, t] =
    # weight[n, t] * one_hot(ids[n, t], o)`` (an embedding's gradient: ``o`` is the vocabulary, too wide to form)
    index_factors: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    notes: dict = field(default_factory=dict)

    def row_norms(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(||A[n, t]||, ||X[n, t]||)``, each ``[n, t]``: from ``token_norms``, else from the factors."""
        if self.token_norms is not None:
            return self.token_norms(*inputs)
        a, x = self.factors(*inputs)
        dtype = _norm_dtype(a.dtype)
        return a.to(dtype).norm(dim=2), x.to(dtype).norm(dim=2)

    def linear_options(self) -> list[tuple[int, tuple[int, Layout]]]:
        """Every ``(arg, (dim, layout))`` that ``rebuild`` is linear in, ``linear_arg`` first."""
        if self.linear_arg is None or self.linear_layout is None:
            return []
        return [(self.linear_arg, self.linear_layout), *self.other_linear]


# ----- the math of low-rank (factored) per-sample gradients: g[n] = A[n]^T X[n] -----

def factored_per_sample(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[n, t, o], [n, t, i] -> [n, o, i]; for t = 1 an outer product (one fused write, no GEMM)."""
    if a.shape[1] == 1:
        return a.transpose(1, 2) * x
    return torch.bmm(a.transpose(1, 2), x)


def factored_sq_norms(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """||A[n]^T X[n]||_F^2 = <A A^T, X X^T>: ``||a_n|| ||x_n||`` squared when t = 1 (the ghost norm).

    For t > 1 the ghost norm sums t^2 signed terms, and a sample whose tokens contribute large, nearly opposite
    gradients cancels them: in the input's precision the result can be 0, negative or NaN, and clipping with it
    would let that sample's whole gradient into the sum. So it is computed in float64 and returned as a certified
    upper bound (``certified_sq_norms``): clipping with it never lets a sample past C."""
    if a.shape[1] == 1:  # a product of sums of squares: no cancellation
        a_sq, x_sq = a.pow(2).sum((1, 2)), x.pow(2).sum((1, 2))
        # a zero factor makes the gradient exactly zero where the other factor is finite, also where its squares
        # overflow (inf * 0 = NaN would drop the sample: a saturated tanh after an input of 3e19); where the other
        # holds an inf or a NaN, the gradient itself is NaN (0 * inf, as autograd and the clipped sum compute it),
        # and so is the norm: the sample is dropped (a saturated tanh after an input of inf)
        finite = torch.isfinite(a).flatten(1).all(1) & torch.isfinite(x).flatten(1).all(1)
        return torch.where(((a_sq == 0) | (x_sq == 0)) & finite, torch.zeros_like(a_sq), a_sq * x_sq)
    a64, x64 = a.double(), x.double()
    sq = (torch.bmm(a64, a64.transpose(1, 2)) * torch.bmm(x64, x64.transpose(1, 2))).sum((1, 2))
    scale = (a64.norm(dim=2) * x64.norm(dim=2)).sum(1).square()
    return certified_sq_norms(sq, scale, a.shape[2] + x.shape[2], a.shape[1], _norm_dtype(a.dtype), a.dtype)


def certified_sq_norms(sq: torch.Tensor, scale: torch.Tensor, dot_length: int, t: int,
                       dtype: torch.dtype, sum_dtype: torch.dtype) -> torch.Tensor:
    """An upper bound of the squared norm of each sample's contribution as the clipped sum computes it.

    ``sq`` is the float64 ghost form ``sum_ts c_ts`` of the exact squared norm, with ``sum_ts |c_ts| <= scale``
    (``scale = (sum_t ||a_t|| ||x_t||)^2``). Two roundings are bounded (Higham, Accuracy and Stability of
    Numerical Algorithms, 3.1):

    - of the ghost form: products of dot products of ``dot_length`` entries in all, t^2 terms summed, so at most
      ``(dot_length + t^2 + 2) eps64 scale``;
    - of the clipped sum itself, which adds each sample's t token terms in ``sum_dtype`` (the book-keeping
      contraction, or a per-row scatter for embeddings): its result is off the exact ``A^T X`` by at most
      ``(t + 2) eps sqrt(scale)`` in norm. Where tokens cancel (large activations, opposite gradients) that is
      larger than the exact norm, and a factor from the exact norm alone let 1.35 C into a float32 sum.

    Both cost a relative ``~(t + 2) eps`` on ordinary data (float32: ~1e-5 at t = 128, a slightly smaller clip
    factor); they matter only where the terms cancel. The samples' contributions are then added up in
    ``sum_dtype`` like any sum of clipped gradients."""
    ghost = (dot_length + t * t + 2) * torch.finfo(torch.float64).eps
    summed = (t + 2) * torch.finfo(sum_dtype).eps if sum_dtype.is_floating_point else 0.0
    norm = (sq.clamp_min(0) + ghost * scale).sqrt() + summed * scale.sqrt()
    return norm.square().to(dtype)


def bounded_materialized_sq_norms(sq: torch.Tensor, a_norms: torch.Tensor, x_norms: torch.Tensor,
                                  eps: float) -> torch.Tensor:
    """An upper bound of the squared norm of each sample's contribution to a book-keeping sum, from the squared
    norm ``sq`` of the materialized ``fl(A[n]^T X[n])`` (t > 1).

    The book-keeping sum redoes the contraction with scaled rows, so its values are not the materialized ones, and
    where tokens cancel the two differ by more than the gradient itself (see ``certified_sq_norms``). Both are off
    the exact ``A^T X`` by a rounding of ``t`` token terms per entry: the materialized one by at most
    ``t eps sqrt(scale)`` in norm, the sum's by ``(t + 2) eps sqrt(scale)``, with ``sqrt(scale) = sum_t ||a_t||
    ||x_t||``. So ``sqrt(sq) + (2 t + 2) eps sqrt(scale)`` bounds the contribution summed; the roundings of the
    norm itself are covered by the slack of ``eps = 2u`` over Higham's ``gamma_t`` and ``gamma_{t+2}``. On ordinary
    data that adds a relative ``~2 t eps sqrt(t)`` (float32: ~1e-4 at t = 64), as the ghost norm's bound does.
    Like the ghost norm's certificate, it assumes matmuls round in the inputs' precision (no TF32).

    ``a_norms [n, t]`` and ``x_norms [n, t]`` are the norms of the factors' rows ``||a_t||`` and ``||x_t||``
    (``Contraction.row_norms``), ``eps`` the machine epsilon of the factors' dtype."""
    t, dtype = a_norms.shape[1], _norm_dtype(sq.dtype)
    root_scale = (a_norms.to(dtype) * x_norms.to(dtype)).sum(1)
    return (sq.to(dtype).clamp_min(0).sqrt() + (2 * t + 2) * eps * root_scale).square()


# ----- a gradient that sums several contractions (a weight tied between an embedding and a head) -----

# One factor of a contraction: dense rows ``[n, t, k]``, or rows that select a column, ``(ids [n, t], weight [n, t])``
Rows = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
GHOST_WIDTH_BYTES = 4 * 2**20  # per sample: the float64 slice of a dense factor converted at a time


def _rows_gram(r: Rows, s: Rows) -> torch.Tensor:
    """``R S^T`` per sample in float64, ``[n, t_r, t_s]``: a dense pair a slice of columns at a time
    (``dense_gram``), a selecting row as the column it selects."""
    if isinstance(r, tuple) and isinstance(s, tuple):
        (ids_r, w_r), (ids_s, w_s) = r, s
        same = (ids_r.unsqueeze(2) == ids_s.unsqueeze(1)).double()
        return same * w_r.double().unsqueeze(2) * w_s.double().unsqueeze(1)
    if isinstance(r, tuple):
        return _rows_gram(s, r).transpose(1, 2)
    if isinstance(s, tuple):
        ids, w = s
        picked = r.gather(2, ids.unsqueeze(1).expand(-1, r.shape[1], -1))  # [n, t_r, t_s]: r[n, t, ids[n, u]]
        return picked.double() * w.double().unsqueeze(1)
    return dense_gram(r, s)


def _slice_width(*rows: torch.Tensor) -> int:
    """Columns per slice: ``GHOST_WIDTH_BYTES`` of float64 per sample for the longest rows."""
    return max(1, GHOST_WIDTH_BYTES // (8 * max(1, *(r.shape[1] for r in rows))))


# One op each, opaque to the compiler: traced, the slices' partial Grams were separate buffers that Inductor added
# up in one kernel at the end, so all of them were live at once (99 Grams [B, T, T] for GPT-2's LM head at T = 1024:
# 1.68 GiB at B = 2 on the CPU, benchmarks/scale_notes.md); here one slice and the running Gram exist at a time.
@torch.library.custom_op("compiled_psg::dense_gram", mutates_args=())
def dense_gram(r: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``R S^T`` per sample in float64, ``[n, t_r, t_s]``, from dense rows ``[n, t_r, k]`` and ``[n, t_s, k]``, a
    slice of ``GHOST_WIDTH_BYTES`` of float64 per sample at a time (the float64 copy of a vocabulary-wide factor
    would be twice its size)."""
    gram = r.new_zeros((r.shape[0], r.shape[1], s.shape[1]), dtype=torch.float64)
    step = _slice_width(r, s)
    for start in range(0, r.shape[2], step):
        gram.baddbmm_(r[:, :, start:start + step].double(), s[:, :, start:start + step].double().transpose(1, 2))
    return gram


@dense_gram.register_fake
def _(r, s):
    return r.new_empty((r.shape[0], r.shape[1], s.shape[1]), dtype=torch.float64)


@torch.library.custom_op("compiled_psg::dense_self_gram", mutates_args=())
def dense_self_gram(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``R R^T`` and the rows' squared norms ``||r[n, t]||^2`` in float64, from one set of slices (as
    ``dense_gram``)."""
    gram = r.new_zeros((r.shape[0], r.shape[1], r.shape[1]), dtype=torch.float64)
    sq = r.new_zeros((r.shape[0], r.shape[1]), dtype=torch.float64)
    step = _slice_width(r)
    for start in range(0, r.shape[2], step):
        part = r[:, :, start:start + step].double()
        gram.baddbmm_(part, part.transpose(1, 2))
        sq += part.square().sum(2)
    return gram, sq


@dense_self_gram.register_fake
def _(r):
    return (r.new_empty((r.shape[0], r.shape[1], r.shape[1]), dtype=torch.float64),
            r.new_empty((r.shape[0], r.shape[1]), dtype=torch.float64))


def _self_gram(r: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """``R R^T`` and the rows' squared norms ``||r[n, t]||^2``, in float64."""
    if isinstance(r, tuple):
        return _rows_gram(r, r), r[1].double().square()
    return dense_self_gram(r)


def summed_factored_sq_norms(parts: list[tuple[Rows, Rows]], width: int, sum_dtype: torch.dtype) -> torch.Tensor:
    """``||sum_k A_k[n]^T X_k[n]||_F^2`` for factors ``(A_k, X_k)`` of one gradient (``[n, t_k, o]``, ``[n, t_k,
    i]``; ``width = o + i``), certified like ``factored_sq_norms``: the factors concatenated along the tokens are
    one factored gradient, ``[A_1; A_2]^T [X_1; X_2]``, whose ghost norm is the sum of the blocks ``<A_k A_l^T, X_k
    X_l^T>``. A tied embedding and LM head: ``A_1`` the one-hot rows of the token ids, ``A_2`` the logits'
    gradient, so the cross block is the logits' gradient read at the ids and the embedding's table is never
    formed."""
    sq = scale = 0
    for k, (a_k, x_k) in enumerate(parts):
        (aa, a_sq), (xx, x_sq) = _self_gram(a_k), _self_gram(x_k)
        sq = sq + (aa * xx).sum((1, 2))
        scale = scale + (a_sq * x_sq).sqrt().sum(1)
        for a_m, x_m in parts[k + 1:]:
            sq = sq + 2 * (_rows_gram(a_k, a_m) * _rows_gram(x_k, x_m)).sum((1, 2))
    # a selecting side may be either factor (a flipped embedding): count its rows from the ids
    tokens = sum((x[0] if isinstance(x, tuple) else x).shape[1] for _, x in parts) + len(parts) - 1
    return certified_sq_norms(sq, scale.square(), width, tokens, _norm_dtype(sum_dtype), sum_dtype)


def cpu_rounds_in_float32(op: str) -> bool:
    """Whether oneDNN's float32 ``op`` ("conv" or "matmul") on the CPU rounds in float32: its ``fp32_precision``
    (``torch.backends.mkldnn.<op>``, else the backend's, else torch's generic one; "none" defers to the next) is
    "none" or "ieee", and for matmuls ``torch.get_float32_matmul_precision()`` is "highest". "bf16" or "tf32" there
    round below float32, past the bounds the ghost and bounded norms certify."""
    mkldnn = torch.backends.mkldnn
    chain = [getattr(getattr(mkldnn, op, None), "fp32_precision", "none"), getattr(mkldnn, "fp32_precision", "none"),
             getattr(torch.backends, "fp32_precision", "none")]
    effective = next((p for p in chain if p != "none"), "none")
    if op == "matmul" and not float32_matmuls_highest():
        return False
    return effective in ("none", "ieee")


def float32_matmuls_highest() -> bool:
    """``torch.get_float32_matmul_precision() == "highest"``; False where torch cannot say (it raises when the
    legacy and the per-backend precision settings were both used)."""
    try:
        return torch.get_float32_matmul_precision() == "highest"
    except RuntimeError:
        return False


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms of low-precision gradients are kept in float32 (they feed the float32 clip factors)."""
    return torch.promote_types(dtype, torch.float32)


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
