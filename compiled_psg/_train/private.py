"""``make_private``: the model, optimizer and loader of a training loop, turned into DP-SGD (like Opacus's
``PrivacyEngine.make_private``), with the step compiled by ``compile_step`` and the accounting delegated to
dp-accounting or opacus (``accounting.py``)."""

from __future__ import annotations

import inspect
import time
import warnings
import weakref
from collections.abc import Callable, Mapping

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from .._errors import BatchInputError, DPConfigError, require_flag
from .._generators import states_put_back
from . import distributed as dist_utils
from .accounting import Accountant, calibrate_noise, check_accountable, check_delta, check_sample_rate, check_steps
from .api import check_noise_source, compile_step
from .checkpoint import check_state_kind, load_step_state, saved_step_count
from .config import check_noise_multiplier, is_number
from .sampling import (
    PoissonBatchSampler,
    check_batched,
    check_samples_whole_dataset,
    dataset_of,
    peek_batch,
    poisson_loader,
)
from .step import DPStep, refuse_copy


class PrivateTraining:
    """What ``make_private`` returns: ``step(*batch) -> loss`` (one DP-SGD step, counted by the accountant),
    ``data_loader`` (Poisson-sampled), ``epsilon(delta)`` and the parameters of the mechanism.

    ``noise_multiplier`` may be assigned between steps (or by a noise scheduler, ``StepNoise``, ...): the next
    step uses it and the accountant records, for every step, the noise multiplier that step actually used.
    ``state_dict()``/``load_state_dict()`` save and resume the whole training state.

    ``dataset_size``: the samples the training draws from (summed over the ranks), which with ``sample_rate``
    defines the expected batch size, the gradient's divisor.
    """

    def __init__(self, *args, **kwargs):
        raise DPConfigError(
            "a PrivateTraining is built by make_private, which checks that its parts agree: the loader samples at the "
            "rate the accountant counts, over the dataset the step's divisor assumes, and the step adds noise to "
            "clipped gradients (one built from parts that disagree reports the epsilon of another training). Fix: "
            "psg.make_private(model, optimizer, data_loader, loss_fn, ...)")

    @classmethod
    def _built(cls, model: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
               dp_step: DPStep, accountant: Accountant, sample_rate: float, target_delta: float,
               poisson_sampling: bool = True, *, dataset_size: int | None = None) -> PrivateTraining:
        """The training ``make_private`` checked, put together."""
        self = cls.__new__(cls)
        self._take(model, optimizer, data_loader, dp_step, accountant, sample_rate, target_delta, poisson_sampling,
                   dataset_size)
        return self

    def _take(self, model, optimizer, data_loader, dp_step, accountant, sample_rate, target_delta, poisson_sampling,
              dataset_size) -> None:
        self.model = model
        self.optimizer = optimizer
        self.data_loader = data_loader
        self.dp_step = dp_step
        self.accountant = accountant
        self.sample_rate = sample_rate
        self.target_delta = target_delta
        self.poisson_sampling = poisson_sampling
        self.dataset_size = dataset_size
        # the step counts each step it releases, however it is called (``self.step`` or ``self.dp_step``)
        dp_step.on_release(self._account)
        dp_step.accounted_by = type(self).__name__  # its state loads with the accountant's, through this object

    #: what make_private fixed, which the accountant's analysis (or the step it counts) assumes: assigning one
    #: would have epsilon computed for another training than the one that runs (red team O:
    #: ``private.sample_rate = 0.001`` reported epsilon 0.61 for a run sampled at 0.2, whose epsilon is 4.54)
    _FIXED = ("model", "optimizer", "data_loader", "dp_step", "accountant", "sample_rate", "target_delta",
              "poisson_sampling", "dataset_size")

    def __setattr__(self, name: str, value) -> None:
        self._refuse_changing(name)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        self._refuse_changing(name)
        super().__delattr__(name)

    def _refuse_changing(self, name: str) -> None:
        if name in self._FIXED and name in self.__dict__:
            fix = ("pass the delta to epsilon(delta=...)" if name == "target_delta" else
                   "build the training with the make_private arguments that give it (a noise multiplier, a "
                   "clipping bound and a noise schedule can be changed between steps)")
            raise DPConfigError(f"a PrivateTraining's {name} is fixed when make_private builds it: the accountant "
                                "counts every step at the training's sampling rate over its dataset, with its step, "
                                f"loader and model. Fix: {fix}")

    def _account(self, noise_multiplier: float) -> None:
        self.accountant.step(noise_multiplier, self.sample_rate)

    @property
    def noise_multiplier(self) -> float:
        """The noise multiplier of the next step; assignable (validated by the step)."""
        return self.dp_step.noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        self.dp_step.noise_multiplier = value  # noise > 0, as every setting of the step: its _check_owner_rules

    @property
    def clipping(self) -> str:
        return self.dp_step.clipping

    @property
    def max_grad_norm(self) -> float | tuple[float, ...]:
        """The clipping bound of the next step (per_layer: the bounds; adaptive: moves every step); assignable
        (sigma is relative to the sensitivity: the accounting holds)."""
        return self.dp_step.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        self.dp_step.max_grad_norm = value

    @property
    def expected_batch_size(self) -> float:
        return self.dp_step.expected_batch_size

    @property
    def compile_seconds(self) -> float:
        return self.dp_step.compile_seconds

    @property
    def steps(self) -> int:
        """Logical steps taken (the accountant's count)."""
        return self.accountant.steps

    def step(self, *batch, **keywords) -> torch.Tensor:
        """One DP-SGD step on a (logical) batch. The step itself has the accountant record the noise multiplier it
        used, when its update is applied (``DPStep.on_release``): a failure after that point (an interrupt, the
        compile at the end of the first step) still counts it, a failure before it counts nothing."""
        return self.dp_step(*batch, **keywords)  # keywords refused there, naming the fix

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (default: ``target_delta``). The accountant's analysis assumes
        Poisson sampling: with ``poisson_sampling=False`` a warning says the number is not a guarantee."""
        if not self.poisson_sampling:
            warnings.warn("epsilon() assumes Poisson sampling, but make_private(poisson_sampling=False) kept the "
                          "original loader: the number is not a privacy guarantee for this training",
                          UserWarning, stacklevel=2)
        return self.accountant.epsilon(self.target_delta if delta is None else delta)

    def _sampler(self) -> PoissonBatchSampler | None:
        sampler = getattr(self.data_loader, "batch_sampler", None)
        return sampler if isinstance(sampler, PoissonBatchSampler) else None

    __deepcopy__ = __reduce_ex__ = refuse_copy

    def state_dict(self) -> dict:
        """Everything a resumed run needs, for ``torch.save``: the step's state (the model's and the optimizer's
        ``state_dict``, the settings, the noise generator's state: see ``DPStep.state_dict``), the accountant's
        history and the Poisson sampler's position (its generator's state at the start of the epoch and the
        batches drawn since; a state loaded and not yet iterated, as loaded). Noise from ``secure_rng=True``
        (``os.urandom``) is not reproducible by design: a resumed secure run is a valid continuation, not a replay.
        A noise scheduler has its own ``state_dict``.

        The model's and the optimizer's tensors are the live ones (as ``nn.Module.state_dict``): a state kept in
        memory follows the training. Keep ``copy.deepcopy(private.state_dict())`` to roll back to it later.

        The state holds the generators' states, seeds included: the noise and the batches can be re-drawn from it
        (docs/training.md, "Save and resume"). Keep it as secret as the training data."""
        sampler = self._sampler()
        if sampler is not None and self.data_loader.num_workers > 0 and 0 < sampler.state_dict()["drawn"]:
            warnings.warn("a loader with worker processes draws batches ahead of the training: a state saved in "
                          "the middle of an epoch may skip batches on resume; save between epochs",
                          UserWarning, stacklevel=2)
        return {"kind": "PrivateTraining",
                "step": self.dp_step.state_dict(),
                "accountant": {"mechanism": self.accountant.mechanism, "history": list(self.accountant.history)},
                "sampler": None if sampler is None else sampler.state_dict(),
                "sample_rate": self.sample_rate,
                "dataset_size": self.dataset_size,
                "poisson_sampling": self.poisson_sampling}

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict`` into a ``PrivateTraining`` built the same way (same model class, optimizer,
        loader and ``make_private`` arguments, a fresh seeded generator where the saved run had one). The next
        ``for batch in private.data_loader`` continues the interrupted epoch. Everything is checked before anything
        is loaded: a refused state changes nothing (parameters, optimizer, accountant, generators, sampler)."""
        check_state_kind(state, "PrivateTraining")
        check_state_kind(state["step"], "DPStep", holder="the 'step' entry of a PrivateTraining's state")
        accountant = state["accountant"]
        if not (isinstance(accountant, dict) and {"mechanism", "history"} <= set(accountant)):
            got = (f"a dict with keys {sorted(accountant, key=str)}" if isinstance(accountant, dict)
                   else type(accountant).__name__)
            raise DPConfigError(f"the saved accountant must be a dict with 'mechanism' and 'history', got {got}. "
                                "Nothing was loaded. Fix: load what PrivateTraining.state_dict() returned")
        if state["accountant"]["mechanism"] != self.accountant.mechanism or state["sample_rate"] != self.sample_rate:
            raise DPConfigError(
                "the saved training used another accountant or sampling rate (saved: "
                f"{state['accountant']['mechanism']!r}, q={state['sample_rate']}; here: "
                f"{self.accountant.mechanism!r}, q={self.sample_rate}). Nothing was loaded. Fix: build the "
                "PrivateTraining with the same make_private arguments")
        self._check_dataset_size(state)
        saved_poisson = state.get("poisson_sampling", state["sampler"] is not None)  # a state of an older release
        if saved_poisson != self.poisson_sampling:
            raise DPConfigError(
                f"the saved training was built with make_private(poisson_sampling={saved_poisson}), this one with "
                f"poisson_sampling={self.poisson_sampling}: the saved run's sampling (and what its accounting "
                "assumed) cannot continue here. Nothing was loaded. Fix: build the training with "
                f"poisson_sampling={saved_poisson}, as the saved run was")
        sampler = self._sampler()
        if (state["sampler"] is None) != (sampler is None):
            raise DPConfigError(
                "the saved training " + ("had no Poisson sampler state, but this one's data_loader is Poisson-sampled"
                                         if sampler is not None else "holds a Poisson sampler's position, but this "
                                         "one's data_loader is not the Poisson loader make_private built")
                + ". Nothing was loaded. Fix: iterate private.data_loader as make_private returned it, in both runs")
        if sampler is not None:
            sampler.check_state(state["sampler"])
        history = self._saved_history(accountant["history"], saved_step_count(state["step"]))
        load_step_state(self.dp_step, state["step"])  # checks everything it loads before loading any of it
        self.accountant.load_history(history)
        if sampler is not None:
            sampler.load_state_dict(state["sampler"])

    def _check_dataset_size(self, state: dict) -> None:
        """The dataset size defines, with the sampling rate (checked beside the accountant), the expected batch
        size the saved step divides its gradient by: a state of another dataset size would impose its divisor."""
        if "dataset_size" not in state:
            raise DPConfigError(
                "the saved training records no dataset_size, which with the sampling rate defines the expected batch "
                f"size the gradient is divided by: it cannot be checked against this training's {self.dataset_size} "
                "samples. Nothing was loaded. Fix: resume it with the compiled_psg release that saved it, or start "
                "the training afresh")
        saved = state["dataset_size"]
        if saved != self.dataset_size:
            sizes = ("" if not is_number(saved) else
                     f" (expected batch size {self.sample_rate * saved} against {self.sample_rate * self.dataset_size}"
                     " here, the gradient's divisor)")
            raise DPConfigError(
                f"the saved training sampled a dataset of {saved!r} samples, this one over {self.dataset_size} "
                f"(summed over the ranks) at the same sample_rate={self.sample_rate}{sizes}: the saved run's "
                "batches and divisor are another training's. Nothing was loaded. Fix: build the training over the "
                "saved run's dataset")

    def _saved_history(self, history, steps_taken: int) -> list[tuple[float, float, int]]:
        """The saved accountant's history, refused unless each entry is ``(noise_multiplier, sample_rate, steps)``
        at this training's rate and the entries count at least the step's ``steps_taken`` (more where the step
        counted a release twice after a listener failed: epsilon over-reported, never under-)."""
        shape = "(noise_multiplier, sample_rate, steps)"
        fix = ". Nothing was loaded. Fix: load what PrivateTraining.state_dict() returned, unchanged"
        if not isinstance(history, list | tuple):
            raise DPConfigError(f"the saved accountant's history must be a list of {shape} entries, got "
                                f"{type(history).__name__}{fix}")
        entries = []
        for k, entry in enumerate(history):
            if not (isinstance(entry, list | tuple) and len(entry) == 3):
                raise DPConfigError(f"the saved accountant's history entry {k} must be {shape}, got {entry!r}{fix}")
            sigma, q, n = entry
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise DPConfigError(f"the saved accountant's history entry {k} must be {shape} with steps a "
                                    f"positive int, got {n!r}{fix}")
            try:
                sigma = check_noise_multiplier(sigma)
            except DPConfigError as error:
                raise DPConfigError(f"the saved accountant's history entry {k}: {error}{fix}") from None
            if q != self.sample_rate:
                raise DPConfigError(f"the saved accountant's history entry {k} has sample rate {q!r}, this "
                                    f"training's is {self.sample_rate!r}: every step of the training is accounted "
                                    f"at its rate{fix}")
            entries.append((sigma, q, n))
        counted = sum(n for _, _, n in entries)
        if counted < steps_taken:
            raise DPConfigError(f"the saved accountant's history counts {counted} step(s), fewer than the step's "
                                f"steps_taken {steps_taken}: epsilon() would not cover the steps the saved weights "
                                f"were trained for{fix}")
        return entries


