"""Refusals: sample mixing, bad inputs, graph breaks. Each error names the culprit, the user's line, a fix.

Offending lines carry a ``# <marker>`` comment; ``line_of(marker)`` finds their line number in this file.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compiled_psg as psg

THIS = Path(__file__)
F64 = torch.float64


def line_of(marker: str) -> int:
    lines = THIS.read_text().splitlines()
    hits = [i + 1 for i, text in enumerate(lines) if text.rstrip().endswith(f"# <{marker}>")]
    assert len(hits) == 1, f"marker {marker!r} found on lines {hits}"
    return hits[0]


def assert_points_at(message: str, *markers: str):
    """The message names this file and the line of one of ``markers``."""
    lines = [line_of(m) for m in markers]
    assert any(re.search(rf"{re.escape(THIS.name)}\D{{1,12}}{line}\b", message) for line in lines), (
        f"the message should point at {THIS.name} line {' or '.join(map(str, lines))}:\n{message}")


def data(B=4, n_in=5, n_classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, n_in, generator=g, dtype=F64), torch.randint(0, n_classes, (B,), generator=g)


# ---------------------------------------------------------------- sample mixing


def _batchnorm(bn: nn.Module):
    """A BatchNorm2d ``bn`` then a linear head; the loss line is tagged ``<batchnorm>``."""
    torch.manual_seed(0)
    bn, head = bn.double(), nn.Linear(2 * 4 * 4, 3).double()
    model = nn.ModuleList([bn, head])

    def loss(x, y):
        return F.cross_entropy(head(bn(x).flatten(1)), y)  # <batchnorm>

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, 4, 4, generator=g, dtype=F64)
    return model, loss, (x, torch.randint(0, 3, (4,), generator=g))


def batchnorm_train():
    return _batchnorm(nn.BatchNorm2d(2).train())


def center_over_batch():
    torch.manual_seed(0)
    lin = nn.Linear(5, 3).double()

    def loss(x, y):
        h = lin(x - x.mean(0))  # <center>
        return F.cross_entropy(h, y)

    return lin, loss, data()


def softmax_over_batch():
    torch.manual_seed(0)
    lin = nn.Linear(5, 3).double()

    def loss(x, y):
        p = F.softmax(lin(x), dim=0)  # <softmax0>
        return -(p.log() * F.one_hot(y, 3)).sum()

    return lin, loss, data()


def contrastive():
    torch.manual_seed(0)
    enc = nn.Linear(5, 4).double()

    def loss(x, y):
        z = F.normalize(enc(x), dim=1)
        logits = z @ z.T  # <contrastive>
        return F.cross_entropy(logits, torch.arange(x.shape[0]))

    return enc, loss, data()


def batchnorm_eval_without_running_stats():
    return _batchnorm(nn.BatchNorm2d(2, track_running_stats=False).eval())


def instance_norm_over_the_batch():
    torch.manual_seed(0)
    norm, head = nn.InstanceNorm1d(2, affine=True).double(), nn.Linear(2 * 3, 3).double()
    model = nn.ModuleList([norm, head])

    def loss(x, y):
        h = norm(x.permute(2, 1, 0)).permute(2, 1, 0)  # <instance_norm_batch>
        return F.cross_entropy(head(h.flatten(1)), y)

    g = torch.Generator().manual_seed(0)
    return model, loss, (torch.randn(4, 2, 3, generator=g, dtype=F64), torch.randint(0, 3, (4,), generator=g))


def write_at_batch_positions(op):
    def build():
        torch.manual_seed(0)
        lin = nn.Linear(5, 3).double()

        def loss(x, y):
            n, h = x.shape[0], lin(x)
            at = torch.arange(n)
            out = {"index_add": lambda z: z.index_add(0, at, h),  # <index_add_at_arange>
                   "index_copy": lambda z: z.index_copy(0, at, h),  # <index_copy_at_arange>
                   "scatter": lambda z: z.scatter(0, at[:, None].expand(-1, 3), h),  # <scatter_at_arange>
                   }[op](torch.zeros(n, 3, dtype=F64))
            return F.cross_entropy(out, y)

        return lin, loss, data()
    return build


MIXING = [
    # id, builder, marker, acceptable op names (one must appear), required fix words
    ("batchnorm_train", batchnorm_train, "batchnorm", ["batch_norm"], ["eval", "GroupNorm"]),
    ("center_over_batch", center_over_batch, "center", ["mean", "sum"], ["fix"]),
    ("softmax_dim0", softmax_over_batch, "softmax0", ["softmax"], ["fix"]),
    ("contrastive_z_zT", contrastive, "contrastive", ["mm", "matmul", "bmm"], ["fix"]),
    ("batchnorm_eval_without_running_stats", batchnorm_eval_without_running_stats, "batchnorm",
     ["batch_norm"], ["in eval mode too", "track_running_stats=True", "GroupNorm"]),
    ("instance_norm_over_the_batch", instance_norm_over_the_batch, "instance_norm_batch", ["batch_norm"],
     ["InstanceNorm normalizes over the dimension that holds the batch", "in_dims"]),
    *[(f"{op}_at_arange", write_at_batch_positions(op), f"{op}_at_arange", [op],
       ["h[torch.arange(n)] = v", "accumulate=True"]) for op in ("index_add", "index_copy", "scatter")],
]


@pytest.mark.parametrize("builder,marker,ops,fixes", [m[1:] for m in MIXING], ids=[m[0] for m in MIXING])
def test_sample_mixing_refused(builder, marker, ops, fixes):
    model, loss, args = builder()
    fn = psg.per_sample(model, backend="eager")(loss)
    with pytest.raises(psg.SampleMixingError) as info:
        fn(*args)
    message = str(info.value)
    assert any(op in message for op in ops), f"the message should name the op (one of {ops}):\n{message}"
    assert_points_at(message, marker)
    for word in fixes:
        assert word.lower() in message.lower(), f"the message should suggest a fix ({word!r}):\n{message}"
    assert isinstance(info.value, psg.PerSampleError)


# ---------------------------------------------------------------- bad input


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()


def test_different_batch_sizes():
    model = _mlp()
    fn = psg.per_sample(model, backend="eager")(lambda x, y: F.cross_entropy(model(x), y))
    x, _ = data(B=3)
    _, y = data(B=4)
    with pytest.raises(psg.BatchInputError, match=r"batch size") as info:
        fn(x, y)
    assert "3" in str(info.value) and "4" in str(info.value), str(info.value)


def test_in_dims_tuple_wrong_length():
    model = _mlp()
    fn = psg.per_sample(model, in_dims=(0,), backend="eager")(lambda x, y: F.cross_entropy(model(x), y))
    with pytest.raises(psg.BatchInputError, match=r"in_dims") as info:
        fn(*data())
    assert "1" in str(info.value) and "2" in str(info.value), str(info.value)


def test_non_tensor_batched_argument():
    model = _mlp()
    fn = psg.per_sample(model, backend="eager")(lambda x, y: F.cross_entropy(model(x), torch.tensor(y)))
    x, y = data()
    with pytest.raises(psg.BatchInputError, match=r"(?i)tensor") as info:
        fn(x, y.tolist())
    assert "list" in str(info.value) or "argument 1" in str(info.value), str(info.value)


def test_loss_with_two_values_per_sample():
    model = _mlp()
    fn = psg.per_sample(model, backend="eager")(lambda x, y: F.cross_entropy(model(x), y, reduction="none")
                                                .unsqueeze(1).expand(-1, 2))
    with pytest.raises(psg.BatchInputError) as info:
        fn(*data())
    message = str(info.value)
    assert re.search(r"[\[(]4, 2[\])]", message) or "2" in message and "shape" in message.lower(), message


def test_non_floating_parameter_in_dict():
    W = torch.randn(3, 5, dtype=F64, requires_grad=True)
    index = torch.tensor([0, 2])

    def loss(x, y):
        return F.cross_entropy(F.linear(x, W)[:, index], y % 2)

    fn = psg.per_sample({"W": W, "index": index}, backend="eager")(loss)
    with pytest.raises(psg.BatchInputError, match=r"index") as info:
        fn(*data())
    assert "int64" in str(info.value) or "float" in str(info.value), str(info.value)


def test_per_sample_without_the_model_is_refused_at_decoration():
    """``@psg.per_sample`` with no ``(model)`` made the loss its params: the decoration passed and the first call
    raised "decorate() takes 1 positional argument but 2 were given". A loss that is not a function failed inside
    the capture as a graph break. Both are refused where they are written."""
    model = _mlp()
    with pytest.raises(psg.BatchInputError, match=r"got function loss\. .*Fix: @psg.per_sample\(model\)"):
        @psg.per_sample
        def loss(x, y):
            return F.cross_entropy(model(x), y)
    with pytest.raises(psg.BatchInputError, match="got str"):
        psg.per_sample("model")
    for decorate in (psg.per_sample(model), psg.per_sample_grad):
        with pytest.raises(psg.BatchInputError, match="the loss must be a function, got int 42"):
            decorate(42)


def test_batches_and_arguments_of_the_wrong_kind_are_refused_naming_them():
    """Each of these escaped as a raw RuntimeError, TypeError or AttributeError from inside compiled_psg (or, for
    in_dims=True, was read as 1): a sparse or nested batch, keyword arguments to per_sample_grad, explain or a DP
    step, argnums="0", clip_sum("1"), custom(None), graph_text("nope"), and a nested params dict (which was
    called empty). Labels on the meta device and a complex loss said "report this message"."""
    model = _mlp()
    x, y = data()
    loss = lambda x, y: F.cross_entropy(model(x), y)  # noqa: E731
    fn = psg.per_sample(model, backend="eager")(loss)
    functional = psg.per_sample_grad(lambda p, x, y: F.cross_entropy(x @ p["w"].T, y), backend="eager")
    step = psg.compile_step(loss, model, torch.optim.SGD(model.parameters(), lr=0.1), backend="eager")
    cases = ((lambda: fn(x.to_sparse(), y), "argument 0 is a torch.sparse_coo tensor"),
             # a step and explain(step) made the batch contiguous first: torch's raw RuntimeError
             (lambda: step(x.to_sparse(), y), "argument 0 is a torch.sparse_coo tensor"),
             (lambda: psg.explain(step, x.to_sparse(), y), "argument 0 is a torch.sparse_coo tensor"),
             (lambda: fn(torch.nested.nested_tensor([x[0], x[1]], layout=torch.jagged), y[:2]),
              "argument 0 is a nested tensor"),
             (lambda: psg.per_sample(model, in_dims=True)(loss)(x, y), "in_dims must be an int, None or a tuple, "
                                                                       "got bool"),
             (lambda: psg.per_sample(model, in_dims=(0, False))(loss)(x, y), r"in_dims\[1\] must be an int"),
             (lambda: functional({"w": torch.randn(3, 5, dtype=F64)}, x, y=y), "keyword arguments"),
             (lambda: psg.explain(fn, x, y=y), "keyword arguments"),
             (lambda: step(x, y=y), "keyword arguments"),
             (lambda: psg.per_sample_grad(loss, argnums="0"), "argnums must be an int >= 0, .* got '0'"),
             (lambda: psg.clip_sum("1"), "max_norm must be positive, a number, got '1'"),
             (lambda: psg.custom(None), "per_param must be a function, got NoneType"),
             # round L: a truthy string turned the option on
             (lambda: psg.norms(per_parameter="no"), "per_parameter must be True or False, got str 'no'"),
             (lambda: psg.clip_sum(1.0, return_norms="x"), "return_norms must be True or False, got str 'x'"),
             # round L: accepted, then a raw TypeError "'int' object is not callable" on an empty batch
             (lambda: psg.custom(lambda n, g: g.sum(0), empty_result=3), "empty_result must be a function .* got int"),
             (lambda: psg.per_sample(model, reduce="norms")(loss)(x, y), "reduce must be a compiled_psg reduction"),
             (lambda: psg.per_sample(model, backend="aot_eager")(loss)(x, y), "backend must be one of"),
             (lambda: psg.explain(fn, x, y).graph_text("nope"), "takes 'captured' .*'before' .*'after' .*'nope'"),
             (lambda: functional({"a": {"w": torch.randn(3, 5)}}, x, y), r"\['a'\] are dicts: nested dicts"),
             (lambda: psg.per_sample({"a": {"w": torch.randn(3, 5)}})(loss)(x, y), "nested dicts"),
             # were "report this message to compiled_psg": a device mismatch and autograd's error inside the trace
             (lambda: fn(x, y.to("meta")), "argument 1 is on the meta device"),
             (lambda: psg.per_sample(model, backend="eager")(lambda x, y: (model(x).to(torch.complex128) ** 2).sum())(
                 x, y), "the loss is complex: .*Fix: return a real loss"))
    for call, match in cases:
        with pytest.raises(psg.BatchInputError, match=match):
            call()
    assert step.steps_taken == 0


def test_a_custom_reduction_that_fails_is_named_with_its_function_its_line_and_a_fix():
    """A custom reduction's own errors were blamed on the loss ("capturing and rewriting the loss failed ... fix it
    there"), ``float(t)`` relayed torch's GuardOnDataDependentSymNode and ``len(g)`` was an InternalError ("please
    report"). Each names the function (and parameter) that failed, its line and a fix; the fixes are exact."""
    model = _mlp()
    x, y = data()
    loss = lambda x, y: F.cross_entropy(model(x), y)  # noqa: E731
    cases = ((psg.custom(lambda n, g: g.sum(0) + undefined_name), "per_param", r"NameError: .*undefined_name",  # noqa: F821 # <custom_name>
              "custom_name"),
             (psg.custom(lambda n, g: g.sum(0) * float(g.norm())), "per_param",  # <custom_float>
              r"reads a tensor's value as a Python value.*Fix: compute with tensor ops", "custom_float"),
             (psg.custom(lambda n, g: g.sum(0), lambda d: d["nope"]), "combine", "KeyError: 'nope'",  # <custom_key>
              "custom_key"))
    for reduction, function, match, marker in cases:
        with pytest.raises(psg.BatchInputError, match=rf"custom reduction's {function}.*{match}") as caught:
            psg.per_sample(model, reduce=reduction, backend="eager")(loss)(x, y)
        assert_points_at(str(caught.value), marker)
    with pytest.raises(psg.BatchInputError, match=r"turned the batch size into the Python number 4 .*Fix: .*"
                                                  r"g\.shape\[0\]"):
        psg.per_sample(model, reduce=psg.custom(lambda n, g: g.sum(0) / len(g)), backend="eager")(loss)(x, y)
    weights = torch.ones(len(x), dtype=x.dtype)  # red team Q1: was "turned the batch size into the Python number"
    with pytest.raises(psg.BatchInputError, match=r"meets the per-sample values with `weights` \(a tensor of shape "
                                                  r"\(4,\) that per_param reads from outside\).*Fix: weight each "
                                                  r"sample in the loss"):
        psg.per_sample(model, reduce=psg.custom(lambda n, g: (g.flatten(1).sum(1) * weights).sum()),
                       backend="eager")(loss)(x, y)
    full = psg.per_sample(model, backend="eager")(loss)(x, y)
    fixed = psg.per_sample(model, reduce=psg.custom(lambda n, g: g.sum(0) / g.shape[0] * g.norm()),
                           backend="eager")(loss)(x, y)
    for name, value in full.items():
        torch.testing.assert_close(fixed[name], value.mean(0) * value.norm(), rtol=1e-12, atol=1e-14)
    # the result has the structure combine built, in plain containers (it was fx's immutable_dict/immutable_list)
    nested = psg.per_sample(model, reduce=psg.custom(lambda n, g: [g.sum(0)], lambda d: {"sums": d}),
                            backend="eager")(loss)(x, y)
    assert type(nested) is dict and type(nested["sums"]) is dict
    assert all(type(v) is list for v in nested["sums"].values())
    nested["sums"]["extra"] = []  # a plain dict takes new keys


