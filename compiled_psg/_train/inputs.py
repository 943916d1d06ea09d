"""The run-time inputs of a fused step program (``fuse.StepProgram.inputs``): what each placeholder after the
per-sample graph's own is, and the object that feeds them on every step."""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

from .._reduce.reductions import sum_dtype
from .binding import OptimizerBinding
from .config import DPConfig
from .eager import NoiseSource


class InputKind(str, enum.Enum):
    """What feeds one placeholder of a step program, with its key: ``(kind, key)`` in ``StepProgram.inputs``."""

    REDUCE_INPUT = "reduce_input"  # the reduction's own run-time input k (adaptive clipping's bounds)
    PARTIAL = "partial"  # parameter j's clipped sum over the earlier micro-batches
    NOISE = "noise"  # parameter j's noise
    COUNT = "count"  # this rank's batch size (all-reduced in the program)
    SCALE = "scale"  # what the noisy sums are multiplied by (1 / the expected batch size)
    DOT_GRAD = "dot_grad"  # the tensor installed as parameter j's .grad
    GRAD = "grad"  # the optimizer update's j-th gradient (inside the program only)
    TENSOR = "tensor"  # a tensor the optimizer reads, itself (a state buffer, a tensor lr)


class StepInputs:
    """Feeds a step program's inputs: noise drawn for the step, read-only zeros and scalars kept across steps
    (one tensor per shape or value: the program only reads them)."""

    def __init__(self, binding: OptimizerBinding, noise: NoiseSource, acc_dtype: Callable[[], torch.dtype]):
        self.binding, self.noise, self.acc_dtype = binding, noise, acc_dtype
        self._zeros: dict[tuple, torch.Tensor] = {}
        self._scalars: dict[tuple, torch.Tensor] = {}

    def for_program(self, config: DPConfig, inputs: list[tuple[str, object]], batch_size: int,
                    draw_noise: bool = True, partial: list[torch.Tensor] | None = None) -> list:
        """One value per entry of ``inputs`` for a step of ``batch_size`` samples (``draw_noise=False``: zeros in
        place of the noise, for compiling without drawing)."""
        ref = self.binding.params[0]
        acc_dtype = self.acc_dtype()  # once per step: it reads every parameter's dtype
        likes = [self.sum_like(key, acc_dtype) for kind, key in inputs if kind == InputKind.NOISE]
        noises = iter(self.noise.draw_many(config, likes) if draw_noise and likes else likes)
        values = []
        for kind, key in inputs:
            if kind == InputKind.REDUCE_INPUT:
                values.extend(self.reduce_inputs(config, 1))
            elif kind == InputKind.NOISE:
                values.append(next(noises))
            elif kind == InputKind.PARTIAL:
                values.append(partial[key] if partial is not None else self.sum_like(key, acc_dtype))
            elif kind == InputKind.COUNT:
                values.append(self.scalar(float(batch_size), ref))
            elif kind == InputKind.SCALE:
                values.append(self.scalar(config.scale(batch_size), ref))
            elif kind == InputKind.DOT_GRAD:
                values.append(self.binding.dot_grads[key])
            else:
                values.append(key)
        return values

    def sum_like(self, j: int, acc_dtype: torch.dtype) -> torch.Tensor:
        """Zeros shaped like the clipped sum of the ``j``-th parameter (float32 for a bfloat16 parameter, in
        ``acc_dtype``'s precision at least). Only read (the noise's template, a program input the graph adds): one
        tensor per shape serves every step."""
        p = self.binding.params[j]
        key = (p.shape, sum_dtype(p.dtype, acc_dtype), p.device)
        zeros = self._zeros.get(key)
        if zeros is None:
            zeros = self._zeros[key] = torch.zeros(key[0], dtype=key[1], device=key[2])
        return zeros

    def scalar(self, value: float, ref: torch.Tensor) -> torch.Tensor:
        """``value`` as a 0-d tensor like ``ref``; only read by the program, so kept per value (a few batch sizes)."""
        key = (value, ref.dtype, ref.device)
        t = self._scalars.get(key)
        if t is None:
            if len(self._scalars) > 256:  # Poisson batch sizes: keep the cache small
                self._scalars.clear()
            t = self._scalars[key] = torch.tensor(value, dtype=ref.dtype, device=ref.device)
        return t

    def reduce_inputs(self, config: DPConfig, count: int) -> list[torch.Tensor]:
        """The per-sample graph's own run-time inputs: the clipping bounds under adaptive clipping."""
        if count == 0:
            return []
        ref = self.binding.params[0]
        return [torch.tensor(config.bounds, dtype=self.acc_dtype(), device=ref.device)]
