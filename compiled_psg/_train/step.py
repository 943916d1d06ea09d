"""``compile_step``: one DP-SGD step (clipped per-sample sum, Gaussian noise, optimizer update), compiled.

The forward and backward run as compiled_psg's rewritten graph with the ``clip_sum`` reduction, so the
per-sample gradients are never materialized; the noise, the scaling and ``optimizer.step()`` run as one
``torch.compile``d function (full graph: the optimizer's own ``step`` is called without its graph-breaking
wrappers; with step hooks, or an optimizer Dynamo cannot take whole, it compiles with graph breaks). That
function only sees parameter-shaped tensors, so neither graph recompiles when the batch size changes (Poisson
sampling draws a different one every step). The first update runs eagerly, so that the optimizer's lazily
created state exists before the compiled function first sees it.
"""

from __future__ import annotations

import math
import time
import types
from collections.abc import Callable

import torch
import torch.nn as nn

from .._reduce.reductions import clip_sum
from . import distributed as dist_utils
from .dp import gaussian_like


def _raw_step(optimizer: torch.optim.Optimizer) -> Callable:
    """The optimizer's own ``step``, without the hook and ``no_grad`` wrappers (their graph breaks would stop
    a full-graph compile; we call it under ``no_grad`` ourselves)."""
    fn = type(optimizer).step
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    from torch.optim import optimizer as optim_module

    return bool(getattr(optimizer, "_optimizer_step_pre_hooks", None)
                or getattr(optimizer, "_optimizer_step_post_hooks", None)
                or getattr(optim_module, "_global_optimizer_pre_hooks", None)
                or getattr(optim_module, "_global_optimizer_post_hooks", None))


