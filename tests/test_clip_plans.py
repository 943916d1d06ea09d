"""Clip norms and the sums they bound: every ``clip_sq_norm`` plan against the loop, the bound under cancellation,
and the pricing that picks among them (strategies ``clip_sq_norm``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from reference import ref_clip_sum, reference_per_sample
from zoo import BY_ID

import compiled_psg as psg
from compiled_psg._reduce import strategies

PLANS = [s.name for s in strategies.STRATEGIES["clip_sq_norm"]]
CASES = ["seq_linear", "encoder_batch_first_padmask"]


def _choices(fn, *args) -> dict[str, dict[str, str]]:
    entry = fn.prepare_call(*args).entry
    return {name: {c.quantity: c.method for c in cs} for name, cs in entry.rewritten.choices.items()}


def _assert_matches(got, norms, want, want_norms, dtype) -> None:
    """Clipped sums and norms against the loop's. In float32 the bounded and ghost norms are upper bounds, larger
    by a relative ~(2t + 2) eps sqrt(t)."""
    tol = dict(rtol=1e-9, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-4, atol=1e-6)
    torch.testing.assert_close(norms, want_norms, **tol)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **tol, msg=lambda m, name=name: f"{name}: {m}")


def test_the_plans_are_the_ones_documented():
    assert PLANS == ["ghost", "materialize", "materialize, bounded"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("case_id", CASES)
def test_each_plan_matches_the_loop(case_id, plan, dtype):
    built = BY_ID[case_id].build(dtype)
    args = built.make_batch(4, dtype, torch.Generator().manual_seed(7))
    with strategies.preferred("clip_sq_norm", plan):
        fn = psg.per_sample(built.model, in_dims=built.in_dims, reduce=psg.clip_sum(0.05, return_norms=True),
                            backend="eager")(built.loss)
        (got, norms) = fn(*args)
        choices = _choices(fn, *args)
    want, want_norms = ref_clip_sum(reference_per_sample(built.loss, built.params(), args, built.in_dims), 0.05,
                                    return_norms=True)
    assert (want_norms > 0.05).any(), "no sample is clipped: the test would not see a wrong norm"
    _assert_matches(got, norms, want, want_norms, dtype)
    # the plan was used (every plan applies to a Linear over tokens), and each sum is one its norm bounds
    assert any(c.get("sq_norm") == plan for c in choices.values()), choices
    for name, chosen in choices.items():
        if chosen.get("sq_norm") == "materialize, bounded":
            assert chosen["weighted_sum"] == "book-keeping (the sum its norm bounds)", (name, chosen)
    if plan == "materialize":  # a Linear over tokens sums several terms per entry: its sum reuses the values
        assert any(c.get("weighted_sum") == "materialize (the values its norm was taken of)"
                   for c in choices.values()), choices


@pytest.mark.parametrize("magnitude", [1e4, 1e7])
def test_a_bounded_materialized_norm_bounds_the_book_keeping_sum_under_cancellation(magnitude):
    """Near-repeated tokens with opposite output gradients: the materialized norm is of ``fl(g)``, the float32
    book-keeping sum rounds the same terms differently (1.35 C with the norm alone); the bound covers both."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 4, bias=False)
    base = torch.randn(4, 1, 8) * magnitude
    x = torch.cat([base + torch.randn(4, 1, 8), base], 1)
    v1 = torch.randn(4, 1, 4) * 1e3
    v = torch.cat([v1, -v1], 1)
    with strategies.preferred("clip_sq_norm", "materialize, bounded"):
        fn = psg.per_sample(lin, backend="eager", reduce=psg.clip_sum(1.0))(lambda x, v: (lin(x) * v).sum())
        worst = max(fn(x[k:k + 1].repeat(2, 1, 1), v[k:k + 1].repeat(2, 1, 1))["weight"].double().norm().item() / 2
                    for k in range(4))
        assert _choices(fn, x, v)["weight"]["sq_norm"] == "materialize, bounded"
    assert worst <= 1.0 + 1e-5


