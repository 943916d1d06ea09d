"""The suite's backend policy (tests/conftest.py): an unmarked test runs the public entry points on the eager
backend, a test marked ``inductor`` on the library's own default. The policy holds only if conftest's list names
every public function whose ``backend`` defaults to Inductor."""

from __future__ import annotations

import inspect

import pytest
from conftest import DEFAULTS_TO_INDUCTOR

import compiled_psg
from compiled_psg._train.step import DPStep


def _public_inductor_defaults() -> set:
    found = set()
    for name in dir(compiled_psg):
        obj = getattr(compiled_psg, name)
        fn = obj.__init__ if inspect.isclass(obj) else obj
        if name.startswith("_") or not callable(fn):
            continue
        backend = inspect.signature(fn).parameters.get("backend")
        if backend is not None and backend.default == "inductor":
            found.add(fn)
    return found


@pytest.mark.inductor
def test_conftest_lists_every_public_function_that_defaults_to_inductor():
    found = _public_inductor_defaults()
    assert len(found) >= 4, found  # per_sample, per_sample_grad, compile_step, make_private
    assert found | {DPStep.__init__} == set(DEFAULTS_TO_INDUCTOR)


def test_an_unmarked_test_gets_the_eager_backend():
    assert _public_inductor_defaults() == set()
    assert all(fn.__kwdefaults__["backend"] == "eager" for fn in DEFAULTS_TO_INDUCTOR)
