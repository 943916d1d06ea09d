"""Suite-wide guards.

torch.fx's symbolic tracer (which ``make_fx`` and AOT autograd use) patches ``nn.Module.__call__`` through one
process-global patcher: two traces in two threads at once leave the patch in place for good, and every later
capture of a module in that process then fails (Dynamo meets ``module_call_wrapper``). A test that leaves it so
fails here, by name, and the original is put back, so that the tests after it are not affected."""

from __future__ import annotations

import pytest
import torch

_MODULE_CALL = torch.nn.Module.__call__


@pytest.fixture(autouse=True)
def module_call_not_left_patched(request):
    yield
    if torch.nn.Module.__call__ is not _MODULE_CALL:
        torch.nn.Module.__call__ = _MODULE_CALL
        pytest.fail(f"{request.node.nodeid} left torch.nn.Module.__call__ patched by torch.fx's tracer "
                    "(two traces ran at once in two threads); restored for the tests after it", pytrace=False)
