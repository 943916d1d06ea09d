"""Linear algebra on stacks of per-sample matrices (``ops.MATRIX_STACKS``): each matrix is solved, factored or
inverted on its own, so the per-sample gradients through them are exact against the loop; a batch inside a
matrix's rows or columns is refused, and the ops that raise on a singular matrix name their ``_ex`` twins."""

from __future__ import annotations

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
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_matrix_stack_ops_are_exact(name):
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


def test_ops_that_raise_on_a_singular_matrix_name_their_ex_twins():
    p, x = _problem()
    with pytest.raises(psg.UnsupportedError, match="_linalg_check_errors.*torch.linalg.inv_ex"):
        psg.per_sample({"p": p}, backend="eager")(lambda x: torch.linalg.inv(x * p).sum())(x)
