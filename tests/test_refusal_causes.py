"""Refusals that name the real cause (issue items: a batch of another dtype than the model, make_private over a
loader of dicts) and calls that work as they read (``torch.inference_mode()`` as ``torch.no_grad()``)."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import reference_per_sample
from torch.utils.data import DataLoader, Dataset

import compiled_psg as psg
from compiled_psg._capture import corrected_decompositions
from compiled_psg._compat import item_of_a_constant_tensor_is_a_size, torch_minor


def _model_and_loss():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return model, lambda x, y: F.cross_entropy(model(x), y)


@pytest.mark.parametrize("x,model_dtype", [(torch.randn(5, 4, dtype=torch.float64), torch.float32),
                                           (torch.randint(0, 3, (5, 4)), torch.float32),
                                           (torch.randn(5, 4), torch.float64)],
                         ids=["float64", "int64", "float32_into_float64"])
def test_a_batch_of_another_dtype_is_named(x, model_dtype):
    model, loss = _model_and_loss()
    model.to(model_dtype)
    fn = psg.per_sample(model, backend="eager")(loss)
    with pytest.raises(psg.BatchInputError, match=rf"argument 0 is {x.dtype}.*the parameters are {model_dtype}"
                                                  rf".*x\.to\({model_dtype}\)"):
        fn(x, torch.randint(0, 3, (5,)))


def test_per_sample_and_a_step_under_inference_mode_work_as_under_no_grad():
    model, loss = _model_and_loss()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    fn = psg.per_sample(model, backend="eager")(loss)
    with torch.inference_mode():
        got = fn(x, y)
    want = reference_per_sample(loss, dict(model.named_parameters()), (x, y))
    for name in want:
        torch.testing.assert_close(got[name], want[name])
    step = psg.compile_step(loss, model, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0,
                            backend="eager")
    before = model.weight.detach().clone()
    with torch.inference_mode():
        step(x, y)
    assert step.steps_taken == 1 and not torch.equal(before, model.weight)
    with torch.inference_mode():  # said "the loss has no gradient with respect to the parameters"
        report = psg.explain(psg.per_sample(model, backend="eager")(loss), x, y)
        step_report = psg.explain(step, x, y)
    assert "weight" in report.graph_text("after") and "weight" in step_report.graph_text("after")


class _Dicts(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return {"x": torch.full((4,), float(i)), "y": torch.tensor(i % 3)}


def test_make_private_over_a_loader_of_dicts_names_the_dicts_and_a_fix():
    model, _ = _model_and_loss()
    with pytest.raises(psg.BatchInputError, match=r"yields dicts \(keys \['x', 'y'\]\).*collate_fn"):
        psg.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_Dicts(), batch_size=8),
                         lambda b: F.cross_entropy(model(b["x"]), b["y"]), noise_multiplier=1.0, backend="eager")


def test_cdist_between_samples_is_refused_and_its_row_count_branch_names_compute_mode():
    """Distances between the samples' own rows pair every sample with every other: refused at the distance op.
    Distances to shared points with torch.cdist's default compute_mode take the matrix-product algorithm above 25
    rows: the batch size picks the algorithm, and the fix names compute_mode, not a branch the user never wrote."""
    torch.manual_seed(0)
    prototypes = nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
    x = torch.randn(6, 5, 4, dtype=torch.float64)

    def between_samples(x):
        h = x.mean(1) @ prototypes.T
        return torch.cdist(h, h).sum()

    with pytest.raises(psg.SampleMixingError, match="_cdist_forward.*pairs every sample with every other"):
        psg.per_sample({"prototypes": prototypes}, backend="eager")(between_samples)(x)

    def to_prototypes(x):
        return torch.cdist(x.reshape(-1, 4), prototypes).sum()

    with pytest.raises(psg.CaptureError, match="compute_mode='donot_use_mm_for_euclid_dist'"):
        psg.per_sample({"prototypes": prototypes}, backend="eager")(to_prototypes)(x)


def test_a_dict_of_tensors_that_do_not_require_grad_is_named_and_per_sample_grad_takes_it():
    """``torch.func.functional_call`` with a plain state dict: per_sample names the frozen tensors and the
    functional form, which differentiates them as given."""
    model = nn.Linear(4, 3).double()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))

    def loss(x, y):
        return F.cross_entropy(torch.func.functional_call(model, params, (x,)), y)

    named = r"\['weight', 'bias'\] of params do not require grad.*per_sample_grad"
    with pytest.raises(psg.BatchInputError, match=named):
        psg.per_sample(params, backend="eager")(loss)(x, y)

    def functional(p, x, y):
        return F.cross_entropy(torch.func.functional_call(model, p, (x,)), y)

    got = psg.per_sample_grad(functional, backend="eager")(params, x, y)
    for i in range(5):
        g = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), list(model.parameters()))
        for (name, _), w in zip(model.named_parameters(), g, strict=True):
            torch.testing.assert_close(got[name][i], w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layer", [lambda: nn.InstanceNorm2d(4, affine=True), lambda: nn.Conv2d(4, 4, 3, groups=2)],
                         ids=["instance_norm", "grouped_conv"])
def test_a_batch_size_fixed_by_a_double_backward_is_named_as_such(layer):
    """A gradient penalty through these layers: torch's double backward fixes the batch size. The message says
    so, instead of pointing at a view in the user's code (there is none) and a stack inside compiled_psg."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), layer(), nn.Tanh(), nn.Flatten(), nn.LazyLinear(1)).double()
    x = torch.randn(3, 2, 8, 8, dtype=torch.float64)
    model(x)

    def loss(x):
        x = x.detach().requires_grad_(True)
        out = model(x).sum()
        (g,) = torch.autograd.grad(out, x, create_graph=True)
        return out + g.pow(2).sum()

    # torch 2.11's Dynamo stops earlier, at requires_grad_(), and the message names that instead
    cause = ("tracing the gradients of the loss fixed the batch size" if torch_minor() >= (2, 13)
             else r"does not trace requires_grad_\(\) inside a compiled function")
    with pytest.raises(psg.CaptureError, match=cause) as info:
        psg.per_sample(model, backend="eager")(loss)(x)
    ours = str(info.value).split("Details from Dynamo")[0]  # what follows is Dynamo's own report
    assert "x.view" not in ours and "dynamo.py" not in ours
    if torch_minor() >= (2, 13):  # the op, the layer and the inner gradient's line, found in the failure
        name = type(model[1]).__name__
        assert re.search(rf"double backward of \w*(batch_norm|convolution)\w* at .*{name}.*create_graph=True\) at "
                         r".*test_refusal_causes.py:\d+", ours), ours


def _exact(loss, p: torch.Tensor, x: torch.Tensor, tol: float = 1e-12, fn=None) -> None:
    got = (fn or psg.per_sample({"p": p}, backend="eager")(loss))(x)["p"]
    want = torch.stack([torch.autograd.grad(loss(x[i:i + 1]), p)[0] for i in range(x.shape[0])])
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("is_complex", [False, True], ids=["real", "complex"])
def test_torch_sgn_whose_backward_fixes_the_batch_size_is_exact(is_complex):
    """torch's backward of sgn on real tensors builds zeros from the input's concrete sizes, which fixes the batch
    size; the capture traces it as torch.sign there, and as x / |x| (0 at 0) on complex tensors."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(3, dtype=torch.float64))
    x = torch.randn(4, 3, dtype=torch.float64)
    x[1, 2] = 0  # sgn(0) = 0, with a zero gradient

    def real(x):
        h = x * p
        return torch.sgn(h).pow(3).sum() + (torch.sgn(h) * h).sum()

    def complex_(x):  # the complex value from a view (aten.complex has no op fact)
        h = x * p
        z = torch.view_as_complex(torch.stack([h, h.flip(1)], -1))
        return torch.view_as_real(torch.sgn(z)).pow(3).sum() + (torch.sgn(z) * h).real.sum()

    loss = complex_ if is_complex else real
    _exact(loss, p, x, tol=1e-10)


@pytest.mark.parametrize("operands", ["batch_first", "batch_second", "vector"])
def test_kron_whose_decomposition_fixes_the_batch_size_is_exact(operands):
    """torch's C++ decomposition of kron reads sizes as integers; the capture traces a broadcast product."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(2, 3, dtype=torch.float64))
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    other = torch.randn(2, 2, dtype=torch.float64)
    kron = {"batch_first": lambda h: torch.kron(h, other), "batch_second": lambda h: torch.kron(other[:1], h),
            "vector": lambda h: torch.kron(h, other[0])}[operands]
    _exact(lambda x: kron(x * p).pow(2).sum(), p, x)


