"""The committed dumps in graphs/ must match what the current rewrite produces (regenerate: see graphs/README.md)."""

from pathlib import Path

import pytest

from compiled_psg._compat import GRAPH_DUMP_VERSION, torch_minor
from compiled_psg._inspect.examples import EXAMPLES
from compiled_psg._jobs.explain import report_for

GRAPHS = Path(__file__).resolve().parent.parent / "graphs"
TEXT_FILES = ("summary.txt", "captured.txt", "before.txt", "after.txt", "diff.txt")


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_committed_dumps_are_fresh(name, tmp_path):
    report_for(name).save(tmp_path, drawings=False)
    if torch_minor() != GRAPH_DUMP_VERSION:  # the dumps were made above: they must still be produced
        assert all((tmp_path / file).read_text() for file in TEXT_FILES)
        pytest.skip(f"graphs/ is generated on torch {GRAPH_DUMP_VERSION}; this torch traces the same programs with "
                    "other node names (compiled_psg._compat.GRAPH_DUMP_VERSION)")
    stale = []
    for file in TEXT_FILES:
        committed = GRAPHS / name / file
        fresh = tmp_path / file
        assert committed.exists(), f"graphs/{name}/{file} is missing: run python -m compiled_psg graphs graphs"
        if committed.read_text() != fresh.read_text():
            stale.append(file)
    assert not stale, (f"graphs/{name}: {stale} differ from the current rewrite. If the change is intended, "
                       "regenerate with: python -m compiled_psg graphs graphs")


def test_every_example_is_dumped():
    assert {p.name for p in GRAPHS.iterdir() if p.is_dir()} == set(EXAMPLES)


def test_rewritten_nodes_are_marked_and_rules_named():
    report = report_for("reduce_clip_sum")
    after = report.graph_text("after")
    assert "# psg: book_keeping[mm]" in after
    assert "# psg: ghost_norm[mm]" in after
    assert all(r.rules and not r.fallback for r in report.rewrites)
    assert "book-keeping" in str(report)
