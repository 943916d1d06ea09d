"""torch modules the capture used to refuse (issue 11), against the naive loop; and refusals in our own words.

Float64, eager backend. Each exactness test compares every parameter's per-sample gradient with
``reference.reference_per_sample``; each refusal test asserts the error class and the parts of the message that
tell the user where and what to fix.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import reference_per_sample

import compiled_psg as psg
from compiled_psg._compat import traces_batch_size_exponent
from compiled_psg._errors import BatchInputError, CaptureError, SampleMixingError

DTYPE = torch.float64
TOL = dict(rtol=1e-7, atol=1e-9)


def _check(model: nn.Module, loss, args: tuple, **kwargs) -> dict:
    fn = psg.per_sample(model, backend="eager", **kwargs)(loss)
    got = fn(*args)
    ref = reference_per_sample(loss, dict(model.named_parameters()), args)
    assert set(got) == set(ref)
    for name, r in ref.items():
        torch.testing.assert_close(got[name], r, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    assert any(r.abs().sum() > 0 for r in ref.values())
    return fn


# ---------------------------------------------------------------- MultiheadAttention's weights path


@pytest.mark.parametrize("average", [True, False], ids=["average", "per_head"])
@pytest.mark.parametrize("attn_mask", [False, True], ids=["kpm", "kpm_and_attn_mask"])
def test_multihead_attention_with_masks_and_weights(average, attn_mask):
    """need_weights=True (the default) with a key padding mask: the weights path adds the mask with baddbmm."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(3, 3, batch_first=True).to(DTYPE)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5, 3, generator=g, dtype=DTYPE)
    kpm = torch.zeros(4, 5, dtype=torch.bool)
    kpm[1, -2:] = True
    kpm[2, -1] = True
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1) if attn_mask else None
    proj = torch.randn(5, 5, generator=g, dtype=DTYPE)

    def loss(x, kpm):
        out, weights = mha(x, x, x, key_padding_mask=kpm, attn_mask=causal, average_attn_weights=average)
        return out.pow(2).sum() + (weights * proj).sum()

    _check(mha, loss, (x, kpm))


# ---------------------------------------------------------------- Transformer with 2-D masks