@pytest.mark.parametrize("case", ["rows", "negative_dim", "parameter_broadcast", "shared_indices", "middle_dim"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_take_along_dim_whose_decomposition_fixes_the_batch_size_is_exact(case, dtype):
    """torch's C++ decomposition of take_along_dim reads sizes as integers (the refusal said the loss fixes the batch
    size); the capture traces the broadcast and the gather."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(1, 6, dtype=dtype))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, dtype=dtype, generator=g)
    idx = torch.randint(0, 6, (4, 3), generator=g)
    shared = torch.tensor([[5, 0, 2]])
    take = {"rows": lambda x, i: torch.take_along_dim(x * p, i, dim=1),
            "negative_dim": lambda x, i: torch.take_along_dim(x * p, i, dim=-1),
            "parameter_broadcast": lambda x, i: torch.take_along_dim(p, i, dim=1) * x[:, :3],
            "shared_indices": lambda x, i: torch.take_along_dim(x * p, shared, dim=1) + i,
            "middle_dim": lambda x, i: torch.take_along_dim((x * p).unsqueeze(1).expand(-1, 2, -1),
                                                            i.unsqueeze(1)[:, :, :2], dim=2)}[case]

    def loss(x, i):
        return take(x, i).tanh().pow(2).sum()

    got = psg.per_sample({"p": p}, backend="eager")(loss)(x, idx)["p"]
    want = reference_per_sample(loss, {"p": p}, (x, idx))["p"]
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_take_along_dim_over_the_flattened_batch_is_sample_mixing():
    p = nn.Parameter(torch.randn(6, dtype=torch.float64))
    x, idx = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 24, (4, 2))
    with pytest.raises(psg.SampleMixingError, match=r"test_refusal_causes.py.*take_along_dim\(x \* p, i\)"):
        psg.per_sample({"p": p}, backend="eager")(lambda x, i: torch.take_along_dim(x * p, i).sum())(x, idx)


@pytest.mark.parametrize("points", [[1, 3], 3], ids=["points", "sections"])
def test_tensor_split_at_points_held_in_a_tensor_names_the_values_and_the_fix(points):
    """The split points (or the number of sections) in a tensor: the output shapes depend on its values, which one
    graph for every batch cannot hold. The message says so, whether torch stops while capturing (sections, torch
    2.13) or a later pass does (points), rather than that the loss fixes the batch size (or, on torch 2.14, that
    it branches on the batch size: the sections' value is a size there, guarded on the value, and exact even after
    the tensor changes in place); as Python ints they are exact."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(6, dtype=torch.float64))
    x = torch.randn(4, 6, dtype=torch.float64)
    split = torch.tensor(points)

    def loss(x):
        parts = torch.tensor_split(x * p, split, 1)
        return sum((k + 1) * t.pow(k + 1).sum() for k, t in enumerate(parts))

    if isinstance(points, int) and item_of_a_constant_tensor_is_a_size():
        fn = psg.per_sample({"p": p}, backend="eager")(loss)
        _exact(loss, p, x, fn=fn)
        with torch.no_grad():
            split.fill_(2)
        _exact(loss, p, x, fn=fn)  # the same function, captured again
    else:
        with pytest.raises(psg.CaptureError, match=r"computes a shape from a tensor's values in .* "
                                                   r"at .*test_refusal_causes.py:\d+ in loss: .*tensor_split.*"
                                                   r"Fix: .*Python ints or lists"):
            psg.per_sample({"p": p}, backend="eager")(loss)(x)
    split = points
    _exact(loss, p, x)


@pytest.mark.parametrize("uses", ["one", "two"])
def test_a_gradient_written_in_place_through_a_view_is_refused(uses):
    """``W.as_strided(...)``: its backward copies the gradient into a view of a fresh buffer and returns another
    view of that buffer, so no edge carries the batch to the parameter's gradient. It was taken for independent of
    the batch (every sample got the batch's gradient: norms of the batch's, not the loop's); refused, naming the
    user's line."""
    torch.manual_seed(1)
    weight = nn.Parameter(torch.randn(6, 6, dtype=torch.float64) / 2)
    model = nn.Module()
    model.W = weight
    x = torch.randn(4, 5, 6, dtype=torch.float64)

    def strided(w):
        return w.as_strided((6, 6), (1, 6))  # W.T, written the hard way

    def loss(x):
        h = torch.tanh(F.linear(x, weight)) if uses == "two" else x
        return F.linear(h, strided(weight)).square().sum()

    want = reference_per_sample(loss, {"W": weight}, (x,))["W"]
    assert want.flatten(1).norm(dim=1).std() > 0, "the samples' norms differ: a shared gradient would show"
    with pytest.raises(psg.UnsupportedError, match=r"as_strided.*test_refusal_causes.py:\d+.*copy_.*Fix: "):
        psg.per_sample(model, backend="eager", reduce=psg.clip_sum(1.0))(loss)(x)


def test_a_loss_function_that_cannot_take_the_batch_names_its_signature_not_a_graph_break():
    """A loss written ``(model, x, y)`` for a step that calls ``loss_fn(x, y)``: Dynamo reports an argument
    mismatch as a graph break ("rewrite this line with torch operations"); the error names the signature."""
    model, _ = _model_and_loss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = psg.compile_step(lambda model, x, y: F.cross_entropy(model(x), y), model, opt, max_grad_norm=1.0,
                            backend="eager")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(psg.BatchInputError, match=r"<lambda>\(model, x, y\) cannot take the 2 argument.*closure"):
        step(torch.randn(5, 4), torch.randint(0, 3, (5,)))
    assert step.steps_taken == 0 and all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_a_call_inside_the_loss_with_the_wrong_arguments_names_the_call():
    model, _ = _model_and_loss()

    def head(logits, y):
        return F.cross_entropy(logits, y)

    fn = psg.per_sample(model, backend="eager")(lambda x, y: head(model(x)))
    # torch 2.14 on show Dynamo the TypeError the call raises (named as the loss's own exception, BatchInputError);
    # 2.11 and 2.13 stop with a graph break at the call (CaptureError): the same words in both
    with pytest.raises((psg.CaptureError, psg.BatchInputError)) as info:
        fn(torch.randn(5, 4), torch.randint(0, 3, (5,)))
    ours = str(info.value).split("Details from Dynamo")[0]  # Dynamo's words differ between torch versions
    assert "TypeError" in ours and "without compiled_psg too" in ours and "torch operations" not in ours


def test_a_parameter_written_through_data_inside_the_loss_is_named_with_the_fix():
    """``weight.data.clamp_()`` in the loss: AOT autograd partitions a training graph, which the capture took for
    its own (an ``InternalError``: "6 Dynamo inputs but 2 AOT inputs"). The refusal names the write and the
    ``no_grad`` form (torch 2.11 captures the write as a mutation of the parameter, refused as such); the parameter
    is as before."""
    model, _ = _model_and_loss()
    before = model.weight.detach().clone()

    def loss(x, y):
        model.weight.data.clamp_(-0.1, 0.1)
        return F.cross_entropy(model(x), y)

    # torch 2.13 on: a training graph; torch 2.11: a write into the parameter. Both refused, with the no_grad form
    with pytest.raises(psg.UnsupportedError,
                       match=r"(p.data.clamp_|the parameter 'weight' in place).*with torch.no_grad\(\): p.clamp_"):
        psg.per_sample(model, backend="eager")(loss)(torch.randn(5, 4), torch.randint(0, 3, (5,)))
    assert torch.equal(model.weight, before)


@pytest.mark.parametrize("target", ["closure", "global"])
def test_a_value_carrying_the_gradient_written_into_a_tensor_of_the_users_is_named(target):
    """Red team Q1 (F9): ``acc.copy_(model.bias * 2)`` in the loss was refused as "computed from the parameters
    outside the loss" or as a write into a tensor that requires grad (``p.data.clamp_``), with no line and fixes
    that did not apply. The refusal names the tensor and the line, with the detached form; the tensor is as
    before."""
    model, _ = _model_and_loss()
    acc = torch.zeros(3)
    _WRITTEN[0] = torch.zeros(3)

    def loss(x, y):
        (acc if target == "closure" else _WRITTEN[0]).copy_(model.bias * 2)
        return F.cross_entropy(model(x), y)

    name = "the tensor acc that the loss function closes over" if target == "closure" else r"_WRITTEN"
    with pytest.raises(psg.UnsupportedError, match=rf"into a tensor that is not a parameter: [^:]*{name}.* at "
                                                   rf"\S*test_refusal_causes.py:\d+ in loss: .*copy_\(model.bias "
                                                   rf"\* 2\).*Fix: write a detached value"):
        psg.per_sample(model, backend="eager")(loss)(torch.randn(5, 4), torch.randint(0, 3, (5,)))
    assert not acc.any() and not _WRITTEN[0].any()

    def detached(x, y):
        acc.copy_((model.bias * 2).detach())
        return F.cross_entropy(model(x), y)

    psg.per_sample(model, backend="eager")(detached)(torch.randn(5, 4), torch.randint(0, 3, (5,)))
    assert torch.equal(acc, (model.bias * 2).detach())


_WRITTEN: list[torch.Tensor] = [torch.zeros(3)]


def test_a_per_sample_tensor_read_from_a_closure_or_a_dict_is_named_as_a_cause():
    """A ``[B]`` mask read from a closure fixes the batch size; the message names that cause (no view in the
    loss); a dict marked batched is told to pass its tensors as arguments, not to mark it unbatched."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    mask = torch.rand(4) > 0.3
    with pytest.raises(psg.CaptureError, match="not a batched argument") as info:
        psg.per_sample(model, backend="eager")(
            lambda x, y: (F.cross_entropy(model(x), y, reduction="none") * mask).sum())(x, y)
    assert "read from a closure" in str(info.value)
    with pytest.raises(psg.BatchInputError, match="as its own positional argument"):
        psg.per_sample(model, backend="eager")(lambda x, b: F.cross_entropy(model(x), b["y"]))(x, {"y": y})


def test_a_params_dict_that_names_one_tensor_twice_is_refused():
    w = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(psg.BatchInputError, match="names one tensor twice, as 'enc' and 'dec'"):
        psg.per_sample({"enc": w, "dec": w}, backend="eager")(lambda x: (x @ w.t()).sum())(torch.randn(2, 4))


def test_a_params_dict_that_holds_a_view_of_another_entry_is_refused():
    """Autograd's gradient of ``w`` includes the uses of ``w.view(...)``; the capture differentiates each entry as
    an input of its own, so ``w`` would get only its direct uses (a silent wrong result before)."""
    w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    view = w.view(6, 4)
    with pytest.raises(psg.BatchInputError, match="holds 'b', a view of 'a'"):
        psg.per_sample({"a": w, "b": view}, backend="eager")(lambda x: (x @ w.t() + x @ view.t()).pow(2).sum())(
            torch.randn(5, 4, dtype=torch.float64))


def test_fold_col2im_keeps_samples_apart_and_is_exact():
    """``F.fold`` (``aten.col2im``) sums patches within a sample: a spatial op over its last two dimensions."""
    torch.manual_seed(0)
    p = torch.randn(8, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 4, 6, 6, dtype=torch.float64)
    _exact(lambda x: F.fold(F.conv2d(x, p, padding=1).flatten(2), (7, 7), 2).pow(2).sum(), p, x)


@pytest.mark.parametrize("size", [None, 3], ids=["chunk", "split"])
def test_a_batch_split_into_micro_batches_names_the_split_and_the_whole_batch_fix(size):
    """Each part holds some samples whole, but no fact follows part of a batch: not proved apart, and not called
    mixing (the samples stay apart here); the message names the split and the whole-batch loss."""
    model, _ = _model_and_loss()

    def loss(x, y):
        xs, ys = (x.chunk(2), y.chunk(2)) if size is None else (x.split(size), y.split(size))
        return sum(F.cross_entropy(model(xc), yc, reduction="sum") for xc, yc in zip(xs, ys, strict=True))

    fn = psg.per_sample(model, backend="eager")(loss)
    with pytest.raises(psg.UnsupportedError, match=r"(?s)aten\.split.* at .*test_refusal_causes.py:\d+ in loss: "
                       r".*splits the batch into parts.*Fix: compute the loss on the whole batch"):
        fn(torch.randn(5, 4), torch.randint(0, 3, (5,)))


@pytest.mark.parametrize(("x", "y", "cause"), [
    (torch.randn(5, 6), torch.randint(0, 3, (5,)), r"RuntimeError: .*\[5, 6\] X \[4, 3\]"),
    (torch.randn(5, 4), torch.randn(5), r"RuntimeError: .*Expected dtype int32/int64 for index"),
], ids=["features_do_not_fit_the_layer", "float_labels"])
def test_a_batch_that_does_not_fit_the_loss_at_any_size_is_a_batch_input_error(x, y, cause):
    """The trace fails with the batch size symbolic and again with every size fixed: the batch is the cause, named
    with its own sizes (not a CaptureError asking for a bug report)."""
    model, loss = _model_and_loss()
    fn = psg.per_sample(model, backend="eager")(loss)
    with pytest.raises(psg.BatchInputError, match=rf"(?s)the loss fails on this batch at .*{cause}.*at any batch size"):
        fn(x, y)
    good = (torch.randn(5, 4), torch.randint(0, 3, (5,)))  # the refused call left nothing behind
    got = fn(*good)
    want = reference_per_sample(loss, dict(model.named_parameters()), good)
    torch.testing.assert_close(got["weight"], want["weight"])


def test_a_loss_that_fails_for_every_batch_names_torchs_error_at_the_users_line():
    """A shape bug in the loss (a parameter of the wrong width after a flatten that merges the batch with another
    dimension): torch's error with the batch's own sizes, at the user's line, as the user's bug, not a capture
    failure to report (the symbolic trace's sizes, [2*s, 108], differ from the fixed ones in more than numbers)."""
    w = nn.Parameter(torch.randn(4, 27))
    fn = psg.per_sample({"w": w}, backend="eager")(
        lambda x: (x.flatten(0, 1).flatten(1) @ w.t()).pow(2).sum())  # the buggy line
    with pytest.raises(psg.BatchInputError, match=r"(?s)the loss fails on this batch at \S*test_refusal_causes.py:\d+ "
                                                  r".*# the buggy line: RuntimeError: .*\[6, 108\] X \[27, 4\].*"
                                                  r"torch's own error.*a bug at this line"):
        fn(torch.randn(3, 2, 3, 6, 6))


@pytest.mark.parametrize(("size", "step"), [(2, 1), (3, 2)])
def test_windows_over_the_batch_are_sample_mixing_at_the_unfold(size, step):
    """``x.unfold(0, ...)`` slides windows over the samples. The backward's size expression has no value at a batch
    of one (``Mod(B - 1, 2*B - 2)``), which stopped the capture's watch of batch-size decisions with a
    ZeroDivisionError (refused as a failure of torch, to report); the analysis refuses the unfold itself, at the
    user's line. Windows within each sample are exact."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(4, 6, dtype=torch.float64))
    x = torch.randn(5, 4, dtype=torch.float64)
    fn = psg.per_sample({"p": p}, backend="eager")(lambda x: (x @ p).unfold(0, size, step).pow(2).sum())
    with pytest.raises(psg.SampleMixingError,
                       match=r"aten.unfold .*test_refusal_causes.py:\d+.*unfolds the batch dimension.*Fix: .*"
                             r"along a non-batch dimension"):
        fn(x)
    _exact(lambda x: (x @ p).unfold(1, size, step).pow(2).sum(), p, x)


def test_a_decision_with_no_value_at_a_batch_of_one_is_a_branch():
    """The loss's own decision on an expression that a batch of one cannot evaluate (a modulo by ``B - 1``) is
    refused as a branch on the batch size, not a failure of torch."""
    p = nn.Parameter(torch.randn(4, dtype=torch.float64))

    def loss(x):
        h = x * p
        return h.sum() if x.shape[1] % (x.shape[0] - 1) == 0 else h.pow(2).sum()

    with pytest.raises(psg.CaptureError, match="has no value for a batch of one"):
        psg.per_sample({"p": p}, backend="eager")(loss)(torch.randn(5, 4, dtype=torch.float64))


@pytest.mark.parametrize("samples", ["batched", "drawn", "full", "module"])
def test_fractional_max_pool2d_is_exact(samples):
    """torch's backward of fractional_max_pool2d reads the batch size as an integer (its C++ meta function), which
    fixed it: refused as the double backward of a torch.autograd.grad the loss never calls. The capture traces
    the pooled values as a gather at the op's indices. With the random samples given per sample, built with the
    batch size or drawn by torch (a pool from 8 to 4 with kernel 2 takes the same regions for every draw), the
    per-sample gradients are the loop's."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3).double()
    deterministic = samples in ("drawn", "module")
    x = torch.randn(4, 2, *((10, 10) if deterministic else (9, 11)), dtype=torch.float64)
    u = torch.rand(4, 3, 2, dtype=torch.float64)
    out = (4, 4) if deterministic else (4, 3)
    module = nn.FractionalMaxPool2d(2, output_size=out)
    losses = {
        "batched": lambda x, u: F.fractional_max_pool2d(conv(x), 2, output_size=out, _random_samples=u).pow(2).sum(),
        "drawn": lambda x: F.fractional_max_pool2d(conv(x), 2, output_size=out).pow(2).sum(),
        "full": lambda x: F.fractional_max_pool2d(
            conv(x), 2, output_size=out, _random_samples=torch.full((x.shape[0], 3, 2), 0.3, dtype=x.dtype)
        ).pow(2).sum(),
        "module": lambda x: module(conv(x)).pow(2).sum(),
    }
    loss = losses[samples]
    args = (x, u) if samples == "batched" else (x,)
    got = psg.per_sample(conv, backend="eager")(loss)(*args)
    want = reference_per_sample(loss, dict(conv.named_parameters()), args)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)


def test_a_backward_that_fixes_the_batch_size_is_named(monkeypatch):
    """An op whose backward formula reads the batch size as a number (fractional_max_pool2d without the capture's
    traceable form): the message names the op, the user's line and the autograd node, not a double backward."""
    monkeypatch.delitem(corrected_decompositions.TRACEABLE, torch.ops.aten.fractional_max_pool2d.default)
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3).double()
    fn = psg.per_sample(conv, backend="eager")(
        lambda x: F.fractional_max_pool2d(conv(x), 2, output_size=(4, 3)).pow(2).sum())
    with pytest.raises(psg.CaptureError, match=r"backward formula of fractional_max_pool2d at .*"
                                               r"test_refusal_causes.py:\d+.*FractionalMaxPool2DBackward0") as info:
        fn(torch.randn(4, 2, 9, 11, dtype=torch.float64))
    assert "create_graph" not in str(info.value) and "double backward" not in str(info.value)


def test_fractional_max_pool_with_shared_random_samples_is_refused():
    """Random samples read from a closure: the batch's sample ``i`` pools over the regions of row ``i``, the sample
    alone over those of row 0."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3).double()
    u = torch.rand(4, 3, 2, dtype=torch.float64)
    fn = psg.per_sample(conv, backend="eager")(
        lambda x: F.fractional_max_pool2d(conv(x), 2, output_size=(4, 3), _random_samples=u).pow(2).sum())
    with pytest.raises(psg.SampleMixingError, match=r"fractional_max_pool2d.*test_refusal_causes.py:\d+.*"
                                                    r"row of _random_samples at its position.*Fix: .*batched"):
        fn(torch.randn(4, 2, 9, 11, dtype=torch.float64))


def test_a_fixed_batch_size_is_refused_without_torchs_guard_log_and_names_the_op(capfd, caplog):
    """Dynamo logs a failed shape guard (``Error while creating guard``, a ConstraintViolationError's traceback)
    before it raises: nothing of it reaches stderr or the log; the user's filters and level on that logger are as
    before. The message names the op that fixed the batch size and the user's line."""
    logger = logging.getLogger("torch._guards")
    mine = logging.Filter()  # passes every record
    logger.addFilter(mine)
    level = logger.level
    # torch's own stderr handler holds the stream it found at import (under pytest, not the test's fd 2): a
    # handler of the test's sees what would reach it
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        model, _ = _model_and_loss()
        fn = psg.per_sample(model, backend="eager")(lambda x, y: F.cross_entropy(model(x.view(6, -1)), y))
        with caplog.at_level(logging.DEBUG), pytest.raises(
                psg.CaptureError, match=r"fixed in aten\.view\.default, at .*test_refusal_causes.py:\d+"):
            fn(torch.randn(6, 4), torch.randint(0, 3, (6,)))
        err = capfd.readouterr().err
        assert "Error while creating guard" not in err + stream.getvalue(), err + stream.getvalue()
        assert "ConstraintViolationError" not in err + stream.getvalue()
        assert not [r for r in caplog.records if r.name == "torch._guards"]
        assert logger.filters == [mine] and logger.level == level
    finally:
        logger.removeFilter(mine)
        logger.removeHandler(handler)


@pytest.mark.parametrize("api", ["inv", "solve", "cholesky"])
def test_a_singular_batch_names_the_samples_that_fail(api):
    """Two samples of five whose matrices (one of two per sample) fail: the message names their positions, found
    after the failure by running the captured graph up to the check's info; the user's batch is as before."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.eye(3, dtype=torch.float64) + 0.1)
    x = torch.randn(5, 2, 3, 3, dtype=torch.float64) * 0.1 + torch.eye(3, dtype=torch.float64)
    x = x @ x.mT
    op = {"inv": lambda m: torch.linalg.inv(m).sum(), "solve": lambda m: torch.linalg.solve(m, m[..., :1] + 1).sum(),
          "cholesky": lambda m: torch.linalg.cholesky(m).sum()}[api]
    fn = psg.per_sample({"p": p}, backend="eager")(lambda x: op(x * p))
    fn(x)
    x[1, 0] = 0
    x[4, 1] = 0
    before = x.clone()
    with pytest.raises(psg.BatchInputError, match=rf"torch.linalg.{api} raises at \S*test_refusal_causes.py:\d+ "
                                                  r".*Fix: .*samples at positions "
                                                  r"\[1, 4\] of the batch"):
        fn(x)
    assert torch.equal(x, before)


@pytest.mark.parametrize("samples", ["batched", "drawn"])
def test_fractional_max_pool3d_is_refused_naming_the_op(samples):
    """torch's backward of fractional_max_pool3d has no shape function for fake tensors (and its forward's C++ meta
    reads the batch size): refused, naming the backward's op and the fix, not a line of the loss to rewrite."""
    torch.manual_seed(0)
    conv = nn.Conv3d(2, 3, 3).double()
    x, u = torch.randn(4, 2, 8, 8, 8, dtype=torch.float64), torch.rand(4, 3, 3, dtype=torch.float64)
    if samples == "batched":
        fn = psg.per_sample(conv, backend="eager")(
            lambda x, u: F.fractional_max_pool3d(conv(x), 2, output_size=3, _random_samples=u).pow(2).sum())
        args = (x, u)
    else:
        fn = psg.per_sample(conv, backend="eager")(
            lambda x: F.fractional_max_pool3d(conv(x), 2, output_size=3).pow(2).sum())
        args = (x,)
    with pytest.raises(psg.CaptureError, match=r"backward formula of fractional_max_pool3d runs "
                                               r"aten\.fractional_max_pool3d_backward.*compute that op"):
        fn(*args)


@pytest.mark.parametrize("factored", ["cholesky", "lu"])
def test_a_solve_with_a_matrix_factored_from_a_parameter_names_the_op_the_fallback_cannot_batch(factored):
    """The backward of cholesky / lu_factor solves with the factor (linalg_solve_triangular), whose vmap fallback
    fails with a symbolic batch size in torch's shape function: an UnsupportedError naming that op and the forms
    that work (the factor as the parameter, torch.linalg.solve), not a capture failure to report; the latter works."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 3, dtype=torch.float64)
    root = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    model = nn.ModuleDict({"lin": lin})
    model.root = root

    def matrix():
        return root @ root.t() + 3 * torch.eye(3, dtype=torch.float64)

    solve = {"cholesky": lambda h: torch.cholesky_solve(h, torch.linalg.cholesky(matrix())),
             "lu": lambda h: torch.linalg.lu_solve(*torch.linalg.lu_factor(matrix()), h)}[factored]
    x = torch.randn(5, 4, dtype=torch.float64)
    fn = psg.per_sample(model, backend="eager")(lambda x: solve(lin(x).t()).square().sum())
    with pytest.raises(psg.UnsupportedError, match=r"linalg_solve_triangular.*vmap fallback for it fails with a "
                                                   r"symbolic batch size.*torch\.linalg\.solve"):
        fn(x)

    def loss(x):
        return torch.linalg.solve(matrix(), lin(x).t()).square().sum()

    grads = psg.per_sample(model, backend="eager")(loss)(x)
    want = reference_per_sample(loss, dict(model.named_parameters()), (x,))
    for name, value in want.items():
        torch.testing.assert_close(grads[name], value, rtol=1e-9, atol=1e-11)


def test_a_singular_batch_after_a_random_draw_names_no_samples():
    """Run again, a draw before the failed check would give other values: the message names no positions (it named
    samples that had passed)."""
    lin = nn.Linear(3, 3).double()

    def loss(x):  # a sample's matrix is singular where dropout zeroed one of its diagonal entries
        return torch.linalg.inv(torch.diag_embed(F.dropout(torch.ones_like(x), 0.5) * x) + 0 * lin.weight).sum()

    fn = psg.per_sample(lin, backend="eager")(loss)
    torch.manual_seed(1)
    with pytest.raises(psg.BatchInputError, match=r"torch.linalg.inv raises at \S*test_refusal_causes.py:\d+ ") as info:
        fn(torch.ones(8, 3, dtype=torch.float64))
    assert "The samples at positions" not in str(info.value)


def test_a_batch_of_the_wrong_width_is_refused_without_torchs_meta_traceback():
    """torch logs an op that fails on fake tensors with its whole traceback ('failed while attempting to run meta
    for aten.mm') before the exception propagates: none of it reaches a handler of that logger during the
    capture, whose own error names the cause; the user's filters are as before."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    mine = logging.Filter()
    logger.addFilter(mine)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        lin = nn.Linear(4, 3)
        fn = psg.per_sample(lin, backend="eager")(lambda x, y: F.cross_entropy(lin(x), y))
        fn(torch.randn(5, 4), torch.randint(0, 3, (5,)))
        with pytest.raises(psg.BatchInputError, match="the loss fails on this batch"):
            fn(torch.randn(5, 6), torch.randint(0, 3, (5,)))
        assert "failed while attempting to run meta" not in stream.getvalue(), stream.getvalue()[:2000]
        assert logger.filters == [mine]
    finally:
        logger.removeFilter(mine)
        logger.removeHandler(handler)


def test_rows_merged_with_frames_through_an_op_without_a_layout_rule_name_the_merge_and_the_view_back():
    """``[B*T, ...]`` rows through an op whose layout the rewrite cannot follow (an FFT's backward) are refused
    with the merge named and the view back to ``[B, T, ...]`` as the fix, which is then exact."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1).double()
    frames = torch.randn(3, 2, 3, 6, 6, dtype=torch.float64)

    def merged(x):
        return torch.fft.rfft2(conv(x.flatten(0, 1))).abs().pow(2).sum()  # <merged_fft>

    def viewed_back(x):
        h = conv(x.flatten(0, 1))
        return torch.fft.rfft2(h.view(x.shape[0], -1, *h.shape[1:])).abs().pow(2).sum()

    with pytest.raises(psg.UnsupportedError, match=r"merged with another one \(2\*B, 4, 6, 6\)") as info:
        psg.per_sample(conv, backend="eager")(merged)(frames)
    lines = Path(__file__).read_text().splitlines()
    line = next(i + 1 for i, text in enumerate(lines) if text.endswith("# <merged_fft>"))
    assert re.search(rf"test_refusal_causes.py\D{{1,12}}{line}\b", str(info.value)), str(info.value)
    assert "Fix: view the merged rows back to [B, T, ...]" in str(info.value)
    # the op the walk cannot follow the rows through, by name (said "an op between the merge and here")
    assert re.search(r"no rule to follow the rows through aten\._fft_\w+\.default in the backward of "
                     rf"\S*test_refusal_causes.py\D{{1,12}}{line}\b", str(info.value)), str(info.value)
    got = psg.per_sample(conv, backend="eager")(viewed_back)(frames)
    want = reference_per_sample(viewed_back, dict(conv.named_parameters()), (frames,))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-10)


def test_a_slice_to_a_constant_length_is_whole_only_for_batches_it_covers():
    """``h[:1000]`` keeps every sample of a batch of at most 1000 (Dynamo guards on it): exact there; a batch of
    1001 is captured again, and the slice that drops its last sample is refused."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 3).double()

    def loss(x, y):
        return F.cross_entropy(lin(x)[:1000], y[:1000])

    fn = psg.per_sample(lin, backend="eager")(loss)
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    got = fn(x, y)
    want = reference_per_sample(loss, dict(lin.named_parameters()), (x, y))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-10)
    with pytest.raises(psg.SampleMixingError, match="keeps only some samples"):
        fn(torch.randn(1001, 4, dtype=torch.float64), torch.randint(0, 3, (1001,)))


def _ctc(lin, x, targets, input_lengths, target_lengths):
    return F.ctc_loss(lin(x).log_softmax(-1).transpose(0, 1), targets, input_lengths, target_lengths)


@pytest.mark.parametrize("op", ["ctc_loss", "lstsq"])
def test_an_op_with_a_data_dependent_output_shape_is_named_as_unsupported(op):
    """F.ctc_loss (tensor lengths) and torch.linalg.lstsq have output shapes that depend on values, which Dynamo
    does not trace: the refusal names the op, the user's line, the cause and docs/limits.md, not a graph break to
    rewrite without Python control flow; lstsq's names the solve that gives its solution."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 6)
    if op == "ctc_loss":
        fn = psg.per_sample(lin, backend="eager")(lambda x, t, il, tl: _ctc(lin, x, t, il, tl))
        args = (torch.randn(4, 8, 4), torch.randint(1, 6, (4, 3)), torch.tensor([8, 7, 8, 6]),
                torch.tensor([3, 2, 1, 3]))
        named, fix = r"aten\._ctc_loss\.Tensor", r"compute it outside the per-sample function"
    else:
        rhs = torch.randn(6, 2)
        fn = psg.per_sample(lin, backend="eager")(lambda x: torch.linalg.lstsq(lin(x).t(), rhs).solution.sum())
        args = (torch.randn(5, 4),)
        named, fix = r"aten\.linalg_lstsq", r"torch\.linalg\.solve\(A\.mT @ A, A\.mT @ B\)"
    with pytest.raises(psg.CaptureError, match=rf"the loss calls {named}\S* at \S*test_refusal_causes.py:\d+ .*the "
                                               r"shape of its output depends on the values of its inputs.*"
                                               rf"docs/limits\.md.*Fix: .*{fix}") as info:
        fn(*args)
    assert "Python control flow" not in str(info.value)


@pytest.mark.parametrize("loss_of", [
    lambda h, t: F.poisson_nll_loss(h, t.abs()),
    lambda h, t: F.kl_div(h.log_softmax(-1), t.softmax(-1), reduction="batchmean"),
    lambda h, t: F.hinge_embedding_loss(h, t.sign()),
], ids=["poisson_nll_loss", "kl_div_batchmean", "hinge_embedding_loss"])
def test_losses_of_torch_functional_that_docs_list_are_exact(loss_of):
    torch.manual_seed(0)
    lin = nn.Linear(5, 2).double()

    def loss(x, t):
        return loss_of(lin(x), t)

    x, t = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    got = psg.per_sample(lin, backend="eager")(loss)(x, t)
    want = reference_per_sample(loss, dict(lin.named_parameters()), (x, t))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-10)


def test_a_value_check_inside_a_library_function_is_named_with_the_function_and_the_users_line():
    """``F.gaussian_nll_loss`` checks ``torch.any(var < 0)`` in Python: the refusal names that function, not the
    user's control flow, which has none."""
    lin = nn.Linear(5, 2)
    x, t = torch.randn(4, 5), torch.randn(4, 2)
    fn = psg.per_sample(lin, backend="eager")(lambda x, t: F.gaussian_nll_loss(lin(x), t, torch.ones_like(t)))
    with pytest.raises(psg.CaptureError, match="gaussian_nll_loss .*functional.py:\\d+.* branches on a tensor's "
                       "values") as info:
        fn(x, t)
    assert f"{Path(__file__).name}:" in str(info.value) and "formula" in str(info.value)


def _exact_against_the_loop(model, loss, args):
    got = psg.per_sample(model, backend="eager")(loss)(*args)
    for name, value in reference_per_sample(loss, dict(model.named_parameters()), args).items():
        torch.testing.assert_close(got[name], value, rtol=1e-9, atol=1e-11)


def test_a_mean_reduced_mse_loss_differentiated_inside_the_loss_is_refused():
    """``autograd.grad(F.mse_loss(out, y), x)`` inside the loss: the gradient divides by the batch's element count,
    where each sample's own divides by its own (it was computed with the batch's, silently). The same penalty with
    the mean written out is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)

    def penalty(inner):
        def loss(x, y):
            x = x.detach().requires_grad_(True)
            out = model(x)
            (g,) = torch.autograd.grad(inner(out, y), x, create_graph=True)
            return F.mse_loss(out, y) + g.pow(2).sum()
        return loss

    with pytest.raises(psg.SampleMixingError, match="mse_loss_backward.*mean-reduced loss"):
        psg.per_sample(model, backend="eager")(penalty(F.mse_loss))(x, y)
    _exact_against_the_loop(model, penalty(lambda o, t: (o - t).pow(2).mean()), (x, y))


def test_rrelu_is_exact_in_eval_mode_and_refused_in_training_mode():
    """Training-mode RReLU's backward reads the slopes its forward drew into a buffer: the gradients of the layers
    before it came out wrong (NaN on Inductor). Refused, naming eval mode; in eval mode it is leaky_relu."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.RReLU(), nn.Linear(8, 3)).double().eval()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))

    def loss(x, y):
        return F.cross_entropy(model(x), y)

    _exact_against_the_loop(model, loss, (x, y))
    model.train()
    with pytest.raises(psg.UnsupportedError, match="RReLU in training mode.*model.eval"):
        psg.per_sample(model, backend="eager")(loss)(x, y)


@pytest.mark.parametrize("draw", [
    lambda h: F.gumbel_softmax(h, tau=0.5),
    lambda h: h * torch.empty_like(h).exponential_() + h.pow(2) * torch.empty_like(h).cauchy_(),
    lambda h: h * torch.empty_like(h).log_normal_() + h * torch.empty_like(h).geometric_(0.3),
], ids=["gumbel_softmax", "exponential_cauchy", "log_normal_geometric"])
def test_random_draws_shaped_like_the_batch_are_per_sample(draw):
    """``gumbel_softmax`` (``exponential_``) and the other in-place draws were refused ("no batch semantics for
    aten.exponential"), as ``uniform_`` is not: a draw shaped like the batch is one draw per sample. With the same
    seed the per-sample gradients add up to autograd's batch gradient, and a sample's own does not move when
    another sample changes."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    x = torch.randn(5, 4, dtype=torch.float64)

    def loss(x):
        return draw(model(x)).pow(2).sum()

    fn = psg.per_sample(model, backend="eager")(loss)
    torch.manual_seed(3)
    got = fn(x)
    torch.manual_seed(3)
    model.zero_grad()
    loss(x).backward()
    assert model.weight.grad.abs().sum() > 0
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name].sum(0), p.grad, rtol=1e-10, atol=1e-12)
    other = x.clone()
    other[1:] = torch.randn(4, 4, dtype=torch.float64)
    torch.manual_seed(3)
    moved = fn(other)
    for name in got:
        torch.testing.assert_close(moved[name][0], got[name][0], rtol=1e-12, atol=0)


def test_a_boolean_mask_is_refused_with_fixes_that_keep_the_shape_and_are_exact():
    """``out[mask] = h[mask]`` gathers every sample's selected elements into one row: refused (torch's trace of
    its gradient failed with PendingUnbackedSymbolNotFound, "please report"; a masked read's fix said only "express
    this step with common tensor operations"). The forms the fix names are exact."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))

    def masked(x, y):
        h = model(x)
        out = torch.zeros_like(h)
        out[h > 0] = h[h > 0]
        return F.cross_entropy(out, y)

    with pytest.raises(psg.PerSampleError, match=r"boolean mask.*Fix: keep the shape: torch.where\(mask, new, "
                                                 r"h\)") as caught:  # torch's backward trace fails first
        psg.per_sample(model, backend="eager")(masked)(x, y)
    assert "please report" not in str(caught.value)

    def masked_read(x, y):
        h = model(x)
        return F.cross_entropy(h, y) + h[x[:, :3] > 0].sum()

    with pytest.raises(psg.UnsupportedError, match=r"aten.index with a boolean mask.*Fix: keep the shape: "):
        psg.per_sample(model, backend="eager")(masked_read)(x, y)

    def where(x, y):
        h = model(x)
        return F.cross_entropy(torch.where(h > 0, h, torch.zeros_like(h)), y)

    def masked_fill(x, y):
        h = model(x)
        return F.cross_entropy(h.masked_fill(~(h > 0), 0), y)

    _exact_against_the_loop(model, where, (x, y))
    _exact_against_the_loop(model, masked_fill, (x, y))


