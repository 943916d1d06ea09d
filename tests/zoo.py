"""The model zoo, as data: one ``Case`` per model/loss shape the engine must handle.

``case.build(dtype)`` seeds the RNG, calls the case's builder and returns a ``Built``: the model (converted to
``dtype``, in the mode the case needs), ``loss`` (the batched loss as a function of the batch arguments,
closing over the model), ``make_batch(B, dtype, generator) -> args`` and ``in_dims``. Dropout is off
everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Built:
    model: nn.Module
    loss: Callable
    make_batch: Callable[[int, torch.dtype, torch.Generator], tuple]
    in_dims: object = 0

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}


@dataclass(frozen=True)
class Case:
    id: str
    builder: Callable[[], Built]
    batch: int = 3

    def build(self, dtype: torch.dtype = torch.float64, seed: int = 0) -> Built:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            built = self.builder()
        built.model.to(dtype)
        return built

    def __repr__(self) -> str:
        return self.id


# ---------------------------------------------------------------- batch helpers


def randn(g, dtype, *shape, scale=1.0):
    return torch.randn(*shape, generator=g, dtype=dtype) * scale


def labels(g, n_classes, *shape):
    return torch.randint(0, n_classes, shape, generator=g)


def _flat_size(module: nn.Module, *shape) -> int:
    with torch.no_grad():
        return module(torch.zeros(1, *shape)).numel()


class Seq(nn.Module):
    """A feature extractor followed by a flatten and a linear classifier (sizes found by a dry run)."""

    def __init__(self, features: nn.Module, in_shape: tuple, n_classes: int):
        super().__init__()
        self.features = features
        self.head = nn.Linear(_flat_size(features, *in_shape), n_classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def classifier_case(features_fn: Callable[[], nn.Module], in_shape: tuple, n_classes: int = 3,
                    mode: str = "ce_mean") -> Callable[[], Built]:
    """A builder for ``features -> flatten -> Linear`` with a classification or regression loss."""

    def build():
        model = Seq(features_fn(), in_shape, n_classes)

        if mode == "ce_mean":
            def loss(x, y):
                return F.cross_entropy(model(x), y)
        elif mode == "mse_mean":  # mean over the batch AND the output elements
            def loss(x, y):
                return F.mse_loss(model(x), y)
        else:
            raise ValueError(mode)

        def make_batch(B, dtype, g):
            x = randn(g, dtype, B, *in_shape)
            y = labels(g, n_classes, B) if mode == "ce_mean" else randn(g, dtype, B, n_classes)
            return x, y

        return Built(model, loss, make_batch)

    return build


# ---------------------------------------------------------------- the tutorial's SimpleCNN


from compiled_psg._inspect.examples import SeedCNN as SimpleCNN  # noqa: E402  (one definition of the model)


def build_simple_cnn():
    model = SimpleCNN()

    def loss(x, y):
        return F.nll_loss(model(x), y)

    return Built(model, loss, lambda B, dtype, g: (randn(g, dtype, B, 1, 28, 28), labels(g, 10, B)))


# ---------------------------------------------------------------- MLPs


def build_mlp_sum_mse():
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))

    def loss(x, y):
        return F.mse_loss(model(x), y, reduction="sum")

    return Built(model, loss, lambda B, dtype, g: (randn(g, dtype, B, 5), randn(g, dtype, B, 3)))


ELEMENTWISE_LOSSES = {  # loss(output [B, 3, 2], target) with a reduction over the batch and the elements
    "huber_mean": lambda o, t: F.huber_loss(o, t, delta=0.5),
    "smooth_l1_sum": lambda o, t: F.smooth_l1_loss(o, t, beta=0.3, reduction="sum"),
    "soft_margin_mean": lambda o, t: F.soft_margin_loss(o, t.sign()),
    "bce_weighted_sum": lambda o, t: F.binary_cross_entropy(torch.sigmoid(o), torch.sigmoid(t),
                                                            weight=torch.linspace(0.5, 1.5, 2, dtype=o.dtype),
                                                            reduction="sum"),
    "bce_logits_pos_weight_mean": lambda o, t: F.binary_cross_entropy_with_logits(
        o, torch.sigmoid(t), pos_weight=torch.full((2,), 2.0, dtype=o.dtype)),
}


def elementwise_loss_case(name: str) -> Callable[[], Built]:
    """An MLP over [B, 3, 4] inputs with one of ``ELEMENTWISE_LOSSES`` (rules/reduce.py, ``elementwise_loss``)."""

    def build():
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))

        def loss(x, t):
            return ELEMENTWISE_LOSSES[name](model(x), t)

        return Built(model, loss, lambda B, dtype, g: (randn(g, dtype, B, 3, 4), randn(g, dtype, B, 3, 2)))

    return build


def build_mlp_ce_mean():
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6), nn.GELU(), nn.Linear(6, 4))

    def loss(x, y):
        return F.cross_entropy(model(x), y)

    return Built(model, loss, lambda B, dtype, g: (randn(g, dtype, B, 5), labels(g, 4, B)))


# ---------------------------------------------------------------- sequences and embeddings


def build_embedding_layernorm_seq():
    V, E, T = 11, 8, 6

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, E, padding_idx=0)
            self.norm = nn.LayerNorm(E)
            self.out = nn.Linear(E, V)

        def forward(self, tokens):
            return self.out(self.norm(self.emb(tokens)))

    model = Model()

    def loss(tokens, targets):
        logits = model(tokens)
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))

    def make_batch(B, dtype, g):
        tokens = labels(g, V, B, T)
        tokens[:, -1] = 0  # padding tokens present in every sample
        return tokens, labels(g, V, B, T)

    return Built(model, loss, make_batch)


def build_rmsnorm_seq():
    T = 5
    model = nn.Sequential(nn.Linear(5, 8), nn.RMSNorm(8), nn.GELU(), nn.Linear(8, 3))

    def loss(x, y):
        return F.cross_entropy(model(x).reshape(-1, 3), y.reshape(-1))

    return Built(model, loss, lambda B, dtype, g: (randn(g, dtype, B, T, 5), labels(g, 3, B, T)))


def build_seq_linear():
    T = 5
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5))

    def loss(x, y):
        return F.cross_entropy(model(x).reshape(-1, 5), y.reshape(-1))

    return Built(model, loss, lambda B, dtype, g: (randn(g, dtype, B, T, 4), labels(g, 5, B, T)))


def build_position_embedding_lm():
    V, E, T = 13, 8, 6

    class PositionLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(V, E)
            self.pos = nn.Embedding(T, E)  # shared by every sample: its gradient is summed before the scatter
            self.out = nn.Linear(E, V)

        def forward(self, tokens):
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            return self.out(torch.tanh(self.tok(tokens) + self.pos(positions)))

    model = PositionLM()

    def loss(tokens, targets):
        return F.cross_entropy(model(tokens).reshape(-1, V), targets.reshape(-1))

    return Built(model, loss, lambda B, dtype, g: (labels(g, V, B, T), labels(g, V, B, T)))


def build_tied_embedding_lm():
    V, E, T = 13, 8, 6

    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, E)
            self.mix = nn.Linear(E, E)
            self.norm = nn.LayerNorm(E)
            self.out_bias = nn.Parameter(torch.zeros(V))

        def forward(self, tokens):
            h = self.emb(tokens)
            h = self.norm(h + torch.tanh(self.mix(h)))
            return F.linear(h, self.emb.weight, self.out_bias)  # the embedding reused as the output layer

    model = TiedLM()

    def loss(tokens):
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1))

    return Built(model, loss, lambda B, dtype, g: (labels(g, V, B, T),))


def build_masked_token_mean():
    V, T = 7, 6
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, V))

    def loss(x, y, mask):
        tok = F.cross_entropy(model(x).transpose(1, 2), y, reduction="none")  # [B, T]
        return (tok * mask).sum() / mask.sum()

    def make_batch(B, dtype, g):
        mask = (torch.rand(B, T, generator=g) < 0.6).to(dtype)
        mask[:, 0] = 1  # every sample has at least one token
        mask[0, :] = 1  # and the lengths differ
        return randn(g, dtype, B, T, 4), labels(g, V, B, T), mask

    return Built(model, loss, make_batch)


def build_ce_ignore_index():
    V, T = 7, 6
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, V))

    def loss(x, y):
        return F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), ignore_index=-100)

    def make_batch(B, dtype, g):
        y = labels(g, V, B, T)
        drop = torch.rand(B, T, generator=g) < 0.4
        drop[:, 0] = False
        drop[0, :] = False
        y[drop] = -100
        return randn(g, dtype, B, T, 4), y

    return Built(model, loss, make_batch)


def build_lstm():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(4, 5, batch_first=True)
            self.head = nn.Linear(5, 3)

        def forward(self, x):
            out, _ = self.rnn(x)
            return self.head(out[:, -1])

    model = Model()

    def loss(x, y):
        return F.cross_entropy(model(x), y)

    return Built(model, loss, lambda B, dtype, g: (randn(g, dtype, B, 5, 4), labels(g, 3, B)))


def build_gru_seq_first():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(4, 5)  # [T, B, F]
            self.head = nn.Linear(5, 3)

        def forward(self, x):
            out, h = self.rnn(x)
            return self.head(out.mean(0) + h[-1])

    model = Model()

    def loss(x, y):
        return F.cross_entropy(model(x), y)

    return Built(model, loss, lambda B, dtype, g: (randn(g, dtype, 5, B, 4), labels(g, 3, B)), in_dims=(1, 0))


# ---------------------------------------------------------------- attention


def _causal(T):
    return torch.ones(T, T, dtype=torch.bool).triu(1)  # True = not allowed


def build_mha_batch_first():
    E, T = 8, 5

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(E, 2, batch_first=True)
            self.head = nn.Linear(E, 3)

        def forward(self, x, mask):
            out, _ = self.attn(x, x, x, attn_mask=mask, need_weights=False)
            return self.head(out)

    model = Model().eval()

    def loss(x, mask, y):  # mask is unbatched
        return F.mse_loss(model(x, mask), y)

    def make_batch(B, dtype, g):
        return randn(g, dtype, B, T, E), _causal(T), randn(g, dtype, B, T, 3)

    return Built(model, loss, make_batch, in_dims=(0, None, 0))


def build_mha_seq_first():
    E, T, S = 8, 4, 5

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(E, 2, kdim=6, vdim=6)  # [T, B, E], cross-attention
            self.head = nn.Linear(E, 3)

        def forward(self, q, kv):
            out, weights = self.attn(q, kv, kv)  # need_weights=True: averaged weights returned
            return self.head(out.mean(0)) + weights[:, :, :1].sum(1)

    model = Model().eval()

    def loss(q, kv, y):
        return F.cross_entropy(model(q, kv), y)

    return Built(model, loss,
                 lambda B, dtype, g: (randn(g, dtype, T, B, E), randn(g, dtype, S, B, 6), labels(g, 3, B)),
                 in_dims=(1, 1, 0))


def build_encoder_batch_first():
    E, T = 8, 6

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(E, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
            self.head = nn.Linear(E, 4)

        def forward(self, x, pad):
            return self.head(self.layer(x, src_key_padding_mask=pad).mean(1))

    model = Model().eval()

    def loss(x, pad, y):
        return F.cross_entropy(model(x, pad), y)

    def make_batch(B, dtype, g):
        pad = torch.rand(B, T, generator=g) < 0.3
        pad[:, 0] = False
        return randn(g, dtype, B, T, E), pad, labels(g, 4, B)

    return Built(model, loss, make_batch)


def build_encoder_seq_first():
    E, T = 8, 5

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(E, 2, dim_feedforward=16, dropout=0.0, norm_first=True,
                                                    activation="gelu")  # [T, B, E]
            self.head = nn.Linear(E, 4)

        def forward(self, x):
            return self.head(self.layer(x, src_mask=_causal(x.shape[0]))[-1])

    model = Model().eval()

    def loss(x, y):
        return F.cross_entropy(model(x), y)

    return Built(model, loss, lambda B, dtype, g: (randn(g, dtype, T, B, E), labels(g, 4, B)), in_dims=(1, 0))


# ---------------------------------------------------------------- other layers


def build_bilinear():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.bil = nn.Bilinear(4, 5, 6)
            self.head = nn.Linear(6, 3)

        def forward(self, a, b):
            return self.head(torch.tanh(self.bil(a, b)))

    model = Model()

    def loss(a, b, y):
        return F.cross_entropy(model(a, b), y)

    def make_batch(B, dtype, g):
        return randn(g, dtype, B, 4), randn(g, dtype, B, 5), labels(g, 3, B)

    return Built(model, loss, make_batch)


def build_prelu():
    model = nn.Sequential(nn.Linear(5, 6), nn.PReLU(), nn.Linear(6, 6), nn.PReLU(6), nn.Linear(6, 3))

    def loss(x, y):
        return F.cross_entropy(model(x), y)

    return Built(model, loss, lambda B, dtype, g: (randn(g, dtype, B, 5), labels(g, 3, B)))


def build_weight_norm_mlp():
    wn = torch.nn.utils.parametrizations.weight_norm
    model = nn.Sequential(wn(nn.Linear(5, 6)), nn.Tanh(), wn(nn.Linear(6, 3), dim=None))

    def loss(x, y):
        return F.cross_entropy(model(x), y)

    return Built(model, loss, lambda B, dtype, g: (randn(g, dtype, B, 5), labels(g, 3, B)))


class RawParams(nn.Module):
    """Bare parameters used by functional code in the loss."""

    def __init__(self, **shapes_and_inits):
        super().__init__()
        for name, value in shapes_and_inits.items():
            setattr(self, name, nn.Parameter(value))


def build_raw_affine():
    m = RawParams(W=torch.randn(6, 5) * 0.4, b=torch.randn(6) * 0.1, scale=1 + 0.2 * torch.randn(6),
                  shift=0.1 * torch.randn(6), W2=torch.randn(3, 6) * 0.4)

    def loss(x, y):
        h = x @ m.W.T + m.b
        h = torch.tanh(h * m.scale + m.shift)
        return F.cross_entropy(h @ m.W2.T, y)

    return Built(m, loss, lambda B, dtype, g: (randn(g, dtype, B, 5), labels(g, 3, B)))


def build_raw_strided_slices():
    """A weight read in strided slices and rows (``slice_backward`` with a step, ``select_backward``)."""
    m = RawParams(W=torch.randn(4, 6) * 0.4, b=torch.randn(4) * 0.1)

    def loss(x, y):
        W = torch.cat([m.W[:, ::2], m.W[:, 1::2]], 1)
        return F.cross_entropy(x @ W.T, y) + 0.1 * ((x @ m.W[1]).tanh() + x[:, :2] @ m.b[::2].tanh()).sum()

    return Built(m, loss, lambda B, dtype, g: (randn(g, dtype, B, 6), labels(g, 4, B)))


def build_raw_temperature():
    m = RawParams(W=torch.randn(4, 5) * 0.4, temperature=torch.tensor(1.7))

    def loss(x, y):
        logits = F.linear(x, m.W) / m.temperature
        return F.cross_entropy(logits, y)

    return Built(m, loss, lambda B, dtype, g: (randn(g, dtype, B, 5), labels(g, 4, B)))


def build_raw_einsum():
    T = 4
    m = RawParams(W=torch.randn(6, 5) * 0.4, v=torch.randn(6) * 0.5, M=torch.randn(6, 6) * 0.3)

    def loss(x, y):
        h = torch.tanh(torch.einsum("bti,oi->bto", x, m.W))  # sequence linear
        q = torch.einsum("bto,op,btp->bt", h, m.M, h)  # a bilinear form per token
        s = torch.einsum("bto,o->bt", h, m.v) + q
        return F.mse_loss(s, y)

    return Built(m, loss, lambda B, dtype, g: (randn(g, dtype, B, T, 5), randn(g, dtype, B, T)))


def build_layer_reused():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(4, 6)
            self.shared = nn.Linear(6, 6)
            self.head = nn.Linear(6, 3)

        def forward(self, x):
            h = torch.tanh(self.inp(x))
            for _ in range(3):
                h = torch.tanh(self.shared(h)) + h
            return self.head(h)

    model = Model()

    def loss(x, y):
        return F.cross_entropy(model(x), y)

    return Built(model, loss, lambda B, dtype, g: (randn(g, dtype, B, 4), labels(g, 3, B)))


def build_frozen_and_buffers():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(5, 5)
            self.frozen = nn.Linear(5, 6)
            self.frozen.requires_grad_(False)
            self.frozen_scale = nn.Parameter(torch.rand(6) + 0.5, requires_grad=False)
            self.head = nn.Linear(6, 3)
            self.register_buffer("shift", torch.randn(5))
            self.register_buffer("gain", torch.rand(6) + 0.5)

        def forward(self, x):
            h = torch.tanh(self.inp(x - self.shift))
            h = torch.tanh(self.frozen(h)) * self.gain * self.frozen_scale
            return self.head(h)

    model = Model()

    def loss(x, y):
        return F.cross_entropy(model(x), y)

    return Built(model, loss, lambda B, dtype, g: (randn(g, dtype, B, 5), labels(g, 3, B)))


def build_batchnorm_eval():
    features = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3),
                             nn.BatchNorm2d(4))
    model = Seq(features, (2, 7, 7), 3)
    for bn in (features[1], features[4]):
        bn.running_mean.copy_(torch.randn(4) * 0.3)
        bn.running_var.copy_(torch.rand(4) + 0.5)
    model.eval()

    def loss(x, y):
        return F.cross_entropy(model(x), y)

    return Built(model, loss, lambda B, dtype, g: (randn(g, dtype, B, 2, 7, 7), labels(g, 3, B)))


def build_instancenorm_running_stats_eval():
    """InstanceNorm with running statistics in eval mode: instance_norm views ``[B, C, H, W]`` as ``[1, B*C, H, W]``
    and repeats the statistics and weights ``B`` times, so the samples are the batch norm's channels."""
    norm = nn.InstanceNorm2d(4, affine=True, track_running_stats=True)
    model = Seq(nn.Sequential(nn.Conv2d(2, 4, 3), norm, nn.ReLU()), (2, 6, 6), 3)
    norm.running_mean.copy_(torch.randn(4) * 0.3)
    norm.running_var.copy_(torch.rand(4) + 0.5)
    model.eval()

    def loss(x, y):
        return F.cross_entropy(model(x), y)

    return Built(model, loss, lambda B, dtype, g: (randn(g, dtype, B, 2, 6, 6), labels(g, 3, B)))