def test_a_loss_that_trains_another_model_than_the_one_given_is_named():
    """``psg.per_sample(model)`` around a loss that calls another model (an EMA copy, a teacher) whose parameters
    require grad: the re-trace failed, blaming ``.item()`` and asking for a bug report."""
    model, other = _mlp(), _mlp()
    x, y = data()
    for params in (model, {"w": torch.randn(3, 5, dtype=F64, requires_grad=True)}):
        with pytest.raises(psg.BatchInputError, match=r"uses none of the parameters given to per_sample, yet it has "
                                                      r"a gradient.*Fix: pass the model"):
            psg.per_sample(params, backend="eager")(lambda x, y: F.cross_entropy(other(x), y))(x, y)
    got = psg.per_sample(other, backend="eager")(lambda x, y: F.cross_entropy(other(x), y))(x, y)  # the fix
    assert set(got) == {n for n, _ in other.named_parameters()}


def test_a_per_sample_function_inside_a_transform_or_another_loss_is_named():
    """Called inside ``torch.func.vmap``/``grad`` or inside another per-sample loss, the fix said "rewrite this
    line with torch operations (no Python control flow on tensor values)"."""
    model = _mlp()
    x, y = data()
    fn = psg.per_sample(model, backend="eager")(lambda x, y: F.cross_entropy(model(x), y))
    for transformed in (torch.func.vmap(lambda x, y: fn(x[None], y[None])["0.weight"].sum()),
                        torch.func.grad(lambda x, y: fn(x, y)["0.weight"].sum())):
        with pytest.raises(psg.BatchInputError, match=r"inside a torch.func transform.*Fix: call it on the batch "
                                                      r"outside the transform"):
            transformed(x, y)
    outer = psg.per_sample(model, backend="eager")(
        lambda x, y: F.cross_entropy(model(x), y) + fn(x, y)["0.weight"].sum())
    with pytest.raises(psg.CaptureError, match=r"Fix: a per-sample function \(or a DP step\) is called inside the "
                                               r"loss of another"):
        outer(x, y)