class _WritesBuffersDict(nn.Module):
    def __init__(self, in_place: bool):
        super().__init__()
        self.lin, self.in_place = nn.Linear(4, 3), in_place
        self.register_buffer("running", torch.zeros(4))

    def forward(self, x):
        if self.in_place:
            with torch.no_grad():
                self.running.copy_(x.mean(0))
        else:
            self._buffers["running"] = x.mean(0).detach()
        return self.lin(x)


def test_a_buffer_written_through_the_buffers_dict_gets_a_fix_that_applies():
    """``self._buffers["running"] = value`` failed inside AOT autograd ("node ... must have _dynamo_source
    attribute", "please report"). The fix it names now, an in-place copy under no_grad, runs and is exact, and
    the buffer holds the batch's value as in eager mode."""
    torch.manual_seed(0)
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    model = _WritesBuffersDict(in_place=False).double()
    loss = lambda x, y: F.cross_entropy(model(x), y)  # noqa: E731
    with pytest.raises(psg.CaptureError, match=r"writes a module's buffer through its _buffers dict.*Fix: update "
                                               r"the buffer in place, under torch.no_grad\(\)") as caught:
        psg.per_sample(model, backend="eager")(loss)(x, y)
    assert "please report" not in str(caught.value)
    model.in_place = True
    _exact_against_the_loop(model, loss, (x, y))
    model.running.zero_()
    psg.per_sample(model, backend="eager")(loss)(x, y)
    torch.testing.assert_close(model.running, x.mean(0))


