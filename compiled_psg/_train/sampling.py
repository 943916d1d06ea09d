"""Poisson sampling for DP-SGD: every example joins a batch independently with probability ``q``.

Batch sizes vary from step to step and may be zero; an empty batch still takes a (noisy) step, which the
accountant counts. ``poisson_loader`` turns a dataset (or an existing ``DataLoader``) into such a loader, with
a collate function that returns correctly shaped empty tensors for an empty batch.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils import _pytree as pytree
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler, default_collate

from .._errors import BatchInputError, DPConfigError, require_flag
from .._generators import state_loads, states_put_back
from .accounting import check_sample_rate
from .config import is_int, is_number
from .dp import secure_uniform


class PoissonBatchSampler:
    """Yields ``steps`` batches of indices into ``range(num_samples)``, each index kept with probability
    ``sample_rate``. ``steps`` defaults to ``round(1 / sample_rate)`` (one epoch in expectation). With
    ``secure=True`` the coin flips use ``os.urandom`` instead of a generator.

    The coins come from ``generator``, or, without one, from a generator of the sampler's own, seeded once at
    construction by one draw from torch's global generator: the sampler never draws from the global generator
    after that, so dropout and other global draws between batches neither change the batches nor are changed by a
    resume (which sets the sampler's generator, never the global one).

    Resumable: ``state_dict()`` records the generator's state at the start of the current epoch, how many
    batches of it were drawn, and what the draws depend on, the sampling rate and the dataset size (a state of
    another rate or size, or one without them, is refused); after ``load_state_dict`` the next epoch replays those
    draws and yields the rest,
    so a resumed run samples exactly the batches the interrupted one would have. A state loaded and not yet
    iterated is what ``state_dict()`` returns, so a checkpoint saved right after a resume resumes at the same
    batch. The count is of batches drawn: a ``DataLoader`` with worker processes draws a few ahead of the
    training, so save between epochs there. ``os.urandom`` cannot be replayed: a secure sampler resumes with the
    remaining batches of the epoch, fresh. Two iterations of the sampler open in one epoch (a peek,
    ``next(iter(loader))``, in the middle of a ``for`` loop over the loader) draw from one generator, in an order
    no position replays: ``state_dict()`` refuses until that epoch has ended.
    """

    def __init__(self, num_samples: int, sample_rate: float, steps: int | None = None,
                 generator: torch.Generator | None = None, secure: bool = False):
        sample_rate = check_sample_rate(sample_rate)
        if not (is_int(num_samples) and num_samples >= 1):  # torch.rand's raw error at the first draw, or none
            raise DPConfigError(f"num_samples (the dataset's size, which the coins are drawn over) must be a positive "
                                f"int, got {num_samples!r}. Fix: PoissonBatchSampler(len(dataset), sample_rate)")
        if steps is not None and not (is_int(steps) and steps >= 1):
            raise DPConfigError(f"steps (the batches of an epoch) must be a positive int or None, got {steps!r}. Fix: "
                                "steps=None draws round(1 / sample_rate) batches an epoch, a pass over the data")
        if generator is not None and not (isinstance(generator, torch.Generator) and generator.device.type == "cpu"):
            raise DPConfigError(f"generator must be a CPU torch.Generator or None (the coins are drawn on the CPU), "
                                f"got {type(generator).__name__} {generator!r}. Fix: "
                                "generator=torch.Generator().manual_seed(seed)")
        if require_flag("secure", secure, DPConfigError) and generator is not None:
            raise DPConfigError("secure=True draws the coins from os.urandom, which no generator seeds: generator= "
                                "would be ignored. Fix: give one source, secure=True without a generator or "
                                "generator= without secure")
        self.num_samples = int(num_samples)
        self.sample_rate = sample_rate
        self.steps = max(1, round(1 / sample_rate)) if steps is None else int(steps)
        if generator is None and not secure:
            # one draw from the global generator, so that an unseeded loader follows torch.manual_seed
            generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, ())))
        self.generator = generator
        self.secure = secure
        self._epoch_state: torch.Tensor | None = None  # the generator's state when the current epoch began
        self._drawn = 0  # batches drawn in the current epoch
        self._resume: tuple[torch.Tensor | None, int] | None = None  # a loaded state, until the next epoch starts
        self._open: set[object] = set()  # the iterations neither exhausted nor closed (a token each)
        self._current: object | None = None  # the latest iteration begun
        self._interleaved = False  # an earlier iteration drew after a later one began, in this epoch

    #: what the accountant's analysis assumes (a training counts every step at this rate over this many samples)
    _FIXED = ("num_samples", "sample_rate", "steps", "generator", "secure")

    def __setattr__(self, name: str, value) -> None:
        self._refuse_changing(name)  # red team P: sample_rate = 0.9 drew 38 of 40 per batch
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        self._refuse_changing(name)  # red team Q: a deleted one could be set again
        super().__delattr__(name)

    def _refuse_changing(self, name: str) -> None:
        if name in self._FIXED and name in self.__dict__:
            raise DPConfigError(f"a PoissonBatchSampler's {name} is fixed when it is built: the accountant counts "
                                "every batch at its sampling rate over its samples. Fix: build another sampler (or "
                                "training, make_private) with the setting")

    def __len__(self) -> int:
        return self.steps

    def _draw(self) -> list[int]:
        if self.secure:
            u = secure_uniform(self.num_samples)
        else:
            u = torch.rand(self.num_samples, generator=self.generator, dtype=torch.float64)
        return torch.nonzero(u < self.sample_rate).flatten().tolist()

    def _state(self) -> torch.Tensor | None:
        return None if self.secure else self.generator.get_state()

    def __iter__(self) -> Iterator[list[int]]:
        skip = 0
        if self._resume is not None:
            state, skip = self._resume
            self._resume = None
            if state is not None:
                self.generator.set_state(state)
        self._epoch_state, self._drawn = self._state(), 0
        token = object()
        if not self._open:
            self._interleaved = False
        self._open.add(token)
        self._current = token
        try:
            for k in range(self.steps):
                if self._current is not token:
                    self._interleaved = True
                batch = self._draw() if not (self.secure and k < skip) else []
                self._drawn = k + 1
                if k >= skip:
                    yield batch
        finally:
            self._open.discard(token)

    def state_dict(self) -> dict:
        """The position in the current epoch (an epoch drawn whole counts as none begun); a loaded state that no
        iteration has started from yet is returned as loaded."""
        if 0 < self._drawn < self.steps and self._resume is None and (
                self._interleaved or any(t is not self._current for t in self._open)):
            raise DPConfigError(
                "the Poisson sampler has two iterations in this epoch (an iterator of the loader begun while another "
                "was in the middle of its epoch, e.g. a peek next(iter(loader)) inside the training loop): they draw "
                "from one generator in an order that no saved position replays, so a resumed run would draw other "
                "batches. Fix: save between epochs, or peek at a batch of another loader over the same dataset")
        if self._resume is not None:
            state, drawn = self._resume
            position = {"epoch_state": None if state is None else state.clone(), "drawn": drawn}
        elif self._drawn == 0 or self._drawn >= self.steps:
            position = {"epoch_state": self._state(), "drawn": 0}
        else:
            position = {"epoch_state": None if self.secure else self._epoch_state.clone(), "drawn": self._drawn}
        # what the position's draws depend on: replayed at another rate or over another size, they are other batches
        return {**position, "sample_rate": float(self.sample_rate), "num_samples": self.num_samples}

    def check_state(self, state: dict) -> None:
        """Refuse, changing nothing, a state that ``load_state_dict`` could not resume exactly: one without the
        sampling rate and dataset size or of others, one of a secure sampler into a seeded one or the reverse,
        another generator's state, a position outside the epoch."""
        if isinstance(state, dict) and set(state) == {"epoch_state", "drawn"}:
            raise DPConfigError(
                "the saved Poisson sampler state records no sample_rate or num_samples (it has only its position, "
                "epoch_state and drawn), so it cannot show that its batches were drawn at this sampler's rate over "
                "this dataset. Nothing was loaded. Fix: if the saved run sampled this dataset at this rate, add both "
                f"to the state, state.update(sample_rate={float(self.sample_rate)!r}, "
                f"num_samples={self.num_samples}) (state['sampler'] in a PrivateTraining state), and load it; "
                "otherwise build the loader as the saved run did")
        if not isinstance(state, dict) or set(state) != _STATE_KEYS:
            raise DPConfigError("the saved sampler state is not a PoissonBatchSampler's state_dict() (keys "
                                f"{sorted(state) if isinstance(state, dict) else type(state).__name__}). Nothing was "
                                "loaded. Fix: load the state saved by PrivateTraining.state_dict()")
        rate, size = state["sample_rate"], state["num_samples"]
        if not (is_number(rate) and is_number(size)) or float(rate) != float(self.sample_rate) \
                or size != self.num_samples:
            raise DPConfigError(
                f"the saved Poisson sampler drew from {size!r} examples at sample_rate {rate!r}, this one from "
                f"{self.num_samples} examples at sample_rate {self.sample_rate!r}: the saved position replayed here "
                "would draw other batches than the saved run's, and its accounting assumed the saved rate. Nothing "
                "was loaded. Fix: build the loader over the saved run's dataset at its sample_rate (make_private: "
                "the same loader and arguments)")
        epoch_state, drawn = state["epoch_state"], state["drawn"]
        if self.secure != (epoch_state is None):
            saved, here = "a generator", "os.urandom (secure_rng=True)"
            if not self.secure:
                saved, here = here, saved
            raise DPConfigError(f"the saved Poisson sampler drew its coins from {saved}, this one from {here}: the "
                                "saved position cannot be resumed. Nothing was loaded. Fix: build the training with "
                                "the secure_rng of the saved run")
        if epoch_state is not None and not state_loads(self.generator, epoch_state):
            raise DPConfigError("the saved Poisson sampler state is not one of this sampler's generator. Nothing was "
                                "loaded. Fix: build the sampler with a generator of the same kind (a CPU "
                                "torch.Generator) as the saved run's")
        if not isinstance(drawn, int) or isinstance(drawn, bool) or not 0 <= drawn < self.steps:
            raise DPConfigError(f"the saved Poisson sampler had drawn {drawn!r} batches of an epoch of "
                                f"{self.steps} here. Nothing was loaded. Fix: build the loader with the sampling "
                                "rate and steps of the saved run")

    def load_state_dict(self, state: dict) -> None:
        """The next iteration resumes the saved epoch (see the class docstring)."""
        self.check_state(state)
        epoch_state = state["epoch_state"]
        self._resume = (None if epoch_state is None else epoch_state.clone(), state["drawn"])


#: the keys of ``PoissonBatchSampler.state_dict()``: the position, and the sampling it is a position in
_STATE_KEYS = {"epoch_state", "drawn", "sample_rate", "num_samples"}


class _CollateWithEmpty:
    """Wrap a collate function: an empty list of samples becomes the collate of one sample, cut to size 0 along
    each argument's batch dimension (``in_dims``, as ``compile_step`` reads it: an int for every argument, or one
    entry per argument, None for an unbatched one, which is left as one sample collates it)."""

    def __init__(self, dataset: Dataset, collate_fn, in_dims=0):
        self.dataset = dataset
        self.collate_fn = collate_fn or default_collate
        self.in_dims = in_dims
        self._empty = None

    def __call__(self, samples):
        if samples:
            return self.collate_fn(samples)
        if self._empty is None:
            self._empty = empty_batch(self.collate_fn([self.dataset[0]]), self.in_dims)
        return self._empty


def empty_batch(one, in_dims):
    """``one`` (a collated batch of one sample) cut to 0 samples along the batch dimensions ``in_dims`` names."""
    def cut(dim):
        def leaf(t):
            if not isinstance(t, torch.Tensor):
                return t
            if t.dim() == 0 or not -t.dim() <= dim < t.dim():
                raise BatchInputError(
                    f"the collate function's batch holds a tensor of shape {tuple(t.shape)}, which has no batch "
                    f"dimension {dim} (in_dims) to cut to an empty Poisson batch. Fix: collate every batched "
                    "tensor with its batch along in_dims, or mark an argument that holds nothing per sample None in "
                    "in_dims")
            return t.narrow(dim, 0, 0)
        return leaf

    if isinstance(in_dims, tuple):
        if not isinstance(one, list | tuple) or len(one) != len(in_dims):
            got = f"{len(one)} arguments" if isinstance(one, list | tuple) else "one argument"
            raise BatchInputError(f"in_dims has {len(in_dims)} entries but the collate function's batch is {got}. "
                                  "Fix: give one in_dims entry per element of the batch the loader yields")
        parts = [part if d is None else pytree.tree_map(cut(d), part) for part, d in zip(one, in_dims, strict=True)]
        return type(one)(*parts) if hasattr(one, "_fields") else type(one)(parts)  # a namedtuple, or not
    if in_dims is None:
        return one
    return pytree.tree_map(cut(in_dims), one)


def dataset_of(data: Dataset | DataLoader, name: str) -> Dataset:
    """The dataset of ``data`` (a ``DataLoader`` or a dataset), refused unless it is map-style and not empty:
    Poisson sampling draws from its indices, and the sampling rate is batch size / dataset size."""
    dataset = data.dataset if isinstance(data, DataLoader) else data
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise DPConfigError(f"{name} must be a DataLoader over a dataset with a length, or such a dataset (Poisson "
                            "sampling draws from its indices, and the sampling rate is batch size / dataset size), "
                            f"got a {type(dataset).__name__}. Fix: use a map-style dataset (torch.utils.data.Dataset "
                            "with __len__ and __getitem__), e.g. DataLoader(TensorDataset(x, y), batch_size=...)")
    if len(dataset) == 0:
        raise DPConfigError(f"the dataset of {name} is empty: there is nothing to sample. Fix: pass the training "
                            "data")
    return dataset


def poisson_loader(data: Dataset | DataLoader, sample_rate: float | None = None, *, steps: int | None = None,
                   generator: torch.Generator | None = None, secure: bool = False, in_dims=0) -> DataLoader:
    """A ``DataLoader`` over ``data``'s dataset whose batches are Poisson samples at ``sample_rate``.

    From a ``DataLoader``, the rate defaults to ``1 / len(loader)`` (its batch size over the dataset size,
    as in Opacus) and its collate function, workers and pinning are kept. The coins come from ``generator``, or
    from the sampler's own generator seeded by one draw from torch's global one (``PoissonBatchSampler``); the
    loader draws nothing from the global generator after its construction (the worker processes' seeds come
    from a generator of its own, which a resume does not restore: with workers, save between epochs). An
    empty batch is the collate of one sample cut to size 0 along each argument's batch dimension: give the
    ``in_dims`` of the step (``compile_step(..., in_dims=)``) when the collate function does not put the batch
    first.
    """
    dataset = dataset_of(data, "data")
    if isinstance(data, DataLoader):
        check_batched(data, "data")
        check_samples_whole_dataset(data, "data")
        collate = data.collate_fn
        options = dict(num_workers=data.num_workers, pin_memory=data.pin_memory)
        if sample_rate is None:
            sample_rate = 1 / len(data)
    else:
        collate, options = None, {}
        if sample_rate is None:
            raise DPConfigError("sample_rate is required when building a Poisson loader from a dataset")
    sampler = PoissonBatchSampler(len(dataset), sample_rate, steps, generator=generator, secure=secure)
    # A DataLoader draws its worker processes' base seed at every iter(), from torch's global generator unless it
    # has one: its own, so that starting an epoch (again after a resume) does not move the global stream that the
    # user saves and restores for dropout. Seeded by one draw from the sampler's generator, at construction.
    seeds = torch.Generator()
    if secure:
        seeds.seed()
    else:
        seeds.manual_seed(int(torch.randint(0, 2**62, (), generator=sampler.generator)))
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=_CollateWithEmpty(dataset, collate, in_dims),
                      generator=seeds, **options)


