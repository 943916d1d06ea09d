"""Edge cases across capture, reductions and training: each exact against the loop, or refused in our words."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import reference_per_sample

import compiled_psg as psg


def test_kthvalue_over_the_batch_is_refused_in_our_words():
    """A sample's own loss is undefined (kthvalue(2) of one value): BatchInputError, not torch's RuntimeError."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    with pytest.raises(psg.BatchInputError, match="batch of one"):
        psg.per_sample(m, backend="eager")(lambda x: m(x).kthvalue(2, 0).values.pow(2).sum())(x)


def test_spectral_norm_eval_is_exact():
    """spectral_norm's power iteration uses ``vdot``, whose second argument is ``other`` (``dot``'s is ``tensor``):
    the analysis raised a raw KeyError."""
    torch.manual_seed(0)
    lin = nn.utils.parametrizations.spectral_norm(nn.Linear(4, 3).double()).eval()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))

    def loss(x, y):
        return F.cross_entropy(lin(x), y)

    got = psg.per_sample(lin, backend="eager")(loss)(x, y)
    ref = reference_per_sample(loss, dict(lin.named_parameters()), (x, y))
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-9, atol=1e-12)


def test_sparse_embedding_gradients_refused_in_our_words():
    """Sparse gradients failed deep in torch (NotImplementedError on SparseCPU); refused with the fix."""
    torch.manual_seed(0)
    emb, head = nn.Embedding(10, 4, sparse=True).double(), nn.Linear(4, 3).double()
    params = nn.ModuleDict({"emb": emb, "head": head})
    ids, y = torch.randint(0, 10, (5, 3)), torch.randint(0, 3, (5,))
    with pytest.raises(psg.CaptureError, match="sparse=False"):
        psg.per_sample(params, backend="eager")(lambda i, y: F.cross_entropy(head(emb(i).sum(1)), y))(ids, y)


def test_an_argument_computed_from_the_parameters_is_refused():
    """``feats = model[0](x)`` outside the loss carries part of model[0]'s gradient: treated as data it would
    give those parameters 0 (the loop differentiates through it)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    fn = psg.per_sample(m, backend="eager")(lambda feats, y: F.cross_entropy(m[2](m[1](feats)), y))
    with pytest.raises(psg.BatchInputError, match=r"argument 0 was computed from the parameters \(0.bias, 0.weight"):
        fn(m[0](x), y)
    got = fn(m[0](x).detach(), y)  # as data: exact for the parameters it reaches, 0 for the others
    ref = reference_per_sample(lambda feats, y: F.cross_entropy(m[2](m[1](feats)), y), dict(m.named_parameters()),
                               (m[0](x).detach(), y))
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- pass 3 (branch wip-adv3, findings/ there)


def _mlp_and_batch():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    return m, torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))


def _assert_exact(loss, m, args):
    got = psg.per_sample(m, backend="eager")(loss)(*args)
    ref = reference_per_sample(loss, dict(m.named_parameters()), args)
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-10, atol=1e-12)


def test_vector_losses_divided_by_the_batch_size_are_exact():
    """forward_slice dropped an input only the gradients read (a second batch-size symbol), so the retrace got
    its inputs shifted: CaptureError ("Expected a value of type 'Tensor' ... found type 'SymInt'")."""
    m, x, y = _mlp_and_batch()
    _assert_exact(lambda x, y: F.cross_entropy(m(x), y, reduction="none") / len(x), m, (x, y))
    _assert_exact(lambda x, y: F.cross_entropy(m(x), y, reduction="none").sum()
                  / torch.scalar_tensor(len(x), dtype=torch.float64), m, (x, y))


@pytest.mark.parametrize("divisor", ["new_full", "new_full_1", "full_like"])
def test_batch_size_as_the_fill_value_of_a_shape_only_factory_reads_one(divisor):
    """``x.new_full((), len(x))``: the fill value is the batch size, but the factory was marked independent of
    the batch (its tensor argument gives only the shape): each sample's loss was divided by B, not 1."""
    m, x, y = _mlp_and_batch()
    make = {"new_full": lambda x: x.new_full((), len(x)),
            "new_full_1": lambda x: x.new_full((1,), len(x)).sum(),
            "full_like": lambda x: torch.full_like(m[2].bias, len(x)).sum() / 3}[divisor]
    _assert_exact(lambda x, y: F.cross_entropy(m(x), y, reduction="sum") / make(x), m, (x, y))


