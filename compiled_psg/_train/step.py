"""``compile_step``: one (DP-)SGD training step, forward to optimizer update, as ONE compiled program.

The program is the per-sample graph with the reduction (``clip_sum``: per-sample gradients are never
materialized) followed by the noise, the all-reduce across ranks (under ``torch.distributed``), the scaling
and the optimizer's own update, spliced into one FX graph (``fuse.py``) and compiled once by Inductor for every
batch size from 2 up (a batch of one compiles the same graph once more). The update graph is captured from the
optimizer's ``step`` by Dynamo and AOT autograd (``update_graph.py``), so any ``torch.optim`` optimizer works.

The noise itself is drawn outside the program into one buffer that every step fills again
(``dp.gaussian_many``: on CPU in float32 the native AES-CTR stream keyed from the generator, ``native_noise``;
else torch's generators, or ``os.urandom`` with ``secure_rng``) and enters as an input: the secure source cannot
run inside a graph, a seeded ``torch.Generator`` keeps runs resumable, and on CPU Inductor's in-graph generator
was 2.9-5.6x slower than ``torch.randn`` plus a compiled add for 1e5 to 1e7 parameters
(``python -m benchmarks.noise``; 2 cores, quiet machine).

The first step runs eagerly (the rewritten graph without a compiler, then ``optimizer.step()``): optimizers
create their state lazily, and the program reads that state. The program is built and compiled at the end of
that first step. Empty batches (Poisson sampling) also take the eager path: a step with noise only. An
optimizer with step hooks, or one Dynamo cannot trace whole, keeps the eager update after the compiled
per-sample graph (``step.fused`` is False, ``step.fallback_reason`` says why, and a warning is logged).

``DPStep`` composes small parts: a frozen ``DPConfig`` (C, sigma, the divisor, the loss reduction, the clipping
mode; ``config.py``), the ``OptimizerBinding`` (the trained parameters and their ``.grad`` buffers;
``binding.py``), the ``ProgramCache`` (fuse and compile; ``programs.py``) and the eager update with its
``NoiseSource`` (``eager.py``). The step itself chooses the per-sample graph (one per clipping bound), splits
micro-batches, and runs either the program or the eager path.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from .._compile.run import CompiledPerSample
from .._errors import DPConfigError
from .._reduce.reductions import ClipSum, DPClip, Gram, Norms, PerSampleGrads, Reduction, sum_dtype
from . import distributed as dist_utils
from . import update_graph
from .binding import OptimizerBinding
from .config import DPConfig
from .eager import NoiseSource, eager_update
from .fuse import StepProgram
from .programs import ProgramCache
from .release import refuse_private_writes

log = logging.getLogger("compiled_psg")


def _resolve_reduction(reduce: Reduction | None, max_grad_norm: float | None) -> tuple[Reduction | None, float | None]:
    """The user's custom reduction (None: the default clip_sum) and the clipping bound."""
    if isinstance(reduce, ClipSum):
        if max_grad_norm is not None and float(max_grad_norm) != float(reduce.max_norm):
            raise DPConfigError(f"max_grad_norm={max_grad_norm} contradicts reduce=clip_sum({reduce.max_norm}); "
                                "give the bound once")
        return None, float(reduce.max_norm)
    if reduce is None:
        return None, max_grad_norm
    if not isinstance(reduce, Reduction):
        raise DPConfigError(f"reduce must be a compiled_psg reduction (psg.clip_sum(C), psg.custom(...)) or None, "
                            f"got {type(reduce).__name__}")
    if isinstance(reduce, Norms | Gram | PerSampleGrads):
        raise DPConfigError(f"reduce={type(reduce).__name__.lower()}() gives no gradient per parameter for the "
                            "optimizer. Fix: reduce=psg.clip_sum(C), or psg.custom(...) returning {name: tensor "
                            "shaped like the parameter}")
    return reduce, None


def _split_result(result, names: list[str], params: list[torch.Tensor]) -> tuple[dict, torch.Tensor | None]:
    """``(sums, norms)`` from a reduction's result, checked: the optimizer needs one tensor per parameter."""
    sums, norms = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
    bad = (not isinstance(sums, dict) or any(not isinstance(sums.get(n), torch.Tensor) or sums[n].shape != p.shape
                                             for n, p in zip(names, params, strict=True)))
    if bad:
        raise DPConfigError("the reduction must give {name: tensor shaped like the parameter} for every trained "
                            f"parameter ({names}), got {type(sums).__name__}. Fix: reduce=psg.clip_sum(C) or a "
                            "psg.custom(...) reduction of that form")
    return sums, norms


