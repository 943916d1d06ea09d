"""Ops torch decomposes in Python at the autograd dispatch key (``py_impl(DispatchKey.Autograd)``): a trace records
a decomposition, not the op, so no rule sees it and a wrong decomposition is silently wrong (torch 2.13's
``multilabel_margin_loss_forward`` was: ``_capture/corrected_decompositions.py``). Each case builds a loss on the
op's public function and checks its per-sample gradients against the loop in float64, whichever Python kernel the
trace takes (for upsampling and the recurrent ops a ``CompositeImplicitAutograd`` one comes first; the ``.data``
overloads of the recurrent ops, for packed sequences, are listed but not built here). A torch upgrade that
decomposes a new op this way fails ``test_every_op_decomposed_at_the_autograd_key_is_covered`` until a case is
added."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import reference_per_sample
from torch._C import DispatchKey

import compiled_psg as psg


def _conv_then(op):
    """A conv on ``[B, 2, 6, 6]`` images whose output goes through ``op``, then squared and summed."""
    conv = nn.Conv2d(2, 3, 3, padding=1).double()
    return conv, (lambda x: op(conv(x)).pow(2).sum()), (torch.randn(4, 2, 6, 6, dtype=torch.float64),)


def _conv1d_then(op):
    conv = nn.Conv1d(2, 3, 3, padding=1).double()
    return conv, (lambda x: op(conv(x)).pow(2).sum()), (torch.randn(4, 2, 7, dtype=torch.float64),)


def _conv3d_then(op):
    conv = nn.Conv3d(2, 3, 3, padding=1).double()
    return conv, (lambda x: op(conv(x)).pow(2).sum()), (torch.randn(4, 2, 4, 4, 4, dtype=torch.float64),)


def _linear_then(op):
    lin = nn.Linear(5, 4).double()
    return lin, (lambda x: op(lin(x)).pow(2).sum()), (torch.randn(4, 5, dtype=torch.float64),)


def _loss(fn):
    lin = nn.Linear(5, 4).double()
    targets = torch.tensor([1, 0, 3, 2])
    return lin, (lambda x, y: fn(lin(x), y)), (torch.randn(4, 5, dtype=torch.float64), targets)


def _multilabel():
    lin = nn.Linear(5, 4).double()
    targets = torch.tensor([[0, 2, -1, 1], [3, -1, 0, 0], [1, 2, 3, 0], [-1, 0, 1, 2]])
    return lin, (lambda x, y: F.multilabel_margin_loss(lin(x), y)), (torch.randn(4, 5, dtype=torch.float64), targets)


def _recurrent(cls, **kwargs):
    rnn = cls(3, 4, batch_first=True, **kwargs).double()
    return rnn, (lambda x: rnn(x)[0].pow(2).sum()), (torch.randn(4, 5, 3, dtype=torch.float64),)


def _batch_norm_eval():
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3)).double()
    model[1].running_mean.uniform_(-1, 1)
    model[1].running_var.uniform_(0.5, 2)
    model.eval()
    return model, (lambda x: model(x).pow(2).sum()), (torch.randn(4, 2, 6, 6, dtype=torch.float64),)


def _resize(**kwargs):
    return lambda h: F.interpolate(h, **kwargs)


# case id -> (the ops it reaches, a builder of (module, loss, args))
CASES = {
    "nearest1d": (["upsample_nearest1d.default", "upsample_nearest1d.vec"],
                  lambda: _conv1d_then(_resize(scale_factor=1.5, mode="nearest"))),
    "nearest_exact1d": (["_upsample_nearest_exact1d.default", "_upsample_nearest_exact1d.vec"],
                        lambda: _conv1d_then(_resize(scale_factor=1.5, mode="nearest-exact"))),
    "linear1d": (["upsample_linear1d.vec"], lambda: _conv1d_then(_resize(size=(10,), mode="linear"))),
    "nearest2d": (["upsample_nearest2d.default", "upsample_nearest2d.vec"],
                  lambda: _conv_then(_resize(scale_factor=1.5, mode="nearest"))),
    "nearest_exact2d": (["_upsample_nearest_exact2d.default", "_upsample_nearest_exact2d.vec"],
                        lambda: _conv_then(_resize(size=(4, 9), mode="nearest-exact"))),
    "bilinear2d": (["upsample_bilinear2d.default", "upsample_bilinear2d.vec"],
                   lambda: _conv_then(_resize(size=(9, 4), mode="bilinear", align_corners=False))),
    "bilinear2d_align_corners": (["upsample_bilinear2d.vec"],
                                 lambda: _conv_then(_resize(size=(9, 9), mode="bilinear", align_corners=True))),
    "bicubic2d": (["upsample_bicubic2d.default", "upsample_bicubic2d.vec"],
                  lambda: _conv_then(_resize(scale_factor=1.7, mode="bicubic"))),
    "bilinear2d_aa": (["_upsample_bilinear2d_aa.vec"],
                      lambda: _conv_then(_resize(size=(4, 3), mode="bilinear", antialias=True))),
    "bicubic2d_aa": (["_upsample_bicubic2d_aa.vec"],
                     lambda: _conv_then(_resize(size=(4, 3), mode="bicubic", antialias=True))),
    "lanczos2d_aa": (["_upsample_lanczos2d_aa.vec"],
                     lambda: _conv_then(_resize(size=(4, 3), mode="lanczos", antialias=True))),
    "nearest3d": (["upsample_nearest3d.default", "upsample_nearest3d.vec"],
                  lambda: _conv3d_then(_resize(scale_factor=1.5, mode="nearest"))),
    "nearest_exact3d": (["_upsample_nearest_exact3d.default", "_upsample_nearest_exact3d.vec"],
                        lambda: _conv3d_then(_resize(size=(5, 3, 6), mode="nearest-exact"))),
    "trilinear3d": (["upsample_trilinear3d.vec"], lambda: _conv3d_then(_resize(size=(5, 3, 6), mode="trilinear"))),
    "hardshrink": (["hardshrink.default"], lambda: _linear_then(lambda h: F.hardshrink(h, 0.3))),
    "softshrink": (["softshrink.default"], lambda: _linear_then(lambda h: F.softshrink(h, 0.3))),
    "multi_margin_loss": (["multi_margin_loss.default"], lambda: _loss(lambda o, y: F.multi_margin_loss(o, y, p=2))),
    "multilabel_margin_loss": (["multilabel_margin_loss_forward.default"], _multilabel),
    "batch_norm_eval": (["native_batch_norm.default"], _batch_norm_eval),
    "rnn_tanh": (["rnn_tanh.input", "rnn_tanh.data"], lambda: _recurrent(nn.RNN)),
    "rnn_relu": (["rnn_relu.input", "rnn_relu.data"], lambda: _recurrent(nn.RNN, nonlinearity="relu")),
    "lstm": (["lstm.input", "lstm.data"], lambda: _recurrent(nn.LSTM)),
    "gru": (["gru.input", "gru.data"], lambda: _recurrent(nn.GRU, bidirectional=True)),
}
# Reached only where no per-sample gradient is compared: on CUDA, or random by design.
NOT_COMPARED = {"cudnn_batch_norm.default": "CUDA only (cuDNN)", "miopen_batch_norm.default": "ROCm only (MIOpen)",
                "dropout.default": "random: docs/semantics.md, 'Dropout and other randomness'"}


def _decomposed_at_the_autograd_key() -> set[str]:
    import torch._inductor.compile_fx  # noqa: F401 -- registers more of them (miopen_batch_norm) on import

    found = set()
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if DispatchKey.Autograd in op.py_kernels:
                found.add(f"{name}.{overload}")
    return found


def test_every_op_decomposed_at_the_autograd_key_is_covered():
    covered = {op for ops, _ in CASES.values() for op in ops} | set(NOT_COMPARED)
    missing = _decomposed_at_the_autograd_key() - covered
    assert not missing, f"torch decomposes these at the autograd key too: add a case to CASES for each: {missing}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_ops_decomposed_at_the_autograd_key_give_the_loops_gradients(case):
    torch.manual_seed(0)
    module, loss, args = CASES[case][1]()
    got = psg.per_sample(module, backend="eager")(loss)(*args)
    want = reference_per_sample(loss, dict(module.named_parameters()), args)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-10, msg=f"{case}: {name}")


def test_bicubic_antialias_is_exact_under_inductor_and_its_replacement_matches_the_kernel():
    """torch cannot trace ``_upsample_bicubic2d_aa``'s backward with a symbolic batch; the capture traces it as a
    separable product (``corrected_decompositions.upsample_bicubic2d_aa``), which matches the eager kernel."""
    from compiled_psg._capture.corrected_decompositions import upsample_bicubic2d_aa

    torch.manual_seed(0)
    module, loss, args = CASES["bicubic2d_aa"][1]()
    got = psg.per_sample(module)(loss)(*args)  # Inductor
    want = reference_per_sample(loss, dict(module.named_parameters()), args)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-10)
    kernel = torch.ops.aten._upsample_bicubic2d_aa.default
    x = torch.randn(3, 2, 7, 9, dtype=torch.float64)
    for size, align_corners, scales in [((4, 5), False, (None, None)), ((11, 13), True, (None, None)),
                                        ((5, 6), False, (0.7, 0.65)), ((3, 20), True, (None, None)),
                                        ((1, 5), False, (None, None)), ((7, 1), False, (None, None))]:
        torch.testing.assert_close(upsample_bicubic2d_aa(x, list(size), align_corners, *scales),
                                   kernel(x, list(size), align_corners, *scales), rtol=1e-12, atol=1e-12)
    flat = torch.randn(3, 2, 1, 9, dtype=torch.float64)  # width 1 out, the height (1) kept
    torch.testing.assert_close(upsample_bicubic2d_aa(flat, [1, 1], False), kernel(flat, [1, 1], False),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("width", [1, 5])
def test_bicubic_antialias_to_width_one_with_the_height_changed_is_refused_in_our_words(width):
    """There the eager forward gives every output row one value and its backward is the true adjoint: no traced
    form matches the loop (``[N, C, 7, w] -> [N, C, 4, 1]``)."""
    conv = nn.Conv2d(2, 3, 3, padding=1).double()
    x = torch.randn(4, 2, 7, width, dtype=torch.float64)

    def loss(x):
        return F.interpolate(conv(x), size=(4, 1), mode="bicubic", antialias=True).pow(2).sum()

    with pytest.raises(psg.UnsupportedError, match="antialias=False, or mode='bilinear'"):
        psg.per_sample(conv, backend="eager")(loss)(x)