BATCH_SIZE_VALUES = {  # adversarial finding 09: each was refused as SampleMixingError ("samples are mixed")
    "logits_over_sqrt_len": lambda m, x, y: F.cross_entropy(m(x) / math.sqrt(len(x)), y),
    "hidden_times_inverse_len": lambda m, x, y: F.cross_entropy(m[2](m[1](m[0](x) * (1.0 / len(x)))), y),
    "logits_over_full": lambda m, x, y: F.cross_entropy(m(x) / torch.full((), len(x), dtype=x.dtype), y),
    "logits_over_tensor_of_len": lambda m, x, y: F.cross_entropy(m(x) / torch.tensor(float(len(x)),
                                                                                  dtype=x.dtype), y),
    "logits_over_ones_times_len": lambda m, x, y: F.cross_entropy(m(x) / torch.ones((), dtype=x.dtype)
                                                                  .mul(len(x)), y),
    "losses_over_zeros_plus_len": lambda m, x, y: (F.cross_entropy(m(x), y, reduction="none")
                                                   / x.new_zeros(()).add(len(x))),
    "sum_over_filled_len": lambda m, x, y: (F.cross_entropy(m(x), y, reduction="sum")
                                            / x.new_empty(()).fill_(len(x))),
}


@pytest.mark.parametrize("case", sorted(BATCH_SIZE_VALUES))
def test_the_batch_size_as_a_tensor_reads_one_per_sample(case):
    """A value computed from the batch size reads 1 in each sample's own loss (the batch of one), whether it is a
    Python number or a tensor, and wherever it enters the network."""
    m, x, y = _mlp_and_batch()
    _assert_exact(lambda x, y: BATCH_SIZE_VALUES[case](m, x, y), m, (x, y))


def test_a_batch_size_argument_a_batch_of_one_cannot_read_is_not_called_mixing():
    """``roll(h, len(x), 1)`` on a batched value: the op's argument would read 1 for a sample's own loss, which
    compiled_psg cannot substitute there; refused as unsupported, not as samples mixing."""
    m, x, y = _mlp_and_batch()
    with pytest.raises(psg.UnsupportedError, match="batch size as a value") as info:
        psg.per_sample(m, backend="eager")(lambda x, y: F.cross_entropy(m(x).roll(len(x), 1), y))(x, y)
    assert not isinstance(info.value, psg.SampleMixingError)
    assert "test_edge_cases.py" in str(info.value) and "Fix:" in str(info.value)


BCE_CASES = {  # adversarial finding 08: pos_weight with the default mean was refused with torch's in-place error
    "pos_weight_mean": lambda y, t, w: F.binary_cross_entropy_with_logits(y, t, pos_weight=w),
    "weight_and_pos_weight_mean": lambda y, t, w: F.binary_cross_entropy_with_logits(y, t, w.flip(0), pos_weight=w),
    "pos_weight_sum": lambda y, t, w: F.binary_cross_entropy_with_logits(y, t, pos_weight=w, reduction="sum"),
    "per_sample_weight_mean": lambda y, t, w: F.binary_cross_entropy_with_logits(y, t, t.detach() + w),
    "sequence_pos_weight_mean": lambda y, t, w: F.binary_cross_entropy_with_logits(
        torch.stack([y, 2 * y], 1), torch.stack([t, t.flip(1)], 1), pos_weight=w),
}


@pytest.mark.parametrize("case", sorted(BCE_CASES))
def test_bce_with_logits_weights_are_exact(case):
    m, x, _ = _mlp_and_batch()
    t = torch.softmax(torch.randn(len(x), 3, dtype=torch.float64), 1)
    w = torch.tensor([0.2, 1.0, 3.0], dtype=torch.float64)
    _assert_exact(lambda x, t: BCE_CASES[case](m(x), t, w), m, (x, t))


