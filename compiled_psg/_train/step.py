"""``compile_step``: one (DP-)SGD training step, forward to optimizer update, as ONE compiled program.

The program is the per-sample graph with the reduction (``clip_sum``: per-sample gradients are never
materialized) followed by the noise, the all-reduce across ranks (under ``torch.distributed``), the scaling
and the optimizer's own update, spliced into one FX graph (``fuse.py``) and compiled once by Inductor for every
batch size from 2 up (a batch of one compiles the same graph once more). The update graph is captured from the
optimizer's ``step`` by Dynamo and AOT autograd (``update_graph.py``), so any ``torch.optim`` optimizer works.

The noise itself is drawn outside the program (``torch.randn``, or ``os.urandom`` with ``secure_rng``) and
enters as an input: the secure source cannot run inside a graph, and Inductor's CPU random generator was
slower than ``torch.randn`` here.

The first step runs eagerly (the rewritten graph without a compiler, then ``optimizer.step()``): optimizers
create their state lazily, and the program reads that state. The program is built and compiled at the end of
that first step. Empty batches (Poisson sampling) also take the eager path: a step with noise only. An
optimizer with step hooks, or one Dynamo cannot trace whole, keeps the eager update after the compiled
per-sample graph (``step.fused`` is False, ``step.fallback_reason`` says why, and a warning is logged).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch
import torch.nn as nn

from .._compile.run import CompiledPerSample
from .._reduce.reductions import ClipSum, Reduction, clip_sum
from . import distributed as dist_utils
from . import update_graph
from .dp import gaussian_like
from .fuse import StepProgram, fuse_step

log = logging.getLogger("compiled_psg")


def _resolve_reduction(reduce: Reduction | None, max_grad_norm: float | None) -> tuple[Reduction, float | None]:
    """The reduction the step runs (with the per-sample norms when it clips) and the clipping bound."""
    if isinstance(reduce, ClipSum):
        if max_grad_norm is not None and float(max_grad_norm) != float(reduce.max_norm):
            raise ValueError(f"max_grad_norm={max_grad_norm} contradicts reduce=clip_sum({reduce.max_norm}); "
                             "give the bound once")
        return clip_sum(reduce.max_norm, return_norms=True), float(reduce.max_norm)
    if reduce is None:
        bound = math.inf if max_grad_norm is None else float(max_grad_norm)
        return clip_sum(bound, return_norms=True), max_grad_norm
    if not isinstance(reduce, Reduction):
        raise TypeError(f"reduce must be a compiled_psg reduction (psg.clip_sum(C), psg.custom(...)) or None, "
                        f"got {type(reduce).__name__}")
    if max_grad_norm is not None:
        raise ValueError("max_grad_norm applies to the default clip_sum reduction; with a custom reduce, clip "
                         "inside it")
    return reduce, None


class DPStep:
    """The callable ``compile_step`` returns: ``step(*batch) -> loss``. See ``compile_step``."""

    def __init__(self, loss_fn: Callable, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 reduce: Reduction | None = None, max_grad_norm: float | None = None,
                 noise_multiplier: float = 0.0, expected_batch_size: float | None = None,
                 loss_reduction: str = "mean", secure_rng: bool = False, backend: str = "inductor",
                 generator: torch.Generator | None = None, in_dims=0, distributed: bool | None = None):
        from .._api import per_sample

        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if noise_multiplier < 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}")
        reduction, bound = _resolve_reduction(reduce, max_grad_norm)
        if (bound is None or math.isinf(bound)) and noise_multiplier > 0:
            raise ValueError("noise needs a clipping bound: pass max_grad_norm or reduce=psg.clip_sum(C) (the "
                             "noise std is noise_multiplier * C)")
        if expected_batch_size is not None and not expected_batch_size > 0:
            raise ValueError(f"expected_batch_size must be positive, got {expected_batch_size}")
        self.model = model
        self.optimizer = optimizer
        self.max_grad_norm = bound
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch_size = expected_batch_size
        self.loss_reduction = loss_reduction
        self.secure_rng = secure_rng
        self.generator = generator
        self.distributed = dist_utils.is_distributed() if distributed is None else distributed
        self.per_sample = per_sample(model, in_dims=in_dims, reduce=reduction, backend=backend)(loss_fn)
        self.fused = True
        self.fallback_reason: str | None = None
        self._update: update_graph.UpdateGraph | None = None
        self._programs: dict[int, tuple[StepProgram, CompiledPerSample]] = {}
        self._dot_grads_by_param: dict[int, torch.Tensor] = {}
        self._bound: tuple = ()
        self._bind()
        if self.distributed:
            dist_utils.broadcast_parameters(self.params)
        self._state_ready = False
        self.program_builds = 0
        self.compile_seconds = 0.0
        self.last_batch_size = 0
        self.last_norms: torch.Tensor | None = None

    @property
    def noise_std(self) -> float:
        return self.noise_multiplier * (self.max_grad_norm or 0.0)

    @property
    def programs(self) -> int:
        """Compiled programs per step: 1 (fused) or 2 (compiled per-sample graph, eager update)."""
        return 1 if self.fused else 2

    @property
    def graph(self) -> torch.fx.GraphModule | None:
        """The fused step program (after the first step), for inspection: ``print(step.graph.code)``."""
        return next(reversed(self._programs.values()))[0].gm if self._programs else None

    @property
    def compiles(self) -> int:
        """Graphs compiled so far: the step program (any batch size, and a batch of one), plus the per-sample
        graph when the update runs eagerly."""
        return self.per_sample.compiles + sum(c.compiles for _, c in self._programs.values())

    def _bind(self) -> None:
        """Which of the optimizer's parameters the step trains (those that require grad), and their names; redone
        when the optimizer's parameters or their ``requires_grad`` change (``add_param_group``, freezing)."""
        flat = update_graph.flat_params(self.optimizer)
        bound = tuple((id(p), p.requires_grad) for p in flat)
        if bound == self._bound:
            return
        trainable = {id(p): n for n, p in self.model.named_parameters() if p.requires_grad}
        self.trained = [j for j, p in enumerate(flat) if p.requires_grad]
        self.params = [flat[j] for j in self.trained]
        strangers = [tuple(p.shape) for p in self.params if id(p) not in trainable]
        if strangers:
            raise ValueError(f"the optimizer updates tensors of shapes {strangers} that are not parameters of "
                             "the model. Fix: build the optimizer on model.parameters()")
        self.names = [trainable[id(p)] for p in self.params]
        for p in flat:  # a parameter frozen since: drop the .grad the step left, as zero_grad() would
            if not p.requires_grad and p.grad is not None and p.grad is self._dot_grads_by_param.get(id(p)):
                p.grad = None
        # what p.grad holds after a step; kept per parameter across rebinds
        self._dot_grads = [self._dot_grads_by_param.setdefault(id(p), torch.zeros_like(p)) for p in self.params]
        if self.distributed and len({p.dtype for p in self.params}) > 1:
            self._fall_back("parameters of several dtypes do not share one all-reduce buffer")
        self._bound = bound
        self._update = None
        self._programs.clear()

    def _fall_back(self, reason: str) -> None:
        self.fused, self.fallback_reason = False, reason
        log.warning("compiled_psg: compile_step runs the optimizer update eagerly after the compiled per-sample "
                    "graph (two programs): %s", reason)

    def _scale(self, batch_size: int) -> float:
        if self.loss_reduction == "sum":
            return 1.0
        if self.expected_batch_size is not None:
            return 1.0 / self.expected_batch_size
        return 1.0 / max(batch_size, 1)

    def _install_dot_grads(self) -> None:
        for p, buffer in zip(self.params, self._dot_grads, strict=True):
            if p.grad is not buffer:
                p.grad = buffer

    # --- the fused program ---------------------------------------------------------------------------------
    def _program_for(self, entry: CompiledPerSample) -> tuple[StepProgram, CompiledPerSample] | None:
        """The program for this per-sample graph; rebuilt when the optimizer changed (see update_graph)."""
        if update_graph.has_step_hooks(self.optimizer):
            self._fall_back("the optimizer has step hooks, which run in Python")
            return None
        if self._update is not None and self._update.signature != update_graph.signature(self.optimizer,
                                                                                          self.trained):
            log.warning("compiled_psg: the optimizer's hyperparameters or state tensors changed; recompiling the "
                        "step (use tensor hyperparameters, lr=torch.tensor(0.1), to change them without this)")
            self._update = None
            self._programs.clear()
        if self._update is None:
            self._install_dot_grads()
            try:
                self._update = update_graph.capture_update(self.optimizer, self.trained, self.params[0].dtype)
            except update_graph.StateMissing:  # e.g. the state was cleared: one eager step creates it again
                self._state_ready = False
                return None
            except Exception as e:  # noqa: BLE001 -- any failure to trace the step: keep it eager, and say so
                self._fall_back(f"{type(self.optimizer).__name__}.step could not be captured whole "
                                f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]})")
                return None
        if id(entry) not in self._programs:
            divide_by_count = self.loss_reduction == "mean" and self.expected_batch_size is None
            program = fuse_step(entry.rewritten, self._update, self.params, self.names,
                                noisy=self.noise_std > 0 and dist_utils.rank() == 0,
                                group_name=dist_utils.group_name() if self.distributed else None,
                                divide_by_count=divide_by_count)
            compiled = CompiledPerSample(entry.rewritten, entry.backend, graph=program.gm)
            self._programs[id(entry)] = (program, compiled)
            self.program_builds += 1
        return self._programs[id(entry)]

    def _extra_inputs(self, program: StepProgram, batch_size: int, draw_noise: bool = True) -> list:
        ref = self.params[0]
        extra = []
        for kind, key in program.inputs:
            if kind == "noise":
                extra.append(self._noise(self.params[key]) if draw_noise else torch.zeros_like(self.params[key]))
            elif kind == "count":
                extra.append(torch.tensor(float(batch_size), dtype=ref.dtype, device=ref.device))
            elif kind == "scale":
                extra.append(torch.tensor(self._scale(batch_size), dtype=ref.dtype, device=ref.device))
            elif kind == "dot_grad":
                extra.append(self._dot_grads[key])
            else:
                extra.append(key)
        return extra

    def _run_fused(self, program: StepProgram, compiled: CompiledPerSample, params: dict, args: tuple,
                   batch_size: int) -> torch.Tensor:
        self._install_dot_grads()
        outputs = dict(zip(program.outputs, compiled.run(params, args, batch_size,
                                                         self._extra_inputs(program, batch_size)), strict=True))
        self.last_norms = outputs.get("norms")
        count = outputs.get("global_count")
        self.last_batch_size = batch_size if count is None else int(round(count.item()))
        return outputs["loss"]

    # --- the eager path: first step, empty batches, fallbacks ----------------------------------------------
    def _noise(self, like: torch.Tensor) -> torch.Tensor:
        return gaussian_like(like, self.noise_std, secure=self.secure_rng, generator=self.generator)

    def _run_eager_update(self, sums: dict, batch_size: int) -> None:
        grads = [sums[n] for n in self.names]
        if self.noise_std > 0 and dist_utils.rank() == 0:
            grads = [g + self._noise(g) for g in grads]
        if self.distributed:
            count = torch.tensor(float(batch_size), dtype=grads[0].dtype, device=grads[0].device)
            grads, count = dist_utils.all_reduce_flat(grads, count)
            batch_size = int(round(count.item()))
        self.last_batch_size = batch_size
        scale = self._scale(batch_size)
        self._install_dot_grads()
        with torch.no_grad():
            for buffer, g in zip(self._dot_grads, grads, strict=True):
                buffer.copy_(g * scale)
            self.optimizer.step()
        self._state_ready = True

    # --- one step ------------------------------------------------------------------------------------------
    def __call__(self, *batch) -> torch.Tensor:
        f = self.per_sample
        # contiguous copies of strided views (x[rank::world]): the capture assumes dense batch inputs
        batch = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in batch)
        before = (f.captures, self.program_builds, self.compiles)
        start = time.perf_counter()
        loss = self._step(batch)
        if (f.captures, self.program_builds, self.compiles) != before:  # the call's time is compile time
            self.compile_seconds += time.perf_counter() - start
        return loss


    def _step(self, batch: tuple) -> torch.Tensor:
        from .._api import batch_dims_of

        _, batch_size = batch_dims_of(batch, self.per_sample.in_dims)
        self._bind()
        if batch_size == 0:  # a step of noise alone (Poisson sampling draws empty batches)
            loss, _, result = self.per_sample.with_losses(*batch)
            self.last_norms = result[1] if isinstance(result, tuple) else None
            self._run_eager_update(result[0] if isinstance(result, tuple) else result, 0)
            return loss
        entry, params, args, batch_size = self.per_sample.compiled_for(*batch)
        if self.fused and self._state_ready:
            built = self._program_for(entry)
            if built is not None:
                return self._run_fused(*built, params, args, batch_size)
        # the first step (optimizer state does not exist yet) runs the rewritten graph without compiling it
        runner = entry if not self.fused else CompiledPerSample(entry.rewritten, "eager")  # no double compile
        loss, _, result = runner(params, args, batch_size)
        sums, self.last_norms = result if isinstance(result, tuple) else (result, None)
        self._run_eager_update(sums, batch_size)
        if self.fused:  # build and compile the program now, so that the first call carries the compile time
            built = self._program_for(entry)
            if built is not None:
                program, compiled = built
                compiled.prepare(params, args, max(batch_size, 2),
                                 self._extra_inputs(program, batch_size, draw_noise=False))
        return loss


