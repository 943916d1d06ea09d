"""The per-call shortcuts (benchmarks/probes/call_overhead.py) read what the slow paths read: one module walk for the
parameters and training flags, sizes without sympy, the step's cached noise template."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

import compiled_psg as psg
from compiled_psg._api import _params_and_modes, _walk


class _Scale(nn.Module):
    def forward(self, w):
        return 2 * w


def _tangled() -> nn.Module:
    """Shared submodules, a tied parameter, a missing bias, a frozen parameter, a parametrization, mixed modes."""
    torch.manual_seed(0)
    shared = nn.Linear(3, 3)
    model = nn.Sequential(nn.Linear(4, 3, bias=False), shared, nn.Sequential(shared, nn.Linear(3, 3)), nn.Tanh())
    tied = nn.Linear(3, 3)
    tied.weight = shared.weight
    model.append(tied)
    model[2][1].bias.requires_grad_(False)
    parametrize.register_parametrization(model[0], "weight", _Scale())
    model[2].eval()
    model.holder = nn.ModuleDict({"none": None, "again": model[2]})
    return model


def test_walk_matches_named_parameters_and_modules():
    model = _tangled()
    named, modes = _walk(model)
    expected = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert [(n, id(p)) for n, p in named.items()] == [(n, id(p)) for n, p in expected]
    assert modes == tuple(m.training for m in model.modules())
    assert len(modes) == len(list(model.modules()))
    assert "parametrizations.weight.original" in next(iter(named))


class _Listed(nn.Module):
    """Lists only some of its submodules: the walk must ask it rather than read ``_modules``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        yield prefix, self
        yield from self.a.named_modules(memo, prefix + ("." if prefix else "") + "a", remove_duplicate)


def test_walk_defers_to_overridden_listing():
    model = nn.Sequential(_Listed())
    assert _walk(model) is None
    named, modes = _params_and_modes(model)
    assert list(named) == [n for n, p in model.named_parameters()] == ["0.a.weight", "0.a.bias"]
    assert len(modes) == 3


def test_sizes_follow_the_batch():
    """The batch size enters the graph as an input (``x.view(x.shape[0] * 2, 8)``): read from each call."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1).double()

    @psg.per_sample(model, backend="eager")
    def loss(x):
        h = model(x.view(x.shape[0] * 2, 8))
        return h.view(x.shape[0], 2).sum(1).pow(2).mean()

    for b in (3, 5, 1, 3):
        x = torch.randn(b, 16, dtype=torch.float64)
        got = loss(x)
        for i in range(b):
            model.zero_grad()
            loss.fn(x[i:i + 1]).backward()
            torch.testing.assert_close(got["weight"][i], model.weight.grad)
    assert loss.captures == 1
    assert [kind for _, kind, _ in loss.compiled_for(x)[0]._plan].count("batch") == 1


def test_step_noise_template_stays_zero():
    """The step's zero tensors (noise templates, an absent partial sum) and scalars (the scale) are program inputs
    shared by every step: they must never be written."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = psg.compile_step(lambda x, y: F.cross_entropy(model(x), y), model, opt, max_grad_norm=1.0,
                            noise_multiplier=1.0, backend="eager", max_physical_batch_size=8)
    for _ in range(3):
        step(torch.randn(6, 4), torch.randint(0, 2, (6,)))
    assert step.inputs._zeros and all(bool((z == 0).all()) for z in step.inputs._zeros.values())
    assert step.inputs._scalars and all(t.item() == torch.tensor(value, dtype=dtype).item()
                                 for (value, dtype, _), t in step.inputs._scalars.items())
