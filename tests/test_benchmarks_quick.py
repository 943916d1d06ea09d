"""``python -m benchmarks --quick`` end to end, in a subprocess, into a temporary folder.

Checks the outputs exist and that every method has, on every model, either a measurement or a recorded
failure ("unsupported: ..."). Timings are not asserted: they depend on the machine.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_run_records_every_method(tmp_path):
    out = tmp_path / "docs"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    for name in (
        "benchmarks.md",
        "benchmarks.json",
        "img/benchmarks_time_ratio.png",
        "img/benchmarks_memory.png",
    ):
        assert (out / name).stat().st_size > 0, name
    results = json.loads((out / "benchmarks.json").read_text())
    page = (out / "benchmarks.md").read_text()
    assert results["quick"] and results["command"].startswith("python -m benchmarks --quick")
    assert len(results["methods"]) >= 18 and results["models"]

    for model, data in results["models"].items():
        assert set(data["methods"]) == set(results["methods"]), model
        for key, record in data["methods"].items():
            assert record["label"] in page
            if "error" in record:  # the method could not even be set up on this model
                assert record["error"].startswith("unsupported: "), (model, key)
                continue
            assert record["sizes"], (model, key)
            for size, entry in record["sizes"].items():
                if "error" in entry:
                    assert entry["error"].startswith("unsupported: "), (model, key, size)
                else:
                    assert entry["median_s"] > 0 and len(entry["times_s"]) >= 3, (model, key, size)
