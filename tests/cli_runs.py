"""Shared by the main jobs' tests: keep torch's thread count (the jobs set it), read a run's JSON and plot."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(autouse=True)
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def read_outputs(out, png: str) -> dict:
    """``out/metrics.json``, after checking that ``out/png`` is a real PNG."""
    data = (out / png).read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
    return json.loads((out / "metrics.json").read_text())
