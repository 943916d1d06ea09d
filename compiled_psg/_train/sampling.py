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

from .dp import secure_uniform


class PoissonBatchSampler:
    """Yields ``steps`` batches of indices into ``range(num_samples)``, each index kept with probability
    ``sample_rate``. ``steps`` defaults to ``round(1 / sample_rate)`` (one epoch in expectation). With
    ``secure=True`` the coin flips use ``os.urandom`` instead of ``generator``."""

    def __init__(self, num_samples: int, sample_rate: float, steps: int | None = None,
                 generator: torch.Generator | None = None, secure: bool = False):
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.steps = max(1, round(1 / sample_rate)) if steps is None else steps
        self.generator = generator
        self.secure = secure

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            if self.secure:
                u = secure_uniform(self.num_samples)
            else:
                u = torch.rand(self.num_samples, generator=self.generator, dtype=torch.float64)
            yield torch.nonzero(u < self.sample_rate).flatten().tolist()


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


def poisson_loader(data: Dataset | DataLoader, sample_rate: float | None = None, *, steps: int | None = None,
                   generator: torch.Generator | None = None, secure: bool = False) -> DataLoader:
    """A ``DataLoader`` over ``data``'s dataset whose batches are Poisson samples at ``sample_rate``.

    From a ``DataLoader``, the rate defaults to ``1 / len(loader)`` (its batch size over the dataset size,
    as in Opacus) and its collate function, workers and pinning are kept.
    """
    if isinstance(data, DataLoader):
        dataset, collate = data.dataset, data.collate_fn
        options = dict(num_workers=data.num_workers, pin_memory=data.pin_memory)
        if sample_rate is None:
            sample_rate = 1 / len(data)
    else:
        dataset, collate, options = data, None, {}
        if sample_rate is None:
            raise ValueError("sample_rate is required when building a Poisson loader from a dataset")
    sampler = PoissonBatchSampler(len(dataset), sample_rate, steps, generator=generator, secure=secure)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=_CollateWithEmpty(dataset, collate),
                      **options)