def test_a_reentrant_checkpoint_of_the_batch_is_refused_and_its_fixes_are_exact():
    """``checkpoint(f, x, use_reentrant=True)`` where x is the batch: eager autograd gives f's parameters no gradient
    (nothing checkpointed requires grad), while Dynamo traces the non-reentrant meaning; they got one, silently.
    Refused naming the line; both fixes the message gives are exact against the loop, and a reentrant checkpoint
    of a value that requires grad (a later layer) is exact too."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = nn.ModuleDict({"first": nn.Linear(4, 4), "inner": nn.Linear(4, 4), "head": nn.Linear(4, 3)}).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))

    def through(inner):
        def loss(x, y):
            return F.cross_entropy(model["head"](torch.tanh(inner(x))), y)
        return loss

    with pytest.raises(psg.UnsupportedError, match=r"use_reentrant=True\) at .*test_refusal_causes.py.*"
                       r"Fix: pass use_reentrant=False"):
        psg.per_sample(model, backend="eager")(through(
            lambda x: checkpoint(model["inner"], x, use_reentrant=True)))(x, y)
    _exact_against_the_loop(model, through(lambda x: checkpoint(model["inner"], x, use_reentrant=False)), (x, y))

    def under_no_grad(x):
        with torch.no_grad():
            return model["inner"](x)

    _exact_against_the_loop(model, through(under_no_grad), (x, y))
    got = psg.per_sample(model, backend="eager")(through(
        lambda x: checkpoint(model["inner"], model["first"](x), use_reentrant=True)))(x, y)
    reference = reference_per_sample(through(lambda x: model["inner"](model["first"](x))),
                                     dict(model.named_parameters()), (x, y))  # autograd.grad refuses reentrancy
    for name, value in reference.items():
        torch.testing.assert_close(got[name], value, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("combine", [
    lambda ce, aux: ce + aux.detach(), lambda ce, aux: ce / ce.detach(), lambda ce, aux: aux * ce.detach(),
    lambda ce, aux: ce - ce.detach() + 1.0,
], ids=["plus_detached", "divided_by_itself_detached", "weighted_by_detached", "straight_through"])
def test_a_detached_batch_loss_in_the_returned_loss_stops_the_gradient_per_sample(combine):
    """A loss reduced over the batch and detached (loss balancing, a straight-through term) is a constant for each
    sample's own loss too: the per-sample head kept the value but dropped the detach, so its gradient flowed."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"l0": nn.Linear(4, 8), "l2": nn.Linear(8, 3)}).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    t = torch.randn(6, 8, dtype=torch.float64)

    def loss(x, y, t):
        hidden = model["l0"](x)
        return combine(F.cross_entropy(model["l2"](torch.tanh(hidden)), y), F.mse_loss(hidden, t))

    _exact_against_the_loop(model, loss, (x, y, t))


