"""psg.per_sample_grad, the functional form, against the naive loop."""

import pytest
import torch
import torch.nn.functional as F
from reference import reference_per_sample

import compiled_psg as psg


def loss(params, x, y):
    h = torch.tanh(x @ params["w1"].T + params["b1"])
    return F.cross_entropy(h @ params["w2"].T, y)


def make_params(features, generator):
    return {"w1": torch.randn(4, features, generator=generator, dtype=torch.float64),
            "b1": torch.randn(4, generator=generator, dtype=torch.float64),
            "w2": torch.randn(3, 4, generator=generator, dtype=torch.float64)}


def check(grad_fn, params, x, y):
    got = grad_fn(params, x, y)
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    expected = reference_per_sample(lambda a, b: loss(leaves, a, b), leaves, (x, y), 0)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-9, atol=1e-10)


def test_per_sample_grad_matches_loop_across_params_batches_and_recaptures():
    g = torch.Generator().manual_seed(0)
    grad_fn = psg.per_sample_grad(loss, backend="eager")
    params = make_params(5, g)
    for batch in (4, 2, 1):
        x = torch.randn(batch, 5, generator=g, dtype=torch.float64)
        check(grad_fn, params, x, torch.randint(0, 3, (batch,), generator=g))
    check(grad_fn, {k: 2 * v for k, v in params.items()}, x, torch.randint(0, 3, (1,), generator=g))
    assert grad_fn.per_sample_function.captures == 1
    wider = make_params(7, g)  # a new signature: captured again, with the new tensors
    x = torch.randn(3, 7, generator=g, dtype=torch.float64)
    check(grad_fn, wider, x, torch.randint(0, 3, (3,), generator=g))
    assert grad_fn.per_sample_function.captures == 2


def test_per_sample_grad_with_params_not_first_and_tuple_in_dims():
    g = torch.Generator().manual_seed(1)
    params = make_params(5, g)
    grad_fn = psg.per_sample_grad(lambda x, p, y: loss(p, x, y), argnums=1, in_dims=(0, None, 0), backend="eager")
    x = torch.randn(3, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (3,), generator=g)
    expected = psg.per_sample_grad(loss, backend="eager")(params, x, y)
    got = grad_fn(x, params, y)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])


def test_an_in_dims_entry_for_the_parameter_dict_is_refused():
    """A tuple in_dims with one entry per argument of fn: the parameter dict's entry was dropped whatever it said
    (in_dims=(0, 0, 0) ran as (None, 0, 0)). Only None means something there: anything else is refused."""
    g = torch.Generator().manual_seed(1)
    params = make_params(5, g)
    x = torch.randn(3, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (3,), generator=g)
    for argnums, dims, args in ((0, (0, 0, 0), (params, x, y)), (1, (0, 1, 0), (x, params, y))):
        fn = loss if argnums == 0 else (lambda x, p, y: loss(p, x, y))
        grad_fn = psg.per_sample_grad(fn, argnums=argnums, in_dims=dims, backend="eager")
        with pytest.raises(psg.BatchInputError, match=rf"in_dims\[{argnums}\]=\d is the entry of the parameter dict"
                                                      rf"(.|\n)*Fix: in_dims\[{argnums}\]=None"):
            grad_fn(*args)