def test_transformer_encoder_with_square_mask_one_capture_for_every_batch_size():
    """TransformerEncoder compares the mask with a causal one (a data-dependent guard); the capture replaces that
    detection, computes the same attention with the mask as given, and restores torch's function."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to(DTYPE)
    mask = nn.Transformer.generate_square_subsequent_mask(5, dtype=DTYPE)
    detect = torch.nn.modules.transformer._detect_is_causal_mask

    def loss(x):
        return model(x, mask=mask).pow(2).sum()

    fn = _check(model, loss, (torch.randn(3, 5, 4, dtype=DTYPE),))
    assert torch.nn.modules.transformer._detect_is_causal_mask is detect
    x = torch.randn(4, 5, 4, dtype=DTYPE)
    got = fn(x)
    ref = reference_per_sample(loss, dict(model.named_parameters()), (x,))
    for name, r in ref.items():
        torch.testing.assert_close(got[name], r, **TOL)
    assert fn.captures == 1, "the guards must hold again after the capture restored torch's function"


def test_transformer_with_src_and_tgt_masks():
    torch.manual_seed(0)
    model = nn.Transformer(4, 2, 1, 1, 8, dropout=0.0, batch_first=True).to(DTYPE)
    src_mask = torch.zeros(5, 5, dtype=DTYPE)
    src_mask[0, 3] = float("-inf")  # not causal: the mask must be applied as given
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(4, dtype=DTYPE)

    def loss(src, tgt):
        return model(src, tgt, src_mask=src_mask, tgt_mask=tgt_mask).pow(2).sum()

    _check(model, loss, (torch.randn(3, 5, 4, dtype=DTYPE), torch.randn(3, 4, 4, dtype=DTYPE)))


# ---------------------------------------------------------------- LinearCrossEntropyLoss(options=...)


@pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason="LinearCrossEntropyLoss exists from torch 2.13")
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_with_chunking_options(reduction):
    """The chunked path is an opaque custom op; the capture runs the reference path (the same loss)."""
    torch.manual_seed(0)
    options = nn.LinearCrossEntropyOptions(batch_chunk_size=2)
    head = nn.LinearCrossEntropyLoss(4, 7, bias=True, options=options, reduction=reduction).to(DTYPE)
    original = F.linear_cross_entropy
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 4, generator=g, dtype=DTYPE)
    y = torch.randint(0, 7, (5,), generator=g)
    _check(head, lambda x, y: head(x, y), (x, y))
    assert F.linear_cross_entropy is original


# ---------------------------------------------------------------- the retrace differentiates what eager does


@pytest.mark.parametrize("first", ["conv", "linear"])
def test_circular_padding_after_a_parametrized_layer(first):
    """Circular padding writes slices of a new tensor (functional ``copy`` + ``slice_scatter`` once captured)."""
    torch.manual_seed(0)
    if first == "conv":
        model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 2, 3, padding=(1, 2),
                                                                       padding_mode="circular"))
        x = torch.randn(3, 2, 5, 6, dtype=DTYPE)
    else:
        model = nn.Sequential(nn.Linear(5, 5), nn.Conv1d(2, 2, 3, padding=2, padding_mode="circular"))
        x = torch.randn(3, 2, 5, dtype=DTYPE)
    model.to(DTYPE)
    _check(model, lambda x: model(x).pow(2).sum(), (x,))


def test_in_place_copy_and_random_fill_differentiate_as_in_eager():
    """``buf.copy_(h)`` across dtypes (functional ``copy``: no derivative in autograd) and ``bernoulli_`` on an
    activation (functional ``bernoulli.p``: no derivative; eager's in-place form has a zero one). p = 1 keeps
    the loss deterministic, so the loop is an exact reference."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DTYPE)

    def loss(x):
        h = model[0](x)
        keep = h.clone().bernoulli_(1.0)
        buf = torch.zeros(x.shape[0], 5, dtype=torch.float32)
        buf.copy_(h)
        return model[2](torch.tanh(h)).pow(2).sum() + (h * keep).sum() + buf.to(DTYPE).pow(2).sum()

    fn = psg.per_sample(model, backend="eager")(loss)
    x = torch.randn(4, 4, dtype=DTYPE)
    got = fn(x)
    ref = reference_per_sample(loss, dict(model.named_parameters()), (x,))
    for name, r in ref.items():  # the float32 buffer rounds
        torch.testing.assert_close(got[name], r, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- refusals in compiled_psg's words


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DTYPE)


def _refuse(model, loss, error, *parts, args=None):
    x = torch.randn(4, 4, dtype=DTYPE) if args is None else args[0]
    with pytest.raises(error) as info:
        psg.per_sample(model, backend="eager")(loss)(*(args or (x,)))
    text = str(info.value)
    for part in parts:
        assert part in text, f"{part!r} not in: {text}"
    return text


def test_loss_without_gradient_is_batch_input_error():
    model = _mlp()
    _refuse(model, lambda x: model(x).detach().sum(), BatchInputError, "no gradient", "detached")
    _refuse(model, lambda x: torch.tensor(3.0, dtype=DTYPE), BatchInputError, "no gradient", "constant")


def test_tuple_loss_is_batch_input_error():
    model = _mlp()
    _refuse(model, lambda x: (model(x).sum(), model(x)), BatchInputError, "must return a tensor", "got tuple")


def test_batch_size_as_exponent_per_torch_version():
    """torch 2.11 to 2.13 cannot trace a symbolic exponent (refused, naming the cause); 2.14+ trace it, and each
    sample's gradient is that of its loss alone, where the exponent is 1 (``_compat``)."""
    model = _mlp()

    def loss(x):
        return (model(x) ** x.shape[0]).sum()

    if not traces_batch_size_exponent():
        _refuse(model, loss, CaptureError, "batch size as a number", "Fix:")
        return
    x = torch.randn(4, 4, dtype=DTYPE)
    got = psg.per_sample(model, backend="eager")(loss)(x)
    ref = reference_per_sample(loss, dict(model.named_parameters()), (x,))
    for key, r in ref.items():
        torch.testing.assert_close(got[key], r, rtol=1e-10, atol=1e-12)


def test_batchnorm_cumulative_average_in_train_mode_is_sample_mixing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5, momentum=None), nn.Linear(5, 3)).to(DTYPE)
    _refuse(model, lambda x: model(x).pow(2).sum(), SampleMixingError, "BatchNorm in training mode", "model.eval()")


def test_print_of_a_tensor_is_refused_at_the_users_line():
    model = _mlp()

    def loss(x):
        h = model(x)
        print(h)  # the graph break
        return h.pow(2).sum()

    text = _refuse(model, loss, CaptureError, "graph break", "test_capture_modules.py", "print(h)",
                   "Fix: print outside the loss function")
    assert text.index("Fix:") < text.index("Details from Dynamo")


def test_tolist_in_the_loss_is_refused_with_the_fix():
    model = _mlp()

    def loss(x):
        h = model(x)
        return h.pow(2).sum() * sum(h.sum(1).tolist())

    _refuse(model, loss, CaptureError, "graph break", ".tolist()", "Fix: keep tensor values as tensors")


def test_a_batched_tensor_split_into_its_samples_is_refused_for_what_it_is():
    """Red team O: ``torch.tensor(y.tolist())`` of a batched argument (an int tensor: no graph break) was refused
    as "fixes the batch size in aten.unbind", with the fix "use x.view(x.shape[0], -1) ... pass every per-sample
    tensor as a batched argument", which ``y`` already is."""
    model = _mlp()

    def split(x, y):
        return (model(x) * torch.tensor(y.tolist(), dtype=DTYPE).unsqueeze(1)).sum()

    _refuse(model, split, CaptureError, "splits a batched tensor into its samples at", "torch.tensor(y.tolist()",
            "aten.unbind", "Fix: keep the values as tensors", args=(torch.randn(4, 4, dtype=DTYPE), torch.arange(4)))