@pytest.mark.parametrize("affine", [False, True])
def test_instance_norm_with_running_statistics_is_exact_in_both_modes(affine):
    """``InstanceNorm2d(track_running_stats=True)``: in eval mode each sample's channels are normalized with the
    running statistics, which instance_norm repeats once per sample beside ``[1, B*C, H, W]`` (refused as a batch
    norm "with the batch in the channel dimension"); in training mode with each sample's own statistics, and the
    running statistics are updated once per call from the whole batch, as one eager call updates them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.InstanceNorm2d(4, affine=affine, track_running_stats=True),
                          nn.Flatten(), nn.Linear(64, 3)).double()
    norm = model[1]
    with torch.no_grad():
        norm.running_mean.normal_()
        norm.running_var.uniform_(0.5, 2.0)
    x, y = torch.randn(3, 2, 6, 6, dtype=torch.float64), torch.randint(0, 3, (3,))

    def loss(x, y):
        return F.cross_entropy(model(x), y)

    model.eval()
    _exact_against_the_loop(model, loss, (x, y))
    model.train()
    before = norm.running_mean.clone(), norm.running_var.clone()
    got = psg.per_sample(model, backend="eager")(loss)(x, y)
    after = norm.running_mean.clone(), norm.running_var.clone()
    norm.running_mean.copy_(before[0])
    norm.running_var.copy_(before[1])
    loss(x, y)  # one eager call: its update of the running statistics
    torch.testing.assert_close(after, (norm.running_mean, norm.running_var), rtol=1e-12, atol=1e-12)
    assert not torch.equal(after[0], before[0])
    norm.running_mean.copy_(before[0])
    norm.running_var.copy_(before[1])
    want = reference_per_sample(loss, dict(model.named_parameters()), (x, y))  # each sample's statistics alone
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("view", ["diagonal", "diagonal_offset", "unfold"])
def test_a_view_of_a_parameter_gets_its_backward_lifted(view, monkeypatch):
    """``x * W.diagonal()``: the parameter's gradient is the batch sum placed back by ``diagonal_backward``, which had
    no lift rule; its vmap fallback fixes the batch size, and the refusal said "at unknown source line" (a backward
    node carries none). Now lifted like slice_backward; without the rule, the refusal names the forward line."""
    from compiled_psg._rewrite import registry

    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(5, 6, dtype=torch.float64))
    pick = {"diagonal": lambda: w.diagonal(),
            "diagonal_offset": lambda: w.diagonal(1, 1, 0)[:4].repeat(2)[:5],
            "unfold": lambda: w.unfold(1, 2, 2).sum(-1)[0, :3].repeat(2)[:5]}[view]

    def loss(x):
        return (x * pick()).tanh().pow(2).sum()  # <view_of_parameter>

    x = torch.randn(4, 5, dtype=torch.float64)
    got = psg.per_sample({"w": w}, backend="eager")(loss)(x)["w"]
    want = reference_per_sample(loss, {"w": w}, (x,))["w"]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if view == "diagonal":
        monkeypatch.delitem(registry.LIFT_RULES, torch.ops.aten.diagonal_backward.default)
        lines = Path(__file__).read_text().splitlines()
        line = next(i + 1 for i, text in enumerate(lines) if text.endswith("# <view_of_parameter>"))
        with pytest.raises(psg.UnsupportedError, match=rf"diagonal_backward.* in the backward of \S*"
                                                       rf"test_refusal_causes.py\D{{1,12}}{line}\b"):
            psg.per_sample({"w": w}, backend="eager")(loss)(x)


def test_a_channels_last_model_names_its_memory_format_and_the_fix_works():
    """Round L: a channels-last model whose ``AdaptiveAvgPool2d`` backward traces to ``as_strided`` was refused as
    "no batch semantics for aten.as_strided ... express this step with common tensor operations"; the cause is the
    model's memory format, and converting it back is the fix (exact against the loop)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 2)).double().to(memory_format=torch.channels_last)
    x = torch.randn(3, 3, 6, 6, dtype=torch.float64)

    def loss(x):
        return model(x).pow(2).sum()

    with pytest.raises(psg.UnsupportedError, match=r"channels_last memory format.*Fix: .*"
                                                   r"model\.to\(memory_format=torch\.contiguous_format\)"):
        psg.per_sample(model, backend="eager")(loss)(x)
    model.to(memory_format=torch.contiguous_format)
    got = psg.per_sample(model, backend="eager")(loss)(x)
    expected = reference_per_sample(loss, dict(model.named_parameters()), (x,))
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12)


