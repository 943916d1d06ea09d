"""scikit-learn's handwritten digits (1,797 images of 8x8 pixels, shipped with the package: no download)."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def load_digits(test_fraction: float = 0.2, seed: int = 0, train_subset: int | None = None,
                dtype: torch.dtype = torch.float32) -> tuple[TensorDataset, TensorDataset]:
    """``(train, test)`` datasets of ``(image [1, 8, 8], label)``, a stratified split fixed by ``seed``.

    Pixels are scaled by a constant (``(x / 16 - 0.5) / 0.5``, into [-1, 1]): nothing is fitted on the
    training data, so the preprocessing costs no privacy. ``train_subset`` keeps the first that many
    training examples (for quick runs).
    """
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    bunch = sklearn_digits()
    x = torch.tensor(bunch.data, dtype=dtype).reshape(-1, 1, 8, 8)
    x = (x / 16.0 - 0.5) / 0.5
    y = torch.tensor(bunch.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(torch.arange(len(y)).numpy(), test_size=test_fraction,
                                           random_state=seed, stratify=bunch.target)
    train_idx, test_idx = torch.as_tensor(train_idx), torch.as_tensor(test_idx)
    if train_subset is not None:
        train_idx = train_idx[:train_subset]
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[test_idx], y[test_idx])
