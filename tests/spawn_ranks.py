"""Running a test's worker in two gloo processes: the shared launch of the distributed tests."""

from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker, tmp_path_factory, name: str) -> list:
    """``worker(rank, port, out)`` in ``WORLD`` processes; each saves ``out/rank{r}.pt``, returned in rank order."""
    out = tmp_path_factory.mktemp(name)
    mp.spawn(worker, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