# ---------------------------------------------------------------- graph breaks


def branch_on_data():
    model = _mlp()

    def loss(x, y):
        out = model(x)
        if x.sum() > 0:  # <branch>
            out = out * 2
        return F.cross_entropy(out, y)

    return model, loss


def item_in_control_flow():
    model = _mlp()

    def loss(x, y):
        value = F.cross_entropy(model(x), y)
        scale = value.item()  # <item>
        if scale > 1.0:  # <item_if>
            return value / scale
        return value

    return model, loss


@pytest.mark.parametrize("builder,marker",
                         [(branch_on_data, "branch"), (item_in_control_flow, ("item", "item_if"))],
                         ids=["branch_on_tensor", "item"])
def test_graph_break_is_capture_error(builder, marker):
    model, loss = builder()
    fn = psg.per_sample(model, backend="eager")(loss)
    with pytest.raises(psg.CaptureError) as info:
        fn(*data())
    assert_points_at(str(info.value), *(marker if isinstance(marker, tuple) else (marker,)))


# ---------------------------------------------------------------- the loss raises


class _LossError(Exception):
    """A user's own exception class."""


_MADE_OUTSIDE = ValueError("labels missing")


def raises_own_class(x, y):
    raise _LossError("mine")  # <raise_own>


def raises_made_outside(x, y):
    raise _MADE_OUTSIDE  # <raise_outside>


