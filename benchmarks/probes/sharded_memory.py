"""Memory of a sharded step (``compile_step`` on a ``fully_shard`` model) against FSDP's own training step.

Two (``--world``) gloo processes on CPU train a stack of ``--layers`` ``Linear(width, width)`` blocks, each its
own ``fully_shard`` module, float32. CPU has no allocator statistics, so the sizes of tensor storages are
counted: a ``TorchDispatchMode`` records every storage an op creates during the step, and before every op sums
the bytes of those still alive (FSDP frees an unsharded parameter by resizing its storage to 0: counted as
0) and, apart, the bytes of the unsharded parameters FSDP holds (its all-gather outputs). Reported per rank, in
MiB, the peak of each over the step:

- ``fsdp``: FSDP's own step, ``loss.backward()`` and ``optimizer.step()`` (no per-sample gradients): FSDP
  all-gathers one block at a time (and prefetches the next) and frees it after use;
- ``psg``: ``compile_step`` on the same model (max_grad_norm, noise on, the second step: the first captures),
  backend ``"eager"`` (the rewritten graph op by op: Inductor's kernels allocate outside the dispatcher).

    python -m benchmarks.probes.sharded_memory [--layers 8] [--width 512] [--batch 32] [--world 2]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import socket
import tempfile
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .. import keep_freed_memory

MIB = 2**20


class LiveStorage(TorchDispatchMode):
    """Peak bytes of the storages created inside the mode (``peak``) and of FSDP's unsharded parameters
    (``params_peak``), sampled before and after every op."""

    def __init__(self, fsdp_params: list):
        super().__init__()
        self.refs: dict[int, weakref.ref] = {}
        self.at_peak: list[int] = []  # the sizes of the storages alive at the peak
        self.fsdp_params = fsdp_params
        self.peak = self.params_peak = 0

    def _sample(self) -> None:
        sizes = []
        for key, ref in list(self.refs.items()):
            st = ref()
            if st is None:
                del self.refs[key]
            elif st.nbytes():
                sizes.append(st.nbytes())
        if sum(sizes) > self.peak:
            self.peak, self.at_peak = sum(sizes), sizes
        held = sum(t.untyped_storage().nbytes() for p in self.fsdp_params for t in p.all_gather_outputs)
        self.params_peak = max(self.params_peak, held)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sample()
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                t = getattr(t, "_local_tensor", t)  # a DTensor's storage is its local tensor's
                st = t.untyped_storage()
                self.refs.setdefault(st._cdata, weakref.ref(st))
        self._sample()
        return out


def model_for(layers: int, width: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])
    for block in model:
        fully_shard(block)
    return fully_shard(model)


def measure(kind: str, args) -> dict:
    from torch.distributed.fsdp import FSDPModule

    model = model_for(args.layers, args.width)
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g)
    loss_fn = lambda x, y: F.mse_loss(model(x), y)  # noqa: E731
    if kind == "psg":
        import compiled_psg as psg

        step = psg.compile_step(loss_fn, model, opt, max_grad_norm=1.0, noise_multiplier=1.0,
                                expected_batch_size=args.batch * world, backend="eager")
    else:
        def step(x, y):
            opt.zero_grad()
            loss_fn(x, y).backward()
            opt.step()

    step(x, y)  # the first step captures (psg) and creates the optimizer state
    if kind == "psg":
        # a dispatch mode adds the Python dispatch key to every tensor, which fails Dynamo's guards on the
        # batch: the measured step reuses the first step's graph without checking them
        for entry in step.per_sample._entries():
            entry.rewritten.captured.guards.check = lambda *a, **k: True
    fsdp_params = [p for m in model.modules() if isinstance(m, FSDPModule)
                   for group in m._get_fsdp_state()._fsdp_param_groups for p in group.fsdp_params]
    tracker = LiveStorage(fsdp_params)
    with tracker:
        step(x, y)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(peak=tracker.peak, params_peak=tracker.params_peak, full=full, at_peak=tracker.at_peak,
                shard=sum(p.to_local().numel() * p.element_size() for p in model.parameters()))


def _worker(rank: int, port: int, out: str, args) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=600))
    torch.set_num_threads(1)
    try:
        torch.save({kind: measure(kind, args) for kind in ("fsdp", "psg")}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def main() -> None:
    keep_freed_memory()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank")
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(port, out, args), nprocs=args.world, join=True)
        results = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(args.world)]
    print(f"torch {torch.__version__}; {args.layers} blocks Linear({args.width}, {args.width}), float32, "
          f"{args.world} ranks, {args.batch} samples per rank; MiB per rank")
    first = results[0]["fsdp"]
    print(f"all parameters {first['full'] / MIB:.2f}, one block {first['full'] / args.layers / MIB:.2f}, "
          f"rank 0's shards {first['shard'] / MIB:.2f}")
    print(f"{'rank':>4} {'step':>5} | {'unsharded parameters, peak':>26} {'all tensors made in the step, peak':>34}")
    for r, result in enumerate(results):
        for kind in ("fsdp", "psg"):
            m = result[kind]
            print(f"{r:>4} {kind:>5} | {m['params_peak'] / MIB:>26.2f} {m['peak'] / MIB:>34.2f}")
    for kind in ("fsdp", "psg"):
        at_peak = collections.Counter(round(n / MIB, 2) for n in results[0][kind]["at_peak"])
        print(f"rank 0, {kind}, the tensors alive at the peak (MiB x count): "
              + ", ".join(f"{size} x {count}" for size, count in sorted(at_peak.items(), reverse=True)))


if __name__ == "__main__":
    main()