def _weight_plan(monkeypatch, held_price: float, t: int) -> str:
    monkeypatch.setattr(strategies, "held_price", lambda: held_price)
    torch.manual_seed(0)
    lin = nn.Linear(128, 128, bias=False)
    fn = psg.per_sample(lin, backend="eager", reduce=psg.clip_sum(1.0))(lambda x: lin(x).square().sum())
    return _choices(fn, torch.randn(4, t, 128))["weight"]["sq_norm"]


def test_held_per_sample_gradients_are_priced(monkeypatch):
    """Reusing the materialized values holds them until the clip factors are known: where the heap recycles them
    (price 0), reuse wins where the ghost norm is dear (t = 64); priced at many fresh pages, the bounded plan,
    which frees them at once."""
    assert _weight_plan(monkeypatch, 0.0, 64) == "materialize"
    assert _weight_plan(monkeypatch, 1e3, 64) == "materialize, bounded"
    assert _weight_plan(monkeypatch, strategies.FRESH_PAGE_FACTOR, 1) == "ghost"  # t = 1: nothing to materialize


def test_the_heap_keeps_freed_memory_only_when_asked(monkeypatch):
    """glibc: a CPU program leaves the heap as it is by default; opted in (the environment, read when the first
    CPU program runs, or ``psg.retain_freed_memory()``), the heap never trims and never maps large blocks, so a
    large block freed and allocated again is recycled, not faulted in fresh."""
    import ctypes
    import resource

    from compiled_psg import _heap as heap

    monkeypatch.setattr(heap, "_state", {})  # as before the first program: nothing asked for
    monkeypatch.delenv(heap.ENV, raising=False)
    if heap._mallopt() is None:
        pytest.skip("not glibc: the heap is left as it is")
    calls = []
    mallopt = heap._mallopt()
    monkeypatch.setattr(heap, "_mallopt", lambda: lambda *a: calls.append(a) or mallopt(*a))
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    per_sample = psg.per_sample(lin, backend="eager", reduce=psg.norms())(lambda x: lin(x).sum())
    per_sample(torch.randn(3, 4))
    assert not heap.retains() and calls == []  # no process-wide setting by default
    monkeypatch.setenv(heap.ENV, "1")
    assert heap.retains()
    psg.per_sample(lin, backend="eager", reduce=psg.norms())(lambda x: lin(x).sum())(torch.randn(3, 4))
    assert psg.retain_freed_memory()
    # never trim (-1; a finite threshold gives back a freed block that leaves that much free at the heap's top),
    # never map (M_MMAP_MAX = 0): the parameter numbers of malloc.h
    assert sorted(calls) == [(-4, 0), (-1, -1)]
    try:
        # 64 MiB, above any mmap threshold, as a program's buffer is, call after call; and 2.5 GiB, more than the
        # largest finite trim threshold mallopt takes (materialized per-sample gradients of a 1.2M-parameter CNN
        # at B = 256 are 1.2 GB per call, beside the program's other buffers)
        for numel in (2**24, 5 * 2**27):
            faults = []
            for _ in range(3):
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                torch.empty(numel).fill_(1.0)
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            assert min(faults[1:]) < 1000, (numel, faults)  # numel / 1024 pages each time when mapped fresh
    finally:
        ctypes.CDLL(None).malloc_trim(0)  # the rest of this worker's tests need not carry 2.5 GiB


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_low_precision_takes_no_bounded_plan(dtype):
    """In bfloat16 the bound's (2t + 2) eps is several times the norm itself (8.7 against 58 at t = 64): a
    low-precision contraction never gets the bounded plan, even where it is priced at nothing."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 16, bias=False).to(dtype)
    with strategies.preferred("clip_sq_norm", "materialize, bounded"):
        fn = psg.per_sample(lin, backend="eager", reduce=psg.clip_sum(1.0))(lambda x: lin(x).float().square().sum())
        x = torch.randn(3, 64, 16).to(dtype)
        fn(x)
        assert _choices(fn, x)["weight"]["sq_norm"] != "materialize, bounded"


def test_norms_alone_are_not_inflated():
    """``psg.norms()`` prices the norm alone: a materialized norm there is the plain norm of the values."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 16, bias=False).double()
    x = torch.randn(3, 64, 16, dtype=torch.float64)
    fn = psg.per_sample(lin, backend="eager", reduce=psg.norms())(lambda x: lin(x).square().sum())
    got = fn(x)
    assert _choices(fn, x)["weight"]["sq_norm"] == "materialize"
    ref = reference_per_sample(lambda x: lin(x).square().sum(), dict(lin.named_parameters()), (x,))["weight"]
    torch.testing.assert_close(got, ref.flatten(1).norm(dim=1), rtol=1e-13, atol=0)


