"""``compile_step``: the DP step of a model, ``DPStep``, or ``ShardedStep`` for a ``fully_shard`` model."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from .._errors import BatchInputError, DPConfigError, require_flag
from .._reduce.reductions import Reduction
from .sharded import ShardedStep, is_sharded
from .step import DPStep, check_step_objects


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
                 memory_budget: float | None = None, public_buffers: Sequence[str] | None = (),
                 transactional: bool = True, batch_buckets: Sequence[int] | None = None,
                 cuda_graphs: bool = False) -> DPStep:
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

    ``batch_buckets=(b_1, ..., b_k)`` (strictly increasing positive ints; None: off) pads each (micro-)batch of
    ``b`` samples to the smallest bucket ``>= b`` with copies of its first sample, weighted 0 in the backward's
    seed: their per-sample gradients are exactly 0, and the step equals the unpadded one. The loss returned is the
    real samples' own losses averaged (``loss_reduction="mean"``) or summed; ``last_norms``, ``last_batch_size``,
    the divisor and the accounting are the real batch's. A batch larger than the largest bucket runs in
    micro-batches of it (the largest bucket must not exceed ``max_physical_batch_size``). Random ops draw for the
    padded rows too. ``cuda_graphs=True`` (a CUDA model, Inductor) records the program as CUDA graphs, one per
    bucket; without ``batch_buckets`` the buckets are powers of two up to ``max_physical_batch_size`` (which it
    then needs). Checked on a GPU by ``python -m benchmarks.gpu_correctness``; see docs/training.md, "Batch
    buckets and CUDA graphs".

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
    public (released as they are, outside the DP guarantee; None: none).

    A step is a transaction (``transactional=True``): if it raises before its update is committed (a refused
    batch, an out-of-memory error in the program, the compile at the end of the first step, an interrupt), the
    parameters, their ``.grad``, the optimizer's state, the buffers and the noise generator are as before the
    call, and nothing is counted. The compiled program writes nothing of yours: it returns the new values, and
    ``torch._foreach_copy_`` commits them; a failure from the commit on counts the step. Per step it costs a
    copy of the buffers, and on an eager update (the first step) one of the parameters, ``.grad`` and state; the
    commit itself costs a pass over the new values, allocated at the program's end.
    ``transactional=False`` skips the copies: a step that fails after its noise was drawn is then counted, and
    the parameters stay as the failure left them.

    ``memory_budget``: bytes of per-sample values the program may have at its peak beyond what the plain step
    holds (None: the fastest plan; 0: the lowest peak the strategies reach): what it holds until the clip factors
    are known (a layer's materialized per-sample gradients or, for a book-keeping sum, its output gradient) plus
    the largest value one layer forms and frees (a per-sample gradient formed for its norm alone, a ghost norm's
    Grams). Layers move to strategies that hold less, the cheapest per byte freed first, at
    the batch size of the first call (``max_physical_batch_size``'s micro-batches: theirs); ``psg.explain(step,
    *batch)`` shows the plan. docs/training.md, "Memory budget", says what it does not bound.
    """
    options = {"clip_groups": _clip_groups(clip_groups),
               "automatic_gamma": automatic_gamma, "target_unclipped_quantile": target_unclipped_quantile,
               "clipbound_learning_rate": clipbound_learning_rate, "unclipped_num_std": unclipped_num_std,
               "min_clipbound": min_clipbound, "max_clipbound": max_clipbound, "memory_budget": memory_budget}
    check_step_objects(model, optimizer, generator)  # before is_sharded reads the model's modules
    check_noise_source(secure_rng, generator)
    for name, flag in (("transactional", transactional), ("cuda_graphs", cuda_graphs)):
        require_flag(name, flag, DPConfigError)
    if distributed is not None:
        require_flag("distributed", distributed, DPConfigError)
    from .._api import check_in_dims  # the per-sample layer, which this module's steps are built on

    try:
        check_in_dims(in_dims)
    except BatchInputError as e:
        raise DPConfigError(f"compile_step: {e}") from None
    cls = ShardedStep if is_sharded(model) else DPStep  # fully_shard: see compiled_psg._train.sharded
    if cls is ShardedStep and (batch_buckets is not None or cuda_graphs is not False):
        raise DPConfigError("batch_buckets and cuda_graphs are not available for a fully_shard model (ShardedStep "
                            "runs its own micro-batches and collectives). Fix: batch_buckets=None, "
                            "cuda_graphs=False")
    if cls is DPStep:
        options.update(batch_buckets=batch_buckets, cuda_graphs=cuda_graphs)
    return cls(loss_fn, model, optimizer, reduce=reduce, max_grad_norm=max_grad_norm,
                  noise_multiplier=noise_multiplier, expected_batch_size=expected_batch_size,
                  loss_reduction=loss_reduction, secure_rng=secure_rng, backend=backend, generator=generator,
                  in_dims=in_dims, distributed=distributed, max_physical_batch_size=max_physical_batch_size,
                  clipping=clipping, public_buffers=public_buffers, transactional=transactional, **options)


def check_noise_source(secure_rng: object, generator: torch.Generator | None) -> None:
    """One source of randomness: ``secure_rng=True`` reads ``os.urandom`` and would ignore ``generator``, so a run
    seeded for reproducibility would silently not be."""
    if require_flag("secure_rng", secure_rng, DPConfigError) and generator is not None:
        raise DPConfigError("secure_rng=True draws from os.urandom, which no generator seeds: generator= would be "
                            "ignored. Fix: give one source, secure_rng=True without a generator (not reproducible) "
                            "or generator= without secure_rng (reproducible, for tests and debugging)")


def _clip_groups(groups) -> tuple[tuple[str, ...], ...] | None:
    """``clip_groups`` as tuples of names; a string, or a group that is one, is refused (it would be read a
    character at a time: ``clip_groups="0.weight"`` named the parameters ``"0"``, ``"."``, ``"w"``...)."""
    if groups is None:
        return None
    example = "clip_groups=[['0.weight', '0.bias'], ['2.weight', '2.bias']]"
    if isinstance(groups, str | bytes) or not isinstance(groups, Sequence | set | frozenset):
        raise DPConfigError(f"clip_groups must be a list of lists of parameter names, got {type(groups).__name__} "
                            f"{groups!r}. Fix: {example}")
    for group in groups:
        if isinstance(group, str | bytes) or not isinstance(group, Sequence | set | frozenset):
            raise DPConfigError(f"clip_groups must be a list of lists of parameter names, and its group {group!r} "
                                f"is a {type(group).__name__}. Fix: {example}")
    return tuple(tuple(g) for g in groups)
