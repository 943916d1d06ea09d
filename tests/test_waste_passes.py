"""Passes that remove work the rewritten graph does for nothing (issue 12): narrowed output masks."""

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import ref_clip_sum, reference_per_sample

import compiled_psg as psg
from compiled_psg._compile.masks import MASKED


class ConvNorms(nn.Module):
    """Two convolutions (the second one's input gradient is needed), GroupNorm and LayerNorm: every masked op."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3)
        self.gn = nn.GroupNorm(2, 4)
        self.conv2 = nn.Conv2d(4, 4, 3)
        self.ln = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 3)

    def forward(self, x):
        h = F.relu(self.conv2(F.relu(self.gn(self.conv1(x)))))  # [n, 4, 2, 2]
        return self.fc(self.ln(h.flatten(1)))


def _setup(reduce, make=None, channels: int = 2, classes: int = 3):
    torch.manual_seed(0)
    model = (make or ConvNorms)().double()
    x = torch.randn(5, channels, 6, 6, dtype=torch.float64)
    y = torch.randint(0, classes, (5,))

    def loss(x, y):
        return F.cross_entropy(model(x), y)

    f = psg.per_sample(model, reduce=reduce, backend="eager")(loss)
    return model, loss, f, (x, y)


def _masked_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in MASKED]


@pytest.mark.parametrize("reduce", [psg.clip_sum(0.5), None], ids=["clip_sum", "per_sample"])
def test_masks_request_only_the_outputs_read(reduce):
    model, loss, f, args = _setup(reduce)
    got = f(*args)
    rewritten = f.prepare_call(*args).entry.rewritten.graph_module
    nodes = _masked_nodes(rewritten)
    assert nodes, "the model has no masked backward op: the test checks nothing"
    for node in nodes:
        read = {u.args[1] for u in node.users if u.target is operator.getitem}
        mask = node.args[-1]
        assert [k for k, m in enumerate(mask) if m] == sorted(read), (node.format_node(), read)
    # the batch-summed weight gradients autograd asked for are gone: some outputs were dropped
    assert rewritten.meta["output_masks_narrowed"] > 0
    ref = reference_per_sample(loss, dict(model.named_parameters()), args)
    want = ref_clip_sum(ref, 0.5) if reduce is not None else ref
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12)


def test_masks_kept_where_the_weight_gradient_is_read():
    """A hand-built graph: an output some ``getitem`` reads stays requested, an unread one is dropped, and the
    values read do not change."""
    import torch.fx as fx

    from compiled_psg._compile.masks import narrow_output_masks

    conv = nn.Conv2d(2, 3, 3).double()
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64, requires_grad=True)

    def f(x, w, b):
        out = torch.ops.aten.convolution_backward.default(
            x.new_ones(2, 3, 3, 3), x, w, [3], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, True])
        return out[0].sum() + out[1].sum()  # out[2] (the bias gradient) is not read

    gm = fx.symbolic_trace(f)
    assert narrow_output_masks(gm) == 1
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.convolution_backward.default]
    assert node.args[-1] == [True, True, False]
    torch.testing.assert_close(gm(x, conv.weight, conv.bias), f(x, conv.weight, conv.bias))


# ----- the clipped sum scales the narrower operand of each contraction -----


class WideNarrow(nn.Module):
    """Linear layers wider in than out and out than in, on vectors and on sequences [n, t, *], and convolutions
    with a small input (scale the input) and a small output gradient (scale the gradient)."""

    def __init__(self):
        super().__init__()
        self.conv_in = nn.Conv2d(1, 6, 3)  # x [1, 6, 6] per sample, gradient [6, 4, 4]: scale x
        self.conv_out = nn.Conv2d(6, 2, 3, stride=2)  # x [6, 4, 4], gradient [2, 1, 1]: scale the gradient
        self.wide_in = nn.Linear(12, 3)  # scale the 3-wide output gradient
        self.wide_out = nn.Linear(3, 12)  # scale the 3-wide input
        self.head = nn.Linear(12, 2)

    def forward(self, x):
        h = F.relu(self.conv_out(F.relu(self.conv_in(x))))  # [n, 2, 1, 1]
        seq = h.flatten(1).unsqueeze(1).expand(-1, 4, -1) * torch.arange(1.0, 5.0, dtype=x.dtype).view(1, 4, 1)
        seq = torch.cat([seq] * 6, dim=2)  # [n, 4, 12]
        seq = self.wide_out(torch.tanh(self.wide_in(seq)))  # [n, 4, 3] -> [n, 4, 12]
        return self.head(seq.mean(1))


class _WeightedSum(psg.Reduction):
    """``sum_n g_n / (n + 1)``: a weighted sum whose weights do not come from materialized norms, so every layer
    may take the book-keeping strategy (after a materialized norm, a clipped sum reuses its values instead)."""

    def emit(self, ctx):
        w = ctx.emit(lambda r: torch.arange(1, r.shape[0] + 1, dtype=r.dtype).reciprocal(), [ctx.batch_ref],
                     "weights")
        return {p.name: ctx.weighted_sum(p, w) for p in ctx.params}


def test_weighted_sum_scales_the_narrower_operand():
    from compiled_psg._reduce.strategies import ITEMSIZE

    model, loss, f, (x, y) = _setup(_WeightedSum(), WideNarrow, channels=1, classes=2)
    got = f(x, y)
    ref = reference_per_sample(loss, dict(model.named_parameters()), (x, y))
    weights = torch.arange(1, 6, dtype=torch.float64).reciprocal()
    for name, value in ref.items():
        torch.testing.assert_close(got[name], torch.tensordot(weights, value, dims=1), rtol=1e-10, atol=1e-12)
    choices = f.prepare_call(x, y).entry.rewritten.choices
    scaled = {name: c.cost["bytes"] / (2 * ITEMSIZE) for name, cs in choices.items() for c in cs
              if c.quantity == "weighted_sum" and c.method == "book-keeping" and name.endswith("weight")}
    # elements scaled per sample: the smaller operand (t = 4 tokens for the sequence layers)
    assert scaled == {"conv_in.weight": 1 * 6 * 6, "conv_out.weight": 2 * 1 * 1, "wide_in.weight": 4 * 3,
                      "wide_out.weight": 4 * 3, "head.weight": 2}, scaled


def test_clip_sum_after_materialized_norms_sums_the_same_values():
    """A clip factor bounds what is summed only if the norm was taken of those values: after a materialized norm
    of a sum of several terms per entry (conv, tokens) the clipped sum reuses the materialized values."""
    model, loss, f, (x, y) = _setup(psg.clip_sum(0.3), WideNarrow, channels=1, classes=2)
    got = f(x, y)
    want = ref_clip_sum(reference_per_sample(loss, dict(model.named_parameters()), (x, y)), 0.3)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12)
    # several products per entry (16 positions, 4 tokens): a materialized norm's values are summed; one product
    # per entry (head, and conv_out's single output position): any strategy
    several = {"conv_in.weight", "conv_in.bias", "wide_in.weight", "wide_in.bias", "wide_out.weight",
               "wide_out.bias"}
    choices = f.prepare_call(x, y).entry.rewritten.choices
    for name in several:
        norm = next(c.method for c in choices[name] if c.quantity == "sq_norm")
        summed = next(c.method for c in choices[name] if c.quantity == "weighted_sum")
        assert norm != "materialize" or summed.startswith("materialize"), (name, norm, summed)
    assert sum(next(c.method for c in choices[n] if c.quantity == "weighted_sum").startswith("materialize")
               for n in several) >= 3, choices


# ----- compile_step: the optimizer's foreach ops become one op per parameter -----


def _train_foreach(make_opt, unroll: bool, monkeypatch):
    import compiled_psg._train.foreach as foreach
    import compiled_psg._train.programs as programs
    from compiled_psg import compile_step

    programs_made = []
    fuse_step = programs.fuse_step

    def spy(*args, **kwargs):
        programs_made.append(fuse_step(*args, **kwargs))
        return programs_made[-1]

    monkeypatch.setattr(programs, "fuse_step", spy)
    if not unroll:
        monkeypatch.setattr(foreach, "unroll_foreach", lambda graph: 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, make_opt(model.parameters()),
                        max_grad_norm=1.0, noise_multiplier=1.0, generator=torch.Generator().manual_seed(3),
                        backend="eager")
    data = torch.Generator().manual_seed(1)
    for _ in range(3):  # the first step runs eagerly, the next ones the fused program
        step(torch.randn(8, 6, generator=data), torch.randint(0, 3, (8,), generator=data))
    monkeypatch.undo()
    return [p.detach().clone() for p in model.parameters()], programs_made[-1].gm


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=True),
], ids=["sgd_momentum", "adamw"])
def test_foreach_update_unrolled_per_parameter(make_opt, monkeypatch):
    kept, kept_gm = _train_foreach(make_opt, False, monkeypatch)
    unrolled, gm = _train_foreach(make_opt, True, monkeypatch)
    assert any("_foreach_" in str(n.target) for n in kept_gm.graph.nodes)
    assert not any("_foreach_" in str(n.target) for n in gm.graph.nodes)
    assert gm.meta["foreach_unrolled"] > 0
    for a, b in zip(kept, unrolled, strict=True):
        assert torch.equal(a, b)