CONVS = {  # (module, input shape without the batch)
    "3x3": (lambda: nn.Conv2d(3, 4, 3), (3, 6, 6)),
    "stride_pad_dilation": (lambda: nn.Conv2d(2, 5, (3, 2), stride=(2, 1), padding=(2, 1), dilation=(2, 1)),
                            (2, 9, 7)),
    "1x1_no_bias": (lambda: nn.Conv2d(4, 3, 1, bias=False), (4, 3, 5)),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("plan", ["ghost", "materialize, bounded"])
@pytest.mark.parametrize("conv", CONVS)
def test_a_conv_weight_takes_the_ghost_and_bounded_plans_on_the_cpu(conv, plan, dtype):
    """On the CPU a Conv2d weight's book-keeping sum rounds as a GEMM over the patches would, so its clip norm may
    be the ghost norm (from the output gradient and the patches, never forming the per-sample gradients) or the
    bounded norm (each per-sample gradient freed after its norm); both match the loop."""
    make, shape = CONVS[conv]
    torch.manual_seed(0)
    net = nn.Sequential(make(), nn.Tanh(), nn.Flatten()).to(dtype)
    x = torch.randn(5, *shape, dtype=dtype)

    def loss(x):
        return net(x).square().sum() * 3

    # a small conv's materialized sum holds less than its output gradient: book-keeping forced for the ghost norm
    with strategies.preferred("clip_sq_norm", plan), strategies.preferred("weighted_sum", "book-keeping"):
        fn = psg.per_sample(net, backend="eager", reduce=psg.clip_sum(0.5, return_norms=True))(loss)
        got, norms = fn(x)
        chosen = _choices(fn, x)["0.weight"]
    assert chosen["sq_norm"] == plan and chosen["weighted_sum"].startswith("book-keeping"), chosen
    want, want_norms = ref_clip_sum(reference_per_sample(loss, dict(net.named_parameters()), (x,)), 0.5,
                                    return_norms=True)
    assert (want_norms > 0.5).all(), "every sample is clipped: a wrong norm shows in the sums"
    _assert_matches(got, norms, want, want_norms, dtype)


@pytest.mark.parametrize("conv", CONVS)
def test_conv_token_norms_are_the_norms_of_the_patches(conv):
    """``conv2d_token_norms`` (a convolution of the summed squares with a kernel of ones) equals the norms of the
    unfolded patches and of the output gradient's columns, position by position."""
    from compiled_psg._rewrite.rules.conv import conv2d_token_norms

    make, shape = CONVS[conv]
    c = make().double()
    torch.manual_seed(1)
    x = torch.randn(3, *shape, dtype=torch.float64)
    g = torch.randn_like(c(x))
    a, xn = conv2d_token_norms(g.unsqueeze(1), x.unsqueeze(1), c.kernel_size, list(c.stride), list(c.padding),
                               list(c.dilation))
    patches = torch.nn.functional.unfold(x, c.kernel_size, c.dilation, c.padding, c.stride)  # [n, c*kh*kw, t]
    torch.testing.assert_close(xn, patches.norm(dim=1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a, g.flatten(2).norm(dim=1), rtol=1e-12, atol=0)


def test_a_conv_bounded_norm_bounds_the_book_keeping_sum_under_cancellation():
    """The Linear cancellation case above as a 1x1 convolution: two positions with near-repeated inputs and
    opposite output gradients, where the float32 book-keeping sum rounds the terms otherwise than the
    materialized norm did; the bound covers both."""
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 4, 1, bias=False)
    base = torch.randn(4, 8, 1, 1) * 1e7
    x = torch.cat([base + torch.randn(4, 8, 1, 1), base], 3)  # [4, 8, 1, 2]
    v1 = torch.randn(4, 4, 1, 1) * 1e3
    v = torch.cat([v1, -v1], 3)
    with strategies.preferred("clip_sq_norm", "materialize, bounded"):
        fn = psg.per_sample(conv, backend="eager", reduce=psg.clip_sum(1.0))(lambda x, v: (conv(x) * v).sum())
        worst = max(fn(x[k:k + 1].repeat(2, 1, 1, 1), v[k:k + 1].repeat(2, 1, 1, 1))["weight"].double().norm().item()
                    / 2 for k in range(4))
        assert _choices(fn, x, v)["weight"]["sq_norm"] == "materialize, bounded"
    assert worst <= 1.0 + 1e-5


def test_the_conv_ghost_norm_takes_the_samples_a_chunk_at_a_time(monkeypatch):
    """``conv2d_ghost_sq_norms`` forms the patches and Grams for a chunk of samples at a time: one sample per chunk
    gives the norms of the whole batch at once."""
    from compiled_psg._rewrite.rules import conv as conv_rule

    torch.manual_seed(2)
    gs, xs = torch.randn(5, 1, 4, 3, 3, dtype=torch.float64), torch.randn(5, 1, 2, 5, 5, dtype=torch.float64)
    args = (gs, xs, [4, 2, 3, 3], [1, 1], [0, 0], [1, 1])
    whole = conv_rule.conv2d_ghost_sq_norms(*args)
    monkeypatch.setattr(conv_rule, "GHOST_CHUNK_BYTES", 1)
    torch.testing.assert_close(conv_rule.conv2d_ghost_sq_norms(*args), whole, rtol=1e-14, atol=0)
    per_sample = torch.stack([torch.autograd.grad((torch.nn.functional.conv2d(xs[i], w := torch.zeros(
        4, 2, 3, 3, dtype=torch.float64, requires_grad=True)) * gs[i]).sum(), w)[0] for i in range(5)])
    torch.testing.assert_close(whole, per_sample.flatten(1).pow(2).sum(1), rtol=1e-10, atol=0)


@pytest.mark.parametrize("plan", ["ghost", "materialize, bounded"])
def test_conv_plans_where_the_batch_folds_replicas(plan):
    """Video-like input: ``n`` samples of ``r`` frames, each frame through the same Conv2d as one batch of
    ``n * r`` (``x.flatten(0, 1)``): a sample's gradient sums its frames' positions, and both plans match the
    loop."""
    torch.manual_seed(3)
    conv = nn.Conv2d(2, 3, 3, padding=1).double()

    def loss(x):
        n, r = x.shape[:2]
        return conv(x.flatten(0, 1)).tanh().reshape(n, -1).square().sum() * 2

    x = torch.randn(4, 3, 2, 5, 4, dtype=torch.float64)
    with strategies.preferred("clip_sq_norm", plan):
        fn = psg.per_sample(conv, backend="eager", reduce=psg.clip_sum(0.3, return_norms=True))(loss)
        got, norms = fn(x)
        assert _choices(fn, x)["weight"]["sq_norm"] == plan
    want, want_norms = ref_clip_sum(reference_per_sample(loss, dict(conv.named_parameters()), (x,)), 0.3,
                                    return_norms=True)
    _assert_matches(got, norms, want, want_norms, torch.float64)


@pytest.mark.parametrize("op", ["conv", "matmul"])
def test_no_certified_norm_where_onednn_rounds_below_float32(op):
    """oneDNN set to round float32 convolutions or matmuls in bfloat16 (``torch.backends.mkldnn.<op>
    .fp32_precision``): the ghost and bounded norms certify float32 rounding, so a float32 layer over several
    positions takes neither, even where they are priced at nothing; float64 keeps them."""
    torch.manual_seed(0)
    if op == "conv":
        layer, x = nn.Conv2d(2, 3, 3), torch.randn(3, 2, 6, 6)
    else:
        layer, x = nn.Linear(4, 3), torch.randn(3, 5, 4)
    settings = getattr(torch.backends.mkldnn, op)
    before = settings.fp32_precision
    settings.fp32_precision = "bf16"
    try:
        for plan in ("ghost", "materialize, bounded"):
            with strategies.preferred("clip_sq_norm", plan):
                for dtype in (torch.float32, torch.float64):
                    model = layer.to(dtype)
                    fn = psg.per_sample(model, backend="eager", reduce=psg.clip_sum(1.0))(
                        lambda x, model=model: model(x).square().sum())
                    chosen = _choices(fn, x.to(dtype))["weight"]["sq_norm"]
                    assert (chosen == plan) == (dtype == torch.float64), (plan, dtype, chosen)
    finally:
        settings.fp32_precision = before


class _ThreeUses(nn.Module):
    """One matrix as an embedding, a head and an input projection (three contractions summed)."""

    def __init__(self, vocab: int = 11, width: int = 5, padding_idx: int | None = None):
        super().__init__()
        self.emb = nn.Embedding(vocab, width, padding_idx=padding_idx)

    def forward(self, ids):
        h = torch.softmax(nn.functional.linear(torch.tanh(self.emb(ids)), self.emb.weight), -1)
        return nn.functional.linear(h, self.emb.weight.t())


class _FlippedEmbedding(nn.Module):
    """A table stored ``[width, vocab]``, read as an embedding through its transpose and as a head: the embedding's
    contraction reaches the gradient transposed, its selecting rows on the other side."""

    def __init__(self, vocab: int = 11, width: int = 5):
        super().__init__()
        self.emb = nn.Module()
        self.emb.weight = nn.Parameter(torch.randn(width, vocab))

    def forward(self, ids):
        return torch.tanh(nn.functional.embedding(ids, self.emb.weight.t())) @ self.emb.weight


TIED = {  # id -> (model and loss from the zoo or built here, batch)
    "zoo_tied_embedding_lm": lambda dtype: _zoo_tied(dtype),
    "three_uses": lambda dtype: _three_uses(dtype, None),
    "three_uses_padding_idx": lambda dtype: _three_uses(dtype, 2),
    "flipped_embedding": lambda dtype: _three_uses(dtype, None, _FlippedEmbedding),
}


def _zoo_tied(dtype):
    built = BY_ID["tied_embedding_lm"].build(dtype)
    return built.model, built.loss, built.make_batch(4, dtype, torch.Generator().manual_seed(3))


def _three_uses(dtype, padding_idx, build=_ThreeUses):
    torch.manual_seed(4)
    model = (build(padding_idx=padding_idx) if padding_idx is not None else build()).to(dtype)
    ids = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(5))
    ids[0, :3] = 2  # a padding token (where there is one), repeated
    ids[1, 1] = ids[1, 4]

    def loss(ids):
        return model(ids).square().sum() * 4

    return model, loss, (ids,)


