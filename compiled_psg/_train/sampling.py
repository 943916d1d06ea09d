"""Poisson sampling for DP-SGD: every example joins a batch independently with probability ``q``.

Batch sizes vary from step to step and may be zero; an empty batch still takes a (noisy) step, which the
accountant counts. ``poisson_loader`` turns a dataset (or an existing ``DataLoader``) into such a loader, with
a collate function that returns correctly shaped empty tensors for an empty batch.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, Dataset, default_collate

from .._errors import DPConfigError
from .accounting import check_sample_rate
from .dp import secure_uniform


class PoissonBatchSampler:
    """Yields ``steps`` batches of indices into ``range(num_samples)``, each index kept with probability
    ``sample_rate``. ``steps`` defaults to ``round(1 / sample_rate)`` (one epoch in expectation). With
    ``secure=True`` the coin flips use ``os.urandom`` instead of ``generator``.

    Resumable: ``state_dict()`` records the generator's state at the start of the current epoch and how many
    batches of it were drawn; after ``load_state_dict`` the next epoch replays those draws and yields the rest,
    so a resumed run samples exactly the batches the interrupted one would have. The count is of batches drawn:
    a ``DataLoader`` with worker processes draws a few ahead of the training, so save between epochs there.
    ``os.urandom`` cannot be replayed: a secure sampler resumes with the remaining batches of the epoch, fresh.
    """

    def __init__(self, num_samples: int, sample_rate: float, steps: int | None = None,
                 generator: torch.Generator | None = None, secure: bool = False):
        check_sample_rate(sample_rate)
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.steps = max(1, round(1 / sample_rate)) if steps is None else steps
        self.generator = generator
        self.secure = secure
        self._epoch_state: torch.Tensor | None = None  # the generator's state when the current epoch began
        self._drawn = 0  # batches drawn in the current epoch
        self._resume: tuple[torch.Tensor | None, int] | None = None

    def __len__(self) -> int:
        return self.steps

    def _draw(self) -> list[int]:
        if self.secure:
            u = secure_uniform(self.num_samples)
        else:
            u = torch.rand(self.num_samples, generator=self.generator, dtype=torch.float64)
        return torch.nonzero(u < self.sample_rate).flatten().tolist()

    def _state(self) -> torch.Tensor | None:
        if self.secure:
            return None
        return self.generator.get_state() if self.generator is not None else torch.get_rng_state()

    def _set_state(self, state: torch.Tensor) -> None:
        if self.generator is not None:
            self.generator.set_state(state)
        else:
            torch.set_rng_state(state)

    def __iter__(self) -> Iterator[list[int]]:
        skip = 0
        if self._resume is not None:
            state, skip = self._resume
            self._resume = None
            if state is not None and not self.secure:
                self._set_state(state)
        self._epoch_state, self._drawn = self._state(), 0
        for k in range(self.steps):
            batch = self._draw() if not (self.secure and k < skip) else []
            self._drawn = k + 1
            if k >= skip:
                yield batch

    def state_dict(self) -> dict:
        """The position in the current epoch (an epoch drawn whole counts as none begun)."""
        if self._epoch_state is None or self._drawn >= self.steps:
            return {"epoch_state": self._state(), "drawn": 0}
        return {"epoch_state": self._epoch_state, "drawn": self._drawn}

    def load_state_dict(self, state: dict) -> None:
        """The next iteration resumes the saved epoch (see the class docstring)."""
        self._resume = (state["epoch_state"], int(state["drawn"]))


class _CollateWithEmpty:
    """Wrap a collate function: an empty list of samples becomes the collate of one sample, cut to size 0."""

    def __init__(self, dataset: Dataset, collate_fn):
        self.dataset = dataset
        self.collate_fn = collate_fn or default_collate
        self._empty = None

    def __call__(self, samples):
        if samples:
            return self.collate_fn(samples)
        if self._empty is None:
            one = self.collate_fn([self.dataset[0]])
            self._empty = pytree.tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) else t, one)
        return self._empty


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
                   generator: torch.Generator | None = None, secure: bool = False) -> DataLoader:
    """A ``DataLoader`` over ``data``'s dataset whose batches are Poisson samples at ``sample_rate``.

    From a ``DataLoader``, the rate defaults to ``1 / len(loader)`` (its batch size over the dataset size,
    as in Opacus) and its collate function, workers and pinning are kept.
    """
    dataset = dataset_of(data, "data")
    if isinstance(data, DataLoader):
        collate = data.collate_fn
        options = dict(num_workers=data.num_workers, pin_memory=data.pin_memory)
        if sample_rate is None:
            sample_rate = 1 / len(data)
    else:
        collate, options = None, {}
        if sample_rate is None:
            raise DPConfigError("sample_rate is required when building a Poisson loader from a dataset")
    sampler = PoissonBatchSampler(len(dataset), sample_rate, steps, generator=generator, secure=secure)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=_CollateWithEmpty(dataset, collate),
                      **options)