def check_samples_whole_dataset(loader: DataLoader, name: str) -> None:
    """Refuse a loader whose sampler draws from part of its dataset (``SubsetRandomSampler``, a custom sampler or
    batch sampler): Poisson sampling draws from every index of the dataset, so it would train on rows the sampler
    leaves out, at a rate computed from the sampler's batches (red team N: 595 of 655 rows drawn outside the
    user's split, batches 10 times the size)."""
    sampler, batch_sampler = loader.sampler, loader.batch_sampler
    whole = type(sampler) is SequentialSampler or (type(sampler) is RandomSampler and not sampler.replacement
                                                   and sampler.num_samples == len(loader.dataset))
    if not whole or (batch_sampler is not None and type(batch_sampler) is not BatchSampler):
        custom = type(batch_sampler if type(batch_sampler) is not BatchSampler else sampler).__name__
        raise DPConfigError(f"{name} draws its batches with a {custom}, and Poisson sampling draws from every index "
                            f"of its dataset ({len(loader.dataset)}): it would use samples the {custom} leaves out, "
                            "at a rate computed from its batches. Fix: give the loader the dataset to sample from, "
                            "DataLoader(torch.utils.data.Subset(dataset, indices), batch_size=...), with shuffle or "
                            "not")


def peek_batch(loader: DataLoader):
    """The loader's first batch, with every generator the peek draws from left as it was: starting an iterator
    draws the workers' base seed from the loader's generator (torch's global one without), and a shuffling
    sampler draws its permutation's seed. ``make_private`` only looks at this batch; a refused call, or a run that
    then iterates the loader itself (``poisson_sampling=False``), must see the streams the user seeded."""
    with states_put_back((loader.generator, getattr(loader.sampler, "generator", None),
                          getattr(loader.batch_sampler, "generator", None))):
        return next(iter(loader))


def check_batched(loader: DataLoader, name: str) -> None:
    """Refuse a loader that yields single samples (``batch_size=None``): its length is the dataset's, not a number
    of batches, and its collate function (``default_convert``) does not stack samples into a batch."""
    if loader.batch_sampler is None:
        raise DPConfigError(f"{name} yields single samples, not batches (DataLoader(..., batch_size=None)): the "
                            "sampling rate is batch size / dataset size, and the Poisson loader collates its "
                            "samples into batches with the loader's collate_fn. Fix: give the loader a batch size, "
                            "DataLoader(dataset, batch_size=...), the expected size of a Poisson batch")
