"""The benchmark models, as data: ``MODELS[name]`` says how to build the model, its batches and its loss.

Every model is built from code (no downloads) with a fixed seed, so every method in a process starts from the
same weights and sees the same batches. ``config`` is the full-size model; ``quick`` overrides it for
``--quick`` (tiny sizes, for checking the harness, not for figures).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

# -- models ----------------------------------------------------------------------------------------


class SimpleCNN(nn.Module):
    """The CNN of the PyTorch per-sample-gradients tutorial (MNIST-sized input [B, 1, 28, 28]), returning logits
    (the benchmarks' criterion is cross-entropy) rather than the tutorial's log-probabilities. The layers of
    ``compiled_psg._inspect.examples.SeedCNN``, defined here so that the harness (and its baselines) runs even
    where ``compiled_psg`` cannot be imported."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def mlp(sizes: tuple[int, ...]) -> nn.Module:
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(d_in, d_out))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class TransformerClassifier(nn.Module):
    """Token and position embeddings, ``nn.TransformerEncoder`` (nn.MultiheadAttention), mean-pool, linear."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.encoder(self.embed(tokens) + self.pos(positions))
        return self.head(h.mean(1))


class GNBlock(nn.Module):
    """A ResNet basic block with GroupNorm: conv-GN-relu-conv-GN, plus the (possibly strided) shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.gn1 = nn.GroupNorm(groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.gn2 = nn.GroupNorm(groups, c_out)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.GroupNorm(groups, c_out))

    def forward(self, x):
        h = F.relu(self.gn1(self.conv1(x)))
        return F.relu(self.gn2(self.conv2(h)) + self.shortcut(x))