def test_a_factory_of_the_batch_length_is_a_batch_size_refusal_not_mixing():
    """Round M2: ``torch.eye(len(x)) @ h`` (which is h) was "samples are mixed"; no sample reads another, but a
    batch of one would see other values, and compiled_psg cannot read these as the sample's batch size 1."""
    lin = nn.Linear(3, 3).double()
    with pytest.raises(psg.UnsupportedError, match=r"cannot give this loss a sample's own batch size(.|\n)*torch\."
                                                   r"eye of the batch's length(.|\n)*Fix: build it from"):
        psg.per_sample(lin, backend="eager")(lambda x: (torch.eye(len(x), dtype=x.dtype) @ lin(x)).pow(2).sum())(
            torch.randn(5, 3, dtype=torch.float64))


@pytest.mark.parametrize("factory", ["linspace", "logspace"])
def test_a_factory_taking_the_batch_length_as_a_python_int_names_the_op_and_the_line(factory):
    """``torch.linspace(0.5, 1, x.shape[0])`` as per-sample weights: torch takes ``steps`` as a Python int, so the
    trace fixes the batch size at the call. The refusal is the one for a factory of the batch's length, naming the
    factory and the user's line (it said "tracing the gradients of the loss fixed the batch size", naming
    neither)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    make = getattr(torch, factory)

    def loss(x, y):
        weights = make(0.5, 1, x.shape[0])  # <batch_length_factory>
        return (F.cross_entropy(model(x), y, reduction="none") * weights).sum()

    line = _line_of("# <batch_length_factory>")
    with pytest.raises(psg.UnsupportedError, match=rf"cannot give this loss a sample's own batch size(.|\n)*torch\."
                                                   rf"{factory} at \S*test_refusal_causes.py:{line}\b.*torch\."
                                                   rf"{factory} of the batch's length.*Fix: build it from"):
        psg.per_sample(model, backend="eager")(loss)(torch.randn(4, 6), torch.randint(0, 3, (4,)))


def test_a_python_int_argument_fixed_to_the_batch_size_names_the_function_and_the_line():
    """A torch function whose argument is a Python int (``torch.histc``'s ``bins``) given ``x.shape[0]``: the
    message names the function and the user's line, not torch's backward formulas."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)

    def loss(x, y):
        return F.cross_entropy(model(x), y) + torch.histc(x.detach(), bins=x.shape[0]).sum()  # <int_argument>

    line = _line_of("# <int_argument>")
    with pytest.raises(psg.CaptureError, match=rf"torch\.histc(.|\n)*test_refusal_causes.py:{line}\b(.|\n)*Fix: ") \
            as info:
        psg.per_sample(model, backend="eager")(loss)(torch.randn(4, 4), torch.randint(0, 3, (4,)))
    assert "tracing the gradients of the loss" not in str(info.value)


def _line_of(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i + 1 for i, text in enumerate(lines) if text.endswith(marker))


_NON_BATCH_SIZE = {
    "interpolate": (lambda m, x: F.interpolate(m(x).transpose(1, 2), size=x.shape[0]).mean(2), "_unsafe_index"),
    "slice": (lambda m, x: m(x).sum(1) * x[:, :, :x.shape[0]].sum((1, 2)).unsqueeze(1), "slice"),
    "repeat": (lambda m, x: m(x).sum(1).repeat(1, x.shape[0])[:, :3], "repeat"),
}


@pytest.mark.parametrize("case", list(_NON_BATCH_SIZE))
def test_the_batch_size_as_the_size_of_a_non_batch_dimension_is_named_as_such(case):
    """``F.interpolate(h, size=x.shape[0])``, ``x[:, :x.shape[0]]``, ``h.repeat(1, x.shape[0])``: each sample is
    computed on its own, but a sample's own loss sees size 1 there, so its problem differs from its part of the
    batched one. The refusal says so, names the op and the line, and gives a fix the user owns (it said "holds
    batch positions as float32 ... pairing samples" at an arange the user never wrote, or "no batch semantics")."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    body, op = _NON_BATCH_SIZE[case]

    def loss(x, y):
        return F.cross_entropy(body(model, x), y)  # <non_batch_size>

    line = _line_of("# <non_batch_size>")
    with pytest.raises(psg.UnsupportedError, match=rf"cannot give this loss a sample's own batch size(.|\n)*aten\."
                                                   rf"{op} .*test_refusal_causes.py:\d+.*batch size as the size of "
                                                   rf"a non-batch dimension.*Fix: .*fixed size") as info:
        psg.per_sample(model, backend="eager")(loss)(torch.randn(4, 5, 6), torch.randint(0, 3, (4,)))
    assert re.search(rf"test_refusal_causes.py:({line}|\d+ in <lambda>)", str(info.value)), str(info.value)
    assert "pairing samples" not in str(info.value) and "float32" not in str(info.value)


@pytest.mark.parametrize("dims,align_corners", [(2, False), (2, True), (3, False)], ids=["2d", "2d_aligned", "3d"])
def test_a_spatial_transformer_with_affine_grid_is_exact(dims, align_corners):
    """``F.affine_grid(theta, list(x.shape))`` takes the batch size as a size; torch's backward of it reads that
    size as an integer, which stopped the capture (a CaptureError naming neither the op nor the line). Each
    ``theta_i`` makes ``grid_i``: exact against the loop, in float64, with the loss equal to the eager one."""
    torch.manual_seed(0)
    spatial = (4, 5) if dims == 2 else (3, 4, 2)
    x = torch.randn(4, 2, *spatial, dtype=torch.float64)
    model = nn.Linear(x[0].numel(), dims * (dims + 1)).double()
    y = torch.randint(0, 3, (4,))

    def loss(x, y):
        theta = model(x.flatten(1)).view(-1, dims, dims + 1)
        grid = F.affine_grid(theta, list(x.shape), align_corners=align_corners)
        out = F.grid_sample(x, grid, align_corners=align_corners)
        return F.cross_entropy(out.flatten(1)[:, :3], y)

    fn = psg.per_sample(model, backend="eager")(loss)
    got = fn(x, y)
    want = reference_per_sample(loss, dict(model.named_parameters()), (x, y))
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fn.with_losses(x, y)[0], loss(x, y), rtol=1e-12, atol=1e-12)


def test_affine_grid_matches_the_eager_kernel_bit_for_bit():
    """The traced decomposition gives the eager kernel's values (the same base grid and bmm), in float32 too."""
    torch.manual_seed(0)
    for size, align in (([3, 1, 4, 5], False), ([3, 1, 4, 5], True), ([2, 1, 3, 4, 2], False), ([2, 1, 1, 1], False),
                        ([2, 1, 1, 3, 1], False)):
        theta = torch.randn(size[0], len(size) - 2, len(size) - 1)
        want = F.affine_grid(theta, size, align_corners=align)
        got = corrected_decompositions.affine_grid_generator(theta, size, align)
        assert torch.equal(got, want), (size, align)


def test_per_sample_tensors_left_out_of_the_batched_arguments_are_named_as_such():
    """Red team P: labels marked ``in_dims=None`` (or read from a closure) were "the loss gives the batch size to
    F.cross_entropy ... as a Python int", targets "the loss branches on the batch size ... Eq(s38, 6)": the cause
    is a tensor with one entry per sample outside the batched arguments."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y, t = torch.randn(6, 4), torch.randint(0, 3, (6,)), torch.randn(6, 3)
    cases = ((lambda x, y: F.cross_entropy(model(x), y), (x, y), (0, None)),
             (lambda x: F.cross_entropy(model(x), y), (x,), 0),
             (lambda x, t: F.mse_loss(model(x), t), (x, t), (0, None)))
    for loss, args, in_dims in cases:
        with pytest.raises(psg.CaptureError) as info:
            psg.per_sample(model, in_dims=in_dims, backend="eager")(loss)(*args)
        text = str(info.value)
        assert "a tensor with one entry per sample that is not a batched argument" in text, text
        assert "gives the batch size to" not in text and "branches on the batch size" not in text, text
    fixed = psg.per_sample(model, in_dims=(0, 0), backend="eager")(lambda x, t: F.mse_loss(model(x), t))(x, t)
    expected = reference_per_sample(lambda x, t: F.mse_loss(model(x), t), dict(model.named_parameters()), (x, t))
    torch.testing.assert_close(fixed["weight"], expected["weight"], rtol=1e-5, atol=1e-6)


def test_a_parameter_passed_as_a_batched_argument_is_refused_and_the_fix_is_exact():
    """Red team P: a learnable weight per example passed as a batched argument (``loss(x, y, model.w)``) got
    per-sample gradients of 0 (its slices read as data) where the loop's flow through the slice."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    model.w = nn.Parameter(torch.rand(6, dtype=torch.float64))
    x, y, idx = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,)), torch.arange(6)

    def weighted(x, y, w):
        return (F.cross_entropy(model(x), y, reduction="none") * w).sum()

    with pytest.raises(psg.BatchInputError, match=r"argument 2 is the parameter 'w', passed as a batched argument.*"
                                                  r"Fix: pass the samples' indices .* \(w\[idx\]\)"):
        psg.per_sample(model, backend="eager")(weighted)(x, y, model.w)

    def indexed(x, y, i):
        return (F.cross_entropy(model(x), y, reduction="none") * model.w[i]).sum()

    got = psg.per_sample(model, backend="eager")(indexed)(x, y, idx)
    expected = reference_per_sample(indexed, dict(model.named_parameters()), (x, y, idx))
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12)
    assert got["w"].count_nonzero() == 6  # each sample's own entry