def test_a_complex_parameter_is_refused_with_a_fix_that_keeps_it():
    """Red team O: the fix said "convert it with .float()", which drops the imaginary part."""
    w = torch.randn(3, dtype=torch.complex128, requires_grad=True)
    with pytest.raises(BatchInputError, match=r"parameter 'w' is complex \(torch.complex128\).*Fix: .*"
                                              r"torch.view_as_complex\(p\)") as info:
        psg.per_sample({"w": w}, backend="eager")(lambda x: (x * w).abs().sum())(torch.randn(4, 3))
    assert ".float()" not in str(info.value)
    real = torch.view_as_real(w.detach()).clone().requires_grad_(True)  # the fix: exact against the loop

    def loss(x):
        return (x.to(torch.complex128) * torch.view_as_complex(real)).abs().pow(2).sum()

    x = torch.randn(4, 3, dtype=torch.float64)
    got = psg.per_sample({"real": real}, backend="eager")(loss)(x)["real"]
    expected = torch.stack([torch.autograd.grad(loss(x[i:i + 1]), real)[0] for i in range(4)])
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_item_in_the_loss_is_refused_with_the_fix():
    model = _mlp()

    def loss(x):
        h = model(x)
        return h.pow(2).sum() * h.sum().item()

    _refuse(model, loss, CaptureError, "re-traced", ".item()", "keep them as tensors")


def test_graph_break_in_library_code_names_the_library_and_the_call(tmp_path, monkeypatch):
    """A break inside an installed package: the message names the library's line and the user's call of it."""
    lib = tmp_path / "site-packages"
    lib.mkdir()
    (lib / "psg_fake_library.py").write_text(textwrap.dedent("""
        def fancy_loss(h):
            print(h)
            return h.pow(2).sum()
    """))
    monkeypatch.syspath_prepend(str(lib))
    import psg_fake_library

    model = _mlp()
    try:
        _refuse(model, lambda x: psg_fake_library.fancy_loss(model(x)), CaptureError, "inside library code",
                "psg_fake_library.py:3", "called from", "test_capture_modules.py",
                "Fix: call that library function outside the loss function")
    finally:
        sys.modules.pop("psg_fake_library", None)


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")
def test_graph_break_in_a_with_of_library_code_names_the_library_line(tmp_path, monkeypatch):
    """A break on a C++ context manager that a library enters (OpInfo's ``freeze_rng_state``): Dynamo reports it
    inside its own polyfill, reached through ``contextlib``; the message names the library's ``with`` line."""
    lib = tmp_path / "site-packages"
    lib.mkdir()
    (lib / "psg_fake_rng_library.py").write_text(textwrap.dedent("""
        import contextlib

        import torch


        @contextlib.contextmanager
        def frozen():
            with torch._C._DisableFuncTorch():
                yield


        def seeded_loss(h):
            with frozen():
                return h.pow(2).sum()
    """))
    monkeypatch.syspath_prepend(str(lib))
    import psg_fake_rng_library

    model = _mlp()
    try:
        message = _refuse(model, lambda x: psg_fake_rng_library.seeded_loss(model(x)), CaptureError,
                          "inside library code", "psg_fake_rng_library.py:9 in frozen", "called from",
                          "test_capture_modules.py")
        assert "polyfills" not in message.split("Fix:")[0] and "contextlib.py" not in message.split("Fix:")[0]
    finally:
        sys.modules.pop("psg_fake_rng_library", None)


def test_keyword_arguments_are_batch_input_error():
    model = _mlp()
    fn = psg.per_sample(model, backend="eager")(lambda x: model(x).sum())
    with pytest.raises(BatchInputError, match="keyword arguments are not supported"):
        fn(x=torch.randn(4, 4, dtype=DTYPE))


def test_data_dependent_branches_are_refused_with_the_fix():
    model = _mlp()

    def branch(x):
        h = model(x)
        if h.sum() > 0:
            return h.pow(2).sum()
        return h.sum()

    def branch_on_item(x):
        h = model(x)
        if h.sum().item() > 0:
            return h.pow(2).sum()
        return h.sum()

    _refuse(model, branch, CaptureError, "graph break", "if h.sum() > 0", "torch.where")
    _refuse(model, branch_on_item, CaptureError, "data-dependent", "torch.where")


def test_stand_ins_are_restored_after_a_refused_capture():
    # F.linear_cross_entropy exists from torch 2.13: before it, the stand-in is not installed, and none is left
    detect, lce = torch.nn.modules.transformer._detect_is_causal_mask, getattr(F, "linear_cross_entropy", None)
    model = _mlp()

    def loss(x):
        h = model(x)
        print(h)
        return h.sum()

    _refuse(model, loss, CaptureError, "graph break")
    assert torch.nn.modules.transformer._detect_is_causal_mask is detect
    assert getattr(F, "linear_cross_entropy", None) is lce