def compile_step(loss_fn: Callable, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 reduce: Reduction | None = None, max_grad_norm: float | None = None,
                 noise_multiplier: float = 0.0, expected_batch_size: float | None = None,
                 loss_reduction: str = "mean", secure_rng: bool = False, backend: str = "inductor",
                 generator: torch.Generator | None = None, in_dims=0,
                 distributed: bool | None = None) -> DPStep:
    """Build ``step(*batch) -> loss``: one (DP-)SGD step of ``optimizer`` on ``model``'s parameters, compiled as
    one program (forward, rewritten backward, reduction, noise, all-reduce, optimizer update).

    ``loss_fn(*batch)`` computes the loss of a batch with ``model`` (batched along ``in_dims``). A step
    computes ``S = sum_i min(1, C / ||g_i||) g_i`` over the batch's per-sample gradients ``g_i``
    (``reduce=psg.clip_sum(C)``, or ``max_grad_norm=C``; neither: no clipping, ``S`` is the plain sum), adds
    Gaussian noise ``N(0, sigma^2 C^2)`` once (``sigma = noise_multiplier``), divides by
    ``expected_batch_size`` (``loss_reduction="mean"``; None: the actual batch size; ``"sum"``: no division),
    writes the result to ``p.grad`` and applies the optimizer's update. Parameters are updated in place. With
    Poisson sampling pass ``expected_batch_size = q * N``: dividing by the actual batch size would reveal it.
    Another reduction that gives one tensor per parameter (``psg.custom``) replaces ``S``.

    The noise comes from torch's global generator, from ``generator`` when one is given, or from ``os.urandom``
    with ``secure_rng=True``. ``backend``: ``"inductor"`` or ``"eager"`` (the same fused graph, op by op).
    Under an initialized ``torch.distributed`` process group (``distributed=None`` detects it) the program
    all-reduces the clipped sums and rank 0 alone adds the noise; see ``compiled_psg._train.distributed``.

    The returned object also has ``per_sample`` (``per_sample.captures``), ``fused``/``programs``/
    ``fallback_reason``, ``program_builds``, ``compile_seconds``, ``last_batch_size`` and ``last_norms`` (the
    unclipped per-sample norms). Python-number hyperparameters are constants of the program: changing one
    (a scheduler on ``lr=0.1``) rebuilds it; ``lr=torch.tensor(0.1)`` changes without rebuilding.
    """
    return DPStep(loss_fn, model, optimizer, reduce=reduce, max_grad_norm=max_grad_norm,
                  noise_multiplier=noise_multiplier, expected_batch_size=expected_batch_size,
                  loss_reduction=loss_reduction, secure_rng=secure_rng, backend=backend, generator=generator,
                  in_dims=in_dims, distributed=distributed)
