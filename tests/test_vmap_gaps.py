"""Cases ``torch.func.vmap(grad)``-style per-sample gradients are defined for, that compiled_psg refused or crashed
on (issue 11): an embedding with ``max_norm``, per-sample losses ``[B]`` scaled by the batch size, and class
weights with an ``ignore_index`` outside the classes. Each is exact against the per-sample loop, or refused by
name where the batch makes each sample's value depend on other samples."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import reference_losses, reference_per_sample

import compiled_psg as psg

EXACT = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def _close(got: dict, ref: dict, dtype) -> None:
    assert set(got) == set(ref)
    for name, r in ref.items():
        torch.testing.assert_close(got[name], r, **EXACT[dtype], msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------- nn.Embedding(max_norm=...)


class _EmbeddingModel(nn.Module):
    def __init__(self, padding_idx=None, tied=False):
        super().__init__()
        self.emb = nn.Embedding(10, 3, max_norm=1.0, padding_idx=padding_idx)
        self.fc = nn.Linear(3, 4)
        self.tied = tied

    def forward(self, idx):
        h = self.emb(idx)
        out = self.fc(h.mean(1))
        if self.tied:  # reads the weight the lookup renormed from every sample's indices
            out = out + (h.mean(1) @ self.emb.weight.T)[:, :4]
        return out


# rows 1 and 2 in several samples; row 0 repeated in one; rows 3..9 in one sample each
_IDX = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 1], [1, 1, 2, 2, 9], [0, 0, 0, 0, 0]])


def _embedding_case(dtype, scale, padding_idx=None, tied=False):
    torch.manual_seed(0)
    model = _EmbeddingModel(padding_idx, tied).to(dtype)
    with torch.no_grad():
        model.emb.weight.mul_(scale)
    y = torch.randint(0, 4, (len(_IDX),))
    return model, (_IDX, y)


@pytest.mark.parametrize(("dtype", "scale", "padding_idx"), [
    (torch.float64, 0.2, None), (torch.float64, 3.0, None), (torch.float64, 3.0, 0), (torch.float32, 3.0, None)],
    ids=["rows-within-max_norm", "rows-above-max_norm", "padding_idx", "float32"])
def test_embedding_max_norm_is_the_loop(dtype, scale, padding_idx):
    """Eager renormalizes the rows the batch looks up, in place, before the lookup, and differentiates the lookup
    only. The loop renorms each sample's rows on its own call; the renorm is idempotent, so every sample's loss
    reads its rows renormed once in both. The weight after the call is eager's after one forward on the batch."""
    model, args = _embedding_case(dtype, scale, padding_idx)
    norms = model.emb.weight.norm(dim=1)
    assert bool((norms > 1.0).any()) == (scale > 1), "the case must (not) need renorming"
    eager, looped = copy.deepcopy(model), copy.deepcopy(model)

    def loss(idx, y):
        return F.cross_entropy(model(idx), y)

    fn = psg.per_sample(model, backend="eager")(loss)
    value, losses, got = fn.with_losses(*args)
    expected = F.cross_entropy(eager(args[0]), args[1])
    torch.testing.assert_close(value, expected.detach(), **EXACT[dtype])
    assert torch.equal(model.emb.weight, eager.emb.weight), "the weight must change as one eager forward changes it"
    ref = reference_per_sample(lambda i, t: F.cross_entropy(looped(i), t), dict(looped.named_parameters()), args)
    _close(got, ref, dtype)
    torch.testing.assert_close(losses, reference_losses(lambda i, t: F.cross_entropy(looped(i), t), args),
                               **EXACT[dtype])
    _close(fn(*args), ref, dtype)  # a second call reads the renormed weight: the same gradients
    expected.backward()  # eager autograd on the batch: the mean of the per-sample gradients
    _close({n: p.grad for n, p in eager.named_parameters()}, {n: g.mean(0) for n, g in got.items()}, dtype)


