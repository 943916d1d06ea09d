"""Batch buckets: every (micro-)batch padded to one of a few sizes, the padding weighted 0.

A compiled program serves every batch size (the batch is symbolic), but a CUDA graph is recorded per shape, and
Poisson sampling draws a new batch size every step. With ``batch_buckets=(b_1 < ... < b_k)`` a micro-batch of
``b`` samples is padded to the smallest bucket ``>= b``, so the program sees ``k`` shapes at most.

Exactness. A padded row is a copy of the micro-batch's first sample: every forward value of the row is finite
where that sample's is. The per-sample graph is built with ``seed_weights`` (``_capture/retrace.py``): its
backward starts from ``sum(w_i * loss_i)`` with ``w_i = 1`` on real rows and ``0`` on padded ones, so a padded
row's per-sample gradients are its seed 0 times finite local derivatives: exactly 0. Its norm is 0 (a ghost
norm's zero factor gives 0 even where the other factor overflows, ``_rewrite/contraction.py``), its clip factor
1, and it adds exactly 0 to the clipped sums. Nothing else the step reports or divides by reads a padded row:
``real_rows`` gives the loss from the real rows' own losses and their norms; the batch size the step counts,
divides by (``expected_batch_size=None``) and accounts for is the user's.

What padding cannot make exact is refused before a step runs (``release.refuse_padded_writes``): a public
buffer written from the batch (its new value reads the padded rows or the bucket's size) and a write into a
batched argument (it would go into the padded copy). A failing sample's error names the user's positions: a
padded row is the sample it copies (``source_row``).

The rows of one piece: index letters n (the bucket), b (the real samples)::

    index = [0, 1, ..., b-1, 0, ..., 0]              # [n]
    arg_padded = arg.index_select(batch_dim, index)  # every batched argument
    w = [1] * b + [0] * (n - b)                      # [n], the seed weights, after the loss's arguments
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._compile.run import CompiledGraph
from .._errors import DPConfigError
from .config import is_int


def check_buckets(value: object) -> tuple[int, ...] | None:
    """``batch_buckets`` as a tuple of increasing positive ints, or None; ``DPConfigError`` otherwise."""
    if value is None:
        return None
    if getattr(value, "ndim", None) == 1 and callable(getattr(value, "tolist", None)):
        value = value.tolist()  # a numpy array or a tensor of sizes: its Python numbers, checked below
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise DPConfigError(f"batch_buckets must be None or a sequence of increasing positive ints (e.g. (8, 16, "
                            f"32, 64)), got {type(value).__name__} {value!r}")
    if len(value) == 0:
        raise DPConfigError("batch_buckets must hold at least one size, got an empty sequence. Fix: "
                            "batch_buckets=None (no padding) or e.g. (8, 16, 32, 64)")
    for b in value:
        if not is_int(b):
            raise DPConfigError(f"batch_buckets must hold ints, got {type(b).__name__} {b!r} in {value!r}")
        if b <= 0:
            raise DPConfigError(f"batch_buckets must hold positive sizes, got {b} in {value!r}")
    sizes = tuple(int(b) for b in value)  # numpy's integers as Python's: the sizes reach shapes and the saved state
    if any(a >= b for a, b in zip(sizes, sizes[1:], strict=False)):
        raise DPConfigError(f"batch_buckets must be strictly increasing (sorted, no duplicates), got {value!r}. "
                            f"Fix: batch_buckets={tuple(sorted(set(sizes)))}")
    return sizes


def check_fits(buckets: tuple[int, ...] | None, max_physical_batch_size: int | None) -> None:
    """A padded micro-batch holds no more samples than ``max_physical_batch_size`` allows (the memory bound)."""
    if buckets is not None and max_physical_batch_size is not None and buckets[-1] > max_physical_batch_size:
        raise DPConfigError(
            f"the largest of batch_buckets={buckets} exceeds max_physical_batch_size={max_physical_batch_size}: a "
            "micro-batch padded to it would hold more samples than the memory bound. Fix: buckets up to "
            f"{max_physical_batch_size}, e.g. {default_buckets(max_physical_batch_size)}")


def default_buckets(largest: int) -> tuple[int, ...]:
    """Powers of two below ``largest``, and ``largest``: ``cuda_graphs=True``'s buckets for a micro-batch size."""
    sizes = []
    b = 1
    while b < largest:
        sizes.append(b)
        b *= 2
    return (*sizes, largest)


def bucket_for(buckets: tuple[int, ...], b: int) -> int:
    """The smallest bucket ``>= b`` (the step cuts micro-batches to at most the largest)."""
    return next(s for s in buckets if s >= b)


@dataclass(frozen=True)
class PaddedCall:
    """A micro-batch padded to its bucket, ready to run: as ``_api.PreparedCall`` (``batch_size`` the bucket,
    ``args`` the padded arguments then the seed weights) with ``real``, its samples from the user's batch."""

    entry: CompiledGraph
    params: dict[str, torch.Tensor]
    args: tuple
    batch_size: int
    real: int


