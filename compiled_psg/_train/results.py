"""What a DP step's pieces hand each other: a batch cut into micro-batches, the per-sample graph's result split
into sums and norms, sums added over micro-batches, and the losses of micro-batches combined into the batch's."""

from __future__ import annotations

import torch

from .._errors import DPConfigError


def split_result(result, names: list[str], params: list[torch.Tensor]) -> tuple[dict, torch.Tensor | None]:
    """``(sums, norms)`` from a reduction's result, checked: the optimizer needs one tensor per parameter."""
    sums, norms = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
    if not isinstance(sums, dict):
        wrong = [f"a {type(sums).__name__}, not a dict"]
    else:
        wrong = [_wrong_sum(n, sums.get(n), p) for n, p in zip(names, params, strict=True)]
        wrong = [w for w in wrong if w is not None]
    if wrong:
        raise DPConfigError("the reduction must give {name: floating tensor shaped like the parameter} for every "
                            f"trained parameter, got {'; '.join(wrong[:3])}{'; ...' if len(wrong) > 3 else ''}. "
                            "Fix: reduce=psg.clip_sum(C) or a psg.custom(...) reduction of that form")
    return sums, norms


def _wrong_sum(name: str, value, param: torch.Tensor) -> str | None:
    """What is wrong with a reduction's sum for ``param`` (None: nothing): a missing entry, another shape, or a
    dtype ``.grad`` would hold only by dropping values (integers, booleans, complex parts)."""
    if not isinstance(value, torch.Tensor):
        return f"{name}: {'missing' if value is None else type(value).__name__}"
    if value.shape != param.shape:
        return f"{name}: shape {tuple(value.shape)}, the parameter's {tuple(param.shape)}"
    if not value.dtype.is_floating_point:
        return f"{name}: dtype {value.dtype}, not floating"
    return None


def add_into(total: list[torch.Tensor] | None, sums: dict, names: list[str]) -> list[torch.Tensor]:
    if total is None:
        return [sums[n].clone() for n in names]
    for t, n in zip(total, names, strict=True):
        t.add_(sums[n])
    return total


def combine_losses(losses: list[torch.Tensor], sizes: list[int], loss_reduction: str) -> torch.Tensor:
    """The loss of a logical batch from its micro-batches' losses (means weighted by size, or sums); per-sample
    losses ``[b_k]`` are concatenated, as the whole batch returns them."""
    if len(losses) == 1:
        return losses[0]
    if losses[0].dim() > 0:
        return torch.cat(losses)
    if loss_reduction == "sum":
        return torch.stack(losses).sum()
    weights = torch.tensor(sizes, dtype=losses[0].dtype, device=losses[0].device)
    return (torch.stack(losses) * weights).sum() / weights.sum()


def micro_batches(batch: tuple, in_dims, batch_size: int, size: int | None) -> list[tuple]:
    """``batch`` in pieces of at most ``size`` samples (None: whole), each batched argument narrowed along its
    batch dimension."""
    from .._api import batch_dims_of

    if size is None or batch_size <= size:
        return [batch]
    dims, _ = batch_dims_of(batch, in_dims)
    return [tuple(a.narrow(dims[i], start, min(size, batch_size - start)).contiguous() if i in dims else a
                  for i, a in enumerate(batch))
            for start in range(0, batch_size, size)]