def calls_with_wrong_arguments(x, y):
    return F.cross_entropy(x, y, 3, 4, 5, 6, 7, 8, 9)  # <wrong_call>


# pytest rewrites a test module's asserts into its own reporting code, which Dynamo traces otherwise (torch 2.11):
# this loss is compiled from the text below as Python would, with its lines numbered as in this file
_ASSERTS_A_SHAPE = '''
def asserts_a_shape(x, y):
    assert x.shape[1] == 7, "expected 7 features"  # <assert_shape>
    return F.cross_entropy(x, y)
'''
exec(compile("\n" * (line_of("assert_shape") - 3) + _ASSERTS_A_SHAPE, str(THIS), "exec"))


@pytest.mark.parametrize("loss,marker,says,cause", [
    (raises_own_class, "raise_own", "_LossError('mine')", _LossError),
    (raises_made_outside, "raise_outside", "made outside the loss function", None),
    (calls_with_wrong_arguments, "wrong_call", "takes from 2 to 8 positional arguments", TypeError),
    (asserts_a_shape, "assert_shape", "AssertionError", None),  # noqa: F821 - defined by exec above
], ids=["own_class", "made_outside", "wrong_call", "assert"])
def test_an_exception_the_loss_raises_is_named_with_its_line(loss, marker, says, cause):
    """What the loss itself raises is the user's error, not a graph break: the message names it and its line,
    keeps the user's exception as the cause where it can be rebuilt, and gives none of the graph-break Fixes
    (rewrite with torch operations, no .item(), "raises TypeError when run without compiled_psg")."""
    model = _mlp()
    fn = psg.per_sample(model, backend="eager")(loss)
    with pytest.raises(psg.BatchInputError) as info:
        fn(*data())
    message = str(info.value)
    assert "the loss function raised" in message and says in message, message
    assert_points_at(message, marker)
    assert "torch operations" not in message and ".item()" not in message and "must derive" not in message, message
    if cause is not None:
        assert type(info.value.__cause__) is cause, repr(info.value.__cause__)


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
def test_keyboard_interrupt_and_system_exit_raised_by_the_loss_propagate(kind):
    """An interrupt or exit asked for by the loss is not an error to report: it leaves the call as itself, and
    the next call works (the capture's switches are undone)."""
    model = _mlp()

    def loss(x, y):
        raise kind

    with pytest.raises(kind):
        psg.per_sample(model, backend="eager")(loss)(*data())
    fn = psg.per_sample(model, backend="eager")(lambda x, y: F.cross_entropy(model(x), y))
    assert fn(*data())["0.weight"].shape[0] == 4