def _fresh_loop(model, loss_with, args) -> dict:
    """Each sample's gradient on the weights as they were before the call (a fresh copy per sample): the loop
    of ``reference.py`` would let each call's in-place renorm change what later samples read before their lookup."""
    rows = []
    for i in range(len(args[0])):
        m = copy.deepcopy(model)
        rows.append(reference_per_sample(lambda *a, m=m: loss_with(m, *a), dict(m.named_parameters()),
                                         tuple(a[i:i + 1] for a in args)))
    return {n: torch.cat([r[n] for r in rows]) for n in rows[0]}


def test_embedding_max_norm_two_lookups_and_a_read_before():
    """Two lookups of one embedding (a pair of index sets per sample) and a read of the weight before them: each
    lookup reads rows renormed per sample (the renorm is idempotent), the earlier read the weight as it was."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, max_norm=1.0).double()
    fc = nn.Linear(3, 2).double()
    model = nn.ModuleDict({"emb": emb, "fc": fc})
    with torch.no_grad():
        emb.weight.mul_(3)
    a, b = _IDX, _IDX.flip(1).roll(1, 0)
    eager = copy.deepcopy(model)

    def loss_with(m, a, b):
        decay = m["emb"].weight.sum() * 1e-2  # (pow(2) would save the weight: eager autograd then fails)
        return (m["fc"](m["emb"](a).mean(1)) * m["fc"](m["emb"](b).mean(1))).sum() + decay

    ref = _fresh_loop(model, loss_with, (a, b))
    value, _, got = psg.per_sample(model, backend="eager")(lambda a, b: loss_with(model, a, b)).with_losses(a, b)
    _close(got, ref, torch.float64)
    torch.testing.assert_close(value, loss_with(eager, a, b).detach(), **EXACT[torch.float64])
    assert torch.equal(emb.weight, eager["emb"].weight)


def test_embedding_max_norm_inductor():
    model, args = _embedding_case(torch.float32, 3.0)
    looped = copy.deepcopy(model)
    got = psg.per_sample(model)(lambda i, t: F.cross_entropy(model(i), t))(*args)
    _close(got, reference_per_sample(lambda i, t: F.cross_entropy(looped(i), t), dict(looped.named_parameters()),
                                     args), torch.float32)


def test_embedding_max_norm_read_again_is_refused_and_changes_nothing():
    """Tied weights read rows renormed for other samples: sample i's loss depends on the other samples."""
    model, args = _embedding_case(torch.float64, 3.0, tied=True)
    before = model.emb.weight.detach().clone()
    where = r"test_vmap_gaps.py:\d+ in forward: out = out \+ \(h.mean\(1\) @ self.emb.weight.T\)"
    with pytest.raises(psg.SampleMixingError, match=where + r".*renormalized it in place.*Fix: "):
        psg.per_sample(model, backend="eager")(lambda i, t: F.cross_entropy(model(i), t))(*args)
    assert torch.equal(model.emb.weight, before)


def test_embedding_max_norm_view_taken_before_is_refused():
    """A view of the weight taken before the lookup shares its storage: eager reads it renormed."""
    model, args = _embedding_case(torch.float64, 3.0)

    def loss(idx, y):
        wt = model.emb.weight.t()
        h = model.emb(idx).mean(1)
        return F.cross_entropy(model.fc(h) + (h @ wt)[:, :4], y)

    with pytest.raises(psg.SampleMixingError, match=r"test_vmap_gaps.py:\d+ in loss: return F.cross_entropy"):
        psg.per_sample(model, backend="eager")(loss)(*args)


def test_embedding_bag_max_norm_is_refused_by_name():
    """Red team O: behind another layer (``head(bag(t))``) it was refused as "the loss writes a tensor that
    requires grad in place (p.data.clamp_(...) on a parameter, say)", with no line and a fix that did not apply."""
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(10, 3, max_norm=1.0, mode="mean").double()
    head = nn.Linear(3, 2).double()
    with torch.no_grad():
        bag.weight.mul_(3)
    before = bag.weight.detach().clone()
    for loss in (lambda i: bag(i).pow(2).sum(), lambda i: head(bag(i)).pow(2).sum()):
        with pytest.raises(psg.UnsupportedError, match=r"EmbeddingBag\(max_norm=\.\.\.\) \(F.embedding_bag\) at "
                                                       r"\S*test_vmap_gaps.py:\d+ in <lambda>.*Fix: renormalize "
                                                       r"outside"):
            psg.per_sample(nn.ModuleList([bag, head]), backend="eager")(loss)(_IDX)
        assert torch.equal(bag.weight, before)


