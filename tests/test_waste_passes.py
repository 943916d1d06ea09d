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


def _setup(reduce):
    torch.manual_seed(0)
    model = ConvNorms().double()
    x = torch.randn(5, 2, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (5,))

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
    rewritten = f.prepare_call(*args).entry.rewritten.rewritten
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
