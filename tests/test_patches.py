"""The registry of every change inside torch (``compiled_psg/_capture/patches.py``): each change is in force while
its phase runs and torch's original is back afterwards, whether the capture or the compile succeeded or failed;
another thread's ``torch.compile`` meanwhile sees torch as it was; docs/semantics.md carries the table."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import reference_per_sample
from torch._dynamo.comptime import comptime

import compiled_psg as psg
from compiled_psg._capture import patches

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _same(before: dict, after: dict) -> list[str]:
    """Names of the entries whose targets are not what they were: the very objects (functions, kernels), or equal
    values (config settings)."""
    return [name for name in before if len(before[name]) != len(after[name]) or any(
        a is not b and (callable(a) or a != b) for a, b in zip(before[name], after[name], strict=True))]


_SEEN: list[dict] = []  # what the traced loss read mid-capture (a comptime hook takes no free variables)


def _record_mid_capture(ctx):
    _SEEN.append(patches.current())


def _capture_phase() -> list[str]:
    return [name for name, p in patches.REGISTRY.items()
            if "capture" in p.when and p.current is not None and p.in_force_here()]


def test_every_phase_has_entries_and_each_entry_says_how_it_is_undone():
    """The package's import registers every change (a module left unimported would leave its change unlisted
    and never entered)."""
    by_phase = {phase: {n for n, p in patches.REGISTRY.items() if phase in p.when} for phase in patches.PHASES}
    assert {"Dynamo settings", "mkldnn off", "opt_einsum off", "stand-ins", "corrected decompositions",
            "traceable decompositions", "batch-size decisions", "membership on sizes"} <= by_phase["capture"]
    assert by_phase["guard check"] == {"stand-ins"}
    assert by_phase["rewrite"] == {"anomaly mode off"}
    assert {"index simplification", "Inductor settings"} <= by_phase["compile"]
    assert {"guard source", "guard finalizers", "memo caches released", "heap keeps freed memory"} <= by_phase[
        "process"]
    for p in patches.REGISTRY.values():
        assert p.why and p.threads and p.undo and p.checked_on, p.name
        assert (p.enter is None) == (p.when == ("process",)), p.name


def test_changes_are_in_force_during_a_capture_and_undone_after_it():
    """A traced loss reads the registry's targets mid-capture (``comptime`` runs while Dynamo traces): every
    capture-phase target is then replaced, and afterwards each is torch's original again, by identity."""
    before = patches.current()
    _SEEN.clear()
    lin = nn.Linear(3, 2)

    def loss(x):
        comptime(_record_mid_capture)
        return lin(x).square().sum()

    psg.per_sample(lin, backend="eager")(loss)(torch.randn(4, 3))
    assert _SEEN, "the traced loss never ran its comptime hook"
    assert sorted(_same(before, _SEEN[0])) == sorted(_capture_phase())
    assert _same(before, patches.current()) == []


@pytest.mark.inductor
def test_torch_is_restored_after_compile_and_after_failures(monkeypatch):
    """After an Inductor compile, a capture that fails (a graph break), an analysis refusal and a compile that
    fails, every registered target is the object it was before."""
    before = patches.current()
    lin = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    psg.per_sample(lin, reduce=psg.norms())(lambda x: lin(x).square().sum())(x)
    assert _same(before, patches.current()) == []

    def breaks(x):
        if lin(x).sum().item() > 1e9:  # data-dependent control flow: Dynamo cannot capture it as one graph
            return lin(x).sum()
        return lin(x).square().sum()

    with pytest.raises(psg.CaptureError):
        psg.per_sample(lin, backend="eager")(breaks)(x)
    assert _same(before, patches.current()) == []
    with pytest.raises(psg.SampleMixingError):
        psg.per_sample(lin, backend="eager")(lambda x: (lin(x) - lin(x).mean(0)).square().sum())(x)
    assert _same(before, patches.current()) == []

    import torch._inductor.compile_fx as compile_fx_module

    in_force = []

    def failing_compile(*args, **kwargs):
        in_force.append(_same(before, patches.current()))
        raise RuntimeError("Inductor broke")

    monkeypatch.setattr(compile_fx_module, "compile_fx", failing_compile)
    with pytest.raises(psg.CompileError):
        psg.per_sample(lin, reduce=psg.norms())(lambda x: lin(x).abs().sum())(x)
    # (the Inductor settings this float32 graph needs are torch's defaults: only the swapped method shows)
    assert in_force and "index simplification" in in_force[0], "the compile phase's changes were not in force"
    assert _same(before, patches.current()) == []