@pytest.mark.parametrize(("case", "dtype", "backend"), [
    *[(case, dtype, "eager") for case in TIED for dtype in (torch.float64, torch.float32)],
    ("three_uses_padding_idx", torch.float64, "inductor"),  # Inductor: one representative case
], ids=lambda v: str(v).replace("torch.", ""))
def test_a_tied_weight_takes_the_ghost_plan(case, dtype, backend):
    """A weight tied between an embedding and linear layers has one contraction per use, summed: its ghost norm
    adds the blocks of every pair (the embedding's one-hot rows read as the columns they select), so neither the
    per-sample table ``[n, vocab, width]`` nor any per-sample gradient of it is formed; sums and norms match the
    loop."""
    model, loss, args = TIED[case](dtype)
    # these small tables' materialized sums hold less than the output gradients: book-keeping forced with the norm
    with strategies.preferred("clip_sq_norm", "ghost"), strategies.preferred("weighted_sum", "book-keeping"):
        fn = psg.per_sample(model, backend=backend, reduce=psg.clip_sum(0.5, return_norms=True))(loss)
        got, norms = fn(*args)
        chosen = _choices(fn, *args)["emb.weight"]
    assert chosen["sq_norm"] == "ghost" and chosen["weighted_sum"].startswith("book-keeping"), chosen
    want, want_norms = ref_clip_sum(reference_per_sample(loss, dict(model.named_parameters()), args), 0.5,
                                    return_norms=True)
    assert (want_norms > 0.5).all(), "every sample is clipped: a wrong norm shows in the sums"
    _assert_matches(got, norms, want, want_norms, dtype)