def build_loss_vector():
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))

    def loss(x, y):
        return F.cross_entropy(model(x), y, reduction="none")  # [B]

    return Built(model, loss, lambda B, dtype, g: (randn(g, dtype, B, 5), labels(g, 3, B)))


def build_explicit_batch_mean():
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))

    def loss(x, y):
        per = F.cross_entropy(model(x), y, reduction="none")
        return per.sum() / x.shape[0]

    return Built(model, loss, lambda B, dtype, g: (randn(g, dtype, B, 5), labels(g, 3, B)))


class _Prototypes(nn.Module):
    """Distances to learned prototypes (a prototype network's head, a codebook): ``torch.cdist(h(x), P)``."""

    def __init__(self, p: float):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 5), nn.Tanh())
        self.prototypes = nn.Parameter(torch.randn(3, 5))
        self.p = p

    def forward(self, x):
        return -torch.cdist(self.body(x), self.prototypes, p=self.p,
                            compute_mode="donot_use_mm_for_euclid_dist")


def prototype_case(p: float, tokens: int | None = None) -> Callable[[], Built]:
    """Nearest-prototype classification by softmax over negative distances: rows ``[B, 4]``, or ``[B, T, 4]``."""
    def build():
        model = _Prototypes(p)

        def loss(x, y):
            return F.cross_entropy(model(x).reshape(-1, 3), y.reshape(-1))

        shape = () if tokens is None else (tokens,)
        return Built(model, loss, lambda B, dtype, g: (randn(g, dtype, B, *shape, 4), labels(g, 3, B, *shape)))
    return build