# ---------------------------------------------------------------- per-sample losses scaled by the batch size


def _losses(m):
    def divided(x, y):
        return F.cross_entropy(m(x), y, reduction="none") / x.shape[0]

    def multiplied(x, y):
        return F.cross_entropy(m(x), y, reduction="none") * len(x)

    def divided_then_summed(x, y):
        return (F.cross_entropy(m(x), y, reduction="none") / x.shape[0]).sum()

    def squared_batch_size(x, y):
        return (m(x).pow(2).sum(1) + y) / (x.shape[0] * x.shape[0])

    return [divided, multiplied, divided_then_summed, squared_batch_size]


@pytest.mark.parametrize(("dtype", "which"), [(torch.float64, i) for i in range(4)] + [(torch.float32, 0)],
                         ids=["divided", "multiplied", "divided_then_summed", "squared", "divided-float32"])
def test_losses_scaled_by_the_batch_size(dtype, which):
    """The batch size reads 1 per sample, and the reported loss keeps the batch's value."""
    torch.manual_seed(0)
    m = nn.Linear(3, 4).to(dtype)
    x, y = torch.randn(5, 3, dtype=dtype), torch.randint(0, 4, (5,))
    loss = _losses(m)[which]
    value, losses, got = psg.per_sample(m, backend="eager")(loss).with_losses(x, y)
    torch.testing.assert_close(value, loss(x, y).detach(), **EXACT[dtype])
    torch.testing.assert_close(losses, reference_losses(loss, (x, y)), **EXACT[dtype])
    _close(got, reference_per_sample(loss, dict(m.named_parameters()), (x, y)), dtype)


def test_dropout_after_a_batch_size_division_keeps_the_batch_mask():
    """The per-sample loss is recomputed from the division on: its dropout must reuse the batch's mask."""
    torch.manual_seed(0)
    m = nn.Linear(3, 4).double()
    x = torch.randn(5, 3, dtype=torch.float64)

    def loss(x):
        return F.dropout(m(x) / x.shape[0], 0.5).pow(2).sum(1)

    value, losses, _ = psg.per_sample(m, backend="eager")(loss).with_losses(x)
    torch.testing.assert_close(losses, value * 25, rtol=1e-12, atol=0)


def test_random_draw_from_the_batch_size_is_refused():
    torch.manual_seed(0)
    m = nn.Linear(3, 4).double()
    x = torch.randn(5, 3, dtype=torch.float64)

    def loss(x):
        h = m(x)
        return (h * torch.bernoulli(torch.ones_like(h) / x.shape[0])).sum()

    with pytest.raises(psg.UnsupportedError, match=r"bernoulli.*draws random numbers.*Fix: "):
        psg.per_sample(m, backend="eager")(loss)(x)


# ---------------------------------------------------------------- class weights with ignore_index


@pytest.mark.parametrize("ignore_index", [9, -100, 2])
def test_class_weights_with_ignore_index(ignore_index):
    """An ignored target may lie outside the classes: its weight must not be read."""
    torch.manual_seed(0)
    m = nn.Linear(3, 4).double()
    weight = torch.rand(4, dtype=torch.float64) + 0.5
    x = torch.randn(6, 3, dtype=torch.float64)
    y = torch.tensor([0, ignore_index, 3, 1, ignore_index, 2])

    def loss(x, y):
        return F.cross_entropy(m(x), y, weight=weight, ignore_index=ignore_index)

    got = psg.per_sample(m, backend="eager")(loss)(x, y)
    _close(got, reference_per_sample(loss, dict(m.named_parameters()), (x, y)), torch.float64)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_sample_whose_tokens_are_all_ignored_has_its_own_nan_loss_and_zero_gradient(backend):
    """A sample alone whose targets are all ``ignore_index`` has the mean of no tokens: eager mode gives loss NaN
    (0 / 0) and gradient 0. The per-sample losses said 0.0 there; they say NaN now, and the gradients stay 0."""
    torch.manual_seed(0)
    m = nn.Linear(4, 5).double()
    x, y = torch.randn(3, 6, 4, dtype=torch.float64), torch.randint(0, 5, (3, 6))
    y[1] = -100

    def loss(x, y):
        return F.cross_entropy(m(x).flatten(0, 1), y.flatten())

    value, losses, got = psg.per_sample(m, backend=backend)(loss).with_losses(x, y)
    reference = reference_losses(loss, (x, y))
    assert reference[1].isnan() and losses[1].isnan()
    torch.testing.assert_close(losses, reference, equal_nan=True, **EXACT[torch.float64])
    torch.testing.assert_close(value, loss(x, y).detach(), **EXACT[torch.float64])
    expected = reference_per_sample(loss, dict(m.named_parameters()), (x, y))
    assert all(e[1].abs().sum() == 0 for e in expected.values())
    _close(got, expected, torch.float64)