def test_micro_batches_with_a_custom_reduction_are_refused():
    """Micro-batches' results are summed: a custom mean or max over the batch gave another update than the same
    step on the whole batch (0.71 apart), silently."""
    m, x, y = _mlp_and_batch()
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    mean = psg.custom(lambda n, g: g.mean(0))
    with pytest.raises(psg.DPConfigError, match="max_physical_batch_size with a custom reduce"):
        psg.compile_step(lambda x, y: F.cross_entropy(m(x), y), m, opt, reduce=mean, backend="eager",
                         max_physical_batch_size=2)
    step = psg.compile_step(lambda x, y: F.cross_entropy(m(x), y), m, opt, reduce=mean, backend="eager")
    with pytest.raises(psg.DPConfigError, match="max_physical_batch_size with a custom reduce"):
        step.max_physical_batch_size = 2
    g = reference_per_sample(lambda x, y: F.cross_entropy(m(x), y), dict(m.named_parameters()), (x, y))
    before = [p.detach().clone() for p in m.parameters()]
    step(x, y)  # the whole batch still works: the mean over its 5 samples, divided by the batch size (mean loss)
    for p, p0, gi in zip(m.parameters(), before, g.values(), strict=True):
        torch.testing.assert_close(p, p0 - gi.mean(0) / 5, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("magnitude", [1e4, 1e7])
def test_a_clipped_contribution_of_a_sequence_linear_stays_within_the_bound(magnitude):
    """One sample's clipped contribution to the float32 sum must have norm <= C (1 + ulps), as the loop's does:
    the noise is calibrated to that sensitivity. Near-repeated tokens with opposite output gradients cancel, and
    the float32 book-keeping sum rounds them off the exact gradient (1.35 C at 1e7 before the fix); the certified
    norm now bounds the rounding of that sum too."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 4, bias=False)
    base = torch.randn(4, 1, 8) * magnitude
    x = torch.cat([base + torch.randn(4, 1, 8), base], 1)  # near-repeated tokens ...
    v1 = torch.randn(4, 1, 4) * 1e3
    v = torch.cat([v1, -v1], 1)  # ... with opposite output gradients
    fn = psg.per_sample(lin, backend="eager", reduce=psg.clip_sum(1.0))(lambda x, v: (lin(x) * v).sum())
    worst = max(fn(x[k:k + 1].repeat(2, 1, 1), v[k:k + 1].repeat(2, 1, 1))["weight"].double().norm().item() / 2
                for k in range(4))
    assert worst <= 1.0 + 1e-5


@pytest.mark.parametrize("magnitude", [1e4, 1e6])
def test_a_clipped_contribution_of_an_embedding_stays_within_the_bound(magnitude):
    """The same for an embedding row looked up twice by one sample with nearly opposite gradients (1.0018 C at
    1e6 before the fix)."""
    torch.manual_seed(0)
    emb = nn.Embedding(5, 8)
    ids = torch.tensor([[1, 1], [2, 2], [3, 3], [4, 4]])
    v1 = torch.randn(4, 1, 8) * magnitude
    v = torch.cat([v1 + torch.randn(4, 1, 8) * 1e-2 * (magnitude / 1e4), -v1], 1)
    fn = psg.per_sample(emb, backend="eager", reduce=psg.clip_sum(1.0))(lambda i, v: (emb(i) * v).sum())
    worst = max(fn(ids[k:k + 1].repeat(2, 1), v[k:k + 1].repeat(2, 1, 1))["weight"].double().norm().item() / 2
                for k in range(4))
    assert worst <= 1.0 + 1e-5


@pytest.mark.usefixtures("eager_first_step")  # the eager update, then the program's compile, which fails
@pytest.mark.parametrize("transactional", [True, False])
def test_a_step_failing_after_its_noisy_update_is_undone_or_accounted(monkeypatch, transactional):
    """The first step applies the eager noisy update, then compiles the program: a CompileError (or Ctrl-C) there
    left PrivateTraining.step before the accountant counted the step (history [], epsilon 0, parameters moved).
    A transactional step now restores the parameters and counts nothing; with transactional=False the update
    stays and is counted. A step refused before any update counts nothing either way."""
    from torch.utils.data import DataLoader, TensorDataset

    from compiled_psg._compile import run as run_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    data = TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
    private = psg.make_private(model, torch.optim.SGD(model.parameters(), lr=0.5), DataLoader(data, batch_size=16),
                               lambda x, y: F.cross_entropy(model(x), y), noise_multiplier=1.0, backend="eager",
                               transactional=transactional)
    x, y = data[:16]
    with pytest.raises(psg.BatchInputError):
        private.step(x, y[:15])  # refused before anything ran
    assert private.steps == 0
    before = [p.detach().clone() for p in model.parameters()]

    def failing_prepare(self, *args, **kwargs):
        raise psg.CompileError("simulated: Inductor failed on the step program")

    monkeypatch.setattr(run_module.CompiledGraph, "prepare", failing_prepare)
    with pytest.raises(psg.CompileError, match="simulated"):
        private.step(x, y)
    moved = any(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert moved is not transactional
    assert private.accountant.history == ([] if transactional else [(1.0, 0.25, 1)])


class _WithClassmethod(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    @classmethod
    def scale(cls):
        return 2.0

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)) * self.scale())


def test_a_classmethod_replaced_after_the_capture_recaptures(monkeypatch):
    """global_guards skipped classmethods (a new bound method on every read): the old graph ran, err 0.23."""
    torch.manual_seed(0)
    m = _WithClassmethod().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))

    def loss(x, y):
        return F.cross_entropy(m(x), y)

    fn = psg.per_sample(m, backend="eager")(loss)
    fn(x, y)
    fn(x, y)
    assert fn.captures == 1  # an unchanged classmethod does not recapture
    monkeypatch.setattr(_WithClassmethod, "scale", classmethod(lambda cls: 3.0))
    got = fn(x, y)
    assert fn.captures == 2
    ref = reference_per_sample(loss, dict(m.named_parameters()), (x, y))
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-10, atol=1e-12)


def test_make_private_refuses_a_loader_without_length_and_a_delta_outside_0_1_in_our_words():
    """An IterableDataset gave a raw TypeError (len()); target_delta=0 a raw NoBracketIntervalFoundError from
    dp-accounting's calibration."""
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter([(torch.randn(4), 0)] * 8)

    m, _, _ = _mlp_and_batch()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def loss(x, y):
        return F.cross_entropy(m(x), y)

    with pytest.raises(psg.DPConfigError, match="dataset with a length"):
        psg.make_private(m, opt, DataLoader(Stream(), batch_size=4), loss, noise_multiplier=1.0, backend="eager")
    data = DataLoader(TensorDataset(torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))), batch_size=4)
    for delta in (0.0, 1.0):
        with pytest.raises(psg.DPConfigError, match=r"delta must be a number in \(0, 1\)"):
            psg.make_private(m, opt, data, loss, target_epsilon=1.0, target_delta=delta, epochs=1, backend="eager")
    private = psg.make_private(m, opt, data, loss, noise_multiplier=1.0, backend="eager")
    with pytest.raises(psg.DPConfigError, match="delta must be"):
        private.epsilon(0.0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_multilabel_margin_loss_with_fewer_targets_than_classes_is_exact(reduction, backend):
    """torch 2.13's traced decomposition of ``multilabel_margin_loss_forward`` counted class 0 once more per target
    slot after the first -1 (silently wrong losses and gradients; ``torch.compile`` too). The capture traces a
    corrected one (``_capture/corrected_decompositions.py``) and puts torch's back."""
    from torch._C import DispatchKey

    from compiled_psg._capture.corrected_decompositions import CORRECTED

    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    targets = torch.tensor([[0, 2, -1], [1, -1, 0], [2, 1, 0], [-1, 0, 1], [1, -1, -1]])
    op = torch.ops.aten.multilabel_margin_loss_forward.default
    before = op.py_kernels.get(DispatchKey.Autograd)

    def loss(x, t):
        return F.multilabel_margin_loss(model(x), t, reduction=reduction)

    per_sample = psg.per_sample(model, backend=backend)(loss)
    got_loss, got_losses, got = per_sample.with_losses(x, targets)
    want = reference_per_sample(loss, dict(model.named_parameters()), (x, targets))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_loss, loss(x, targets).detach(), rtol=1e-12, atol=1e-12)
    eager_losses = torch.stack([loss(x[i:i + 1], targets[i:i + 1]).sum() for i in range(5)]).detach()
    torch.testing.assert_close(got_losses.reshape(-1), eager_losses, rtol=1e-12, atol=1e-12)
    assert op.py_kernels.get(DispatchKey.Autograd) is before  # torch's own kernel is back
    # the corrected decomposition matches the eager kernel, targets with and without a -1
    logits = torch.randn(6, 5, dtype=torch.float64)
    for t in (torch.randint(-1, 5, (6, 5)), torch.randint(0, 5, (6, 5))):
        for r in (0, 1, 2):
            for mine, theirs in zip(CORRECTED[op](logits, t, r), op(logits, t, r), strict=True):  # the C++ kernel
                torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_attention_with_kdim_vdim_a_key_padding_mask_and_its_weights_is_exact():
    """The retrace of the gradient failed ("SymIntArrayRef expected to contain only concrete integers": baddbmm's
    meta expands the mask to symbolic sizes) until it traced with the Python dispatcher, as AOT autograd does."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, batch_first=True, kdim=5, vdim=6).double()
    head = nn.Linear(8, 3).double()
    model = nn.ModuleDict({"attention": attention, "head": head})
    q, k, v = (torch.randn(4, n, d, dtype=torch.float64) for n, d in ((7, 8), (4, 5), (4, 6)))
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[1, 2:] = True
    y = torch.tensor([0, 2, 1, 2])

    def loss(q, k, v, mask, y):
        out, weights = attention(q, k, v, key_padding_mask=mask)
        return F.cross_entropy(head(out.mean(1)), y) + weights.pow(2).sum()

    got = psg.per_sample(model, backend="eager")(loss)(q, k, v, mask, y)
    want = reference_per_sample(loss, dict(model.named_parameters()), (q, k, v, mask, y))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)


def test_assigning_an_inputs_data_in_the_loss_is_refused_with_the_cause_and_the_fix():
    """AOT autograd's "set_ on a graph input" came out as "BackendCompilerFailed: backend='_backend' raised:" and
    "this is a compiled_psg bug"; the input is left as it was."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    given = x.clone()

    def loss(x, y):
        x.data = x.data * 2
        return F.cross_entropy(m(x), y)

    with pytest.raises(psg.CaptureError, match=r"set_ on a graph input.*instead of assigning x\.data") as info:
        psg.per_sample(m, backend="eager")(loss)(x, y)
    assert "compiled_psg bug" not in str(info.value)
    assert torch.equal(x, given)