@contextlib.contextmanager
def _holding(started: threading.Event, proceed: threading.Event, released: threading.Event):
    started.set()
    proceed.wait(timeout=60)
    try:
        yield
    finally:
        released.set()  # the capture's changes are undone from here on


def test_another_threads_compile_waits_and_sees_torch_as_it_was():
    """Thread A captures and holds with every capture-phase change in force (a test entry registered last, so
    entered last, outside Dynamo's own tracing); thread B then runs its own ``torch.compile``. B's backend must
    not run while A's changes are in force (it waits on the compile lock) and must see every original."""
    before = patches.current()
    started, proceed, released = threading.Event(), threading.Event(), threading.Event()
    patches.register(patches.Patch("test: hold the capture", "nothing", "a test", ("capture",), "this test",
                                   "nothing to undo", enter=lambda: _holding(started, proceed, released)))
    lin = nn.Linear(3, 2)
    seen_by_other: list[dict] = []
    errors: list[BaseException] = []

    def capture():
        try:
            psg.per_sample(lin, backend="eager")(lambda x: lin(x).square().sum())(torch.randn(4, 3))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def recording_backend(gm, example_inputs):
        seen_by_other.append({**patches.current(), "capture still holding": (not released.is_set(),)})
        return gm.forward

    def users_compile(results):
        try:
            f = torch.compile(lambda t: (t * 2).sin(), backend=recording_backend, fullgraph=True)
            results.append(f(torch.ones(3)))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    results: list[torch.Tensor] = []
    a = threading.Thread(target=capture)
    b = threading.Thread(target=users_compile, args=(results,))
    try:
        a.start()
        assert started.wait(timeout=60), "the capture never entered its changes"
        b.start()
        b.join(timeout=10)  # unlocked, B compiles a one-op function in well under this
        compiled_during_capture = not b.is_alive()
    finally:
        proceed.set()
        a.join(timeout=60)
        b.join(timeout=60)
        patches.REGISTRY.pop("test: hold the capture")
    assert not errors, errors
    assert not compiled_during_capture, "another thread's torch.compile ran while the capture's changes were in force"
    assert seen_by_other and seen_by_other[0].pop("capture still holding") == (False,)
    assert _same(before, seen_by_other[0]) == [], (before, seen_by_other)
    torch.testing.assert_close(results[0], torch.ones(3).mul(2).sin())


def test_semantics_page_carries_the_registry():
    spec = importlib.util.spec_from_file_location("gen_patches", DOCS / "gen_patches.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = module.PAGE.read_text()
    assert page == module.render(page), "docs/semantics.md's table is stale: run python docs/gen_patches.py"


def test_the_metrics_failure_of_old_torch_is_dropped_and_nothing_else():
    """torch 2.11/2.12 log a traceback for every capture (their compile metrics sort Dynamo's config sets, and
    ignore_logging_functions holds functions): that record alone is dropped during a capture, and only there."""
    logger = logging.getLogger("torch._dynamo.metrics_context")
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    try:
        with patches.REGISTRY["metrics failure unlogged"].enter():
            logger.error("Unexpected exception logging compilation metrics")
            logger.error("another failure")
        logger.error("Unexpected exception logging compilation metrics")
    finally:
        logger.removeHandler(handler)
    assert seen == ["another failure", "Unexpected exception logging compilation metrics"]
    assert not logger.filters
    entry = patches.REGISTRY["metrics failure unlogged"]
    assert entry.in_force_here() == (torch.__version__ < "2.13"), "in force on torch 2.11 and 2.12 only"


def test_anomaly_mode_is_off_during_a_rewrite_and_restored_after_it():
    """torch.autograd.set_detect_anomaly(True) is a common debugging switch; its NaN check of every gradient is a
    data-dependent guard that stopped every capture ("Could not guard on data-dependent expression" at
    compiled_psg's own line). The rewrite runs without it and gives the loop's exact gradients; the user's
    setting is back afterwards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))

    def loss(x, y):
        return F.cross_entropy(model(x), y)

    with torch.autograd.set_detect_anomaly(True):
        got = psg.per_sample(model, backend="eager")(loss)(x, y)
        assert torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()
    expected = reference_per_sample(loss, dict(model.named_parameters()), (x, y))
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12)