def test_a_tied_weights_ghost_norm_is_certified_where_its_uses_cancel():
    """Two uses whose per-sample gradients nearly cancel (an embedding row and a head row with opposite
    gradients): the exact norm is tiny, the float32 sum of the two contributions is not; the certified norm bounds
    the float32 sum, where the float64 ghost form alone does not."""
    from compiled_psg._rewrite.contraction import summed_factored_sq_norms

    torch.manual_seed(0)
    n, t, vocab, width = 3, 4, 7, 5
    ids = torch.randint(0, vocab, (n, t))
    x = torch.randn(n, t, width) * 1e4
    one_hot = nn.functional.one_hot(ids, vocab).float()
    a_dense = -one_hot + 1e-7 * torch.randn(n, t, vocab)  # the head's rows: the embedding's, negated, perturbed
    parts = [((ids, torch.ones(n, t)), x), (a_dense, x)]
    certified = summed_factored_sq_norms(parts, vocab + width, torch.float32)
    summed32 = torch.bmm(one_hot.transpose(1, 2), x) + torch.bmm(a_dense.transpose(1, 2), x)
    exact = torch.bmm((one_hot.double() + a_dense.double()).transpose(1, 2), x.double())
    assert (certified.double() >= summed32.double().flatten(1).square().sum(1)).all()
    assert (exact.flatten(1).square().sum(1) < summed32.double().flatten(1).square().sum(1)).any(), \
        "the float32 sum does not exceed the exact norm: nothing for the certificate to cover"