def test_an_unbatched_argument_in_a_parameters_memory_written_is_named():
    """Red team P: ``m[0].bias.detach()`` passed with ``in_dims=None`` and written by the loss raised
    "InternalError: 9 Dynamo inputs but 8 AOT inputs. This is a bug in compiled_psg"."""
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    before = model[0].bias.detach().clone()

    def loss(x, y, s):
        s.mul_(2.0)
        return F.cross_entropy(model(x), y)

    with pytest.raises(psg.BatchInputError, match=r"argument 2 with parameter '0.bias'.*Fix: pass tensors that do "
                                                  r"not share memory"):
        psg.per_sample(model, in_dims=(0, 0, None), backend="eager")(loss)(
            torch.randn(5, 4), torch.randint(0, 3, (5,)), model[0].bias.detach())
    assert torch.equal(model[0].bias.detach(), before)


def test_a_closure_tensor_in_a_parameters_memory_written_is_named():
    """Red team Q1: ``alias = weight.detach()`` held in a closure and written by the loss raised "InternalError: 9
    Dynamo inputs but 8 AOT inputs. This is a bug in compiled_psg"; the parameter is left as it was."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    alias = model[0].weight.detach()
    before = model[0].weight.detach().clone()

    def loss(x, y):
        alias[0, 0] += 0.5
        return F.cross_entropy(model(x), y)

    with pytest.raises(psg.BatchInputError, match=r"`alias`, a tensor the loss reads from outside its arguments with "
                                                  r"parameter '0.weight'.*Fix: let the loss hold a copy"):
        psg.per_sample(model, backend="eager")(loss)(torch.randn(5, 4), torch.randint(0, 3, (5,)))
    assert torch.equal(model[0].weight.detach(), before)


@pytest.mark.parametrize("op, call, fixed", [
    ("celu", lambda h, x: F.celu(h, alpha=float(len(x))), lambda h, x: F.celu(h, alpha=2.0)),
    ("lerp", lambda h, x: torch.lerp(h, torch.tanh(h), 1.0 / len(x)),
     lambda h, x: torch.lerp(h, torch.tanh(h), x.new_ones(()) / x.shape[0])),
])
def test_a_number_made_of_the_batch_size_read_by_a_backward_formula_is_named(op, call, fixed):
    """Red team Q1: ``F.celu(h, alpha=float(len(x)))`` was refused as "do not branch on x.shape[0]" at
    compiled_psg's own ``torch.autograd.grad`` line. The refusal names the op, the user's line and the number; the
    fix it gives (a tensor weight of the graph for lerp) is exact against the loop."""
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3)).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))

    def loss(x, y):
        return F.cross_entropy(model[1](torch.tanh(call(model[0](x), x))), y)

    with pytest.raises(psg.CaptureError, match=rf"number made of the batch size: torch's backward formula of {op} "
                                               rf"at .*test_refusal_causes.py:\d+.*\(autograd node \w+Backward0\) "
                                               r"reads .* = (5|0.2),.*Fix: give that argument a constant"):
        psg.per_sample(model, backend="eager")(loss)(x, y)

    def repaired(x, y):
        return F.cross_entropy(model[1](torch.tanh(fixed(model[0](x), x))), y)

    got = psg.per_sample(model, backend="eager")(repaired)(x, y)
    want = reference_per_sample(repaired, dict(model.named_parameters()), (x, y))
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(torch_minor() < (2, 13), reason="torch 2.11's Dynamo traces requires_grad_() on no tensor")
def test_requires_grad_on_an_argument_names_the_copy_that_works():
    """Red team Q1: ``a.requires_grad_(True)`` on the loss's argument (an input-gradient penalty) was told "torch
    2.13.0's Dynamo does not trace requires_grad_() ... (torch 2.13 and later do): upgrade torch" on 2.13 to 2.15.
    Dynamo traces it on a tensor the loss makes; the fix the message gives is exact against the loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))

    def penalty(a, y):
        out = model(a)
        (g,) = torch.autograd.grad(out.sum(), a, create_graph=True)
        return F.cross_entropy(out, y) + g.pow(2).sum()

    def on_the_argument(a, y):
        return penalty(a.requires_grad_(True), y)

    with pytest.raises(psg.CaptureError, match=r"requires_grad_\(\) on a tensor that comes from outside it.*"
                                               r"a = a.clone\(\).requires_grad_\(\)") as info:
        psg.per_sample(model, backend="eager")(on_the_argument)(x.clone(), y)
    assert "upgrade torch" not in str(info.value)

    def on_a_copy(a, y):
        return penalty(a.clone().requires_grad_(), y)

    got = psg.per_sample(model, backend="eager")(on_a_copy)(x, y)
    want = reference_per_sample(on_a_copy, dict(model.named_parameters()), (x, y))
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12)