def test_linear_cross_entropy_with_weight_and_ignore_index():
    torch.manual_seed(0)
    module = nn.LinearCrossEntropyLoss(5, 4, weight=torch.rand(4) + 0.5, ignore_index=9,
                                       label_smoothing=0.1).double()
    x = torch.randn(6, 5, dtype=torch.float64)
    y = torch.tensor([0, 9, 3, 1, 9, 2])
    got = psg.per_sample(module, backend="eager")(module)(x, y)
    _close(got, reference_per_sample(module, dict(module.named_parameters()), (x, y)), torch.float64)


# ---------------------------------------------------------------- a loss head that pools over the batch first


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", ["in_dims_1", "sum_over_batch", "weights_ignore_index", "none_then_sum",
                                  "one_target", "pixels"])
def test_cross_entropy_of_a_mean_over_the_batch_is_each_samples_own(case, dtype):
    """``F.cross_entropy(h.mean(1), y)`` with the batch in dimension 1 (``in_dims=1``): each sample's own loss is
    the cross-entropy of its own ``h`` (the mean over a batch of one), with the shared targets. ``nll_loss_forward``
    of a per-sample input had no lift rule, and its vmap fallback fixes the batch size: refused as "no rule for
    nll_loss_forward ... fixes the batch size"."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 1).to(dtype)
    lin = nn.Linear(5, 3).to(dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 5, generator=g, dtype=dtype)  # [T, B, 5]: the batch in dimension 1
    y = torch.tensor([0, 2, 1, 1])
    weights = torch.tensor([0.5, 2.0, 1.0], dtype=dtype)
    image = torch.randn(3, 2, 4, 4, generator=g, dtype=dtype)  # [B, 2, 4, 4]
    pixels = torch.randint(0, 3, (1, 4, 4), generator=g)
    losses = {
        "in_dims_1": lambda x: F.cross_entropy(lin(x).mean(1), y),
        "sum_over_batch": lambda x: F.cross_entropy(lin(x).sum(1), y, reduction="sum"),
        "weights_ignore_index": lambda x: F.cross_entropy(lin(x).mean(1), y.masked_fill(y == 2, -100), weights),
        "none_then_sum": lambda x: F.cross_entropy(lin(x).mean(1), y, reduction="none").pow(2).sum(),
        "one_target": lambda x: F.cross_entropy(lin(x).mean((0, 1)), y[0]),
        "pixels": lambda image: F.cross_entropy(conv(image).mean(0, keepdim=True), pixels),
    }
    loss = losses[case]
    args, in_dims = ((image,), 0) if case == "pixels" else ((x,), 1)
    used = conv if case == "pixels" else lin
    got = psg.per_sample(used, in_dims=in_dims, backend="eager")(loss)(*args)
    _close(got, reference_per_sample(loss, dict(used.named_parameters()), args, in_dims=in_dims), dtype)


class _IndexedRead(nn.Module):
    """A weight read through an op whose backward places the gradient at indices (``scatter``, ``scatter_add``,
    ``index_add``, ``gather``), and a table read by rows with the batch's ids."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.W = nn.Parameter(torch.randn(5, 6, dtype=torch.float64))
        self.E = nn.Parameter(torch.randn(10, 5, dtype=torch.float64))

    def forward(self, x, ids):
        W, E = self.W, self.E
        fixed = torch.tensor([3, 1, 4, 1, 5, 0])
        if self.how == "sort":
            h = x @ W.sort(1).values
        elif self.how == "max":
            h = x[:, :1] * W.max(1).values
        elif self.how == "topk":
            h = x @ W.topk(3, 1).values
        elif self.how == "cummax":
            h = x @ W.cummax(1).values
        elif self.how == "median":
            h = x * W.median(1).values
        elif self.how == "gather":
            h = x @ W.gather(1, fixed.expand(5, 6))
        elif self.how == "index_select":
            h = x @ W.index_select(1, fixed)
        elif self.how == "take_along_dim":
            h = x @ torch.take_along_dim(W, fixed.expand(5, 6), 1)
        elif self.how == "scatter":
            h = x @ torch.zeros(5, 8, dtype=W.dtype).scatter(1, fixed.expand(5, 6), W)
        elif self.how == "rows":
            h = E.index_select(0, ids) * x
        elif self.how == "columns":  # the table stored transposed: rows along dim 1
            h = E.t().contiguous().index_select(1, ids).t() * x
        elif self.how == "scatter_value":  # zeros written into the weight at fixed positions
            h = x @ W.scatter(1, fixed.expand(5, 6)[:, :2], 0.0)
        else:  # rows of tokens: [n, t] ids flattened, the batch merged with the tokens
            h = E.index_select(0, torch.stack([ids, (ids * 3 + 1) % 10], 1).reshape(-1)).view(len(x), 2, 5).sum(1) * x
        return (h.tanh() + x.sum(1, keepdim=True) * W.sum()).pow(2).sum()


