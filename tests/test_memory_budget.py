"""``memory_budget``: the clip plan holds at most that many bytes of per-sample values across the program, and
its results are still the loop's (``psg.clip_sum``, ``compile_step``); bad budgets are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import ref_clip_sum, reference_per_sample

import compiled_psg as psg

# enough positions that the cheapest plan materializes (and holds) the weights' gradients, fewer than the layers'
# inputs, so that a book-keeping sum holds less (each layer's [TOKENS, out] output gradient)
TOKENS = 32
WIDTHS = (64, 96, 80, 3)


def token_mlp(dtype=torch.float64):
    torch.manual_seed(0)
    a, b, c, d = WIDTHS
    model = nn.Sequential(nn.Linear(a, b), nn.GELU(), nn.Linear(b, c), nn.GELU(), nn.Linear(c, d)).to(dtype)
    x = torch.randn(6, TOKENS, a, dtype=dtype)
    y = torch.randint(0, 3, (6,))

    def loss(x, y):
        return F.cross_entropy(model(x).mean(1), y)

    return model, loss, (x, y)


def plan_of(budget, dtype=torch.float64):
    model, loss, batch = token_mlp(dtype)
    fn = psg.per_sample(model, reduce=psg.clip_sum(0.05, return_norms=True, memory_budget=budget),
                        backend="eager")(loss)
    sums, norms = fn(*batch)
    ref_sums, ref_norms = ref_clip_sum(reference_per_sample(loss, dict(model.named_parameters()), batch), 0.05,
                                       return_norms=True)
    tol = dict(rtol=1e-9, atol=1e-11) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(norms, ref_norms, **tol)
    for name, want in ref_sums.items():
        torch.testing.assert_close(sums[name], want, **tol)
    return psg.explain(fn, *batch)


def held_weights(report) -> list[str]:
    return [r.name for r in report.rewrites if r.name.endswith("weight")
            and any(c.method == "materialize" and "held" in c.cost for c in r.choices)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_a_zero_budget_holds_no_weight_gradient_and_matches_the_loop(dtype):
    fastest, bounded = plan_of(None, dtype), plan_of(0, dtype)
    assert fastest.memory_plan is None and held_weights(fastest) == ["0.weight", "2.weight", "4.weight"]
    plan = bounded.memory_plan
    assert held_weights(bounded) == [] and plan["budget"] == 0 and plan["batch_size"] == 6
    # what is left: the output gradients [6, TOKENS, o] the book-keeping sums read, and the biases' [6, o] values,
    # which no other strategy computes without holding them
    itemsize, outs = dtype.itemsize, sum(WIDTHS[1:])
    weights = sum(i * o for i, o in zip(WIDTHS[:-1], WIDTHS[1:], strict=True))
    assert plan["held"] == 6 * (TOKENS * outs + outs) * itemsize and not plan["fits"]
    assert plan["held_by_cheapest"] == plan["peak_by_cheapest"] == 6 * (weights + outs) * itemsize
    # the peak adds the largest gradient one layer forms for its norm and frees, beyond its held output gradient
    formed = max(i * o - TOKENS * o for i, o in zip(WIDTHS[:-1], WIDTHS[1:], strict=True))
    assert plan["peak"] == plan["held"] + 6 * formed * itemsize
    assert "memory budget: 0 bytes" in str(bounded) and "over budget" in str(bounded)
    moved = [c for r in bounded.rewrites for c in r.choices if c.cost.get("for") == "memory_budget"]
    assert len(moved) == 3


def test_a_partial_budget_frees_the_cheapest_bytes_first_and_fits():
    """Between the lowest peak and the fastest plan's: the plan fits the budget and holds some weight's gradient."""
    full, lowest = plan_of(None), plan_of(0).memory_plan
    budget = (lowest["peak"] + lowest["peak_by_cheapest"]) / 2
    report = plan_of(budget)
    plan = report.memory_plan
    assert plan["fits"] and plan["peak"] <= budget < plan["peak_by_cheapest"]
    assert 0 < len(held_weights(report)) < len(held_weights(full))


def test_a_budget_that_the_held_bytes_fit_but_one_layer_s_transient_gradient_does_not_is_over_budget():
    """Holding only output gradients (the bounded plan's held bytes) still forms each weight's per-sample gradient
    for its norm: with the budget at those held bytes the plan does not fit, and explain says so."""
    lowest = plan_of(0).memory_plan
    report = plan_of(lowest["held"])
    assert not report.memory_plan["fits"] and report.memory_plan["peak"] == lowest["peak"]
    assert "over budget" in str(report)


def test_a_plan_that_frees_held_values_only_to_form_them_again_keeps_the_fastest():
    """One layer: a bounded norm holds its output gradient and still forms the whole per-sample gradient, so its
    peak is the materialized plan's; a zero budget then keeps the faster, materialized plan, exact."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 96, dtype=torch.float64)
    x, y = torch.randn(6, TOKENS, 64, dtype=torch.float64), torch.randn(6, 96, dtype=torch.float64)

    def loss(x, y):
        return (layer(x).mean(1) - y).square().sum()

    fn = psg.per_sample(layer, reduce=psg.clip_sum(0.05, memory_budget=0), backend="eager")(loss)
    sums = fn(x, y)
    want = ref_clip_sum(reference_per_sample(loss, dict(layer.named_parameters()), (x, y)), 0.05)
    for name, value in want.items():
        torch.testing.assert_close(sums[name], value, rtol=1e-9, atol=1e-11)
    report = psg.explain(fn, x, y)
    plan = report.memory_plan
    assert held_weights(report) == ["weight"] and not plan["fits"]
    assert plan["peak"] == plan["peak_by_cheapest"] == plan["held"]


def test_compile_step_with_a_budget_takes_the_same_step():
    """One DP step (no noise) with memory_budget=0 moves the parameters as the fastest plan's step does."""
    results = []
    for budget in (None, 0):
        model, loss, batch = token_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        step = psg.compile_step(loss, model, opt, max_grad_norm=0.05, backend="eager", memory_budget=budget)
        step(*batch)
        assert step.config.memory_budget == budget
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("budget", [-1, float("nan"), "1GB", True])
def test_a_bad_budget_is_refused_before_anything_changes(budget):
    model, loss, _ = token_mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with pytest.raises(psg.DPConfigError, match="memory_budget must be None or a number of bytes"):
        psg.compile_step(loss, model, opt, max_grad_norm=1.0, backend="eager", memory_budget=budget)
    with pytest.raises(psg.BatchInputError, match="memory_budget"):
        psg.clip_sum(1.0, memory_budget=budget)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_a_budget_given_through_clip_sum_reaches_the_step_and_a_contradiction_is_refused():
    model, loss, batch = token_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    step = psg.compile_step(loss, model, opt, reduce=psg.clip_sum(0.05, memory_budget=0), backend="eager")
    assert step.config.memory_budget == 0
    step(*batch)
    assert psg.explain(step, *batch).memory_plan["budget"] == 0
    with pytest.raises(psg.DPConfigError, match="give the budget once"):
        psg.compile_step(loss, model, opt, reduce=psg.clip_sum(0.05, memory_budget=0), memory_budget=10,
                         backend="eager")


def test_a_held_output_gradient_is_counted_for_x_at_w_as_for_a_linear():
    """``x @ W`` (a row-major weight, as Hugging Face's Conv1D) has its weight gradient read ``x.t()``, a view the
    backward takes of an activation: held is the output gradient alone, as for ``nn.Linear``."""
    torch.manual_seed(0)
    t, i, o = 32, 40, 24
    weight = nn.Parameter(torch.randn(i, o, dtype=torch.float64) * 0.1)
    linear = nn.Linear(i, o, bias=False, dtype=torch.float64)
    x = torch.randn(3, t, i, dtype=torch.float64)
    for module, forward in ((nn.ParameterList([weight]), lambda x: x @ weight), (linear, linear)):
        fn = psg.per_sample(module, reduce=psg.clip_sum(0.5, memory_budget=0), backend="eager")(
            lambda x, forward=forward: forward(x).square().mean())
        fn(x)
        (rewrite,) = psg.explain(fn, x).rewrites
        norm = next(c for c in rewrite.choices if c.quantity == "sq_norm")
        # one layer keeps the materialized plan (the bounded one forms as much at its peak); its runner-up is priced
        assert norm.method == "materialize" and f", {t * o * 4} held" in norm.cost["vs materialize, bounded"], norm


def test_make_private_plans_memory_at_the_micro_batch_size():
    """Red team N: make_private captured on the loader's whole first batch, so with max_physical_batch_size=8
    the plan was made for 64 samples (peak 577280 bytes, over a 100 kB budget) where compile_step's, for the
    micro-batches the step runs, fits."""
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    data = TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
    private = psg.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=64),
                               lambda x, y: F.cross_entropy(model(x), y), noise_multiplier=1.0, backend="eager",
                               max_physical_batch_size=8, memory_budget=100_000)
    x, y = data[:8]
    assert psg.explain(private.dp_step, x, y).memory_plan["batch_size"] == 8
    assert private.dp_step.per_sample.captures == 1  # the capture make_private made serves the steps