def make_private(model: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                 loss_fn: Callable, *, noise_multiplier: float | None = None,
                 target_epsilon: float | None = None,
                 target_delta: float = 1e-5, epochs: int | None = None, max_grad_norm: float = 1.0,
                 accountant: str = "rdp", secure_rng: bool = False, poisson_sampling: bool = True,
                 loss_reduction: str = "mean", backend: str = "inductor",
                 generator: torch.Generator | None = None,
                 sample_rate: float | None = None,
                 max_physical_batch_size: int | None = None, clipping: str = "flat",
                 **clipping_options) -> PrivateTraining:
    """Make a training loop differentially private (DP-SGD, Abadi et al. 2016).

    ``loss_fn(*batch)`` is the batched loss of ``model`` on one batch as ``data_loader`` yields it. Give
    either ``noise_multiplier`` or ``target_epsilon`` (with ``epochs``: sigma is then calibrated by the
    accountant library for ``epochs * len(data_loader)`` steps at ``target_delta``). The sampling rate is
    ``1 / len(data_loader)`` (batch size over dataset size); the returned ``data_loader`` Poisson-samples the
    same dataset at that rate (``poisson_sampling=False`` keeps the loader as it is, which the accountant's
    analysis does not cover). The gradient is divided by the expected batch size ``q * N`` (``N`` summed over
    the ranks under ``torch.distributed``, where every rank passes a loader over its own shard).

    ``max_physical_batch_size=N`` processes each Poisson-sampled (logical) batch in micro-batches of at most
    ``N`` samples: one noisy optimizer step, and one accounted step, per logical batch.

    The Poisson sampler draws from its own generator, seeded from ``generator`` (or from torch's global one),
    so that it can be saved and resumed (``PrivateTraining.state_dict``) independently of the noise.

    ``clipping``: ``"flat"``, ``"per_layer"`` (``max_grad_norm`` a list of per-group bounds), ``"automatic"``
    or ``"adaptive"``, with the options of ``compile_step`` (``clip_groups``, ``automatic_gamma``,
    ``target_unclipped_quantile``, ``clipbound_learning_rate``, ``unclipped_num_std``, ``min_clipbound``,
    ``max_clipbound``). ``noise_multiplier`` (or the one calibrated for ``target_epsilon``) is the whole step's:
    with adaptive clipping, part of it pays for the noisy count, and the accountant records the noise actually
    added as one Gaussian mechanism.

    The per-sample graph is captured on the loader's first batch, so a model that mixes samples (BatchNorm in
    training mode, ...) is refused here with ``compiled_psg.SampleMixingError``.
    """
    if (noise_multiplier is None) == (target_epsilon is None):
        raise DPConfigError("give exactly one of noise_multiplier and target_epsilon")
    if "expected_batch_size" in clipping_options:  # compile_step takes it; here it is the sampling's to set
        raise DPConfigError("make_private sets the step's expected_batch_size itself, sample_rate x the dataset's "
                            "size (the divisor the accounting assumes). Fix: leave expected_batch_size out; for "
                            "another batch size, give the loader that batch size or pass sample_rate=")
    earlier = _earlier_training(model, optimizer) if isinstance(optimizer, torch.optim.Optimizer) else None
    if earlier is not None and earlier.steps > 0:
        raise _second_training(earlier)
    check_noise_source(secure_rng, generator)
    require_flag("poisson_sampling", poisson_sampling, DPConfigError)
    accounting = Accountant(accountant)  # refused before anything runs or draws
    if target_epsilon is not None and epochs is None:
        raise DPConfigError("target_epsilon needs epochs (the number of passes the noise is calibrated for)")
    if target_epsilon is not None:
        epochs = check_steps(epochs, "epochs")
    elif epochs is not None:  # it would be ignored: nothing is calibrated, and the loader runs as long as iterated
        raise DPConfigError(f"epochs={epochs!r} is used only with target_epsilon (the passes the noise is "
                            "calibrated for); with noise_multiplier given it would do nothing. Fix: drop epochs, "
                            "or give target_epsilon instead of noise_multiplier")
    if not isinstance(data_loader, DataLoader):
        raise DPConfigError(f"data_loader must be a torch.utils.data.DataLoader, got a {type(data_loader).__name__}: "
                            "make_private replaces it with a Poisson-sampling loader over the same dataset. Fix: "
                            "DataLoader(dataset, batch_size=...)")
    dataset_of(data_loader, "data_loader")
    check_batched(data_loader, "data_loader")
    if poisson_sampling:
        check_samples_whole_dataset(data_loader, "data_loader")
    target_delta = check_delta(target_delta)
    if sample_rate is None:
        sample_rate = 1 / len(data_loader)
    sample_rate = check_sample_rate(sample_rate)
    if dist_utils.is_distributed():
        low = -dist_utils.all_reduce_scalar(-sample_rate, op=torch.distributed.ReduceOp.MAX)
        high = dist_utils.all_reduce_scalar(sample_rate, op=torch.distributed.ReduceOp.MAX)
        if abs(high - low) > 1e-12:
            raise DPConfigError(f"ranks disagree on the sampling rate ({low} .. {high}): give every rank a "
                             "shard of the same size and the same batch size, or pass sample_rate=")
    steps_per_epoch = max(1, round(1 / sample_rate))
    if target_epsilon is not None:
        noise_multiplier = calibrate_noise(target_epsilon, target_delta, sample_rate,
                                           epochs * steps_per_epoch, accountant)
    check_accountable(check_noise_multiplier(noise_multiplier), accountant)  # before a step, not at epsilon()
    global_size = dist_utils.all_reduce_scalar(float(len(data_loader.dataset)))
    expected_batch_size = sample_rate * global_size

    # capture on a real batch first: a model that mixes samples is refused before any training
    unknown = sorted(set(clipping_options) - set(inspect.signature(compile_step).parameters))
    if unknown:
        raise DPConfigError(f"make_private got unexpected keyword arguments {unknown}. Fix: pass the settings "
                            "make_private and compile_step take (docs/training.md)")
    first = peek_batch(data_loader)
    if isinstance(first, Mapping):
        raise BatchInputError(
            f"the data loader yields dicts (keys {sorted(first)}); make_private passes a batch to loss_fn as "
            "positional tensors (a tuple or list is spread, anything else is one argument), and a dict is not a "
            "tensor. Fix: yield tuples, e.g. DataLoader(..., collate_fn=lambda rows: (torch.stack([r['x'] for r in "
            "rows]), torch.stack([r['y'] for r in rows]))), with loss_fn(x, y)")
    first = tuple(first) if isinstance(first, list | tuple) else (first,)
    device = next(p.device for p in model.parameters())
    first = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in first)
    dp_step = compile_step(loss_fn, model, optimizer, max_grad_norm=max_grad_norm,
                           noise_multiplier=noise_multiplier, expected_batch_size=expected_batch_size,
                           loss_reduction=loss_reduction, secure_rng=secure_rng, backend=backend,
                           generator=generator, max_physical_batch_size=max_physical_batch_size,
                           clipping=clipping, **clipping_options)
    start = time.perf_counter()
    dp_step.prepare(first)
    dp_step.compile_seconds += time.perf_counter() - start

    loader = data_loader
    with states_put_back([generator], only_on_failure=True):  # the sampler's seed, drawn from it
        if poisson_sampling:
            # its own generator (seeded reproducibly): resuming it must not rewind the noise, nor the other way
            sampler_generator = None
            if not secure_rng:
                seed = int(torch.randint(0, 2**62, (), generator=generator,
                                         device="cpu" if generator is None else generator.device))
                sampler_generator = torch.Generator().manual_seed(seed)
            loader = poisson_loader(data_loader, sample_rate, steps=steps_per_epoch, generator=sampler_generator,
                                    secure=secure_rng, in_dims=clipping_options.get("in_dims", 0))
        training = PrivateTraining._built(model, optimizer, loader, dp_step, accounting, sample_rate,
                                          target_delta, poisson_sampling, dataset_size=round(global_size))
    if earlier is not None:  # one that took no step (a notebook cell run again): this one replaces it
        with earlier.dp_step._running:  # a step of it in flight on another thread ends first, and is seen
            if earlier.steps > 0:
                raise _second_training(earlier)
            earlier.dp_step.retire("this step's PrivateTraining was replaced by a later make_private on the same "
                                   "model, optimizer or parameters, whose accountant counts the model's steps. Fix: "
                                   "step the training the later make_private returned")
    for key, thing in _members(model, optimizer).items():
        try:
            _TRAINING_OF[key] = (weakref.ref(thing), weakref.ref(training))
        except TypeError:  # not weakly referable (a class of the user's with __slots__): not recorded
            pass
    return training