# ---------------------------------------------------------------- inside the user's torch.compile


def test_a_per_sample_function_and_a_step_called_inside_torch_compile_run_as_themselves():
    """A training step wrapped in torch.compile is common. Dynamo must not trace compiled_psg's own capture (it
    failed inside it, "exception table entry", reported as a compiled_psg bug): the compiled region breaks its
    graph at the call and runs it as is, with the same gradients; fullgraph=True, which refuses any break, says to
    call it outside the region."""
    model = _mlp()
    x, y = data()
    fn = psg.per_sample(model, backend="eager")(lambda x, y: F.cross_entropy(model(x), y))
    expected = fn(x, y)
    got = torch.compile(lambda x, y: {k: 2 * v for k, v in fn(x, y).items()}, backend="eager")(x, y)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], 2 * value)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"call it outside the torch.compile\(fullgraph=True\)"):
        torch.compile(lambda x, y: fn(x, y), backend="eager", fullgraph=True)(x, y)
    step = psg.compile_step(lambda x, y: F.cross_entropy(model(x), y), model,
                            torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0, noise_multiplier=0.0,
                            backend="eager")
    torch.compile(lambda x, y: step(x, y), backend="eager")(x, y)
    assert step.steps_taken == 1


EMB, HEAD = nn.Embedding(10, 4).double(), nn.Linear(4, 3).double()