@pytest.mark.parametrize("how", ["sort", "max", "topk", "cummax", "median", "gather", "index_select",
                                 "take_along_dim", "scatter", "scatter_value", "rows", "columns", "token_rows"])
def test_a_parameter_read_at_indices_is_exact(how):
    """Red team R (F01): a parameter read through ``sort``, ``max(dim)``, ``topk``, ``gather``, ``index_select``,
    ``take_along_dim`` or scattered into a tensor, and a table read by rows with the batch's ids, were refused
    ("no rule for aten.scatter.src ... its vmap fallback fixes the batch size"); ``vmap(grad)`` computes them.
    Per-sample gradients, norms and the clipped sum against the loop, float64."""
    torch.manual_seed(0)
    model = _IndexedRead(how)
    x, ids = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 10, (6,))

    def loss(x, ids):
        return model(x, ids)

    ref = reference_per_sample(loss, dict(model.named_parameters()), (x, ids))
    got = psg.per_sample(model, backend="eager")(loss)(x, ids)
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-10)
    norms = sum(v.flatten(1).pow(2).sum(1) for v in ref.values()).sqrt()
    got_norms = psg.per_sample(model, backend="eager", reduce=psg.norms())(loss)(x, ids)
    torch.testing.assert_close(got_norms, norms, rtol=1e-10, atol=1e-10)
    factors = (0.5 / norms).clamp(max=1.0)
    clipped = psg.per_sample(model, backend="eager", reduce=psg.clip_sum(0.5))(loss)(x, ids)
    for name, value in ref.items():
        torch.testing.assert_close(clipped[name], torch.tensordot(factors, value, 1), rtol=1e-10, atol=1e-10)


@pytest.mark.inductor
@pytest.mark.parametrize("how", ["sort", "rows"])
def test_a_parameter_read_at_indices_is_exact_on_inductor(how):
    """The rules of ``test_a_parameter_read_at_indices_is_exact`` in Inductor's code: the clipped sum, float64."""
    torch.manual_seed(0)
    model = _IndexedRead(how)
    x, ids = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 10, (6,))
    ref = reference_per_sample(model, dict(model.named_parameters()), (x, ids))
    norms = sum(v.flatten(1).pow(2).sum(1) for v in ref.values()).sqrt()
    clipped = psg.per_sample(model, backend="inductor", reduce=psg.clip_sum(0.5))(lambda x, ids: model(x, ids))(x, ids)
    for name, value in ref.items():
        torch.testing.assert_close(clipped[name], torch.tensordot((0.5 / norms).clamp(max=1.0), value, 1),
                                   rtol=1e-10, atol=1e-10)
