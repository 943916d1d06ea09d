"""The documentation: the generated supported-op page is fresh, the site builds in strict mode, and every
runnable example in it runs.

Conventions for docs/*.md: on a page that contains the line ``<!-- examples: run -->``, fenced blocks tagged
``python`` are run, in order, one namespace per page, from the repository root, with ``psg.per_sample`` and
``psg.per_sample_grad`` defaulting to ``backend="eager"`` (no compiler: the same numbers, much faster to
build). Blocks tagged ``py``, ``text`` or ``bash``, and every block of other pages, are shown, not run.

A ``text`` block preceded by ``<!-- excerpt: graphs/<example>/<file> -->`` is copied from that committed dump:
each of its lines (but ``...``) must still be a line of the file, so excerpts go stale together with graphs/.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import compiled_psg

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_RUN_MARK = "<!-- examples: run -->"
_EXCERPT = re.compile(r"^<!-- excerpt: (?P<src>\S+) -->\s*^```text[ \t]*\n(?P<body>.*?)^```[ \t]*$",
                      re.S | re.M)


def _generator():
    spec = importlib.util.spec_from_file_location("gen_supported_ops", DOCS / "gen_supported_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_supported_ops_page_is_fresh():
    fresh = _generator().render()
    page = DOCS / "supported-ops.md"
    assert page.exists(), "docs/supported-ops.md is missing: run python docs/gen_supported_ops.py"
    assert page.read_text() == fresh, ("docs/supported-ops.md is stale (the rule table changed): "
                                       "run python docs/gen_supported_ops.py")


def _excerpts():
    for page in sorted(DOCS.glob("*.md")):
        for k, match in enumerate(_EXCERPT.finditer(page.read_text())):
            yield pytest.param(page.name, match["src"], match["body"], id=f"{page.name}-{k + 1}")


@pytest.mark.parametrize("page, source, body", list(_excerpts()))
def test_graph_excerpts_match_the_dumps(page, source, body):
    path = ROOT / source
    assert path.exists(), f"docs/{page} quotes {source}, which does not exist"
    lines = set(path.read_text().splitlines())
    missing = [line for line in body.splitlines()
               if line.strip() and line.strip() != "..." and line not in lines]
    assert not missing, (f"docs/{page}: these lines of the excerpt of {source} are no longer in it (the "
                         "rewrite changed: copy the new lines from the dump):\n" + "\n".join(missing))


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                             str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "site" / "index.html").exists()


def _pages_with_examples() -> list[str]:
    return sorted(p.name for p in DOCS.glob("*.md") if _RUN_MARK in p.read_text().splitlines())


def _eager_default(decorator):
    def wrapped(*args, backend="eager", **kwargs):
        return decorator(*args, backend=backend, **kwargs)

    return wrapped


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages_with_examples())
def test_page_examples_run(page, monkeypatch):
    from compiled_psg._rewrite import table

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(compiled_psg, "per_sample", _eager_default(compiled_psg.per_sample))
    monkeypatch.setattr(compiled_psg, "per_sample_grad", _eager_default(compiled_psg.per_sample_grad))
    monkeypatch.setattr(sys, "path", list(sys.path))  # examples may insert tests/ into sys.path
    rules = dict(table.CONTRACTION_RULES)  # examples may register rules at run time
    module = types.ModuleType(f"docs_example_{page.removesuffix('.md').replace('-', '_')}")
    monkeypatch.setitem(sys.modules, module.__name__, module)  # Dynamo looks globals up by module name
    namespace = module.__dict__
    try:
        text = (DOCS / page).read_text()
        for k, match in enumerate(_FENCE.finditer(text)):
            line = text[:match.start()].count("\n") + 2
            code = compile(match.group(1), f"docs/{page}:{line} (example {k + 1})", "exec")
            with contextlib.redirect_stdout(io.StringIO()):
                exec(code, namespace)
    finally:
        table.CONTRACTION_RULES.clear()
        table.CONTRACTION_RULES.update(rules)