def _add_into(total: list[torch.Tensor] | None, sums: dict, names: list[str]) -> list[torch.Tensor]:
    if total is None:
        return [sums[n].clone() for n in names]
    for t, n in zip(total, names, strict=True):
        t.add_(sums[n])
    return total


def _refuse_ambient_autocast() -> None:
    """A step called inside ``torch.autocast`` would run its whole program under it: the clip factors, the
    clipped sum (a matmul, autocast to bfloat16) and the optimizer update, op by op on the eager backend, so the
    clip bound would hold only to bfloat16's rounding. Autocast belongs inside the loss, where it is captured."""
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            raise DPConfigError(f"the step was called inside torch.autocast({device!r}): the clipping, the noise and "
                                "the optimizer update would run under it too, and the clipped sum in low precision. "
                                "Fix: call the step outside autocast and enter it inside the loss function: "
                                f"def loss_fn(x, y): with torch.autocast({device!r}, dtype=torch.bfloat16): "
                                "out = model(x); return F.cross_entropy(out.float(), y)")


def _combine_losses(losses: list[torch.Tensor], sizes: list[int], loss_reduction: str) -> torch.Tensor:
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


class DPStep:
    """The callable ``compile_step`` returns: ``step(*batch) -> loss``. See ``compile_step``.

    ``max_grad_norm``, ``noise_multiplier`` and ``expected_batch_size`` (the fields of ``config``, a frozen
    ``DPConfig``) may be assigned between steps: they are validated, and the next step uses them (a new ``C``
    recaptures the per-sample graph once per bound, since ``C`` is a constant of that graph; switching noise on
    or off selects the program with or without the noise input). ``last_config`` is what the last step used.
    The other fields of ``config`` (the clipping variants' options, e.g. ``target_unclipped_quantile``) change
    with ``step.config = step.config.replace(...)``; the clipping mode itself is fixed. Under adaptive clipping
    the step sets ``max_grad_norm`` itself after every step.
    """

    def __init__(self, loss_fn: Callable, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 reduce: Reduction | None = None, max_grad_norm: float | None = None,
                 noise_multiplier: float = 0.0, expected_batch_size: float | None = None,
                 loss_reduction: str = "mean", secure_rng: bool = False, backend: str = "inductor",
                 generator: torch.Generator | None = None, in_dims=0, distributed: bool | None = None,
                 max_physical_batch_size: int | None = None, clipping: str = "flat",
                 public_buffers: Sequence[str] = (), **clipping_options):
        from .._api import per_sample

        custom, bound = _resolve_reduction(reduce, max_grad_norm if clipping == "flat" else None)
        if clipping != "flat":
            if reduce is not None:
                raise DPConfigError(f"clipping={clipping!r} is the step's own reduction: pass max_grad_norm, not "
                                    "reduce=")
            bound = max_grad_norm
        self._stalled_bound: str | None = None  # why adaptive clipping cannot go on (_adapt_bound)
        self._config = DPConfig(bound, noise_multiplier, expected_batch_size, loss_reduction,
                                "custom" if custom is not None else clipping, **clipping_options)
        self._custom_reduce = custom
        self.public_buffers = _public_buffers(model, public_buffers)
        self.max_physical_batch_size = max_physical_batch_size
        self._new_per_sample = lambda reduction: per_sample(model, in_dims=in_dims, reduce=reduction,
                                                            backend=backend)(loss_fn)
        self._per_sample_fns: dict[Reduction, object] = {}
        self.model = model
        self.optimizer = optimizer
        self.backend = backend
        self.noise = NoiseSource(secure_rng, generator, native_likely=noise_multiplier > 0 and all(
            p.device.type == "cpu" and p.dtype != torch.float64 for p in model.parameters()))
        self.distributed = dist_utils.is_distributed() if distributed is None else distributed
        self.binding = OptimizerBinding(model, optimizer)
        self._warn_untrained()
        self.per_sample  # noqa: B018 -- the per-sample function of the initial config, checked now
        self.program_cache = ProgramCache(optimizer, self.binding, self.distributed)
        self._check_dtypes()
        self._eager_runners: dict[int, CompiledPerSample] = {}
        self._zeros: dict[tuple, torch.Tensor] = {}  # read-only program inputs: _sum_like's
        self._scalars: dict[tuple, torch.Tensor] = {}  # and _scalar's
        if self.distributed:
            dist_utils.broadcast_parameters(self.binding.params)
        self._state_ready = False
        self.compile_seconds = 0.0
        self.steps_taken = 0
        self.last_batch_size = 0
        self.last_norms: torch.Tensor | None = None
        self.last_config: DPConfig | None = None
        # the config of an update that began in the current call (noise drawn, the optimizer stepping): a call that
        # fails after it (e.g. compiling the program at the end of the first step) still released a noisy update,
        # which the accountant must count (``PrivateTraining.step``)
        self.released_config: DPConfig | None = None
        self.last_unclipped: float | None = None  # adaptive clipping: samples with norm <= C in the last step
        self.last_count_noise: float | None = None  # and the noise added to their (centred) count

    # --- settings: validated on assignment, used from the next step on --------------------------------------
    @property
    def config(self) -> DPConfig:
        return self._config

    @config.setter
    def config(self, value: DPConfig) -> None:
        if not isinstance(value, DPConfig):
            raise DPConfigError(f"config must be a DPConfig, got {type(value).__name__}")
        if value.clipping != self._config.clipping:
            raise DPConfigError(f"the clipping mode is fixed when the step is built ({self._config.clipping!r}), "
                                f"got {value.clipping!r}")
        self._config = value
        self._stalled_bound = None  # a new bound (or max_clipbound) from the user: adaptive clipping goes on

    @property
    def max_grad_norm(self) -> float | None:
        return self._config.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        self.config = self._config.replace(max_grad_norm=value)

    @property
    def noise_multiplier(self) -> float:
        return self._config.noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        self.config = self._config.replace(noise_multiplier=value)

    @property
    def expected_batch_size(self) -> float | None:
        return self._config.expected_batch_size

    @expected_batch_size.setter
    def expected_batch_size(self, value: float | None) -> None:
        self.config = self._config.replace(expected_batch_size=value)

    @property
    def loss_reduction(self) -> str:
        return self._config.loss_reduction

    @property
    def noise_std(self) -> float:
        """The noise std the next step adds to the clipped sum: the gradient's noise multiplier times the
        sensitivity (``noise_multiplier * max_grad_norm`` for flat clipping; see ``DPConfig``)."""
        return self._config.noise_std

    @property
    def clipping(self) -> str:
        """The clipping mode, fixed when the step is built."""
        return self._config.clipping

    @property
    def last_noise_multiplier(self) -> float | None:
        """The noise multiplier the last step used as one Gaussian mechanism (None before the first step), from
        the noise actually added (with adaptive clipping: the gradient's and the count's): what the accountant
        records."""
        return None if self.last_config is None else self.last_config.accounted_noise_multiplier

    @property
    def max_physical_batch_size(self) -> int | None:
        """Micro-batch size: a larger (logical) batch is processed in pieces of at most this many samples."""
        return self._max_physical_batch_size

    @max_physical_batch_size.setter
    def max_physical_batch_size(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise DPConfigError(f"max_physical_batch_size must be a positive int or None, got {value!r}")
        if value is not None and getattr(self, "_custom_reduce", None) is not None:
            # micro-batches' results are summed: right for a sum over samples only (not a mean, max, median)
            raise DPConfigError("max_physical_batch_size with a custom reduce=: the micro-batches' results would be "
                                "summed, which equals the whole batch's result only if the reduction is a sum over "
                                "samples. Fix: max_physical_batch_size=None, or reduce=psg.clip_sum(C) / "
                                "max_grad_norm=C")
        self._max_physical_batch_size = value

    # --- what was built ---------------------------------------------------------------------------------------
    def _acc_dtype(self) -> torch.dtype:
        """What norms, clip factors and clipped sums are computed in: float32, float64 for float64 models."""
        return torch.float64 if any(p.dtype == torch.float64 for p in self.binding.params) else torch.float32

    def _groups(self, config: DPConfig) -> tuple[tuple[str, ...], ...] | None:
        """The parameter groups of per-layer clipping (None: one group), checked against the trained ones."""
        names = list(self.binding.names)
        if config.clipping != "per_layer":
            # the norm covers what the optimizer updates (Opacus' semantics): one group of the trained names
            trainable = [n for n, p in self.model.named_parameters() if p.requires_grad]
            return None if names == trainable else (tuple(names),)
        if config.clip_groups is None:
            return tuple((n,) for n in names)
        listed = {n for g in config.clip_groups for n in g}
        missing, unknown = [n for n in names if n not in listed], sorted(listed - set(names))
        if missing or unknown:
            raise DPConfigError(f"clip_groups must name every trained parameter once: missing {missing}, not "
                                f"trained parameters {unknown}")
        return config.clip_groups

    def _reduction_for(self, config: DPConfig) -> Reduction:
        if config.clipping == "custom":
            return self._custom_reduce
        groups = self._groups(config)
        bounds = config.group_bounds(1 if groups is None else len(groups))
        if groups is not None and len(bounds) != len(groups):
            raise DPConfigError(f"clipping='per_layer': {len(bounds)} bounds in max_grad_norm for {len(groups)} "
                                f"groups of parameters ({[list(g) for g in groups]})")
        mode = {"adaptive": "flat"}.get(config.clipping, config.clipping)
        # adaptive: C changes every step, so it is an input of the graph instead of a constant
        return DPClip(mode, None if config.clipping == "adaptive" else bounds, groups, config.automatic_gamma,
                      self._acc_dtype(), config.memory_budget)

    def _per_sample_for(self, config: DPConfig):
        """The per-sample function of ``config``: one per clipping bound (``C`` is a constant of its graph, but
        an input under adaptive clipping)."""
        reduction = self._reduction_for(config)
        fn = self._per_sample_fns.get(reduction)
        if fn is None:
            if self._per_sample_fns:
                log.warning("compiled_psg: max_grad_norm changed to %s, a constant of the per-sample graph: "
                            "capturing and compiling the step for it (once per bound)", config.max_grad_norm)
            fn = self._per_sample_fns[reduction] = self._new_per_sample(reduction)
        return fn

    def prepare_call(self, f, batch: tuple):
        """``f.prepare_call(*batch)``, refused (``DPConfigError``) when the loss writes a parameter or a buffer
        not in ``public_buffers`` from the batch: the model would carry it out of the step un-noised
        (``release.py``). Before anything runs."""
        call = f.prepare_call(*batch)
        refuse_private_writes(call.entry.rewritten.captured, self.model, self.public_buffers)
        return call

    @property
    def per_sample(self):
        """The ``PerSampleFunction`` of the current settings (``per_sample.captures``)."""
        return self._per_sample_for(self._config)

    # the parts, under the names the step always had
    secure_rng = property(lambda self: self.noise.secure)
    generator = property(lambda self: self.noise.generator)
    params = property(lambda self: self.binding.params)
    names = property(lambda self: self.binding.names)
    trained = property(lambda self: self.binding.trained)
    fused = property(lambda self: self.program_cache.fused)
    fallback_reason = property(lambda self: self.program_cache.fallback_reason)
    program_builds = property(lambda self: self.program_cache.builds)

    @property
    def programs(self) -> int:
        """Compiled programs per step: 1 (fused) or 2 (compiled per-sample graph, eager update)."""
        return 1 if self.fused else 2

    @property
    def graph(self) -> torch.fx.GraphModule | None:
        """The fused step program last used (after the first step), for inspection: ``print(step.graph.code)``."""
        current = self.program_cache.current
        return None if current is None else current.gm

    @property
    def captures(self) -> int:
        """Captures of the loss so far, over every clipping bound used."""
        return sum(fn.captures for fn in self._per_sample_fns.values())

    @property
    def compiles(self) -> int:
        """Graphs compiled so far: the step program (any batch size, and a batch of one), plus the per-sample
        graph when the update runs eagerly or a logical batch is split into micro-batches."""
        return sum(fn.compiles for fn in self._per_sample_fns.values()) + self.program_cache.compiles

    def _check_dtypes(self) -> None:
        if self.distributed and len({p.dtype for p in self.binding.params}) > 1:
            self.program_cache.fall_back("parameters of several dtypes do not share one all-reduce buffer")

    def _bind(self) -> None:
        """Follow changes to the optimizer's parameters (``add_param_group``, freezing): new programs."""
        if self.binding.refresh():
            self.program_cache.clear()
            self._check_dtypes()
            self._warn_untrained()

    def _warn_untrained(self) -> None:
        trained = set(self.binding.names)
        untrained = [n for n, p in self.model.named_parameters() if p.requires_grad and n not in trained]
        if untrained:
            warnings.warn(f"parameters {untrained} require grad but the optimizer does not update them: the DP "
                          "step clips and noises the optimizer's parameters only, and leaves these as they are. "
                          "Fix: freeze them (requires_grad_(False)) or add them to the optimizer", stacklevel=3)

    # --- the fused program ---------------------------------------------------------------------------------
    def _program_for(self, entry: CompiledPerSample, config: DPConfig,
                     accumulate: bool) -> tuple[StepProgram, CompiledPerSample] | None:
        try:
            return self.program_cache.get(entry, config, accumulate)
        except update_graph.StateMissing:  # e.g. the state was cleared: one eager step creates it again
            self._state_ready = False
            return None

    def _extra_inputs(self, config: DPConfig, program: StepProgram, batch_size: int, draw_noise: bool = True,
                      partial: list[torch.Tensor] | None = None) -> list:
        ref = self.params[0]
        likes = [self._sum_like(key) for kind, key in program.inputs if kind == "noise"]
        noises = iter(self.noise.draw_many(config, likes) if draw_noise and likes else likes)
        extra = []
        for kind, key in program.inputs:
            if kind == "reduce_input":
                extra.extend(self._reduce_inputs(config, 1))
            elif kind == "noise":
                extra.append(next(noises))
            elif kind == "partial":
                extra.append(partial[key] if partial is not None else self._sum_like(key))
            elif kind == "count":
                extra.append(self._scalar(float(batch_size), ref))
            elif kind == "scale":
                extra.append(self._scalar(config.scale(batch_size), ref))
            elif kind == "dot_grad":
                extra.append(self.binding.dot_grads[key])
            else:
                extra.append(key)
        return extra

    def _sum_like(self, j: int) -> torch.Tensor:
        """Zeros shaped like the clipped sum of the ``j``-th parameter (float32 for a bfloat16 parameter). Only
        read (the noise's template, a program input the graph adds): one tensor per shape serves every step."""
        p = self.params[j]
        key = (p.shape, sum_dtype(p.dtype, self._acc_dtype()), p.device)
        zeros = self._zeros.get(key)
        if zeros is None:
            zeros = self._zeros[key] = torch.zeros(key[0], dtype=key[1], device=key[2])
        return zeros

    def _scalar(self, value: float, ref: torch.Tensor) -> torch.Tensor:
        """``value`` as a 0-d tensor like ``ref``; only read by the program, so kept per value (a few batch sizes)."""
        key = (value, ref.dtype, ref.device)
        t = self._scalars.get(key)
        if t is None:
            if len(self._scalars) > 256:  # Poisson batch sizes: keep the cache small
                self._scalars.clear()
            t = self._scalars[key] = torch.tensor(value, dtype=ref.dtype, device=ref.device)
        return t

    def _reduce_inputs(self, config: DPConfig, count: int) -> list[torch.Tensor]:
        """The per-sample graph's own run-time inputs: the clipping bounds under adaptive clipping."""
        if count == 0:
            return []
        ref = self.params[0]
        return [torch.tensor(config.bounds, dtype=self._acc_dtype(), device=ref.device)]

    def _run_per_sample(self, entry: CompiledPerSample, config: DPConfig, params: dict, args: tuple, size: int):
        """``(loss, per-sample losses, result)`` of the per-sample graph, fed its run-time inputs."""
        graph = entry.rewritten.rewritten.graph
        extra = sum(n.op == "placeholder" for n in graph.nodes) - len(entry.rewritten.roles)
        loss, losses, *flat = entry.run(params, args, size, self._reduce_inputs(config, extra))
        return loss, losses, pytree.tree_unflatten(list(flat), entry.rewritten.out_spec)

    def _run_fused(self, config: DPConfig, program: StepProgram, compiled: CompiledPerSample, params: dict,
                   args: tuple, physical_size: int, logical_size: int,
                   partial: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the program on the last micro-batch (``physical_size`` samples of ``logical_size``)."""
        self.binding.install()
        extra = self._extra_inputs(config, program, logical_size, partial=partial)
        self.released_config = config
        outputs = dict(zip(program.outputs, compiled.run(params, args, physical_size, extra), strict=True))
        count = outputs.get("global_count")
        self.last_batch_size = logical_size if count is None else int(round(count.item()))
        return outputs["loss"], outputs.get("norms")

    # --- the eager path: first step, empty batches, fallbacks ----------------------------------------------
    def _run_eager_update(self, config: DPConfig, grads: list[torch.Tensor], batch_size: int) -> None:
        self.released_config = config
        self.last_batch_size = eager_update(config, grads, batch_size, self.binding, self.noise, self.distributed)
        self._state_ready = True

    def _eager_runner(self, entry: CompiledPerSample) -> CompiledPerSample:
        """The rewritten graph op by op for the first step (the program compiles at its end: no double
        compile); the compiled per-sample graph itself when the update runs eagerly anyway."""
        if not self.fused:
            return entry
        if id(entry) not in self._eager_runners:
            self._eager_runners[id(entry)] = CompiledPerSample(entry.rewritten, "eager")
        return self._eager_runners[id(entry)]

    # --- one step ------------------------------------------------------------------------------------------
    def __call__(self, *batch) -> torch.Tensor:
        if torch.is_inference_mode_enabled():  # as under no_grad: the step computes its own gradients
            with torch.inference_mode(False):
                return self(*batch)
        # Nothing is released until _step's update: a refusal below must not let a caller count the last step
        # again (PrivateTraining counts released_config when a step raises).
        self.released_config = None
        config = self._config  # one snapshot for the whole step: clipping, noise, scaling and accounting agree
        _refuse_ambient_autocast()
        if self._stalled_bound is not None:
            raise DPConfigError(self._stalled_bound)
        # contiguous copies of strided views (x[rank::world]): the capture assumes dense batch inputs
        batch = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in batch)
        before = (self.captures, self.program_builds, self.compiles)
        start = time.perf_counter()
        try:
            loss = self._step(config, batch)
        except BaseException:
            if self.released_config is not None:  # the update was released: counted, as the accountant does
                self.steps_taken += 1
            raise
        self.last_config = config
        self.steps_taken += 1  # the update is applied: counted before anything else can fail
        if config.clipping == "adaptive":
            self._adapt_bound(config)
        if (self.captures, self.program_builds, self.compiles) != before:  # the call's time is compile time
            self.compile_seconds += time.perf_counter() - start
        return loss

    def _adapt_bound(self, config: DPConfig) -> None:
        """Adaptive clipping (Andrew et al. 2021): the next step's ``C`` from this step's noisy count of
        unclipped samples (norm <= C, compared in the dtype the graph clipped in). Under ``torch.distributed``
        the counts are summed over the ranks and rank 0 alone adds the count's noise, so every rank gets the
        same ``C``."""
        norms = self.last_norms
        bound = torch.tensor(config.bounds[0], dtype=self._acc_dtype())
        unclipped = 0.0 if norms is None else float((norms.to(bound.device) <= bound).sum())
        size = 0.0 if norms is None else float(norms.numel())
        sigma_b = config.unclipped_num_std or 0.0
        noise = self.noise.draw_scalar(sigma_b) if sigma_b > 0 and dist_utils.rank() == 0 else 0.0
        if self.distributed:
            unclipped, size, noise = (dist_utils.all_reduce_scalar(v) for v in (unclipped, size, noise))
        self.last_unclipped = unclipped
        self.last_count_noise = noise
        bound = config.next_bound(unclipped, size, noise)
        limit = torch.finfo(self._acc_dtype()).max  # the noise, std sigma * C, is drawn in this dtype
        if not bound * max(config.noise_multiplier, 1.0) < limit:  # this step is done and counted; the next
            # one's noise would overflow
            self._stalled_bound = (
                f"adaptive clipping moved the clip bound to {bound:.3g} after step {self.steps_taken}, past the range "
                f"of {self._acc_dtype()} "
                f"(clipbound_learning_rate={config.clipbound_learning_rate}, target_unclipped_quantile="
                f"{config.target_unclipped_quantile}, max_clipbound={config.max_clipbound}), so the noise, whose "
                "std scales with it, would overflow. No step was taken. Fix: set a finite max_clipbound or a "
                "smaller clipbound_learning_rate, or assign step.max_grad_norm before the next step")
            return
        self._config = self._config.replace(max_grad_norm=bound)

    def _micro_batches(self, batch: tuple, in_dims, batch_size: int) -> list[tuple]:
        from .._api import batch_dims_of

        size = self._max_physical_batch_size
        if size is None or batch_size <= size:
            return [batch]
        dims, _ = batch_dims_of(batch, in_dims)
        return [tuple(a.narrow(dims[i], start, min(size, batch_size - start)).contiguous() if i in dims else a
                      for i, a in enumerate(batch))
                for start in range(0, batch_size, size)]

    def _step(self, config: DPConfig, batch: tuple) -> torch.Tensor:
        from .._api import batch_dims_of

        f = self._per_sample_for(config)
        _, batch_size = batch_dims_of(batch, f.in_dims)
        self._bind()
        if batch_size == 0:  # a step of noise alone (Poisson sampling draws empty batches)
            loss, _, result = f.with_losses(*batch)
            sums, self.last_norms = _split_result(result, self.names, self.params)
            self._run_eager_update(config, [sums[n] for n in self.names], 0)
            return loss
        pieces = [self.prepare_call(f, piece) for piece in self._micro_batches(batch, f.in_dims, batch_size)]
        sizes = [c.batch_size for c in pieces]
        losses, norms, partial = [], [], None
        *head, last = pieces
        entry, params, args, size = last.entry, last.params, last.args, last.batch_size
        accumulate = self._max_physical_batch_size is not None
        built = self._program_for(entry, config, accumulate) if self.fused and self._state_ready else None
        if built is not None:
            for c in head:  # the earlier micro-batches: the compiled per-sample graph, summed here
                loss, _, result = self._run_per_sample(c.entry, config, c.params, c.args, c.batch_size)
                sums, piece_norms = _split_result(result, self.names, self.params)
                partial = _add_into(partial, sums, self.names)
                losses.append(loss)
                norms.append(piece_norms)
            loss, piece_norms = self._run_fused(config, *built, params, args, size, batch_size, partial)
            self.last_norms = None if piece_norms is None else torch.cat([*norms, piece_norms])
            return _combine_losses([*losses, loss], sizes, config.loss_reduction)
        # the first step (optimizer state does not exist yet), and the eager update when the program cannot be
        # built: the per-sample graph on every micro-batch, then optimizer.step()
        for c in pieces:
            loss, _, result = self._run_per_sample(self._eager_runner(c.entry), config, c.params, c.args,
                                                   c.batch_size)
            sums, piece_norms = _split_result(result, self.names, self.params)
            partial = _add_into(partial, sums, self.names)
            losses.append(loss)
            norms.append(piece_norms)
        self.last_norms = None if norms[0] is None else torch.cat(norms)
        self._run_eager_update(config, partial, batch_size)
        if self.fused:  # build and compile the program now, so that the first call carries the compile time
            built = self._program_for(entry, config, accumulate)
            if built is not None:
                program, compiled = built
                compiled.prepare(params, args, max(size, 2),
                                 self._extra_inputs(config, program, size, draw_noise=False))
        return _combine_losses(losses, sizes, config.loss_reduction)

    # --- save and resume -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What resuming the training needs: the settings (``max_grad_norm``, ``noise_multiplier``,
        ``expected_batch_size``), ``steps_taken``, the model's and the optimizer's ``state_dict`` and the noise
        generator's state (when ``generator=`` was given). Tensors are shared with the live objects, as in
        ``nn.Module.state_dict``: ``torch.save`` it. Torch's global generator is the user's to save
        (``torch.get_rng_state``), and ``secure_rng=True`` (``os.urandom``) cannot be resumed by design: its
        draws are not reproducible."""
        return {"config": {"max_grad_norm": self.max_grad_norm, "noise_multiplier": self.noise_multiplier,
                           "expected_batch_size": self.expected_batch_size},
                "steps_taken": self.steps_taken,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "generator": None if self.generator is None else self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved, into a step built the same way (same model class, optimizer and
        arguments). The next step continues exactly where the saved run stopped (same noise with a seeded
        ``generator``)."""
        if (state["generator"] is not None) != (self.generator is not None):
            raise DPConfigError("the saved step and this one disagree on generator=: build the step with a "
                                "torch.Generator exactly when the saved one had one")
        self.config = self._config.replace(**state["config"])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.generator is not None:
            self.generator.set_state(state["generator"])
        self.steps_taken = int(state["steps_taken"])
        # The first step runs eagerly so that the optimizer creates its state, which the program reads. A run
        # that has stepped has that state (none at all for a stateless optimizer, plain SGD): resume on the
        # program, as the uninterrupted run would.
        self._state_ready = self.steps_taken > 0 or bool(self.optimizer.state)


def _public_buffers(model: nn.Module, names: Sequence[str]) -> frozenset[str]:
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise DPConfigError(f"public_buffers must be a list of buffer names, got {names!r}")
    known = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    unknown = sorted(set(names) - known)
    if unknown:
        raise DPConfigError(f"public_buffers names no buffer of the model: {unknown} (its buffers: {sorted(known)})")
    return frozenset(names)


def compile_step(loss_fn: Callable, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 reduce: Reduction | None = None, max_grad_norm: float | None = None,
                 noise_multiplier: float = 0.0, expected_batch_size: float | None = None,
                 loss_reduction: str = "mean", secure_rng: bool = False, backend: str = "inductor",
                 generator: torch.Generator | None = None, in_dims=0,
                 distributed: bool | None = None, max_physical_batch_size: int | None = None,
                 clipping: str = "flat", clip_groups: Sequence[Sequence[str]] | None = None,
                 automatic_gamma: float = 0.01, target_unclipped_quantile: float = 0.5,
                 clipbound_learning_rate: float = 0.2, unclipped_num_std: float | None = None,
                 min_clipbound: float = 0.0, max_clipbound: float = math.inf,
                 memory_budget: float | None = None, public_buffers: Sequence[str] = ()) -> DPStep:
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

    ``max_physical_batch_size=N`` splits a larger (logical) batch into micro-batches of at most ``N`` samples:
    each micro-batch's clipped sum is accumulated, the noise is added once and the optimizer steps once, the
    same step as the whole batch at once with less memory (the batch size is symbolic: no recompiles).

    ``step.max_grad_norm``, ``step.noise_multiplier`` and ``step.expected_batch_size`` may be assigned between
    steps (validated; used from the next step on; a new ``C`` recaptures the per-sample graph once per bound).
    ``step.last_config`` / ``step.last_noise_multiplier`` say what the last step used. ``state_dict()`` /
    ``load_state_dict()`` save and resume (see ``DPStep.state_dict``).

    The returned object also has ``per_sample`` (``per_sample.captures``), ``fused``/``programs``/
    ``fallback_reason``, ``program_builds``, ``compiles``, ``compile_seconds``, ``steps_taken``,
    ``last_batch_size`` and ``last_norms`` (the unclipped per-sample norms). Python-number hyperparameters are
    constants of the program: changing one (a scheduler on ``lr=0.1``) rebuilds it; ``lr=torch.tensor(0.1)``
    changes without rebuilding. Invalid settings raise ``compiled_psg.DPConfigError``.

    ``clipping`` (see docs/training.md, "Clipping variants", for the sensitivity of each): ``"flat"`` (above);
    ``"per_layer"``: each group of parameters is clipped to its own bound, ``max_grad_norm`` a list with one
    ``C_k`` per group (``clip_groups``: lists of parameter names; None: one group per trained parameter, as
    Opacus) or one number ``C`` split evenly as ``C / sqrt(K)``; the noise std is ``sigma * sqrt(sum C_k^2)``.
    ``"automatic"``: each per-sample gradient becomes ``C g / (||g|| + automatic_gamma)`` (Bu et al. 2022).
    ``"adaptive"``: flat clipping whose ``C`` moves after every step toward the ``target_unclipped_quantile``
    of the per-sample norms, ``C <- C exp(-clipbound_learning_rate (b - target))`` clamped to
    ``[min_clipbound, max_clipbound]``, ``b`` the unclipped fraction counted with noise of std
    ``unclipped_num_std`` (Andrew et al. 2021); ``noise_multiplier`` is the whole step's, the gradient's own is
    ``(sigma^-2 - (2 sigma_b)^-2)^-1/2``. Norms, clip factors and clipped sums are float32 for bfloat16 models
    (float64 for float64 ones); the noise is added in that dtype.

    Nothing computed from the batch leaves the step but the noisy update: a loss that writes a parameter or a
    buffer from the batch (a running statistic under ``no_grad``, ``Embedding(max_norm=...)``'s renorm) is refused
    with ``DPConfigError`` before the step runs. ``public_buffers``: names of buffers whose writes you declare
    public (released as they are, outside the DP guarantee).

    ``memory_budget``: bytes of per-sample values the program may hold beyond what the plain step holds (None:
    the fastest plan, which keeps each layer's materialized per-sample gradients until the clip factors are
    known; 0: holds none). Layers move to strategies that hold nothing, the cheapest per byte freed first, at
    the batch size of the first call (``max_physical_batch_size``'s micro-batches: theirs); ``psg.explain(step,
    *batch)`` shows the plan. docs/training.md, "Memory budget", says what it does not bound.
    """
    options = {"clip_groups": None if clip_groups is None else tuple(tuple(g) for g in clip_groups),
               "automatic_gamma": automatic_gamma, "target_unclipped_quantile": target_unclipped_quantile,
               "clipbound_learning_rate": clipbound_learning_rate, "unclipped_num_std": unclipped_num_std,
               "min_clipbound": min_clipbound, "max_clipbound": max_clipbound, "memory_budget": memory_budget}
    from .sharded import ShardedStep, is_sharded

    cls = ShardedStep if is_sharded(model) else DPStep  # fully_shard: see compiled_psg._train.sharded
    return cls(loss_fn, model, optimizer, reduce=reduce, max_grad_norm=max_grad_norm,
                  noise_multiplier=noise_multiplier, expected_batch_size=expected_batch_size,
                  loss_reduction=loss_reduction, secure_rng=secure_rng, backend=backend, generator=generator,
                  in_dims=in_dims, distributed=distributed, max_physical_batch_size=max_physical_batch_size,
                  clipping=clipping, public_buffers=public_buffers, **options)