def _ids_out_of_range(tokens):
    return HEAD(EMB(tokens)).sum()  # <ids-out-of-range>


def _label_out_of_range(x, y):
    return F.cross_entropy(HEAD(x), y)  # <label-out-of-range>


def _gathered_label_out_of_range(x, y):
    return HEAD(x).gather(1, y[:, None]).sum()  # <gathered-out-of-range>


@pytest.mark.parametrize("loss,args,op,accepted,backend", [
    (_ids_out_of_range, (torch.tensor([[1, 2], [3, 1212], [0, 1]]),), "aten.embedding",
     "[0, 10), the embedding's rows", "eager"),
    (_label_out_of_range, (torch.randn(3, 4, dtype=F64), torch.tensor([0, 1717, 1])), "aten.nll_loss_forward",
     "[0, 3), the number of classes, or the ignore_index -100", "eager"),
    (_gathered_label_out_of_range, (torch.randn(3, 4, dtype=F64), torch.tensor([0, 1717, 1])), "aten.gather",
     "[0, 3), the size of dimension 1", "eager"),
    (_ids_out_of_range, (torch.tensor([[1, 2], [3, 1212], [0, 1]]),), "aten.embedding",
     "[0, 10), the embedding's rows", "inductor"),
], ids=["embedding_id", "label", "gathered_label", "embedding_id_inductor"])
def test_a_batch_value_out_of_an_ops_range_names_the_op_its_line_its_range_and_the_sample_not_the_value(
        loss, args, op, accepted, backend):
    """An index the capture only saw as a fake tensor fails when the program runs: the error names the op and the
    user's line (found by running the captured graph again), not the compiled kernel's C++ line, the range the op
    accepts and the failing sample's position. It showed the value too, in its text (torch's "Target 1717 is out
    of bounds") and in the torch error it was chained to: a training example's content, which a DP library's
    errors and logs must not carry."""
    before = {n: p.detach().clone() for n, p in HEAD.named_parameters()}
    with pytest.raises(psg.BatchInputError) as info:
        psg.per_sample(nn.ModuleList([EMB, HEAD]), backend=backend)(loss)(*args)
    message = str(info.value)
    assert op in message and f"outside the range the op accepts: {accepted}" in message
    assert "Fix: check the batch's labels and indices" in message and "positions [1] of the batch" in message
    assert_points_at(message, "ids-out-of-range", "label-out-of-range", "gathered-out-of-range")
    assert ".cpp" not in message and "please report" not in message
    shown = "".join(traceback.format_exception(info.value))  # the chain as a log would print it
    assert "1212" not in shown and "1717" not in shown, shown
    reachable = " ".join(map(str, _chain(info.value)))  # red team Q1: torch's error stayed the __context__
    assert "1212" not in reachable and "1717" not in reachable, reachable
    assert all(torch.equal(before[n], p) for n, p in HEAD.named_parameters())


