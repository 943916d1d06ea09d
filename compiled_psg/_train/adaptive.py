"""Adaptive clipping's next bound (Andrew et al. 2021): the next step's ``C`` from this step's noisy count of
unclipped samples."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import distributed as dist_utils
from .config import DPConfig
from .eager import NoiseSource


@dataclass(frozen=True)
class NextBound:
    bound: float
    unclipped: float  # samples with norm <= C in the step (summed over the ranks)
    count_noise: float  # the noise added to their (centred) count
    stalled: str | None = None  # why the next step cannot be taken: its noise would overflow


def next_bound(config: DPConfig, norms: torch.Tensor | None, noise: NoiseSource, distributed: bool,
               acc_dtype: torch.dtype, grad_dtype: torch.dtype, steps_taken: int) -> NextBound:
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
    settings = (f"clipbound_learning_rate={config.clipbound_learning_rate}, target_unclipped_quantile="
                f"{config.target_unclipped_quantile}, max_clipbound={config.max_clipbound}")
    if math.isnan(new):  # not from finite options and counts (DPConfig); named as NaN should a count be one
        return NextBound(new, unclipped, count_noise, stalled=(
            f"adaptive clipping computed the clip bound NaN after step {steps_taken}, from {unclipped} unclipped "
            f"samples of {size} and count noise {count_noise} ({settings}). No step was taken. Fix: assign "
            "step.max_grad_norm before the next step"))
    # the noise, std sigma * C, is drawn in acc_dtype; C itself is compared there too (range_problem)
    problem = ("the noise, whose std scales with it, would be infinite" if math.isinf(new)
               else config.replace(max_grad_norm=new).range_problem(acc_dtype, grad_dtype))
    if problem is None:
        return NextBound(new, unclipped, count_noise)
    # this step is done and counted; the next one's noise would overflow
    return NextBound(new, unclipped, count_noise, stalled=(
        f"adaptive clipping moved the clip bound to {new:.3g} after step {steps_taken} ({settings}): {problem}. "
        "No step was taken. Fix: set a finite max_clipbound or a smaller clipbound_learning_rate, or assign "
        "step.max_grad_norm before the next step"))
