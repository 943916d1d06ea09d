"""Graphs that eager PyTorch runs but Inductor's decompositions broke: each compiles and matches the loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import reference_per_sample

import compiled_psg as psg


class CachedAttention(nn.Module):
    """``k = cat([empty, k])`` before ``q @ k.T``, as ``transformers``' DynamicCache.update does (T5)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        n, t, _ = x.shape
        q, k, v = (lin(x).view(n, t, 2, 4).transpose(1, 2) for lin in (self.q, self.k, self.v))
        k = torch.cat([torch.tensor([]), k], dim=-2)
        v = torch.cat([torch.tensor([]), v], dim=-2)
        weights = (q @ k.transpose(-1, -2)).softmax(-1)
        return self.o((weights @ v).transpose(1, 2).reshape(n, t, 8)).mean(1)


@pytest.mark.inductor
def test_attention_over_an_empty_cache_compiles():
    torch.manual_seed(0)
    model = CachedAttention()
    x, y = torch.randn(4, 6, 8), torch.randint(0, 3, (4,))

    def loss(x, y):
        return F.cross_entropy(model(x), y)

    fn = psg.per_sample(model, backend="inductor")(loss)
    got = fn(x, y)
    ref = reference_per_sample(loss, dict(model.named_parameters()), (x, y))
    for name, r in ref.items():
        torch.testing.assert_close(got[name], r, rtol=1e-4, atol=1e-5)
    assert fn.compiles == 1


def test_views_become_reshapes():
    from compiled_psg._compile.prepare import for_inductor

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    v = graph.call_function(torch.ops.aten.view.default, (x, [2, -1]))
    graph.output(graph.call_function(torch.ops.aten.t.default, (v,)))
    before = torch.fx.GraphModule(torch.nn.Module(), graph)
    after = for_inductor(before)
    assert after.meta["views_as_reshapes"] == 1
    assert torch.ops.aten.view.default not in {n.target for n in after.graph.nodes}
    assert torch.ops.aten.view.default in {n.target for n in before.graph.nodes}  # the original is unchanged
    t = torch.arange(6.0)
    torch.testing.assert_close(after(t), before(t))


def test_layout_optimization_off_only_where_per_sample_convolutions_read_nchw():
    """Channels-last buffers would make each per-sample convolution op copy its operands (benchmarks.probes.layout)."""
    from compiled_psg._compile.run import _inductor_settings

    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    dense = nn.Sequential(nn.Flatten(), nn.Linear(36, 3))
    x, y = torch.randn(4, 1, 6, 6), torch.randint(0, 3, (4,))
    settings = {}
    for name, model in (("conv", conv), ("dense", dense)):
        fn = psg.per_sample(model, reduce=psg.norms(), backend="eager")(lambda x, y, m=model: F.cross_entropy(m(x), y))
        settings[name] = _inductor_settings(psg.explain(fn, x, y).after.graph)
    assert settings["conv"]["layout_optimization"] is False
    assert settings["dense"]["layout_optimization"] is torch._inductor.config.layout_optimization is True
    assert settings["conv"]["emulate_precision_casts"] is settings["dense"]["emulate_precision_casts"] is False


@pytest.mark.parametrize("reduce", ["per_sample", pytest.param("clip_sum", marks=pytest.mark.long)])
def test_a_tied_weights_scatter_adds_into_the_head_gradient(reduce):
    """GPT-2's tied embedding and head: the per-sample gradient is the head's GEMM output plus the lookup's
    scatter-add into zeros; for Inductor the scatter-add goes into the GEMM's output (one ``[n, v, d]`` buffer, not
    two), and the values stay the loop's, in the graph and through Inductor."""
    import sys

    from compiled_psg._compile.prepare import for_inductor

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from zoo import BY_ID

    built = BY_ID["tied_embedding_lm"].build(torch.float64)
    (tokens,) = built.make_batch(4, torch.float64, torch.Generator().manual_seed(3))
    reduction = None if reduce == "per_sample" else psg.clip_sum(1e-3)
    want = reference_per_sample(built.loss, built.params(), (tokens,))
    if reduction is not None:
        from reference import ref_clip_sum
        want = ref_clip_sum(want, 1e-3)
    graph = psg.explain(psg.per_sample(built.model, reduce=reduction, backend="eager")(built.loss), tokens).after
    folded = for_inductor(graph)
    assert folded.meta["scatters_into_sums"] == 1
    zeros = {torch.ops.aten.new_zeros.default, torch.ops.aten.zeros.default, torch.ops.aten.full.default}
    assert sum(n.target in zeros for n in folded.graph.nodes) < sum(n.target in zeros for n in graph.graph.nodes)
    got = psg.per_sample(built.model, reduce=reduction, backend="inductor")(built.loss)(tokens)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-9, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def _scatter_graph(base_shape=(2, 3, 4), scattered_dtype=torch.float32, same_operand=False, extra_user=False,
                   query_dim=None):
    """``a + index_add(zeros(6, 4), 0, idx, src).view(2, 3, 4)``, by hand, with the variations the fold must
    leave alone or handle."""
    aten = torch.ops.aten
    g = torch.fx.Graph()
    a, idx, src = g.placeholder("a"), g.placeholder("idx"), g.placeholder("src")
    a.meta["val"] = torch.empty(base_shape)
    zeros = g.call_function(aten.zeros.default, ([6, 4],), {"dtype": scattered_dtype})
    zeros.meta["val"] = torch.empty(6, 4, dtype=scattered_dtype)
    scattered = g.call_function(aten.index_add.default, (zeros, 0, idx, src))
    scattered.meta["val"] = torch.empty(6, 4, dtype=scattered_dtype)
    view = g.call_function(aten.view.default, (scattered, [2, 3, 4]))
    view.meta["val"] = torch.empty(2, 3, 4, dtype=scattered_dtype)
    outputs = []
    if query_dim is not None:  # a size read from the view (the lift's shapes do this)
        outputs.append(g.call_function(aten.sym_size.int, (view, query_dim)))
    total = g.call_function(aten.add.Tensor, (view, view) if same_operand else (a, view))
    total.meta["val"] = torch.empty(torch.broadcast_shapes(base_shape, (2, 3, 4)),
                                    dtype=torch.promote_types(torch.float32, scattered_dtype))
    outputs.append(total)
    if extra_user:
        outputs.append(g.call_function(aten.mul.Tensor, (view, 2)))
    g.output(tuple(outputs))
    return torch.fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("case", ["fold", "size_query", "negative_size_query", "same_operand", "broadcast",
                                  "promotion", "other_user"])