def _chain(error: BaseException) -> list[BaseException]:
    """Every error reachable from ``error`` through ``__cause__`` and ``__context__`` (suppressed or not)."""
    found, stack = [], [error]
    while stack:
        e = stack.pop()
        if e is not None and all(e is not f for f in found):
            found.append(e)
            stack += [e.__cause__, e.__context__]
    return found


def test_a_batch_value_out_of_range_in_a_micro_batch_names_its_position_in_the_batch():
    """A DP step that splits the batch names the position in the batch the user passed, not the value."""
    model = nn.Linear(4, 3).double()
    step = psg.compile_step(lambda x, y: F.cross_entropy(model(x), y), model,
                            torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0, max_physical_batch_size=2)
    y = torch.tensor([0, 1, 2, 1, 1717, 0])
    with pytest.raises(psg.BatchInputError, match=r"positions \[4\] of the batch") as info:
        step(torch.randn(6, 4, dtype=F64), y)
    assert "1717" not in "".join(traceback.format_exception(info.value)) and step.steps_taken == 0
    assert "1717" not in " ".join(map(str, _chain(info.value)))


class _PackedGRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 5, batch_first=True)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)  # <packed>
        return self.rnn(packed)[1].sum()


def test_graph_breaks_name_the_cause_they_have():
    """A packed sequence, a closure tensor computed from the parameters, and checkpointing around dropout: each
    graph break or capture failure names its own cause and fix, not "no Python control flow" or "please report"."""
    gru = _PackedGRU()
    with pytest.raises(psg.CaptureError) as info:
        psg.per_sample(gru, backend="eager")(gru)(torch.randn(4, 6, 4), torch.tensor([6, 3, 2, 5]))
    assert "pack_padded_sequence" in str(info.value) and "out[arange(B), lengths - 1]" in str(info.value)
    assert_points_at(str(info.value), "packed")

    lin = nn.Linear(4, 4)
    doubled = lin.weight * 2
    with pytest.raises(psg.CaptureError) as info:
        psg.per_sample(lin, backend="eager")(lambda x: (x @ doubled).sum() + lin(x).sum())(torch.randn(3, 4))
    assert "reads `doubled`, a tensor computed from the parameters (weight) outside it" in str(info.value)

    from torch.utils.checkpoint import checkpoint
    seq = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    with pytest.raises(psg.CaptureError) as info:
        psg.per_sample(seq, backend="eager")(lambda x: checkpoint(seq, x, use_reentrant=False).sum())(torch.randn(3, 4))
    assert "move the random op out of the checkpointed function" in str(info.value)
    assert "please report" not in str(info.value)


