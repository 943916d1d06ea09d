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
was several times slower than ``torch.randn`` plus a compiled add (docs/benchmarks-probes.md, "Noise drawn
outside the program").

The first step runs eagerly (the rewritten graph without a compiler, then ``optimizer.step()``): optimizers
create their state lazily, and the program reads that state. The program is built and compiled at the end of
that first step. An optimizer that keeps no state (``torch.optim.SGD`` without momentum) runs the program from
the first step. Empty batches (Poisson sampling) also take the eager path: a step with noise only. An
optimizer with step hooks, or one Dynamo cannot trace whole, keeps the eager update after the compiled
per-sample graph (``step.fused`` is False, ``step.fallback_reason`` says why, and a warning is logged).

``DPStep`` composes small parts: a frozen ``DPConfig`` (C, sigma, the divisor, the loss reduction, the clipping
mode; ``config.py``), the ``OptimizerBinding`` (the trained parameters and their ``.grad`` buffers;
``binding.py``), the ``ProgramCache`` (fuse and compile; ``programs.py``) and the eager update with its
``NoiseSource`` (``eager.py``). The step itself chooses the per-sample graph (one per clipping bound), splits
micro-batches, and runs either the program or the eager path.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet

import torch
import torch.nn as nn

from .._capture.dynamo import own_compilation
from .._compile.run import BACKENDS, CompiledGraph
from .._errors import DPConfigError, require_flag
from .._reduce.reductions import Reduction
from . import buckets as buckets_
from . import distributed as dist_utils
from . import update_graph
from .adaptive import next_bound
from .binding import OptimizerBinding, check_optimizer_scalars, refuse_shared_parameters
from .checkpoint import load_step_state, step_state
from .config import DPConfig
from .eager import NoiseSource
from .fuse import StepProgram
from .hooks import refuse_gradient_hooks
from .inputs import StepInputs
from .paths import drawing, eager_path, eager_update_of, fused_path
from .programs import ProgramCache
from .reduction import dp_clip_for, resolve_reduction
from .release import refuse_padded_writes, refuse_private_writes
from .results import micro_batches, split_result
from .settings import StepSettings
from .transaction import Snapshot

log = logging.getLogger("compiled_psg")


def refuse_ambient_autocast() -> None:
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


def refuse_copy(obj, *_) -> None:
    """``__deepcopy__``/``__reduce_ex__``: a step (and a ``PrivateTraining``) holds compiled programs, a bound
    optimizer and a noise generator whose copy would not be the same training (or could not be made)."""
    raise DPConfigError(f"a {type(obj).__name__} cannot be copied or pickled: it holds compiled programs bound to "
                        "its model and optimizer. Fix: save its state_dict() (torch.save works on it) and "
                        "load_state_dict() it into one built the same way for the copy")



def contiguous_batch(batch: tuple) -> tuple:
    """Contiguous copies of the batch's strided views (``x[rank::world]``): the capture assumes dense batch
    inputs. Sparse and nested tensors pass as they are, for the batch check to name them."""
    return tuple(a.contiguous() if isinstance(a, torch.Tensor) and a.layout == torch.strided and not a.is_nested
                 else a for a in batch)

class DPStep(StepSettings):
    """The callable ``compile_step`` returns: ``step(*batch) -> loss``. See ``compile_step``.

    ``max_grad_norm``, ``noise_multiplier`` and ``expected_batch_size`` (the fields of ``config``, a frozen
    ``DPConfig``) may be assigned between steps: they are validated, and the next step uses them (a new ``C``
    recaptures the per-sample graph once per bound, since ``C`` is a constant of that graph; switching noise on
    or off selects the program with or without the noise input). ``last_config`` is what the last step used.
    The other fields of ``config`` (the clipping variants' options, e.g. ``target_unclipped_quantile``) change
    with ``step.config = step.config.replace(...)``; the clipping mode, the loss reduction and the clip groups
    define the mechanism and are fixed. Under adaptive clipping the step sets ``max_grad_norm`` itself after
    every step.
    """

    def __init__(self, loss_fn: Callable, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 reduce: Reduction | None = None, max_grad_norm: float | None = None,
                 noise_multiplier: float = 0.0, expected_batch_size: float | None = None,
                 loss_reduction: str = "mean", secure_rng: bool = False, backend: str = "inductor",
                 generator: torch.Generator | None = None, in_dims=0, distributed: bool | None = None,
                 max_physical_batch_size: int | None = None, clipping: str = "flat",
                 public_buffers: Sequence[str] | None = (), transactional: bool = True, batch_buckets=None,
                 cuda_graphs: bool = False, **clipping_options):
        from .._api import PerSampleFunction, check_loss

        check_step_objects(model, optimizer, generator)
        refuse_gradient_hooks(model)
        refuse_shared_parameters(model)
        if backend not in BACKENDS:
            raise DPConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
        custom, bound, budget = resolve_reduction(reduce, max_grad_norm if clipping == "flat" else None)
        if clipping != "flat":
            if reduce is not None:
                raise DPConfigError(f"clipping={clipping!r} is the step's own reduction: pass max_grad_norm, not "
                                    "reduce=")
            bound = max_grad_norm
        if budget is not None:  # reduce=psg.clip_sum(C, memory_budget=...)
            if clipping_options.get("memory_budget") not in (None, budget):
                raise DPConfigError(f"memory_budget={clipping_options['memory_budget']} contradicts "
                                    f"reduce=clip_sum(..., memory_budget={budget}); give the budget once")
            clipping_options["memory_budget"] = budget
        self._stalled_bound: str | None = None  # why adaptive clipping cannot go on (_adapt_bound)
        self._config = DPConfig(bound, noise_multiplier, expected_batch_size, loss_reduction,
                                "custom" if custom is not None else clipping, **clipping_options)
        self._custom_reduce = custom
        self._public_buffers = _public_buffers(model, public_buffers)
        self.transactional = transactional  # a failed step restores everything and counts nothing
        if distributed and not dist_utils.is_distributed():  # torch's raw ValueError at the broadcast below
            raise DPConfigError("distributed=True needs an initialized torch.distributed process group, and there is "
                                "none. Fix: call torch.distributed.init_process_group(...) on every rank first, or "
                                "leave distributed=None (it detects the group)")
        self.batch_buckets = buckets_.resolve(batch_buckets, cuda_graphs, model, backend, max_physical_batch_size,
                                              custom is not None,
                                              dist_utils.is_distributed() if distributed is None else distributed)
        self.cuda_graphs = cuda_graphs
        self._seed_weights = buckets_.SeedWeights()
        self._written_arguments: set[int] = set()  # positions the loss writes in place (``prepare_batch``)
        # (the pieces that ran, their batch dims) where the loss writes arguments: given back on success only
        self._written_pieces: tuple[list, dict[int, int]] | None = None
        self.max_physical_batch_size = max_physical_batch_size
        check_loss(loss_fn)
        self._new_per_sample = lambda reduction: PerSampleFunction(
            loss_fn, model, in_dims, reduction, backend, seed_weights=self.batch_buckets is not None,
            cuda_graphs=cuda_graphs)
        self._per_sample_fns: dict[Reduction, object] = {}
        self.model = model
        self.optimizer = optimizer
        self.backend = backend
        self.noise = NoiseSource(secure_rng, generator, native_likely=noise_multiplier > 0 and all(
            p.device.type == "cpu" and p.dtype != torch.float64 for p in model.parameters()))
        self.distributed = dist_utils.is_distributed() if distributed is None else distributed
        self.binding = OptimizerBinding(model, optimizer)
        self._config.check_noise_range(self._acc_dtype(), self._grad_dtype())
        self._warn_untrained()
        self.per_sample  # noqa: B018 -- the per-sample function of the initial config, checked now
        self.program_cache = ProgramCache(optimizer, self.binding, self.distributed)
        self._check_dtypes()
        self._eager_runners: dict[int, CompiledGraph] = {}
        self.inputs = StepInputs(self.binding, self.noise, self._acc_dtype)
        if self.distributed:
            dist_utils.broadcast_parameters(self.binding.params)
        # a stateless update (plain SGD) runs in the program from the first step; others create state eagerly first
        self.state_ready = update_graph.creates_no_state(optimizer)
        self.compile_seconds = 0.0
        self.steps_taken = 0
        # steps_taken when the step was built or last loaded a state of another count, and the highest count it
        # released or loaded: no load goes below that (``checkpoint._check_no_rollback``)
        self.steps_at_load = self.steps_reached = 0
        self.last_batch_size = 0
        self.last_norms: torch.Tensor | None = None
        self.last_config: DPConfig | None = None
        # the config of an update that began in the current call (noise drawn, the optimizer stepping): a call that
        # fails after it (past the fused program's commit, or with transactional=False) released a noisy update,
        # which ``_count_release`` counts; a transactional step that fails before restores everything
        self.released_config: DPConfig | None = None
        self._release_listeners: list[Callable[[float], None]] = []
        self._accounted_by: str | None = None  # the owner whose accountant counts this step's releases
        self._retired: str | None = None  # why the step takes no more steps (its owner was replaced)
        self.snapshot: Snapshot | None = None  # the current call's transaction (``transaction.py``)
        # one call at a time: a second thread waits for the running step; a call from inside it (an optimizer
        # hook, the loss) is refused, since its commit would be undone by the outer call's rollback
        self._running = threading.Lock()
        self._running_thread: int | None = None
        self.last_unclipped: float | None = None  # adaptive clipping: samples with norm <= C in the last step
        self.last_count_noise: float | None = None  # and the noise added to their (centred) count

    # --- what was built ---------------------------------------------------------------------------------------
    def _acc_dtype(self) -> torch.dtype:
        """What norms, clip factors and clipped sums are computed in: float32, float64 for float64 models."""
        return torch.float64 if any(p.dtype == torch.float64 for p in self.binding.params) else torch.float32

    def _grad_dtype(self) -> torch.dtype:
        """The trained parameters' dtype of least range: the ``.grad`` the scaled noisy sum is written into."""
        return min((p.dtype for p in self.binding.params), key=lambda d: torch.finfo(d).max,
                   default=self._acc_dtype())

    def _reduction_for(self, config: DPConfig) -> Reduction:
        if config.clipping == "custom":
            return self._custom_reduce
        trainable = [n for n, p in self.model.named_parameters() if p.requires_grad]
        return dp_clip_for(config, list(self.binding.names), trainable, self._acc_dtype())

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

    def prepare_batch(self, f, batch: tuple):
        """``f.prepare_call(*batch)``, refused (``DPConfigError``) when the loss writes a parameter or a buffer
        not in ``public_buffers`` from the batch: the model would carry it out of the step un-noised
        (``release.py``); with ``batch_buckets``, also when it writes a public buffer from the batch or a batched
        argument (``release.refuse_padded_writes``). Before anything runs."""
        call = f.prepare_call(*batch)
        captured = call.entry.rewritten.captured
        refuse_private_writes(captured, self.model, self.public_buffers, f.fn)
        if self.batch_buckets is not None:  # the loss runs on the padded batch (``buckets.py``)
            refuse_padded_writes(captured, self.model, self.public_buffers, f.fn)
        self._written_arguments.update(captured.roles[i].key for i in captured.mutated
                                       if captured.roles[i].kind == "arg")
        return call

    @property
    def per_sample(self):
        """The ``PerSampleFunction`` of the current settings (``per_sample.captures``)."""
        return self._per_sample_for(self._config)

    # read-outs of the program cache: whether the update runs in the program, why not, programs built
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

    # --- the parts the paths use (``paths.py``) --------------------------------------------------------------
    def program_for(self, entry: CompiledGraph, config: DPConfig,
                    accumulate: bool) -> tuple[StepProgram, CompiledGraph] | None:
        try:
            return self.program_cache.get(entry, config, accumulate)
        except update_graph.StateMissing:  # e.g. the state was cleared: one eager step creates it again
            self.state_ready = False
            return None

    def eager_runner(self, entry: CompiledGraph) -> CompiledGraph:
        """The rewritten graph op by op for the first step (the program compiles at its end: no double
        compile); the compiled per-sample graph itself when the update runs eagerly anyway."""
        if not self.fused:
            return entry
        if id(entry) not in self._eager_runners:
            self._eager_runners[id(entry)] = CompiledGraph(entry.rewritten, "eager")
        return self._eager_runners[id(entry)]

    # --- one step ------------------------------------------------------------------------------------------
    def running_here(self) -> bool:
        """Whether this thread is inside this step (a call now would come from a hook, a scheduler or the loss)."""
        # the lock too: an interrupt inside the ``finally`` that clears the thread leaves it set, the lock released
        return self._running_thread == threading.get_ident() and self._running.locked()

    @own_compilation
    def __call__(self, *batch, **kwargs) -> torch.Tensor:
        if kwargs:  # refused as a per-sample function refuses them
            from .._api import no_keywords

            no_keywords(kwargs)
        if self.running_here():
            raise DPConfigError(
                "the DP step was called while it is running (from an optimizer hook, a scheduler or the loss): "
                "the inner step would be counted, then undone if the outer one failed, and its noise drawn again. "
                "No step was taken by the inner call. Fix: call the step only from the training loop")
        with self._running:
            try:  # set inside: an interrupt between the two would leave the step marked running for good
                self._running_thread = threading.get_ident()
                if torch.is_inference_mode_enabled():  # as under no_grad: the step computes its own gradients
                    with torch.inference_mode(False):
                        return self._call(batch)
                return self._call(batch)
            finally:
                self._running_thread = None

    def _call(self, batch: tuple) -> torch.Tensor:
        # Nothing is released until _step's update (released_config is also cleared when each call ends)
        self.released_config = None
        config = self._config  # one snapshot for the whole step: clipping, noise, scaling and accounting agree
        if self._retired is not None:
            raise DPConfigError(self._retired)
        refuse_ambient_autocast()
        refuse_gradient_hooks(self.model)  # each step: a hook may have been added since the last one
        if self._stalled_bound is not None:
            raise DPConfigError(self._stalled_bound)
        # the model's dtype may have changed since the config was set
        config.check_noise_range(self._acc_dtype(), self._grad_dtype())
        check_optimizer_scalars(self.optimizer)  # settings are the user's to change between steps
        given, batch = batch, contiguous_batch(batch)
        self._written_arguments.clear()
        self._written_pieces = None
        before = (self.captures, self.program_builds, self.compiles)
        start = time.perf_counter()
        # after the checks above: what a failed step restores (the eager update adds the parameters to it)
        snapshot = self.snapshot = Snapshot.of_step(self)
        counted: list = []
        try:
            loss = self._step(config, batch)
            if snapshot is not None:  # the update is applied (eager or committed): from here on it is kept
                snapshot.restorable = False
            self._count_release(config, counted)  # the update is applied: counted before anything else can fail
            self._give_written_arguments_back(given)
        except BaseException:
            if snapshot is not None and snapshot.restorable and not counted:
                if snapshot.released:  # the user's code could see the noisy update: counted, its noise kept spent
                    try:
                        self._count_release(self.released_config, counted)
                    finally:
                        snapshot.restore_step(self)  # the training goes on from before the call
                else:  # nothing released or counted
                    snapshot.restore_step(self)
            elif self.released_config is not None:  # the noise may have reached the parameters: counted (the
                self._count_release(self.released_config, counted)  # records not made yet, once each)
            raise
        finally:
            self.snapshot = None  # its copies must not outlive the call (they would sit across the next peak)
            self._written_pieces = None
            self.released_config = None
            self.noise.wipe()  # the spent noise would give back the un-noised sum
        self.last_config = config
        if config.clipping == "adaptive":
            self._adapt_bound(config)
        if (self.captures, self.program_builds, self.compiles) != before:  # the call's time is compile time
            self.compile_seconds += time.perf_counter() - start
        return loss

    def on_release(self, listener: Callable[[float], None]) -> None:
        """Call ``listener(noise_multiplier)`` for every step whose noise may have reached the parameters, where
        the step counts it (``PrivateTraining``'s accountant): a step taken through the step object itself is
        counted too, and a caller interrupted after the step returns cannot miss one."""
        self._release_listeners.append(listener)

    def _count_release(self, config: DPConfig, counted: list) -> None:
        """Count one released step: ``steps_taken`` and every listener, each once. ``counted`` holds the records
        made (``"steps"``, then each listener's index), each marked after it is made: a call after a failure
        (a listener that raised, an interrupt) makes only the records missing, so a record is made twice at worst
        (epsilon over-reported, where a listener raised after it counted), never not at all."""
        if "steps" not in counted:
            self.steps_taken += 1
            counted.append("steps")
        for k, listener in enumerate(self._release_listeners):
            if k not in counted:
                listener(config.accounted_noise_multiplier)
                counted.append(k)

    def _adapt_bound(self, config: DPConfig) -> None:
        """Adaptive clipping: the next step's ``C`` (``adaptive.next_bound``), or the reason the next step
        cannot be taken (its noise would overflow)."""
        step = next_bound(config, self.last_norms, self.noise, self.distributed, self._acc_dtype(),
                          self._grad_dtype(), self.steps_taken)
        self.last_unclipped, self.last_count_noise = step.unclipped, step.count_noise
        if step.stalled is not None:
            self._stalled_bound = step.stalled
        else:
            self._config = self._config.replace(max_grad_norm=step.bound)

    def _step(self, config: DPConfig, batch: tuple) -> torch.Tensor:
        from .._api import batch_dims_of

        self._bind()  # first: the per-sample function's clipping covers the parameters the optimizer holds now
        f = self._per_sample_for(config)
        _, batch_size = batch_dims_of(batch, f.in_dims)
        if batch_size == 0:  # a step of noise alone (Poisson sampling draws empty batches)
            with drawing(self):
                loss, _, result = f.with_losses(*batch)
            sums, self.last_norms = split_result(result, self.binding.names, self.binding.params)
            eager_update_of(self, config, [sums[n] for n in self.binding.names], 0)
            return loss
        pieces = self._writing_copies(f, batch, self._pieces(f, batch, batch_size))
        accumulate = self._max_physical_batch_size is not None or len(pieces) > 1
        self.program_cache.rejoin()
        built = self.program_for(pieces[-1].entry, config, accumulate) if self.fused and self.state_ready else None
        if built is not None:
            return fused_path(self, config, built, pieces, batch_size)
        return eager_path(self, config, pieces, batch_size, accumulate)

    def _writing_copies(self, f, batch: tuple, pieces: list) -> list:
        """The step's prepared calls; where the loss writes arguments in place, each with copies of those: the
        loss writes its own copies, and the user's tensors get what it wrote once the whole step succeeded
        (``_give_written_arguments_back``)."""
        from .._api import batch_dims_of

        if not self._written_arguments:
            return pieces
        written = self._written_arguments
        pieces = [dataclasses.replace(c, args=tuple(a.clone() if i in written else a for i, a in enumerate(c.args)))
                  for c in pieces]
        self._written_pieces = (pieces, batch_dims_of(batch, f.in_dims)[0])
        return pieces

    @property
    def public_buffers(self) -> frozenset[str]:
        """The buffers whose writes from the batch the step releases (``compile_step(public_buffers=...)``)."""
        return self._public_buffers

    @public_buffers.setter
    def public_buffers(self, names) -> None:
        # the captured graphs were checked against the set the step was built with (``_per_sample_for``)
        raise DPConfigError("public_buffers is fixed when the step is built: the loss's writes were checked "
                            "against it when it was captured. Fix: build a new step with "
                            "compile_step(..., public_buffers=[...])")

    @property
    def transactional(self) -> bool:
        """Whether a failed step restores everything and counts nothing (assignable: True or False)."""
        return self._transactional

    @transactional.setter
    def transactional(self, value: bool) -> None:
        require_flag("transactional", value, DPConfigError)
        self._transactional = value

    def retire(self, why: str) -> None:
        """Take no more steps: every later call raises ``DPConfigError(why)``."""
        self._retired = why

    @property
    def accounted_by(self) -> str | None:
        """The owner whose accountant counts this step's releases (``PrivateTraining``), or None. Set once: its
        rules (noise, a bound, a fixed divisor: ``settings._check_owner_rules``) hold for the step's life."""
        return self._accounted_by

    @accounted_by.setter
    def accounted_by(self, owner: str | None) -> None:
        if self._accounted_by is not None and owner != self._accounted_by:
            raise DPConfigError(
                f"this step belongs to a {self._accounted_by}, whose accountant counts its steps, for its life: "
                f"its rules (noise, a clipping bound, a fixed divisor) hold while the accountant counts. Fix: build "
                "another step with compile_step for a training without that accountant")
        self._accounted_by = owner

    @accounted_by.deleter
    def accounted_by(self) -> None:
        self.accounted_by = None  # refused once set, as any other change

    def _give_written_arguments_back(self, given: tuple) -> None:
        """The arguments the loss wrote in place, as it wrote them, into the user's tensors: after the step (a
        failed step leaves them as they were; eager torch would have written them before failing, but the step
        did not happen). A micro-batch off the batch's first dimension is a copy (``micro_batches``): each is
        written to its own rows."""
        if self._written_pieces is None:
            return
        pieces, dims = self._written_pieces
        with torch.no_grad():
            for pos in sorted(self._written_arguments):
                start = 0
                for piece in pieces:
                    size = buckets_.real_size(piece)
                    given[pos].narrow(dims[pos], start, size).copy_(piece.args[pos])
                    start += size

    def prepare(self, batch: tuple) -> None:
        """Capture and check what a step on ``batch`` runs, as the step would (its micro-batches and buckets: the
        memory plan is made at their size), running nothing: ``make_private`` refuses a model on its first batch."""
        from .._api import batch_dims_of

        f = self.per_sample
        batch = contiguous_batch(batch)
        self._pieces(f, batch, batch_dims_of(batch, f.in_dims)[1])

    def _pieces(self, f, batch: tuple, batch_size: int) -> list:
        """The batch's micro-batches, prepared; with ``batch_buckets``, at most the largest bucket each, padded to
        their bucket (``buckets.py``)."""
        from .._api import batch_dims_of

        buckets = self.batch_buckets
        physical = self._max_physical_batch_size
        if buckets is None:
            return [self.prepare_batch(f, piece) for piece in micro_batches(batch, f.in_dims, batch_size, physical)]
        physical = buckets[-1] if physical is None else min(physical, buckets[-1])
        pieces = []
        for piece in micro_batches(batch, f.in_dims, batch_size, physical):
            dims, b = batch_dims_of(piece, f.in_dims)
            bucket = buckets_.bucket_for(buckets, b)
            call = self.prepare_batch(f, buckets_.pad(piece, dims, b, bucket))
            weights = self._seed_weights.get(bucket, b, call.entry.rewritten.seed_weights)
            pieces.append(buckets_.PaddedCall(call.entry, call.params, (*call.args, weights), bucket, b))
        return pieces

    # --- save and resume -------------------------------------------------------------------------------------
    __deepcopy__ = __reduce_ex__ = refuse_copy

    def state_dict(self) -> dict:
        """What resuming the training needs (``checkpoint.step_state``): ``torch.save`` it."""
        return step_state(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved, into a step built the same way (``checkpoint.load_step_state``)."""
        if self.accounted_by is not None:  # its accountant would keep counting from its own history
            raise DPConfigError(
                f"this step belongs to a {self.accounted_by}, whose accountant counts its steps: loading a step state "
                "through it would set the weights and steps_taken of the saved run while the accountant's history "
                f"stays this run's (epsilon would not cover the loaded steps). Nothing was loaded. Fix: load the "
                f"{self.accounted_by}'s own state_dict() with its load_state_dict")
        load_step_state(self, state)


def check_step_objects(model, optimizer, generator) -> None:
    for name, value, kind, expected in (
            ("model", model, nn.Module, "an nn.Module (the one the loss calls)"),
            ("optimizer", optimizer, torch.optim.Optimizer,
             "a torch.optim.Optimizer, e.g. torch.optim.SGD(model.parameters(), lr=0.1)"),
            ("generator", generator, torch.Generator | None,
             "a torch.Generator on the parameters' device, e.g. torch.Generator().manual_seed(0), or None for "
             "torch's global one")):
        if not isinstance(value, kind):
            raise DPConfigError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
    unfit = _UNFIT_OPTIMIZERS.get(type(optimizer).__name__)
    if unfit is not None and type(optimizer).__module__.startswith("torch.optim"):
        raise DPConfigError(f"{type(optimizer).__name__} cannot take a DP step: {unfit}. Fix: use an optimizer whose "
                            "step() reads .grad alone, e.g. torch.optim.SGD or torch.optim.Adam")


#: torch optimizers whose step cannot be the update of a DP step -> why
_UNFIT_OPTIMIZERS = {
    "LBFGS": "its step() calls a closure that recomputes the loss on the batch (un-noised gradients, many times)",
    "SparseAdam": "it takes sparse gradients only, and a noised gradient is dense",
}


def _public_buffers(model: nn.Module, names: Sequence[str] | None) -> frozenset[str]:
    if names is None:
        return frozenset()  # the default's meaning, ()
    # a collection, not any iterable: a generator would be used up by this check
    if isinstance(names, str | bytes) or not isinstance(names, Sequence | AbstractSet) \
            or not all(isinstance(n, str) for n in names):
        raise DPConfigError(f"public_buffers must be a list of buffer names or None (no public buffer), got "
                            f"{type(names).__name__} {names!r}")
    known = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    unknown = sorted(set(names) - known)
    if unknown:
        raise DPConfigError(f"public_buffers names no buffer of the model: {unknown} (its buffers: {sorted(known)})")
    buffers = dict(model.named_buffers(remove_duplicate=False))
    for name in sorted(set(names)):
        shared = _parameter_sharing_memory(model, buffers[name])
        if shared is not None:
            attribute = name.rsplit(".", 1)[-1]
            raise DPConfigError(
                f"public_buffers names buffer {name!r}, which shares its memory with parameter {shared!r} "
                f"(registered from it, as register_buffer({attribute!r}, param.data) does): a write to the buffer "
                "is a write to the trained parameter, which public_buffers cannot make public. Fix: register a "
                f"copy, register_buffer({attribute!r}, param.detach().clone()), or leave {name!r} out of "
                "public_buffers")
    return frozenset(names)


def _parameter_sharing_memory(model: nn.Module, buffer: torch.Tensor) -> str | None:
    """The name of a parameter whose memory overlaps ``buffer``'s, if any (``memory_span``: None for a tensor
    without storage of its own, a sharded DTensor or a meta tensor)."""
    from .._api import memories_overlap, memory_span

    span = memory_span(buffer)
    return next((name for name, p in model.named_parameters(remove_duplicate=False)
                 if memories_overlap(span, memory_span(p))), None)