def test_the_scatter_fold_takes_only_the_same_sum(case):
    """``scatters_into_sums`` folds a scatter into the sum that takes it only where the result is the same tensor:
    not ``s + s``, not a broadcast or a type promotion, not a scatter something else reads; a size read from the
    scatter is answered from the size it was made with. Every variant computes what the original does."""
    from compiled_psg._compile.prepare import for_inductor

    kwargs = {"fold": {}, "size_query": dict(query_dim=1), "negative_size_query": dict(query_dim=-1),
              "same_operand": dict(same_operand=True), "broadcast": dict(base_shape=(3, 4)),
              "promotion": dict(scattered_dtype=torch.float64), "other_user": dict(extra_user=True)}[case]
    before = _scatter_graph(**kwargs)
    after = for_inductor(before)
    assert after.meta["scatters_into_sums"] == (1 if case in ("fold", "size_query", "negative_size_query") else 0)
    torch.manual_seed(0)
    a = torch.randn(kwargs.get("base_shape", (2, 3, 4)))
    idx = torch.tensor([0, 5, 5, 2])
    src = torch.randn(4, 4, dtype=kwargs.get("scattered_dtype", torch.float32))
    for got, want in zip(after(a, idx, src), before(a, idx, src), strict=True):
        torch.testing.assert_close(got, want)


class _TokenHead(nn.Module):
    """Embedding and a linear head over a vocabulary of 1000: the logits are the step's largest tensor."""

    def __init__(self, vocab=1000, width=16):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(torch.tanh(self.embed(tokens)))


def _token_loss(model):
    """Each sequence's mean token loss, averaged (``benchmarks.models.TokenCrossEntropy``)."""
    def loss(tokens):
        logits = model(tokens[:, :-1])
        per_token = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
        return per_token.view(tokens.shape[0], -1).mean(1).mean()
    return loss


@pytest.mark.inductor
def test_the_logits_gradient_is_written_over_the_logits():
    """A per-sequence mean token loss: the backward's seed reads the total loss (``seeds_after_losses``), so the
    kernel that computes the losses runs first and Inductor writes the log-softmax gradient over the logits: one
    ``[tokens, 1000]`` buffer in the generated code, not two. The values stay the loop's."""
    import re

    from torch._inductor.utils import run_and_get_code

    from compiled_psg._compile.prepare import for_inductor

    torch.manual_seed(0)
    model = _TokenHead().double()
    tokens = torch.randint(0, 1000, (3, 9), generator=torch.Generator().manual_seed(1))
    loss = _token_loss(model)
    graph = psg.explain(psg.per_sample(model, reduce=psg.clip_sum(1e-2), backend="eager")(loss), tokens).after
    assert for_inductor(graph).meta["seeds_after_losses"] == 1
    fn = psg.per_sample(model, reduce=psg.clip_sum(1e-2), backend="inductor")(loss)
    with torch._inductor.config.patch(fx_graph_cache=False):
        got, codes = run_and_get_code(fn, tokens)
    vocab_rows = re.findall(r"empty_strided_cpu\(\(\d+\*s\d+, 1000\)", "\n".join(codes))  # [tokens, vocabulary]
    assert len(vocab_rows) == 1, vocab_rows
    from reference import ref_clip_sum
    want = ref_clip_sum(reference_per_sample(loss, dict(model.named_parameters()), (tokens,)), 1e-2)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("total", [2.5, float("inf"), float("-inf"), float("nan"), -0.0])