def test_each_reduction_of_an_empty_batch_is_torchs_over_zero_samples():
    """Round M2: ``psg.variance()`` of an empty batch was 0; a mean over no samples is NaN
    (``torch.zeros(0, 2, 3).var(0, unbiased=False)``)."""
    model = nn.Linear(3, 2)
    x0, y0 = torch.randn(0, 3), torch.randint(0, 2, (0,))
    g = {n: torch.zeros(0, *p.shape) for n, p in model.named_parameters()}  # the per-sample gradients of no samples
    flat = torch.cat([v.flatten(1) for v in g.values()], 1)
    expected = {"norms": flat.norm(dim=1), "sum_squares": {n: v.pow(2).sum(0) for n, v in g.items()},
                "variance": {n: v.mean(0) for n, v in g.items()}, "gram": flat @ flat.T,  # mean: var's, unwarned
                "clip_sum": {n: v.sum(0) for n, v in g.items()}}
    reductions = {"norms": psg.norms(), "sum_squares": psg.sum_squares(), "variance": psg.variance(),
                  "gram": psg.gram(), "clip_sum": psg.clip_sum(1.0)}
    for name, reduction in reductions.items():
        got = psg.per_sample(model, reduce=reduction, backend="eager")(lambda x, y: F.cross_entropy(model(x), y))(
            x0, y0)
        torch.testing.assert_close(got, expected[name], equal_nan=True, msg=name)
    assert all(v.isnan().all() for v in expected["variance"].values())