def test_a_parameter_written_through_data_is_named():
    """Red team Q2: ``lin.bias.data.add_(x[0, 0])`` in the loss got AOT autograd's "One of the differentiated
    Tensors does not require grad" and "please report", where the same write under no_grad is named."""
    lin = nn.Linear(5, 3)
    before = lin.bias.detach().clone()

    def loss(x, y):
        with torch.no_grad():
            lin.bias.data.add_(x[0, 0])
        return F.cross_entropy(lin(x), y)

    with pytest.raises(psg.CaptureError, match=r"writes a parameter through \.data.*Fix: apply the write outside the "
                                               r"loss") as info:
        psg.per_sample(lin, backend="eager")(loss)(torch.randn(8, 5), torch.randint(0, 3, (8,)))
    assert "please report" not in str(info.value) and torch.equal(lin.bias.detach(), before)


def test_masked_select_of_the_batch_is_refused_as_flat_order_not_as_a_fixed_batch_size():
    """Red team R (F02): ``m(x).masked_select(mask)`` was refused as torch's backward formula reading the batch
    size, with a fix ("compute that op outside the per-sample function") that cannot apply where a parameter's
    gradient flows through it; docs/refused.md lists it among the ops that place elements in flat order. The
    refusal is that one, with its ``torch.where`` fix, as for ``take``."""
    model, _ = _model_and_loss()
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    with pytest.raises(psg.SampleMixingError, match=r"masked_select at \S*test_refusal_causes.py:\d+ .*places "
                                                    r"elements by their order.*Fix: .*torch.where"):
        psg.per_sample(model, backend="eager")(lambda x, y: model(x).masked_select(y > 0).pow(2).sum())(x, y)


def test_an_out_of_range_index_the_loss_holds_is_not_called_the_batchs():
    """Red team S (F2): an out-of-range index held in a closure (``W.gather(0, idx)``) was reported as "an index
    that the batch gives ... (it is the batch's data)" with "check the batch's labels"; it is named as an index
    with no dimension of the batch, the loss's, its numbers still left out (it may be computed from the batch)."""
    weight = torch.randn(4, 5, dtype=torch.float64)
    idx = torch.tensor([[0, 2, 2], [1, 1, 0], [3, 0, 4]])

    def loss(p, x):
        return (p["W"].gather(0, idx) * x).sum()

    with pytest.raises(psg.BatchInputError, match=r"aten.gather.default at \S*test_refusal_causes.py:\d+ .*an index "
                                                  r"with no dimension of the batch .*\[0, 4\).*Fix: the index") as info:
        psg.per_sample_grad(loss, backend="eager")({"W": weight}, torch.randn(3, 3, 3, dtype=torch.float64))
    assert "index 4" not in str(info.value) and "labels" not in str(info.value)
