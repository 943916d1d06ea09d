"""Suite-wide guards.

torch.fx's symbolic tracer (which ``make_fx`` and AOT autograd use) patches ``nn.Module.__call__`` through one
process-global patcher: two traces in two threads at once leave the patch in place for good, and every later
capture of a module in that process then fails (Dynamo meets ``module_call_wrapper``). A test that leaves it so
fails here, by name, and the original is put back, so that the tests after it are not affected.

The public entry points compile with Inductor by default. A test that does not name a backend runs on the eager
backend (the same rewritten graph, run without a compiler): the suite checks breadth on the eager backend and
Inductor on a representative subset, the tests marked ``inductor`` and those that name it. The fixture acts on
the test's own calls: a module-scoped fixture and a subprocess (the CLI, the benchmarks, distributed ranks) keep
the library's default unless they name a backend."""

from __future__ import annotations

import pytest
import torch

from compiled_psg import _api, compile_step, make_private
from compiled_psg._train.step import DPStep

_MODULE_CALL = torch.nn.Module.__call__
# every public function whose ``backend`` defaults to "inductor" (test_backend_defaults.py checks this list)
DEFAULTS_TO_INDUCTOR = (_api.per_sample, _api.per_sample_grad, compile_step, make_private, DPStep.__init__)


@pytest.fixture(autouse=True)
def eager_backend_unless_marked_inductor(request, monkeypatch):
    if request.node.get_closest_marker("inductor") is None:
        for fn in DEFAULTS_TO_INDUCTOR:
            monkeypatch.setitem(fn.__kwdefaults__, "backend", "eager")


@pytest.fixture(autouse=True)
def module_call_not_left_patched(request):
    yield
    if torch.nn.Module.__call__ is not _MODULE_CALL:
        torch.nn.Module.__call__ = _MODULE_CALL
        pytest.fail(f"{request.node.nodeid} left torch.nn.Module.__call__ patched by torch.fx's tracer "
                    "(two traces ran at once in two threads); restored for the tests after it", pytrace=False)


@pytest.fixture
def eager_first_step(monkeypatch):
    """The first step of plain SGD runs eagerly, as an optimizer with state does (``update_graph.creates_no_state``
    says no): for the tests that check the eager path and the fused program with plain SGD's simple reference."""
    from compiled_psg._train import update_graph

    monkeypatch.setattr(update_graph, "creates_no_state", lambda optimizer: False)