class ResNetGN(nn.Module):
    """A small ResNet-style CNN for [B, 3, H, W] images: stem, stages of GN blocks, pooling, linear."""

    def __init__(self, width: int, stages: int, blocks: int, groups: int = 8, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.GroupNorm(groups, width), nn.ReLU())
        layers, c = [], width
        for s in range(stages):
            c_out = width * 2**s
            for b in range(blocks):
                layers.append(GNBlock(c, c_out, 2 if (s > 0 and b == 0) else 1, groups))
                c = c_out
        self.blocks = nn.Sequential(*layers)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        h = self.blocks(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 1000
    seq: int = 128
    d: int = 128
    layers: int = 2
    heads: int = 4


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.c_attn = nn.Linear(cfg.d, 3 * cfg.d)
        self.c_proj = nn.Linear(cfg.d, cfg.d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d)
        self.mlp = nn.Sequential(nn.Linear(cfg.d, 4 * cfg.d), nn.GELU(approximate="tanh"), nn.Linear(4 * cfg.d, cfg.d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2-style decoder (pre-LayerNorm blocks, causal attention, GELU MLP), LM head tied to ``wte``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.d)
        self.wpe = nn.Embedding(cfg.seq, cfg.d)
        self.h = nn.Sequential(*[GPTBlock(cfg) for _ in range(cfg.layers)])
        self.ln_f = nn.LayerNorm(cfg.d)
        self.lm_head = nn.Linear(cfg.d, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.lm_head(self.ln_f(self.h(self.wte(tokens) + self.wpe(positions))))


# -- losses ----------------------------------------------------------------------------------------


class TokenCrossEntropy(nn.Module):
    """Cross-entropy of logits [B, T, V] against targets [B, T], a mean over all tokens.

    ``reduction="none"`` gives one loss per sequence (the mean over its tokens), which is the loss of that
    sample alone: what Opacus's ghost clipping and torchjd's Gramian expect.
    """

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, logits, targets):
        per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        per_sample = per_token.view(targets.shape).mean(1)
        if self.reduction == "none":
            return per_sample
        return per_sample.sum() if self.reduction == "sum" else per_sample.mean()


# -- batches ---------------------------------------------------------------------------------------


def images(channels: int, size: int, classes: int = 10) -> Callable[[int, torch.Generator], tuple]:
    def make(batch: int, gen: torch.Generator) -> tuple:
        return torch.randn(batch, channels, size, size, generator=gen), torch.randint(classes, (batch,), generator=gen)

    return make


def vectors(dim: int, classes: int = 10) -> Callable[[int, torch.Generator], tuple]:
    def make(batch: int, gen: torch.Generator) -> tuple:
        return torch.randn(batch, dim, generator=gen), torch.randint(classes, (batch,), generator=gen)

    return make


def token_labels(vocab: int, seq: int, classes: int = 10) -> Callable[[int, torch.Generator], tuple]:
    def make(batch: int, gen: torch.Generator) -> tuple:
        return torch.randint(vocab, (batch, seq), generator=gen), torch.randint(classes, (batch,), generator=gen)

    return make


def next_tokens(vocab: int, seq: int) -> Callable[[int, torch.Generator], tuple]:
    def make(batch: int, gen: torch.Generator) -> tuple:
        tokens = torch.randint(vocab, (batch, seq + 1), generator=gen)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return make


# -- the table -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """``build(**config)`` gives ``(model, make_batch, criterion)``; ``batch`` is the headline batch size."""

    label: str
    build: Callable[..., tuple[nn.Module, Callable, nn.Module]]
    batch: int
    config: dict = field(default_factory=dict)
    quick: dict = field(default_factory=dict)
    quick_batch: int = 8
    # Some module's output has no batch dimension (a position embedding): torchjd then needs batch_dim=None.
    unbatched_module: bool = False

    def describe(self, quick: bool) -> str:
        cfg = {**self.config, **self.quick} if quick else self.config
        return ", ".join(f"{k}={v}" for k, v in cfg.items()) or "as published"


def _simple_cnn():
    return SimpleCNN(), images(1, 28), nn.CrossEntropyLoss()


def _mlp(sizes):
    return mlp(sizes), vectors(sizes[0], sizes[-1]), nn.CrossEntropyLoss()


def _transformer(vocab, d, layers, heads, seq):
    return (
        TransformerClassifier(vocab, d, layers, heads, seq),
        token_labels(vocab, seq),
        nn.CrossEntropyLoss(),
    )


def _resnet(width, stages, blocks, image):
    return ResNetGN(width, stages, blocks), images(3, image), nn.CrossEntropyLoss()


def _gpt2(**cfg):
    config = GPTConfig(**cfg)
    return GPT(config), next_tokens(config.vocab, config.seq), TokenCrossEntropy()


MODELS: dict[str, ModelSpec] = {
    "cnn": ModelSpec("SimpleCNN (per-sample tutorial)", _simple_cnn, batch=64),
    "mlp": ModelSpec(
        "MLP 784-512-512-10",
        _mlp,
        batch=256,
        config=dict(sizes=(784, 512, 512, 10)),
        quick=dict(sizes=(784, 64, 64, 10)),
    ),
    "transformer": ModelSpec(
        "Transformer classifier",
        _transformer,
        batch=32,
        unbatched_module=True,
        config=dict(vocab=1000, d=128, layers=2, heads=4, seq=64),
        quick=dict(d=32, layers=1, seq=16),
    ),
    "resnet": ModelSpec(
        "ResNet-style CNN, GroupNorm",
        _resnet,
        batch=64,
        config=dict(width=32, stages=2, blocks=1, image=32),
        quick=dict(width=8, image=16),
    ),
    "gpt2": ModelSpec(
        "GPT-2-style decoder, tied embeddings",
        _gpt2,
        batch=16,
        unbatched_module=True,
        config=dict(vocab=1000, seq=128, d=128, layers=2, heads=4),
        quick=dict(d=32, layers=1, seq=32),
    ),
}


@dataclass
class Workload:
    """One model, built: the model (each method copies it), deterministic batches, and the loss."""

    name: str
    spec: ModelSpec
    model: nn.Module
    make_batch: Callable[[int, torch.Generator], tuple]
    criterion: nn.Module
    device: torch.device
    batch_size: int  # the headline batch size (the quick one with --quick)

    def batch(self, size: int, seed: int = 0) -> tuple:
        gen = torch.Generator().manual_seed(seed)
        return tuple(t.to(self.device) for t in self.make_batch(size, gen))


def build_workload(name: str, quick: bool, device: torch.device) -> Workload:
    spec = MODELS[name]
    torch.manual_seed(0)
    config = {**spec.config, **spec.quick} if quick else spec.config
    model, make_batch, criterion = spec.build(**config)
    batch_size = spec.quick_batch if quick else spec.batch
    return Workload(name, spec, model.to(device), make_batch, criterion.to(device), device, batch_size)