def test_the_ghost_grams_of_selecting_and_dense_rows(monkeypatch):
    """``_rows_gram`` of rows that select columns equals the Gram of their one-hot rows, and a dense pair taken a
    slice of columns at a time equals the whole product."""
    from compiled_psg._rewrite import contraction

    torch.manual_seed(1)
    ids, weight = torch.randint(0, 9, (2, 5)), torch.rand(2, 5)
    dense = torch.randn(2, 3, 9)
    one_hot = nn.functional.one_hot(ids, 9).double() * weight.double().unsqueeze(2)
    gram = contraction._rows_gram
    torch.testing.assert_close(gram((ids, weight), (ids, weight)), one_hot @ one_hot.transpose(1, 2))
    torch.testing.assert_close(gram((ids, weight), dense), one_hot @ dense.double().transpose(1, 2))
    torch.testing.assert_close(gram(dense, (ids, weight)), dense.double() @ one_hot.transpose(1, 2))
    whole = dense.double() @ dense.double().transpose(1, 2)
    torch.testing.assert_close(gram(dense, dense), whole, rtol=1e-14, atol=0)
    monkeypatch.setattr(contraction, "GHOST_WIDTH_BYTES", 8 * 3 * 2)  # two columns a slice: five slices
    torch.testing.assert_close(gram(dense, dense), whole, rtol=1e-14, atol=0)
    self_gram, row_sq = contraction._self_gram(dense)
    torch.testing.assert_close(self_gram, whole, rtol=1e-14, atol=0)
    torch.testing.assert_close(row_sq, dense.double().square().sum(2), rtol=1e-14, atol=0)
    other = torch.randn(2, 4, 9)
    torch.testing.assert_close(gram(dense, other), dense.double() @ other.double().transpose(1, 2), rtol=1e-14,
                               atol=0)
