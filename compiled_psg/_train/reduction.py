"""Which reduction a DP step's per-sample graph computes: the user's ``reduce=`` resolved against
``max_grad_norm=``, and the clipped sum (``DPClip``) of a configuration over the trained parameters."""

from __future__ import annotations

import torch

from .._errors import DPConfigError
from .._reduce.reductions import ClipSum, DPClip, Gram, Norms, PerSampleGrads, Reduction
from .config import DPConfig


def resolve_reduction(reduce: Reduction | None,
                      max_grad_norm: float | None) -> tuple[Reduction | None, float | None, float | None]:
    """The user's custom reduction (None: the default clip_sum), the clipping bound, and ``clip_sum``'s
    ``memory_budget`` when ``reduce=psg.clip_sum(C, memory_budget=...)``."""
    if isinstance(reduce, ClipSum):
        if max_grad_norm is not None and float(max_grad_norm) != float(reduce.max_norm):
            raise DPConfigError(f"max_grad_norm={max_grad_norm} contradicts reduce=clip_sum({reduce.max_norm}); "
                                "give the bound once")
        return None, float(reduce.max_norm), reduce.memory_budget
    if reduce is None:
        return None, max_grad_norm, None
    if not isinstance(reduce, Reduction):
        raise DPConfigError(f"reduce must be a compiled_psg reduction (psg.clip_sum(C), psg.custom(...)) or None, "
                            f"got {type(reduce).__name__}")
    if isinstance(reduce, Norms | Gram | PerSampleGrads):
        raise DPConfigError(f"reduce={type(reduce).__name__.lower()}() gives no gradient per parameter for the "
                            "optimizer. Fix: reduce=psg.clip_sum(C), or psg.custom(...) returning {name: tensor "
                            "shaped like the parameter}")
    if max_grad_norm is not None:  # a custom reduction computes the update's sums itself: nothing would clip to C
        raise DPConfigError(f"max_grad_norm={max_grad_norm} applies to the default clip_sum reduction, and "
                            f"reduce={type(reduce).__name__}(...) replaces it: the step would not clip to it. Fix: "
                            "drop reduce= to clip to max_grad_norm (reduce=psg.clip_sum(C) for a memory budget), "
                            "or drop max_grad_norm and bound the custom reduction's sums yourself (it is then not "
                            "noised: noise needs the clipping bound clip_sum gives)")
    return reduce, None, None




def clip_groups(config: DPConfig, trained: list[str], trainable: list[str]) -> tuple[tuple[str, ...], ...] | None:
    """The groups of parameter names the clipped sum clips (None: one group of every trainable parameter).
    Flat and automatic clipping: one group, the trained (the optimizer's) parameters, when they are fewer than
    the trainable ones (Opacus' semantics: the norm covers what is updated). Per-layer: ``clip_groups``, or one
    group per trained parameter, checked against the trained ones."""
    if config.clipping != "per_layer":
        return None if trained == trainable else (tuple(trained),)
    if config.clip_groups is None:
        return tuple((n,) for n in trained)
    listed = {n for g in config.clip_groups for n in g}
    missing, unknown = [n for n in trained if n not in listed], sorted(listed - set(trained))
    if missing or unknown:
        raise DPConfigError(f"clip_groups must name every trained parameter once: missing {missing}, not "
                            f"trained parameters {unknown}")
    return config.clip_groups


def dp_clip_for(config: DPConfig, trained: list[str], trainable: list[str], acc_dtype: torch.dtype) -> DPClip:
    """The ``DPClip`` reduction of ``config`` (not ``"custom"``) over the trained parameters."""
    groups = clip_groups(config, trained, trainable)
    bounds = config.group_bounds(1 if groups is None else len(groups))
    if groups is not None and len(bounds) != len(groups):
        raise DPConfigError(f"clipping='per_layer': {len(bounds)} bounds in max_grad_norm for {len(groups)} "
                            f"groups of parameters ({[list(g) for g in groups]})")
    mode = {"adaptive": "flat"}.get(config.clipping, config.clipping)
    # adaptive: C changes every step, so it is an input of the graph instead of a constant
    return DPClip(mode, None if config.clipping == "adaptive" else bounds, groups, config.automatic_gamma,
                  acc_dtype, config.memory_budget)
