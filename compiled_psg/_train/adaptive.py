"""Adaptive clipping's next bound (Andrew et al. 2021): the next step's ``C`` from this step's noisy count of
unclipped samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import distributed as dist_utils
from .config import DPConfig, noise_overflows
from .eager import NoiseSource


@dataclass(frozen=True)
class NextBound:
    bound: float
    unclipped: float  # samples with norm <= C in the step (summed over the ranks)
    count_noise: float  # the noise added to their (centred) count
    stalled: str | None = None  # why the next step cannot be taken: its noise would overflow


def next_bound(config: DPConfig, norms: torch.Tensor | None, noise: NoiseSource, distributed: bool,
               acc_dtype: torch.dtype, steps_taken: int) -> NextBound:
    """The next ``C`` from the unclipped count (norm <= C, compared in the dtype the graph clipped in). Under
    ``torch.distributed`` the counts are summed over the ranks and rank 0 alone adds the count's noise, so
    every rank gets the same ``C``."""
    bound = torch.tensor(config.bounds[0], dtype=acc_dtype)
    unclipped = 0.0 if norms is None else float((norms.to(bound.device) <= bound).sum())
    size = 0.0 if norms is None else float(norms.numel())
    sigma_b = config.unclipped_num_std or 0.0
    count_noise = noise.draw_scalar(sigma_b) if sigma_b > 0 and dist_utils.rank() == 0 else 0.0
    if distributed:
        unclipped, size, count_noise = (dist_utils.all_reduce_scalar(v) for v in (unclipped, size, count_noise))
    new = config.next_bound(unclipped, size, count_noise)
    # the noise, std sigma * C, is drawn in acc_dtype; C itself is compared there too (hence sigma >= 1)
    if not noise_overflows(max(config.noise_multiplier, 1.0), new, acc_dtype):
        return NextBound(new, unclipped, count_noise)
    # this step is done and counted; the next one's noise would overflow
    return NextBound(new, unclipped, count_noise, stalled=(
        f"adaptive clipping moved the clip bound to {new:.3g} after step {steps_taken}, past the range "
        f"of {acc_dtype} "
        f"(clipbound_learning_rate={config.clipbound_learning_rate}, target_unclipped_quantile="
        f"{config.target_unclipped_quantile}, max_clipbound={config.max_clipbound}), so the noise, whose "
        "std scales with it, would overflow. No step was taken. Fix: set a finite max_clipbound or a "
        "smaller clipbound_learning_rate, or assign step.max_grad_norm before the next step"))
