"""Linear algebra on stacks of per-sample matrices (``ops.MATRIX_STACKS``): each matrix is solved, factored or
inverted on its own, so the per-sample gradients through them are exact against the loop; a batch inside a
matrix's rows or columns is refused. The ops that raise on a singular matrix (``linalg.inv``, ``cholesky``,
``lu_factor``, ``solve``) are traced as their ``_ex`` twins and an assertion
(``corrected_decompositions.TRACEABLE``): exact, and a batch with a singular sample raises ``BatchInputError``
naming the op, as eager torch raises on it."""

from __future__ import annotations

import re

import pytest
import torch

import compiled_psg as psg

F64 = torch.float64


def _problem():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.eye(3, dtype=F64) + 0.1)
    x = torch.randn(4, 3, 3, dtype=F64) * 0.1 + torch.eye(3, dtype=F64)
    return p, x


def _spd(m):
    return m @ m.mT + torch.eye(3, dtype=m.dtype)


LOSSES = {
    "inv_ex": lambda m: torch.linalg.inv_ex(m).inverse.pow(2).sum(),
    "solve_ex": lambda m: torch.linalg.solve_ex(m, m[..., :2]).result.pow(2).sum(),
    "cholesky_ex": lambda m: torch.linalg.cholesky_ex(_spd(m)).L.pow(2).sum(),
    "det": lambda m: torch.linalg.det(m).pow(2).sum(),
    "slogdet": lambda m: torch.linalg.slogdet(m).logabsdet.sum(),
    "eigh": lambda m: torch.linalg.eigh(_spd(m)).eigenvalues.pow(2).sum(),
    "svdvals": lambda m: torch.linalg.svdvals(m).sum(),
    "qr": lambda m: torch.linalg.qr(m).R.pow(2).sum(),
    "matrix_exp": lambda m: torch.linalg.matrix_exp(m).sum(),
    "solve_triangular": lambda m: torch.linalg.solve_triangular(torch.linalg.cholesky_ex(_spd(m)).L, m,
                                                                upper=False).sum(),
    "pinv": lambda m: torch.linalg.pinv(m).pow(2).sum(),
    "pinv_hermitian": lambda m: torch.linalg.pinv(_spd(m), hermitian=True, rtol=0.1).pow(2).sum(),
    # from torch 2.14
    "matrix_sqrth": lambda m: torch.linalg.matrix_sqrth(_spd(m)).pow(2).sum(),
    "polar": lambda m: sum(f.pow(2).sum() for f in torch.linalg.polar(m)),
    # checked: traced as the _ex twin and an assertion
    "inv": lambda m: torch.linalg.inv(m).pow(2).sum(),
    "inverse": lambda m: torch.inverse(m).pow(2).sum(),
    "cholesky": lambda m: torch.linalg.cholesky(_spd(m)).pow(2).sum(),
    "cholesky_upper": lambda m: torch.linalg.cholesky(_spd(m), upper=True).pow(2).sum(),
    "lu_factor": lambda m: torch.linalg.lu_factor(m).LU.pow(2).sum(),
    "solve": lambda m: torch.linalg.solve(m, m[..., :2]).pow(2).sum(),
    "solve_right": lambda m: torch.linalg.solve(m, m[..., :2, :], left=False).pow(2).sum(),
    # a stack of vectors on the right (B.shape == A.shape[:-1]: one vector per matrix, torch's rule)
    "solve_vector": lambda m: torch.linalg.solve(m, m[..., 0] + 1).pow(2).sum(),
    "solve_vector_per_sample": lambda m: torch.linalg.solve(m.detach() + torch.eye(3, dtype=m.dtype), m[..., 1])
    .pow(2).sum(),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_matrix_stack_ops_are_exact(name):
    if name in ("matrix_sqrth", "polar") and not hasattr(torch.linalg, name):
        pytest.skip(f"torch.linalg.{name} is new in torch 2.14")
    p, x = _problem()

    def loss(x):
        return LOSSES[name](x * p)

    got = psg.per_sample({"p": p}, backend="eager")(loss)(x)["p"]
    want = torch.stack([torch.autograd.grad(loss(x[i:i + 1]), p)[0] for i in range(4)])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_batch_inside_the_matrices_is_refused():
    p, x = _problem()
    with pytest.raises(psg.SampleMixingError, match="batch sits in a matrix dimension"):
        psg.per_sample({"p": p}, backend="eager")(lambda x: torch.linalg.svdvals((x * p).permute(1, 2, 0)).sum())(x)


def test_pinv_tolerances_per_sample_stay_apart():
    """``rtol`` with one value per sample's matrix (``ops.PER_MATRIX_ARGS``): each matrix its own cut-off."""
    p, x = _problem()
    rtol = torch.tensor([0.0, 0.5, 0.9, 0.99], dtype=F64)

    def loss(x, rtol):
        return torch.linalg.pinv(x * p, rtol=rtol).pow(2).sum()

    got = psg.per_sample({"p": p}, backend="eager")(loss)(x, rtol)["p"]
    want = torch.stack([torch.autograd.grad(loss(x[i:i + 1], rtol[i:i + 1]), p)[0] for i in range(4)])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


CHECKED = {  # op -> (loss of a stack, what the check says, the _ex twin its fix names)
    "torch.linalg.inv": (lambda m: torch.linalg.inv(m).sum(), "is singular", "torch.linalg.inv_ex"),
    "torch.linalg.cholesky": (lambda m: torch.linalg.cholesky(m).sum(), "is not positive-definite",
                              "torch.linalg.cholesky_ex"),
    "torch.linalg.lu_factor": (lambda m: torch.linalg.lu_factor(m).LU.sum(), "is singular",
                               "torch.linalg.lu_factor_ex"),
    "torch.linalg.solve": (lambda m: torch.linalg.solve(m, m[..., :1] + 1).sum(), "is singular",
                           "torch.linalg.solve_ex"),
}


@pytest.mark.parametrize("api", sorted(CHECKED))
def test_a_singular_sample_raises_as_eager_torch_does(api):
    """A batch whose third matrix is singular: eager torch raises on it, and so does the per-sample function,
    with a BatchInputError naming the op and the fix; the batch without it still runs."""
    p, x = _problem()
    x = x @ x.mT  # positive-definite, so that cholesky runs too
    loss, failure, twin = CHECKED[api]
    fn = psg.per_sample({"p": p}, backend="eager")(lambda x: loss(x * p))
    fn(x)
    singular = x.clone()
    singular[2] = 0
    with pytest.raises(RuntimeError):
        loss(singular * p)
    with pytest.raises(psg.BatchInputError, match=rf"{re.escape(api)} raises at \S*test_linalg_stacks.py:\d+ "
                                                  rf".*{failure}.*Fix: .*{twin}.*"
                                                  r"samples at positions \[2\] of the batch"):
        fn(singular)


@pytest.mark.inductor
def test_a_singular_sample_raises_under_inductor():
    """Inductor compiles the assertion too (a device assert): the same error, not garbage."""
    p, x = _problem()
    fn = psg.per_sample({"p": p})(lambda x: torch.linalg.inv(x * p).pow(2).sum())
    fn(x)
    singular = x.clone()
    singular[1] = 0
    with pytest.raises(psg.BatchInputError, match=r"torch.linalg.inv raises at \S*test_linalg_stacks.py:\d+ "
                                                  r".*is singular.*positions \[1\]"):
        fn(singular)
