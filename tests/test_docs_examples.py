"""Every ``python`` example of docs/training.md runs, and so does the README's Use example.

Conventions for docs/training.md: each fenced ``python`` block is self-contained (it builds its own model, data
and optimizer, so it can be copied alone) and is run alone, in a fresh namespace, in a temporary directory
(examples may write files), with ``compile_step``, ``make_private`` and ``per_sample`` defaulting to
``backend="eager"`` (the same programs without Inductor: the same numbers, much faster to build). A block that
cannot run here (``torchrun``, GPUs) is preceded by the line ``<!-- not run: the reason -->``; keep those rare.
A block that imports transformers or peft is skipped when they are not installed (the ``hf`` extra).

The README's Use example names a model and a batch it does not define (``SimpleCNN()``, ``x``, ``y``): they are
given here, and the shapes the example's comments promise are checked.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import compiled_psg

ROOT = Path(__file__).resolve().parent.parent
TRAINING = ROOT / "docs" / "training.md"
_BLOCK = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$", re.S | re.M)
_NOT_RUN = re.compile(r"<!-- not run: (?P<why>[^>]*\S)\s*-->\s*$")
MAX_NOT_RUN = 2  # not-run examples should stay the exception


def _blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, reason not run or None)`` of every ``python`` block of ``path``."""
    text = path.read_text()
    found = []
    for match in _BLOCK.finditer(text):
        if match["lang"] != "python":
            continue
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = _NOT_RUN.search(before)
        found.append((text[:match.start()].count("\n") + 2, match["body"], skip["why"] if skip else None))
    return found


def _eager_default(function):
    def wrapped(*args, backend="eager", **kwargs):
        return function(*args, backend=backend, **kwargs)

    return wrapped


@pytest.fixture
def docs_env(monkeypatch, tmp_path):
    """Eager backends by default, a scratch working directory, torch's global state restored afterwards."""
    for name in ("compile_step", "make_private", "per_sample", "per_sample_grad"):
        monkeypatch.setattr(compiled_psg, name, _eager_default(getattr(compiled_psg, name)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)
    torch.set_rng_state(rng)


def _run(code: str, where: str, namespace: dict | None = None) -> dict:
    # one module per example, under its own name: Dynamo looks globals up by module name
    name = "docs_example_" + re.sub(r"\W", "_", where)
    module = types.ModuleType(name)
    module.__dict__.update(namespace or {})
    sys.modules[name] = module
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            # peft calls a method that transformers 5 deprecated: not the example's doing
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            exec(compile(code, where, "exec"), module.__dict__)
    finally:
        del sys.modules[name]
    return module.__dict__


def test_training_page_has_examples_and_few_not_run():
    blocks = _blocks(TRAINING)
    assert len(blocks) >= 6
    not_run = [(line, why) for line, _, why in blocks if why is not None]
    assert len(not_run) <= MAX_NOT_RUN, f"too many examples of docs/training.md are not run: {not_run}"


@pytest.mark.parametrize("line, code, why", [pytest.param(*b, id=f"training.md:{b[0]}") for b in _blocks(TRAINING)])
def test_training_example_runs(line, code, why, docs_env):
    if why is not None:
        pytest.skip(f"not run: {why}")
    for package in ("transformers", "peft"):
        if re.search(rf"^\s*(from|import) {package}\b", code, re.M):
            pytest.importorskip(package)
    _run(code, f"docs/training.md:{line}")


class SimpleCNN(torch.nn.Module):
    """The README's model: its comment promises ``conv1.weight`` gradients of shape ``[B, 32, 1, 3, 3]``."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 32, 3)
        self.fc = torch.nn.Linear(32 * 6 * 6, 10)

    def forward(self, x):
        return torch.log_softmax(self.fc(torch.relu(self.conv1(x)).flatten(1)), dim=1)


def test_readme_use_example_runs(docs_env):
    text = (ROOT / "README.md").read_text()
    use = text[text.index("## Use"):]
    code = next(m["body"] for m in _BLOCK.finditer(use) if m["lang"] == "python")
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    ns = _run(code, "README.md (Use)", dict(SimpleCNN=SimpleCNN, x=x, y=y))
    grads, norms, sums = ns["grads"], ns["norms"], ns["sums"]
    assert grads["conv1.weight"].shape == (4, 32, 1, 3, 3)
    assert set(grads) == {n for n, _ in ns["model"].named_parameters()}
    torch.testing.assert_close(norms, torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1))
    clip = (1.0 / norms).clamp(max=1.0)
    for name, g in grads.items():
        torch.testing.assert_close(sums[name], (clip.view(-1, *[1] * (g.dim() - 1)) * g).sum(0))
    assert ns["report"] is not None