#: ``id`` of a model, optimizer or trained parameter -> (its weak reference, its live ``PrivateTraining``'s): a
#: second ``make_private`` on any of them (a wrapper module and a new optimizer over the same parameters too)
#: would count the model's steps in an accountant of its own (red team R: the first's epsilon() read 0 after four
#: steps). Keyed by ``id`` with the referent checked: a tensor's ``==`` is elementwise, not identity.
_TRAINING_OF: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _members(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, object]:
    """``id`` -> object of the model, the optimizer and the parameters it trains (one walk, not one per key)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {id(thing): thing for thing in (model, optimizer, *params)}


def _earlier_training(model: nn.Module, optimizer: torch.optim.Optimizer) -> PrivateTraining | None:
    for key, (thing, training) in list(_TRAINING_OF.items()):  # forget the dead
        if thing() is None or training() is None:
            del _TRAINING_OF[key]
    for key, thing in _members(model, optimizer).items():
        entry = _TRAINING_OF.get(key)
        if entry is not None and entry[0]() is thing:
            return entry[1]()
    return None


def _second_training(earlier: PrivateTraining) -> DPConfigError:
    return DPConfigError(
        f"this model, optimizer or its parameters are trained by an earlier make_private, whose accountant counts "
        f"its {earlier.steps} steps: a second training of them would count from zero, and its epsilon would leave "
        "out the earlier steps of the same parameters. Fix: go on with the first (its noise_multiplier, "
        "max_grad_norm and noise schedule can change between steps; state_dict() saves and resumes it), or "
        "train a new model and optimizer")

