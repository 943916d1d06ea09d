"""Reference models for ``python -m compiled_psg explain`` and the committed dumps in ``graphs/``.

Each example is data: a name, a builder returning ``(model, loss_fn, batch)``, and the reduction to explain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._reduce import reductions as R


class SeedCNN(nn.Module):
    """The per-sample-gradients tutorial's SimpleCNN."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), dim=1)


class TiedLM(nn.Module):
    """A small language model whose output layer reuses the embedding (weight tying)."""

    def __init__(self, vocab: int = 50, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.0, batch_first=True)

    def forward(self, tokens):
        return F.linear(self.block(self.embed(tokens)), self.embed.weight)


class EncoderClassifier(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16, classes: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def _weight_norm_mlp():
    return nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(8, 16)), nn.Tanh(), nn.Linear(16, 3))


@dataclass(frozen=True)
class Example:
    name: str
    build: Callable[[], tuple[nn.Module, Callable, tuple]]
    reduce: object = None
    doc: str = ""


def _seed_cnn():
    g = torch.Generator().manual_seed(0)
    model = SeedCNN()
    return model, (lambda x, y: F.nll_loss(model(x), y)), (torch.randn(4, 1, 28, 28, generator=g),
                                                             torch.randint(0, 10, (4,), generator=g))


def _encoder():
    g = torch.Generator().manual_seed(0)
    model = EncoderClassifier()
    return model, (lambda t, y: F.cross_entropy(model(t), y)), (torch.randint(0, 50, (4, 6), generator=g),
                                                                  torch.randint(0, 3, (4,), generator=g))


def _tied_lm():
    g = torch.Generator().manual_seed(0)
    model = TiedLM()
    tokens = torch.randint(0, 50, (4, 7), generator=g)

    def loss_fn(t):
        logits = model(t[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), t[:, 1:].flatten())

    return model, loss_fn, (tokens,)


def _wn_mlp():
    g = torch.Generator().manual_seed(0)
    model = _weight_norm_mlp()
    return model, (lambda x, y: F.cross_entropy(model(x), y)), (torch.randn(4, 8, generator=g),
                                                                  torch.randint(0, 3, (4,), generator=g))


def _mlp():
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    return model, (lambda x, y: F.cross_entropy(model(x), y)), (torch.randn(4, 8, generator=g),
                                                                  torch.randint(0, 3, (4,), generator=g))


EXAMPLES: dict[str, Example] = {e.name: e for e in [
    Example("seed_cnn", _seed_cnn, None, "the tutorial's SimpleCNN, per-sample gradients"),
    Example("transformer_encoder", _encoder, None, "an embedding + TransformerEncoderLayer classifier"),
    Example("tied_embedding_lm", _tied_lm, None, "a language model with the embedding reused as output layer"),
    Example("weight_norm_mlp", _wn_mlp, None, "an MLP with a weight_norm parametrization"),
    Example("reduce_norms", _mlp, R.norms(), "psg.norms(): ghost norms, nothing materialized"),
    Example("reduce_clip_sum", _mlp, R.clip_sum(1.0), "psg.clip_sum(1.0): book-keeping in one backward"),
    Example("reduce_sum_squares", _mlp, R.sum_squares(), "psg.sum_squares(): (G*G)^T (X*X)"),
    Example("reduce_variance", _mlp, R.variance(), "psg.variance()"),
    Example("reduce_gram", _mlp, R.gram(), "psg.gram(): (A A^T) * (G G^T)"),
    Example("reduce_clip_sum_sequence", _tied_lm, R.clip_sum(1.0),
            "clip_sum on a tied-embedding sequence model: the cost model's choice per layer"),
]}