def test_an_empty_batch_is_checked_against_the_loss_and_its_loss_is_the_functions():
    """A batch of zero samples returned empty gradients whatever its shapes (features of the wrong width, float
    labels: what a batch of any other size is refused for), and the loss 0.0 where the function's loss of no
    samples is NaN (a mean; 0 for a sum). Now the empty batch is checked as any batch is, and the loss is the
    function's: per_sample, per_sample_grad and a DP step (whose empty batch is a step of noise alone) alike."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    mean = lambda x, y: F.cross_entropy(model(x), y)
    total = lambda x, y: F.cross_entropy(model(x), y, reduction="sum")
    x0, y0 = torch.randn(0, 3), torch.randint(0, 2, (0,))
    for bad in ((torch.randn(0, 5), y0), (x0, torch.zeros(0))):
        with pytest.raises(psg.BatchInputError, match=r"the loss fails on this batch(.|\n)*The batch is empty"):
            psg.per_sample(model)(mean)(*bad)
        # torch 2.15's Dynamo reports the failing op of functional_call as the loss's own raise
        with pytest.raises(psg.BatchInputError, match=r"(the loss fails on this batch|the loss function raised "
                                                      r"RuntimeError)(.|\n)*The batch is empty"):
            psg.per_sample_grad(lambda p, x, y: F.cross_entropy(torch.func.functional_call(model, p, (x,)), y))(
                dict(model.named_parameters()), *bad)
    for loss_fn in (mean, total):
        fn = psg.per_sample(model)(loss_fn)
        loss, losses, grads = fn.with_losses(x0, y0)
        expected = loss_fn(x0, y0)  # NaN for the mean, 0 for the sum
        assert torch.equal(loss.isnan(), expected.isnan()) and (expected.isnan() or loss == expected)
        assert losses.shape == (0,) and {n: g.shape for n, g in grads.items()} == {"weight": (0, 2, 3), "bias": (0, 2)}
        fn(torch.randn(4, 3), torch.randint(0, 2, (4,)))
        assert fn.captures == 1  # the empty batch's capture serves every batch size
    step = psg.compile_step(mean, model, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0,
                            noise_multiplier=1.0, expected_batch_size=4)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(psg.BatchInputError, match="The batch is empty"):
        step(torch.randn(0, 5), y0)
    assert step.steps_taken == 0 and all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert step(x0, y0).isnan() and step.steps_taken == 1  # a step of noise alone; its loss is the function's
    assert not all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
