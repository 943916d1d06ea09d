"""The optimizer update's capture: torch's per-parameter optimizers are traced for one parameter of each kind and
copied for the others (``update_graph._by_representatives``); the copied graph must compute what the whole trace
computes, bit for bit, and anything the copies cannot stand for is traced whole."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import compiled_psg._train.update_graph as update_graph


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    # repeated kinds: three 6x6 weights, four biases of 6, and one of each other shape
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)).to(dtype)


def _two_groups(params, **kw):
    params = list(params)
    return torch.optim.Adam([{"params": params[:4], "lr": 0.01, "weight_decay": 0.1},
                             {"params": params[4:]}], lr=0.003)


OPTIMIZERS = {
    "sgd_momentum_nesterov_decay": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True,
                                                              weight_decay=0.01),
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "adam_amsgrad_maximize_decay": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True, maximize=True,
                                                               weight_decay=0.1),
    "adam_tensor_lr": lambda ps: torch.optim.Adam(ps, lr=torch.tensor(0.01), foreach=False),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=True),
    "two_groups": _two_groups,
    "rmsprop_centered_momentum": lambda ps: torch.optim.RMSprop(ps, lr=0.01, centered=True, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "adadelta": lambda ps: torch.optim.Adadelta(ps),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.01),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=0.01),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=0.01),
}


def _ready(make_opt, dtype: torch.dtype = torch.float32):
    """A model, its optimizer after two eager steps (its state exists) and the positions of all parameters."""
    model = _model(dtype)
    params = list(model.parameters())
    opt = make_opt(params)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=dtype)
        opt.step()
    return params, opt, list(range(len(params)))


def _run(update: update_graph.UpdateGraph, params, grads, scale) -> dict:
    """Run the update graph on copies of what it reads; every copy afterwards, by what it is a copy of."""
    copies: dict = {}

    def feed(kind, key):
        if kind == "grad":
            return grads[key]
        if kind == "scale":
            return scale
        name = (kind, key if kind == "dot_grad" else id(key))
        if name not in copies:
            copies[name] = (params[key].grad if kind == "dot_grad" else key).detach().clone()
        return copies[name]

    update.gm(*[feed(kind, key) for kind, key in update.sources])
    return copies


def _traced_sizes(monkeypatch) -> list[int]:
    sizes = []
    trace = update_graph._trace

    def spy(shadow, trained, dtype):
        sizes.append(len(trained))
        return trace(shadow, trained, dtype)

    monkeypatch.setattr(update_graph, "_trace", spy)
    return sizes


@pytest.mark.parametrize("make_opt", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_one_trace_per_kind_computes_the_whole_trace_bit_for_bit(make_opt, monkeypatch):
    params, opt, trained = _ready(make_opt)
    sizes = _traced_sizes(monkeypatch)
    copied = update_graph.capture_update(opt, trained, torch.float32)
    assert sizes and sizes[0] < len(params), sizes  # one parameter of each kind was traced
    assert len(sizes) == 1, "the representatives' trace fell back to the whole trace"
    whole = update_graph._whole(opt, trained, torch.float32)
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    scale = torch.tensor(0.25)
    got, want = _run(copied, params, grads, scale), _run(whole, params, grads, scale)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    # and the update did something: every parameter moved
    for p in params:
        assert not torch.equal(got[("tensor", id(p))], p.detach())


@pytest.mark.parametrize("name", ["nadam", "radam"])
def test_float64_counters_read_in_float64_are_copied_bit_for_bit(name, monkeypatch):
    """A float64 model's update reads its float32 counters (``step``, NAdam's ``mu_product``) in float64 and writes
    them back as float32 (``update_graph._read_widened``); the graph traced for one parameter of each kind and
    copied computes what the whole trace computes, counters included."""
    params, opt, trained = _ready(OPTIMIZERS[name], torch.float64)
    sizes = _traced_sizes(monkeypatch)
    copied = update_graph.capture_update(opt, trained, torch.float64)
    assert sizes == [sizes[0]] and sizes[0] < len(params), sizes
    whole = update_graph._whole(opt, trained, torch.float64)
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
    scale = torch.tensor(0.25, dtype=torch.float64)
    got, want = _run(copied, params, grads, scale), _run(whole, params, grads, scale)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    counters = [opt.state[p]["step"] for p in params]
    assert all(got[("tensor", id(c))].dtype == torch.float32 and got[("tensor", id(c))] == 3 for c in counters)
    eager = copy.deepcopy(opt)  # and both are torch's eager step, to float64 rounding
    eager_params = update_graph.flat_params(eager)
    for p, g in zip(eager_params, grads, strict=True):
        p.grad = g * scale
    eager.step()
    for p, q in zip(params, eager_params, strict=True):  # _run updated copies: p holds the step's start
        assert (got[("tensor", id(p))] - q).abs().max() < 1e-12 * (q - p).abs().max()


def test_a_subclass_is_traced_whole(monkeypatch):
    class MySGD(torch.optim.SGD):
        pass

    params, opt, trained = _ready(lambda ps: MySGD(ps, lr=0.1, momentum=0.9))
    sizes = _traced_sizes(monkeypatch)
    update_graph.capture_update(opt, trained, torch.float32)
    assert sizes == [len(params)]


class _GlobalNormSGD(torch.optim.Optimizer):
    """Scales every gradient by the norm over all parameters: no parameter's update is its own."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        params = [p for g in self.param_groups for p in g["params"]]
        total = torch.sqrt(sum((p.grad ** 2).sum() for p in params))
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad / (1 + total), alpha=-group["lr"])


def test_an_update_that_reads_other_parameters_is_traced_whole(monkeypatch):
    # even were it trusted, its graph shows the mixing and the whole trace is taken
    monkeypatch.setattr(update_graph, "PER_PARAMETER", (_GlobalNormSGD,))
    params, opt, trained = _ready(_GlobalNormSGD)
    sizes = _traced_sizes(monkeypatch)
    update = update_graph.capture_update(opt, trained, torch.float32)
    assert sizes[0] < len(params) and sizes[-1] == len(params), sizes
    grads = [torch.ones(p.shape) for p in params]
    got = _run(update, params, grads, torch.tensor(1.0))
    total = torch.sqrt(sum((g ** 2).sum() for g in grads))
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(got[("tensor", id(p))], p.detach() - 0.1 * g / (1 + total))


def test_a_step_that_creates_state_is_refused_before_the_representatives_are_copied():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(update_graph.StateMissing):
        update_graph.capture_update(opt, list(range(len(list(model.parameters())))), torch.float32)
    assert not opt.state  # the user's optimizer got no state from the trace


@pytest.mark.parametrize("where", ["one_group", "two_groups"])
def test_a_parameter_listed_twice_is_traced_whole(where, monkeypatch):
    """torch warns about a parameter listed twice in a group and allows one edited into a second group; copies of
    its update would each update their own tensor, so the whole step is traced, as eager torch runs it."""
    params = list(_model().parameters())
    if where == "one_group":
        with pytest.warns(UserWarning, match="duplicate parameters"):
            opt = torch.optim.SGD([*params, params[2]], lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        opt.param_groups.append({**opt.param_groups[0], "params": [params[2]], "lr": 0.01})
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    flat = update_graph.flat_params(opt)
    sizes = _traced_sizes(monkeypatch)
    update_graph.capture_update(opt, list(range(len(flat))), torch.float32)
    assert sizes == [len(flat)]