def test_the_seed_reads_the_total_and_stays_one(total):
    """``ones_like(t) + nan_to_num(t * 0)`` is exactly one for every ``t``, and now reads ``t``."""
    from compiled_psg._compile.prepare import seeds_after_losses

    aten = torch.ops.aten
    g = torch.fx.Graph()
    t = g.placeholder("t")
    t.meta["val"] = torch.empty(())
    seed = g.call_function(aten.ones_like.default, (t,))
    seed.meta["val"] = torch.empty(())
    g.output((g.call_function(aten.mul.Tensor, (seed, 3.0)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert seeds_after_losses(gm.graph) == 1
    gm.recompile()
    (out,) = gm(torch.tensor(total))
    assert torch.equal(out, torch.tensor(3.0))
    added = [n for n in gm.graph.nodes if n.target is aten.add.Tensor]
    assert len(added) == 1 and t in added[0].args[1].args[0].args


def test_a_ones_like_of_another_dtype_is_not_a_seed():
    """``ones_like(t, dtype=torch.bfloat16)`` (the user's, not the backward's seed) is left as it is: adding a
    float32 zero would promote it."""
    from compiled_psg._compile.prepare import seeds_after_losses

    aten = torch.ops.aten
    g = torch.fx.Graph()
    t = g.placeholder("t")
    t.meta["val"] = torch.empty(())
    ones = g.call_function(aten.ones_like.default, (t,), {"dtype": torch.bfloat16})
    ones.meta["val"] = torch.empty((), dtype=torch.bfloat16)
    g.output((ones,))
    assert seeds_after_losses(g) == 0


class RelativePositionBias(nn.Module):
    """A bias read from a table at fixed positions, ``table[index]``, as Swin's attention reads it."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(7, 2, dtype=torch.float64))
        self.register_buffer("index", torch.randint(0, 7, (16,), generator=torch.Generator().manual_seed(0)))

    def forward(self, x):  # x [n, 2, 4, 4]
        return (x + self.table[self.index].view(4, 4, 2).permute(2, 0, 1)).pow(2).sum()


@pytest.mark.inductor
def test_a_table_read_at_shared_positions_gets_each_samples_gradient():
    """The per-sample gradient of ``table[index]`` is an ``index_put`` of each sample's rows into one broadcast
    zeros (vmap's batching rule); torch 2.13's Inductor wrote every sample into the same storage, so each got the
    batch's sum. A clone of the base gives the writes a tensor of their own."""
    torch.manual_seed(0)
    model = RelativePositionBias()
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    got = psg.per_sample(model, backend="inductor")(model)(x)
    ref = reference_per_sample(model, dict(model.named_parameters()), (x,))
    torch.testing.assert_close(got["table"], ref["table"], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("op", ["index_put", "index_add", "index_copy"])
def test_indexed_writes_into_a_broadcast_get_a_copy(op):
    from torch.fx.experimental.proxy_tensor import make_fx

    from compiled_psg._compile.prepare import for_inductor

    aten = torch.ops.aten
    write = {"index_put": lambda z, v, i: aten.index_put.default(z, [None, i], v, True),
             "index_add": lambda z, v, i: aten.index_add.default(z, 1, i, v),
             "index_copy": lambda z, v, i: aten.index_copy.default(z, 1, i, v)}[op]

    def f(v, i):
        return write(v.new_zeros([4, 2]).expand(v.shape[0], 4, 2), v, i)

    v, i = torch.randn(3, 4, 2), torch.tensor([2, 0, 3, 1])
    before = make_fx(f, tracing_mode="symbolic")(v, i)
    after = for_inductor(before)
    assert after.meta["writes_into_broadcasts"] == 1
    torch.testing.assert_close(after(v, i), f(v, i))
    no_broadcast = for_inductor(make_fx(lambda v, i: write(v.new_zeros(v.shape), v, i), tracing_mode="symbolic")(v, i))
    assert no_broadcast.meta["writes_into_broadcasts"] == 0


@pytest.mark.inductor
def test_a_two_layer_bidirectional_rnn_is_exact_on_inductor():
    """Round L: Inductor's ``reorder_for_locality``, a pass of inference graphs, gave the per-sample graph of a
    2-layer bidirectional ``nn.RNN`` wrong gradients (every parameter, 2.76 off on a scale of 2.68 in float64,
    and the DP step's update with them); the eager backend ran the same graph exactly. Rewritten graphs compile
    without that pass (``_compile/run.py``, ``_inductor_settings``)."""
    torch.manual_seed(0)
    rnn = nn.RNN(3, 4, num_layers=2, bidirectional=True, batch_first=True).double()
    x = torch.randn(4, 5, 3, dtype=torch.float64)

    def loss(x):
        return rnn(x)[0].pow(2).sum()

    got = psg.per_sample(rnn, backend="inductor")(loss)(x)
    expected = reference_per_sample(loss, dict(rnn.named_parameters()), (x,))
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-9, atol=1e-12)
