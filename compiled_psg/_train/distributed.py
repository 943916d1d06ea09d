"""Data-parallel DP-SGD with ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Every rank holds a full copy of the model and its own shard of the data. A step of ``compile_step`` then:

1. computes the rank's clipped sum ``sum_i min(1, C/||g_i||) g_i`` over its local batch;
2. rank 0 adds the Gaussian noise N(0, sigma^2 C^2), once: the other ranks add nothing;
3. all-reduces (sums) the noisy sums and the batch size in one flat buffer, so every rank holds the same
   ``noise + sum over the global batch``: exactly the single-process aggregate of the union of the batches;
4. divides by the global expected batch size and runs the optimizer update on every rank.

All four happen in the one compiled program of the step: the all-reduce is a functional collective
(``_c10d_functional.all_reduce``) inside the graph. A rank that runs a step eagerly (the first step, an empty
local batch) joins the same single collective through ``all_reduce_flat``.

The parameters are broadcast from rank 0 when the step is built, so the replicas start (and stay) identical.
Each rank Poisson-samples its shard with the same rate ``q``: every example of the union is then included
independently with probability ``q``, the global sampling rate the accountant uses.

Across nodes, launch one process per device with torchrun, e.g. on each of 2 nodes with 4 GPUs::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 train.py

and in ``train.py`` call ``torch.distributed.init_process_group("nccl")`` (``"gloo"`` on CPU), select the
device ``LOCAL_RANK``, take the shard ``shard(dataset)`` and build ``make_private`` / ``compile_step`` as
usual; the step detects the process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """True when a process group with more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def broadcast_parameters(params: list[torch.Tensor], src: int = 0) -> None:
    """Copy rank ``src``'s parameter values to every rank."""
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src)


def group_name() -> str:
    """The default process group's name, as functional collectives inside a compiled graph refer to it."""
    return dist.group.WORLD.group_name


def all_reduce_flat(grads: list[torch.Tensor], count: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``cat(g.view(-1) for g in grads) + [count]`` summed over the ranks in one collective: the layout the fused
    step program all-reduces in its graph (``fuse._all_reduce_flat``), so eager and compiled ranks can meet."""
    flat = torch.cat([g.reshape(-1) for g in grads] + [count.reshape(1).to(grads[0].dtype)])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    parts = flat.split([g.numel() for g in grads] + [1])
    return [part.view_as(g) for part, g in zip(parts, grads, strict=False)], parts[-1].view(())


def all_reduce_scalar(value: float, op=None) -> float:
    """A Python number reduced over the ranks (sum by default), in float64."""
    if not is_distributed():
        return value
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op)
    return float(t.item())


def shard(dataset, rank_: int | None = None, world: int | None = None):
    """This rank's disjoint slice of ``dataset`` (every ``world``-th example from ``rank``)."""
    from torch.utils.data import Subset

    r = rank() if rank_ is None else rank_
    w = world_size() if world is None else world
    return Subset(dataset, list(range(r, len(dataset), w)))