_DROPPING = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 3)).double()


def _label_out_of_range_after_dropout(x, y):
    return F.cross_entropy(_DROPPING(x), y)  # <dropout-label-out-of-range>


@pytest.mark.parametrize("where", ["per_sample", "compile_step"])
def test_a_label_out_of_range_behind_dropout_names_the_op_and_leaves_the_generator_as_the_failed_run_did(
        monkeypatch, where):
    """A loss with dropout: the diagnosis runs the captured graph again, drawing other masks, and names the op,
    the user's line, the range and the position as without dropout (it gave a generic "please report this
    message"). The generator the masks come from is where the failed run left it (``per_sample``), or, in a
    step, where it was before the step (the step's rollback)."""
    import compiled_psg._compile.run as run

    x, y = torch.randn(6, 4, dtype=F64), torch.tensor([0, 1, 2, 1, 1717, 0])
    torch.manual_seed(0)
    after_failed_run = []
    real_failure = run._run_failure

    def failure(rw, inputs, e):
        after_failed_run.append(torch.get_rng_state())
        return real_failure(rw, inputs, e)

    monkeypatch.setattr(run, "_run_failure", failure)
    before = torch.get_rng_state()
    if where == "per_sample":
        call = psg.per_sample(_DROPPING, backend="eager")(_label_out_of_range_after_dropout)
    else:
        call = psg.compile_step(_label_out_of_range_after_dropout, _DROPPING,
                                torch.optim.SGD(_DROPPING.parameters(), lr=0.1), max_grad_norm=1.0,
                                noise_multiplier=1.0, backend="eager")
    with pytest.raises(psg.BatchInputError) as info:
        call(x, y)
    message = str(info.value)
    assert "aten.nll_loss_forward" in message and "outside the range the op accepts: [0, 3)" in message
    assert "positions [4] of the batch" in message and "please report" not in message
    assert_points_at(message, "dropout-label-out-of-range")
    assert "1717" not in "".join(traceback.format_exception(info.value))
    expected = after_failed_run[0] if where == "per_sample" else before
    assert torch.equal(torch.get_rng_state(), expected)


def test_a_failure_that_a_rerun_with_other_draws_does_not_repeat_names_the_random_op():
    """Where the re-run, with other random draws, does not fail, the message says the failure depends on the
    draws, names the random op and its line, and gives a fix, rather than asking for a report."""
    from compiled_psg._compile import run

    torch.manual_seed(0)
    f = psg.per_sample(_DROPPING, backend="eager")(_label_out_of_range_after_dropout)
    call = f.prepare_call(torch.randn(6, 4, dtype=F64), torch.tensor([0, 1, 2, 1, 0, 0]))
    inputs = call.entry._inputs(call.params, call.args, call.batch_size)
    error = run._run_failure(call.entry.rewritten, inputs, RuntimeError("a mask left nothing"))
    text = str(error)
    assert "draws random numbers (aten.native_dropout" in text and "did not fail" in text
    assert "please report" not in text and "Fix: call the loss eagerly" in text
    assert_points_at(text, "dropout-label-out-of-range")