# ---------------------------------------------------------------- the list

CASES: list[Case] = [
    Case("simple_cnn", build_simple_cnn, batch=2),
    Case("mlp_sum_mse", build_mlp_sum_mse),
    Case("mlp_ce_mean", build_mlp_ce_mean),
    *(Case(f"loss_{name}", elementwise_loss_case(name)) for name in ELEMENTWISE_LOSSES),
    Case("conv1d_stride_pad_dilation_groups",
         classifier_case(lambda: nn.Conv1d(2, 4, 3, stride=2, padding=2, dilation=2, groups=2), (2, 11))),
    Case("conv2d_stride_pad_dilation_groups",
         classifier_case(lambda: nn.Conv2d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2), (4, 9, 9),
                         mode="mse_mean")),
    Case("conv3d_stride_pad_dilation_groups",
         classifier_case(lambda: nn.Conv3d(2, 4, (2, 3, 3), stride=(1, 2, 1), padding=(0, 1, 1),
                                           dilation=(1, 1, 2), groups=2), (2, 4, 6, 7))),
    Case("conv2d_depthwise",
         classifier_case(lambda: nn.Sequential(nn.Conv2d(3, 3, 3, padding=1, groups=3), nn.ReLU(),
                                               nn.Conv2d(3, 4, 1)), (3, 5, 5))),
    Case("conv_transpose2d",
         classifier_case(lambda: nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, output_padding=1, groups=2),
                         (4, 3, 4), mode="mse_mean")),
    Case("conv2d_reflect",
         classifier_case(lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1, padding_mode="reflect"), (2, 6, 5))),
    Case("conv1d_circular",
         classifier_case(lambda: nn.Conv1d(2, 3, 3, padding=2, dilation=2, padding_mode="circular"), (2, 7))),
    Case("conv2d_replicate",
         classifier_case(lambda: nn.Conv2d(2, 3, (3, 2), padding=(1, 2), padding_mode="replicate"), (2, 5, 4),
                         mode="mse_mean")),
    Case("groupnorm",
         classifier_case(lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU()),
                         (2, 5, 5))),
    Case("instancenorm2d_affine",
         classifier_case(lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.InstanceNorm2d(4, affine=True),
                                               nn.ReLU()), (2, 6, 6))),
    Case("seq_linear", build_seq_linear),
    Case("cdist_prototypes_p2", prototype_case(2.0)),
    Case("cdist_prototypes_p1", prototype_case(1.0)),
    Case("cdist_prototypes_p3_tokens", prototype_case(3.0, tokens=4)),
    Case("rmsnorm_seq", build_rmsnorm_seq),
    Case("embedding_padding_layernorm_seq", build_embedding_layernorm_seq),
    Case("mha_batch_first_causal", build_mha_batch_first),
    Case("mha_seq_first_in_dims", build_mha_seq_first),
    Case("encoder_batch_first_padmask", build_encoder_batch_first),
    Case("encoder_seq_first_in_dims", build_encoder_seq_first),
    Case("lstm", build_lstm),
    Case("gru_seq_first_in_dims", build_gru_seq_first),
    Case("bilinear", build_bilinear),
    Case("prelu", build_prelu),
    Case("tied_embedding_lm", build_tied_embedding_lm),
    Case("position_embedding_lm", build_position_embedding_lm),
    Case("weight_norm_mlp", build_weight_norm_mlp),
    Case("raw_affine", build_raw_affine),
    Case("raw_temperature", build_raw_temperature),
    Case("raw_strided_slices", build_raw_strided_slices),
    Case("raw_einsum", build_raw_einsum),
    Case("layer_reused", build_layer_reused),
    Case("frozen_and_buffers", build_frozen_and_buffers),
    Case("batchnorm_eval", build_batchnorm_eval),
    Case("instancenorm_running_stats_eval", build_instancenorm_running_stats_eval),
    Case("loss_per_sample_vector", build_loss_vector),
    Case("masked_token_mean", build_masked_token_mean),
    Case("ce_ignore_index", build_ce_ignore_index),
    Case("explicit_batch_mean", build_explicit_batch_mean),
]

BY_ID: dict[str, Case] = {c.id: c for c in CASES}
assert len(BY_ID) == len(CASES), "duplicate case ids"
