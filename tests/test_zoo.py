"""Every zoo case against the naive-loop reference, in float64 and float32 on the eager backend; a subset on
Inductor; recapture behaviour across batch sizes; the functional ``per_sample_grad`` form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import reference_losses, reference_per_sample
from zoo import BY_ID, CASES

import compiled_psg as psg

TOL = {
    torch.float64: dict(rtol=1e-9, atol=1e-10),
    torch.float32: dict(rtol=1e-4, atol=1e-5),
}


def assert_grads_match(got: dict, ref: dict, tol: dict, where: str = ""):
    assert set(got) == set(ref), f"{where}: parameter names {sorted(got)} != reference {sorted(ref)}"
    for name, r in ref.items():
        g = got[name]
        assert g.shape == r.shape, f"{where} {name}: shape {tuple(g.shape)} != reference {tuple(r.shape)}"
        assert g.dtype == r.dtype, f"{where} {name}: dtype {g.dtype} != reference {r.dtype}"
        torch.testing.assert_close(g, r, **tol, msg=lambda m, n=name: f"{where} {n}: {m}")


def check_case(case, dtype, backend, batch=None, seed=1):
    built = case.build(dtype)
    batch = case.batch if batch is None else batch
    args = built.make_batch(batch, dtype, torch.Generator().manual_seed(seed))
    fn = psg.per_sample(built.model, in_dims=built.in_dims, backend=backend)(built.loss)
    loss, losses, grads = fn.with_losses(*args)
    tol = TOL[dtype]
    ref = reference_per_sample(built.loss, built.params(), args, built.in_dims)
    assert_grads_match(grads, ref, tol, f"{case.id}[{dtype}, {backend}, B={batch}]")
    with torch.no_grad():
        torch.testing.assert_close(loss, built.loss(*args), **tol)
    torch.testing.assert_close(losses, reference_losses(built.loss, args, built.in_dims), **tol)
    report = psg.explain(fn, *args)  # cached: no new capture
    assert not report.fallbacks, f"{case.id}: ops took the vmap fallback: {[f.op for f in report.fallbacks]}"
    assert {r.name for r in report.rewrites} == set(ref) and all(r.rules for r in report.rewrites)
    return fn


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_zoo_eager(case, dtype):
    check_case(case, dtype, "eager")


INDUCTOR_SUBSET = ["simple_cnn", "encoder_batch_first_padmask", "tied_embedding_lm"]


@pytest.mark.inductor
@pytest.mark.parametrize("case_id", INDUCTOR_SUBSET)
def test_zoo_inductor(case_id):
    check_case(BY_ID[case_id], torch.float32, "inductor")


@pytest.mark.parametrize("case_id", ["mlp_ce_mean", "explicit_batch_mean", "masked_token_mean"])
def test_one_capture_across_batch_sizes(case_id):
    case = BY_ID[case_id]
    built = case.build(torch.float64)
    fn = psg.per_sample(built.model, in_dims=built.in_dims, backend="eager")(built.loss)
    params = built.params()
    for step, batch in enumerate([5, 2, 7, 1]):
        args = built.make_batch(batch, torch.float64, torch.Generator().manual_seed(10 + step))
        ref = reference_per_sample(built.loss, params, args, built.in_dims)
        assert_grads_match(fn(*args), ref, TOL[torch.float64], f"{case_id} B={batch}")
        assert fn.captures == 1, f"{case_id}: {fn.captures} captures after batch size {batch}"
    again = built.make_batch(7, torch.float64, torch.Generator().manual_seed(99))
    assert_grads_match(fn(*again), reference_per_sample(built.loss, params, again, built.in_dims),
                       TOL[torch.float64], f"{case_id} repeat")
    assert fn.captures == 1, "a repeated call re-captured"


def test_parameter_update_is_seen_without_recapture():
    """Gradients follow the current parameter values (no baked-in constants), with no new capture."""
    case = BY_ID["mlp_ce_mean"]
    built = case.build(torch.float64)
    fn = psg.per_sample(built.model, backend="eager")(built.loss)
    args = built.make_batch(4, torch.float64, torch.Generator().manual_seed(3))
    fn(*args)
    with torch.no_grad():
        for p in built.model.parameters():
            p.mul_(1.5).add_(0.1)
    assert_grads_match(fn(*args), reference_per_sample(built.loss, built.params(), args), TOL[torch.float64])
    assert fn.captures == 1


def test_per_sample_grad_functional():
    """The functional form: ``fn(params, *batch)`` with an unbatched argument (in_dims None)."""
    g = torch.Generator().manual_seed(0)
    dtype = torch.float64
    params = {"W": torch.randn(6, 5, generator=g, dtype=dtype) * 0.4,
              "b": torch.randn(6, generator=g, dtype=dtype),
              "W2": torch.randn(3, 6, generator=g, dtype=dtype) * 0.4, "t": torch.tensor(1.3, dtype=dtype)}

    def loss(p, x, offset, y):
        h = torch.tanh(x @ p["W"].T + p["b"] + offset)
        return F.cross_entropy(torch.einsum("bi,oi->bo", h, p["W2"]) / p["t"], y)

    x = torch.randn(4, 5, generator=g, dtype=dtype)
    offset = torch.randn(6, generator=g, dtype=dtype)
    y = torch.randint(0, 3, (4,), generator=g)
    fn = psg.per_sample_grad(loss, in_dims=(0, None, 0), backend="eager")
    got = fn(params, x, offset, y)
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ref = reference_per_sample(lambda *b: loss(leaves, *b), leaves, (x, offset, y), (0, None, 0))
    assert_grads_match(got, ref, TOL[dtype], "per_sample_grad")