def source_row(row: int, b: int) -> int:
    """The sample of a piece of ``b`` real samples that row ``row`` of its padded batch copies (``pad``)."""
    return row if row < b else 0


def pad(batch: tuple, dims: dict[int, int], b: int, bucket: int) -> tuple:
    """``batch`` (``b`` samples) with ``bucket - b`` copies of its first sample appended along each batched
    argument's dimension ``dims[i]``."""
    if b == bucket:
        return batch
    out = list(batch)
    for i, d in dims.items():
        a = batch[i]
        index = torch.cat([torch.arange(b, device=a.device), torch.zeros(bucket - b, dtype=torch.long,
                                                                          device=a.device)])
        out[i] = a.index_select(d, index)
    return tuple(out)


class SeedWeights:
    """The seed weights ``[1] * b + [0] * (n - b)``, one read-only tensor per ``(n, b)``, dtype and device."""

    def __init__(self):
        self._kept: dict[tuple, torch.Tensor] = {}

    def get(self, bucket: int, b: int, like: torch.Tensor) -> torch.Tensor:
        key = (bucket, b, like.dtype, like.device)
        w = self._kept.get(key)
        if w is None:
            if len(self._kept) > 1024:  # a few buckets times their sizes; bounded all the same
                self._kept.clear()
            w = torch.zeros(bucket, dtype=like.dtype, device=like.device)
            w[:b] = 1
            self._kept[key] = w
        return w


def real_size(call) -> int:
    """The user's samples in a piece (a padded one's ``real``)."""
    return call.real if isinstance(call, PaddedCall) else call.batch_size


def real_rows(call, loss: torch.Tensor, losses: torch.Tensor, norms: torch.Tensor | None,
              loss_reduction: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(loss, norms)`` of a piece's real rows. A padded piece's loss is its real rows' own losses summed
    (``loss_reduction="sum"``) or averaged (``"mean"``), or its ``[b]`` per-sample losses where the loss returns
    them; each value is a new tensor (a CUDA graph's replay overwrites its outputs at the next run)."""
    if not isinstance(call, PaddedCall):
        return loss, norms
    b = call.real
    if loss.dim() > 0:
        loss = loss[:b].clone()
    else:
        mine = losses[:b]
        loss = (mine.sum() if loss_reduction == "sum" else mine.mean()).to(loss.dtype)
    return loss, None if norms is None else norms[:b].clone()


def resolve(batch_buckets: object, cuda_graphs: object, model: torch.nn.Module, backend: str,
            max_physical_batch_size: int | None, custom: bool, distributed: bool) -> tuple[int, ...] | None:
    """The step's buckets, checked with ``cuda_graphs`` (``DPConfigError`` naming the fix): ``cuda_graphs=True``
    needs buckets, by default powers of two up to ``max_physical_batch_size``."""
    buckets = check_buckets(batch_buckets)
    if not isinstance(cuda_graphs, bool):
        raise DPConfigError(f"cuda_graphs must be True or False, got {type(cuda_graphs).__name__} {cuda_graphs!r}")
    if cuda_graphs:
        devices = sorted({p.device.type for p in model.parameters()})
        if devices != ["cuda"]:
            raise DPConfigError(f"cuda_graphs=True records CUDA graphs, but the model's parameters are on "
                                f"{' and '.join(devices) or 'no device'}. Fix: model.to('cuda'), or cuda_graphs=False")
        if backend != "inductor":
            raise DPConfigError(f"cuda_graphs=True is Inductor's (it records the compiled program), got "
                                f"backend={backend!r}. Fix: backend='inductor'")
        if distributed:
            raise DPConfigError("cuda_graphs=True under torch.distributed: the program's all-reduce is not "
                                "recorded into CUDA graphs by compiled_psg. Fix: cuda_graphs=False")
        if buckets is None:
            if max_physical_batch_size is None:
                raise DPConfigError("cuda_graphs=True records one CUDA graph per batch size, and Poisson sampling "
                                    "draws a new size every step: it needs batch_buckets. Fix: "
                                    "batch_buckets=(8, 16, 32, 64) (your sizes), or max_physical_batch_size=N "
                                    "(buckets then default to powers of two up to N)")
            buckets = default_buckets(max_physical_batch_size)
    if buckets is not None and custom:
        raise DPConfigError("batch_buckets with a custom reduce=: a custom reduction reads every row of the padded "
                            "batch, padded rows included (their per-sample gradients are 0, but a mean or a "
                            "count over them is not the batch's). Fix: batch_buckets=None, or "
                            "reduce=psg.clip_sum(C) / max_grad_norm=C")
    check_fits(buckets, max_physical_batch_size)
    return buckets