def _fresh(fn: Callable) -> Callable:
    """A copy of ``fn`` with its own code object, so that Dynamo keeps a separate cache for each step."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class DPStep:
    """The callable ``compile_step`` returns: ``step(*batch) -> loss``. See ``compile_step``."""

    def __init__(self, loss_fn: Callable, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 max_grad_norm: float | None = None, noise_multiplier: float = 0.0,
                 expected_batch_size: float | None = None, loss_reduction: str = "mean",
                 secure_rng: bool = False,
                 backend: str = "inductor", generator: torch.Generator | None = None, in_dims=0,
                 update_backend: str | None = None, distributed: bool | None = None):
        from .._api import per_sample

        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if noise_multiplier < 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
        if max_grad_norm is None and noise_multiplier > 0:
            raise ValueError("noise needs a clipping bound: pass max_grad_norm (the noise std is "
                             "noise_multiplier * max_grad_norm)")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}")
        if expected_batch_size is not None and not expected_batch_size > 0:
            raise ValueError(f"expected_batch_size must be positive, got {expected_batch_size}")
        self.model = model
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch_size = expected_batch_size
        self.loss_reduction = loss_reduction
        self.secure_rng = secure_rng
        self.generator = generator
        self.distributed = dist_utils.is_distributed() if distributed is None else distributed
        bound = math.inf if max_grad_norm is None else float(max_grad_norm)
        self.per_sample = per_sample(model, in_dims=in_dims, reduce=clip_sum(bound, return_norms=True),
                                     backend=backend)(loss_fn)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        if self.distributed:
            dist_utils.broadcast_parameters(self.params)
        # Noise is drawn eagerly, outside the compiled update: torch.randn is vectorized, while the compiled
        # (philox) generator on CPU cost ~20 ms per step for a 670k-parameter MLP; rank 0 alone draws it.
        self.noise_outside = self.noise_multiplier > 0
        self.noise_inside = False
        self.update_backend = update_backend or backend
        self.update_compiles = 0
        self.update_fullgraph = True
        self._state_ready = False
        self.compile_seconds = 0.0
        self.last_batch_size = 0
        self.last_norms: torch.Tensor | None = None
        self._update = self._compile_update(fullgraph=not _has_step_hooks(optimizer))

    @property
    def noise_std(self) -> float:
        return self.noise_multiplier * (self.max_grad_norm or 0.0)

    # --- the compiled update -------------------------------------------------------------------------------
    def _backend(self, gm, example_inputs):
        self.update_compiles += 1
        return torch._dynamo.lookup_backend(self.update_backend)(gm, example_inputs)

    def _compile_update(self, fullgraph: bool):
        params, opt = self.params, self.optimizer
        step_fn = _raw_step(opt) if fullgraph else type(opt).step

        if self.noise_inside:
            def update(grads, std, scale):
                for p, g in zip(params, grads, strict=True):
                    p.grad.copy_((g + std * torch.randn_like(g)) * scale)
                step_fn(opt)
        else:
            def update(grads, scale):
                for p, g in zip(params, grads, strict=True):
                    p.grad.copy_(g * scale)
                step_fn(opt)

        self.update_fullgraph = fullgraph
        self._update_eager = update
        return torch.compile(_fresh(update), fullgraph=fullgraph, backend=self._backend)

    def _run_update(self, grads, scale: float):
        for p in self.params:
            if p.grad is None or p.grad.shape != p.shape:
                p.grad = torch.zeros_like(p)
        ref = self.params[0]
        args = [grads]
        if self.noise_inside:
            args.append(torch.tensor(self.noise_std, dtype=ref.dtype, device=ref.device))
        args.append(torch.tensor(scale, dtype=ref.dtype, device=ref.device))
        with torch.no_grad():
            if not self._state_ready:
                # The first update runs eagerly: optimizers create their state (momentum buffers, Adam's
                # moments) lazily, and a compiled first call would be a graph of its own.
                self._state_ready = True
                return self._update_eager(*args)
            try:
                return self._update(*args)
            except torch._dynamo.exc.Unsupported:
                if not self.update_fullgraph:
                    raise
                # an optimizer Dynamo cannot take whole: compile it with graph breaks instead
                self._update = self._compile_update(fullgraph=False)
                return self._update(*args)

    # --- one step ------------------------------------------------------------------------------------------
    def __call__(self, *batch) -> torch.Tensor:
        f = self.per_sample
        # contiguous copies of strided views (x[rank::world]): the capture assumes dense batch inputs
        batch = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in batch)
        before = (f.captures, f.compile_seconds)
        start = time.perf_counter()
        loss, per_sample_losses, (sums, norms) = f.with_losses(*batch)
        if (f.captures, f.compile_seconds) != before:
            self.compile_seconds += time.perf_counter() - start
        batch_size = per_sample_losses.shape[0]
        self.last_norms = norms
        grads = [sums[n] for n in self.names]
        if self.noise_outside and dist_utils.rank() == 0:
            grads = [g + gaussian_like(g, self.noise_std, secure=self.secure_rng, generator=self.generator)
                     for g in grads]
        if self.distributed:
            count = torch.tensor([float(batch_size)], dtype=torch.float64, device=grads[0].device)
            *grads, count = dist_utils.all_reduce_sum(grads + [count])
            batch_size = int(round(count.item()))
        self.last_batch_size = batch_size
        if self.loss_reduction == "sum":
            scale = 1.0
        elif self.expected_batch_size is not None:
            scale = 1.0 / self.expected_batch_size
        else:
            scale = 1.0 / max(batch_size, 1)
        compiles = self.update_compiles
        start = time.perf_counter()
        self._run_update(grads, scale)
        if self.update_compiles != compiles:
            self.compile_seconds += time.perf_counter() - start
        return loss


def compile_step(loss_fn: Callable, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 max_grad_norm: float | None = None, noise_multiplier: float = 0.0,
                 expected_batch_size: float | None = None, loss_reduction: str = "mean",
                 secure_rng: bool = False,
                 backend: str = "inductor", generator: torch.Generator | None = None, in_dims=0,
                 update_backend: str | None = None, distributed: bool | None = None) -> DPStep:
    """Build ``step(*batch) -> loss``: one (DP-)SGD step of ``optimizer`` on ``model``'s parameters.

    ``loss_fn(*batch)`` computes the loss of a batch with ``model`` (batched along ``in_dims``). A step
    computes ``S = sum_i min(1, C / ||g_i||) g_i`` over the batch's per-sample gradients ``g_i``
    (``C = max_grad_norm``; None: no clipping, ``S`` is the plain sum), adds Gaussian noise
    ``N(0, sigma^2 C^2)`` once (``sigma = noise_multiplier``), divides by ``expected_batch_size``
    (``loss_reduction="mean"``; None: the actual batch size; ``"sum"``: no division), writes the result to
    ``p.grad`` and runs ``optimizer.step()``. Parameters are updated in place. With Poisson sampling pass
    ``expected_batch_size = q * N``: dividing by the actual batch size would reveal it.

    The noise comes from torch's global generator, from ``generator`` when one is given, or from ``os.urandom``
    with ``secure_rng=True``; it is drawn outside the compiled update.
    ``backend`` compiles the per-sample graph (``"inductor"`` or ``"eager"``); ``update_backend`` (default:
    the same) is the ``torch.compile`` backend of the update. Under an initialized ``torch.distributed``
    process group (``distributed=None`` detects it) the clipped sums are all-reduced and rank 0 alone adds
    the noise; see ``compiled_psg._train.distributed``.

    The returned object also has ``per_sample`` (the compiled per-sample function; ``per_sample.captures``),
    ``update_compiles``, ``compile_seconds``, ``last_batch_size`` and ``last_norms`` (the unclipped norms).
    Learning rates changed by a scheduler should be tensors (``lr=torch.tensor(0.1)``), or every new value
    recompiles the update.
    """
    return DPStep(loss_fn, model, optimizer, max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
                  expected_batch_size=expected_batch_size, loss_reduction=loss_reduction,
                  secure_rng=secure_rng, backend=backend, generator=generator, in_dims=in_dims,
                  update_backend=update_backend, distributed=distributed)
