"""Running a test's worker in two gloo processes: the shared launch of the distributed tests."""

from __future__ import annotations

import contextlib
import datetime
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker, tmp_path_factory, name: str, world: int = WORLD) -> list:
    """``worker(rank, port, out)`` in ``world`` processes; each saves ``out/rank{r}.pt``, returned in rank order."""
    out = tmp_path_factory.mktemp(name)
    mp.spawn(worker, args=(free_port(), str(out)), nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@contextlib.contextmanager
def gloo_group(rank: int, port: int, world: int = WORLD):
    """Inside a worker: the rank's gloo process group (one torch thread per rank), destroyed on the way out."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    try:
        yield
    finally:
        dist.destroy_process_group()
