"""Library-style code in the loss (logging, warnings) is captured; misuse gets compiled_psg's own errors."""

import logging
import warnings

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
from reference import reference_per_sample

import compiled_psg as psg
from compiled_psg._compile.run import CompiledGraph

library_log = logging.getLogger("some_library")


def _setup(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    g = torch.Generator().manual_seed(seed)
    return model, torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (5,), generator=g)


def test_loss_that_logs_and_warns_is_captured_and_switches_restored(caplog):
    model, x, y = _setup()
    ignored_before = set(torch._dynamo.config.ignore_logging_functions)

    def library_loss(logits, target):  # as library code (e.g. transformers' loss) does
        library_log.warning("computing the loss of %d samples", logits.shape[0])
        warnings.warn("a deprecated argument", UserWarning, stacklevel=2)
        return F.cross_entropy(logits, target)

    @psg.per_sample(model, backend="eager")
    def loss(x, y):
        return library_loss(model(x), y)

    with caplog.at_level(logging.WARNING, logger="some_library"):
        got = loss(x, y)  # warnings are errors under pytest: the traced warning must not be raised
    assert not [r for r in caplog.records if r.name == "some_library"], "logging in the loss is a no-op"
    assert set(torch._dynamo.config.ignore_logging_functions) == ignored_before
    expected = reference_per_sample(lambda a, b: F.cross_entropy(model(a), b), dict(model.named_parameters()), (x, y))
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-9, atol=1e-12)


def test_loss_without_batched_argument_is_batch_input_error():
    model, x, y = _setup(1)
    fixed = torch.randn(3, 4, dtype=torch.float64)

    @psg.per_sample(model, backend="eager")
    def loss(x, y):
        return model(fixed).sum()

    with pytest.raises(psg.BatchInputError, match="does not use any batched argument"):
        loss(x, y)


def test_non_tensor_loss_is_batch_input_error():
    model, x, y = _setup(2)

    @psg.per_sample(model, backend="eager")
    def loss(x, y):
        return 3.0

    with pytest.raises(psg.BatchInputError, match="must return a tensor"):
        loss(x, y)


def test_inductor_failure_is_compile_error(monkeypatch):
    model, x, y = _setup(3)

    @psg.per_sample(model, backend="inductor")
    def loss(x, y):
        return F.cross_entropy(model(x), y)

    def broken_compile_fx(gm, example_inputs):
        raise RuntimeError("simulated Inductor failure")

    import torch._inductor.compile_fx

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", broken_compile_fx)
    with pytest.raises(psg.CompileError, match='backend="eager"') as info:
        loss(x, y)
    assert isinstance(info.value, psg.PerSampleError) and "simulated Inductor failure" in str(info.value)
    entry = loss.compiled_for(x, y)[0]
    eager = CompiledGraph(entry.rewritten, "eager")  # the same graph without a compiler: the exact numbers
    got = eager(loss._params(), (x, y), 5)[2]
    expected = reference_per_sample(loss.fn, dict(model.named_parameters()), (x, y))
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-9, atol=1e-12)
