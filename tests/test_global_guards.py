"""What Dynamo's guards miss must recapture too (``_capture/global_guards.py``): numpy values the loss reads from
globals, global module hooks, a module class's replaced method. Each change made after the first call is compared
with the naive loop, in float64, and must be logged as a recapture."""

import logging
from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_capture_guards import _check, _setup  # the same model, batch and loop check

import compiled_psg as psg
from compiled_psg._capture import global_guards

TEMP = np.float64(1.0)  # globals the losses read, rebound by the tests
WEIGHTS = np.array([1.0, 2.0, 3.0])


def _recaptured(fn, caplog, captures: int, text: str) -> None:
    assert fn.captures == captures
    messages = [r.getMessage() for r in caplog.records if r.name == "compiled_psg" and "recapturing" in r.getMessage()]
    assert messages and text in messages[-1], messages


@pytest.fixture
def restore_globals():
    global TEMP, WEIGHTS
    saved = TEMP, WEIGHTS
    yield
    TEMP, WEIGHTS = saved


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_numpy_scalar_global_rebound_recaptures(backend, caplog, restore_globals):
    global TEMP
    model, x, y = _setup()
    TEMP = np.float64(1.0)
    fn = psg.per_sample(model, backend=backend)(lambda x, y: F.cross_entropy(model(x) / TEMP, y))
    _check(fn, model, x, y)
    TEMP = np.float64(1.0) * 1  # another object, the same value: the graph still applies
    _check(fn, model, x, y)
    assert fn.captures == 1
    with caplog.at_level(logging.WARNING, logger="compiled_psg"):
        TEMP = np.float64(0.25)
        _check(fn, model, x, y)
    _recaptured(fn, caplog, 2, "TEMP")


def test_numpy_array_global_rebound_recaptures_and_in_place_update_is_seen(caplog, restore_globals):
    global WEIGHTS
    model, x, y = _setup()
    WEIGHTS = np.array([1.0, 2.0, 3.0])
    fn = psg.per_sample(model, backend="eager")(lambda x, y: F.cross_entropy(model(x) * torch.from_numpy(WEIGHTS), y))
    _check(fn, model, x, y)
    WEIGHTS[2] = 5.0  # the captured tensor shares the array's memory
    _check(fn, model, x, y)
    assert fn.captures == 1
    with caplog.at_level(logging.WARNING, logger="compiled_psg"):
        WEIGHTS = np.array([0.5, 0.5, 9.0])
        _check(fn, model, x, y)
    _recaptured(fn, caplog, 2, "WEIGHTS")


def test_global_forward_hook_registered_and_removed_recaptures(caplog):
    model, x, y = _setup()
    fn = psg.per_sample(model, backend="eager")(lambda x, y: F.cross_entropy(model(x), y))
    _check(fn, model, x, y)
    handle = nn.modules.module.register_module_forward_hook(
        lambda mod, inp, out: out * 2 if isinstance(mod, nn.Linear) else None)
    try:
        with caplog.at_level(logging.WARNING, logger="compiled_psg"):
            _check(fn, model, x, y)
        _recaptured(fn, caplog, 2, "_global_forward_hooks")
    finally:
        handle.remove()
    _check(fn, model, x, y)  # the first graph again: its snapshot holds once more
    assert fn.captures == 2


def test_global_forward_pre_hook_recaptures_and_does_not_run_on_our_graph(caplog):
    """The pre hook rewrites a Linear's input and returns ``inp[:1]`` for every other module, which would drop
    the inputs of compiled_psg's own GraphModule were it called as a module."""
    model, x, y = _setup()
    fn = psg.per_sample(model, backend="eager")(lambda x, y: F.cross_entropy(model(x), y))
    _check(fn, model, x, y)
    handle = nn.modules.module.register_module_forward_pre_hook(
        lambda mod, inp: (inp[0] * 2,) if isinstance(mod, nn.Linear) else inp[:1])
    try:
        with caplog.at_level(logging.WARNING, logger="compiled_psg"):
            _check(fn, model, x, y)
        _recaptured(fn, caplog, 2, "_global_forward_pre_hooks")
    finally:
        handle.remove()


def test_class_method_swap_recaptures(caplog):
    model, x, y = _setup()
    fn = psg.per_sample(model, backend="eager")(lambda x, y: F.cross_entropy(model(x), y))
    _check(fn, model, x, y)
    original = nn.Tanh.forward
    nn.Tanh.forward = lambda self, h: torch.sin(h)
    try:
        with caplog.at_level(logging.WARNING, logger="compiled_psg"):
            _check(fn, model, x, y)
        _recaptured(fn, caplog, 2, "Tanh.forward")
    finally:
        nn.Tanh.forward = original


def test_method_swap_on_a_module_that_adds_no_op_recaptures():
    """nn.Identity adds no node to the graph; Dynamo still traced into it, and its class is guarded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Identity()).double()
    _, x, y = _setup()
    fn = psg.per_sample(model, backend="eager")(lambda x, y: F.cross_entropy(model(x), y))
    _check(fn, model, x, y)
    original = nn.Identity.forward
    nn.Identity.forward = lambda self, h: h * 3
    try:
        _check(fn, model, x, y)
        assert fn.captures == 2
    finally:
        nn.Identity.forward = original


def test_global_full_backward_hook_after_capture_is_refused():
    model, x, y = _setup()
    fn = psg.per_sample(model, backend="eager")(lambda x, y: F.cross_entropy(model(x), y))
    _check(fn, model, x, y)
    full_before = nn.modules.module._global_is_full_backward_hook  # set for good by a registration
    handle = nn.modules.module.register_module_full_backward_hook(
        lambda mod, gi, go: tuple(None if g is None else 3 * g for g in gi))
    try:
        with pytest.raises(psg.UnsupportedError, match="global module backward hook.*Fix: remove the hook"):
            fn(x, y)
    finally:
        handle.remove()
        nn.modules.module._global_is_full_backward_hook = full_before
    _check(fn, model, x, y)


def test_module_backward_hook_is_refused_in_our_words():
    model, x, y = _setup()
    handle = model[0].register_full_backward_hook(lambda mod, gi, go: gi)
    try:
        fn = psg.per_sample(model, backend="eager")(lambda x, y: F.cross_entropy(model(x), y))
        with pytest.raises(psg.UnsupportedError, match="a module backward hook.*Fix: remove the hook"):
            fn(x, y)
    finally:
        handle.remove()


def test_a_source_that_cannot_be_rechecked_is_refused():
    """The allow-list: a graph input whose source neither Dynamo's guards nor ours can re-evaluate."""
    model, _, _ = _setup()
    joint = torch.fx.symbolic_trace(model)
    with pytest.raises(psg.CaptureError, match="cannot re-check.*Fix: pass it to the loss as a tensor argument"):
        global_guards.capture(None, joint, ["___as_tensor(G['x'])"], {0: torch.zeros(())}, {}, {}, lambda s: False)


def test_a_source_read_through_dynamo_helpers_is_checked_by_identity():
    model, _, _ = _setup()
    joint = torch.fx.symbolic_trace(model)
    held, other = torch.zeros(()), torch.ones(())
    scope = {"d": OrderedDict(w=held)}
    guards = global_guards.capture(None, joint, ["___odict_getitem(G['d'], 'w')"], {0: held}, scope, {},
                                   lambda s: False)
    assert guards.failure({}) is None
    scope["d"]["w"] = other
    assert "___odict_getitem(G['d'], 'w')" in guards.failure({})
