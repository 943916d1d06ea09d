"""A loss that branches on the batch size: each sample's gradient is that of a batch of one, which may take the
other branch. Dynamo assumes a dynamic size is at least 2 and records no guard for a comparison with 1, so these
were silent wrong answers; now each is exact (the batch size stays a value and reads 1 per sample) or refused."""

import math

import pytest
import torch
import torch.nn as nn
from reference import reference_per_sample

import compiled_psg as psg


def _model():
    torch.manual_seed(0)
    return nn.Linear(3, 2).double()


def _branches(m):
    def if_equal_one(x):
        loss = m(x).pow(2).sum()
        if x.shape[0] == 1:
            return 2 * loss
        return loss

    def if_len_greater_than_one(x):
        return m(x).pow(2).sum() if len(x) > 1 else m(x).abs().sum()

    def if_size_not_one(x):
        out = m(x)
        if x.size(0) != 1:
            out = out.tanh()
        return out.pow(2).sum()

    def numel_comparison(x):
        return m(x).pow(2).sum() * (3.0 if x.numel() == 3 else 1.0)

    def int_of_comparison(x):  # int() makes the comparison a constant: a decision, not a value
        return m(x).pow(2).sum() * int(x.shape[0] > 1)

    def shape_tuple_equality(x):
        return m(x).pow(2).sum() * (2.0 if x.shape == (1, 3) else 1.0)

    def truth_of_a_difference(x):  # Dynamo tests `n - 1 != 0` itself, not through a Python bool
        return m(x).pow(2).sum() if len(x) - 1 else m(x).abs().sum()

    def one_in_shape(x):  # Dynamo compared the constant with constant items only
        return m(x).pow(2).sum() * (2.0 if 1 in x.shape else 1.0)

    def assert_two_samples(x):  # the loop raises on a sample alone: refused, not a number
        assert len(x) > 1, "needs two samples"
        return m(x).pow(2).sum()

    def while_on_batch_size(x):
        loss, k = m(x).pow(2).sum(), len(x) - 1
        while k:
            loss, k = loss * 1.5, 0
        return loss

    return [if_equal_one, if_len_greater_than_one, if_size_not_one, numel_comparison,
            int_of_comparison, shape_tuple_equality, truth_of_a_difference, one_in_shape, assert_two_samples,
            while_on_batch_size]


def _values(m):
    """The batch size as a value, not in control flow: it stays symbolic and reads 1 per sample."""
    def times_comparison(x):
        return m(x).pow(2).sum() * (x.shape[0] > 1)

    def times_float_comparison(x):
        return m(x).pow(2).sum() * float(len(x) > 1)

    def sqrt_of_batch_size(x):
        return m(x).pow(2).sum() / math.sqrt(x.shape[0])

    def min_with_one(x):
        return m(x).pow(2).sum() * min(x.shape[0] - 1, 1)

    def mean_then_times_batch(x):
        return m(x).pow(2).mean() * len(x)

    return [times_comparison, times_float_comparison, sqrt_of_batch_size, min_with_one, mean_then_times_batch]


@pytest.mark.parametrize("index", range(10), ids=[f.__name__ for f in _branches(None)])
def test_branch_that_a_batch_of_one_takes_the_other_way_is_refused(index):
    m = _model()
    loss = _branches(m)[index]
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(psg.CaptureError, match="batch of one takes the other branch") as info:
        psg.per_sample(m, backend="eager")(loss)(x)
    assert "test_batch_size_branches.py" in str(info.value), "the message names the user's line"
    assert "Fix:" in str(info.value)


@pytest.mark.parametrize("index", range(5), ids=[f.__name__ for f in _values(None)])
def test_batch_size_as_a_value_reads_one_per_sample(index):
    m = _model()
    loss = _values(m)[index]
    x = torch.randn(4, 3, dtype=torch.float64)
    try:
        got = psg.per_sample(m, backend="eager")(loss)(x)
    except psg.PerSampleError as e:  # refused is sound too, but it must not be a wrong answer
        pytest.fail(f"refused a loss that only uses the batch size as a value: {e}")
    ref = reference_per_sample(loss, dict(m.named_parameters()), (x,))
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-10, atol=1e-12)


def test_the_batch_size_turned_into_a_python_number_is_named_as_such_and_its_fix_is_exact():
    """``math.log(x.shape[0] + 1)`` makes Dynamo specialize the batch size (``math.sqrt`` stays symbolic): a
    number, not a branch, which the message said. The fix it gives keeps the value in the graph and is exact."""
    m = _model()
    x = torch.randn(4, 3, dtype=torch.float64)

    def loss(x):
        return m(x).pow(2).sum() * math.log(x.shape[0] + 1)

    with pytest.raises(psg.CaptureError, match=r"turns the batch size into a Python number.*5 for this batch but "
                                               r"2 for a batch of one.*test_batch_size_branches.py.*Fix: "):
        psg.per_sample(m, backend="eager")(loss)(x)

    def fixed(x):
        return m(x).pow(2).sum() * torch.log(x.new_ones(()) * (x.shape[0] + 1))

    got = psg.per_sample(m, backend="eager")(fixed)(x)
    for name, g in reference_per_sample(fixed, dict(m.named_parameters()), (x,)).items():
        torch.testing.assert_close(got[name], g, rtol=1e-10, atol=1e-12)


def test_branch_on_a_size_other_than_the_batch_is_accepted():
    """Only the batch size is symbolic: branches on feature sizes are constants and stay exact."""
    m = _model()

    def loss(x):
        out = m(x)
        return out.pow(2).sum() if x.shape[1] == 3 else out.sum()

    x = torch.randn(4, 3, dtype=torch.float64)
    got = psg.per_sample(m, backend="eager")(loss)(x)
    ref = reference_per_sample(loss, dict(m.named_parameters()), (x,))
    torch.testing.assert_close(got["weight"], ref["weight"], rtol=1e-10, atol=1e-12)


def test_a_branch_on_the_batch_size_equal_to_another_size_is_named_at_the_batch_that_fixes_it():
    """``x.shape[0] == x.shape[1]`` is False for a batch of one and for most batches, which are exact; a batch as
    large as the other dimension takes the branch and fixes the batch size: the refusal names the branch, not a
    reshape to a fixed size."""
    m = _model()

    def loss(x):
        out = m(x).pow(2).sum()
        if x.shape[0] == x.shape[1]:
            out = 2 * out
        return out

    fn = psg.per_sample(m, backend="eager")(loss)
    x = torch.randn(4, 3, 3, dtype=torch.float64)
    ref = reference_per_sample(loss, dict(m.named_parameters()), (x,))
    torch.testing.assert_close(fn(x)["weight"], ref["weight"], rtol=1e-10, atol=1e-12)
    with pytest.raises(psg.CaptureError, match="batch of one takes the other branch") as info:
        fn(torch.randn(3, 3, 3, dtype=torch.float64))
    assert "x.shape[0] == x.shape[1]" in str(info.value) and "view" not in str(info.value)


@pytest.mark.parametrize("squeeze", [lambda h: h.squeeze(0), lambda h: torch.squeeze(h, (0,)),
                                     lambda h: h.T.squeeze(1).T, lambda h: h.squeeze_(0)],
                         ids=["squeeze_0", "squeeze_dims", "squeeze_after_transpose", "squeeze_in_place"])
def test_squeezing_the_batch_dimension_is_refused(squeeze):
    """A no-op for the batch; for a batch of one it drops the batch dimension (a logsumexp over samples then
    becomes one over features)."""
    m = _model()
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(psg.UnsupportedError, match="squeeze") as info:
        psg.per_sample(m, backend="eager")(lambda x: squeeze(m(x)).logsumexp(0).sum())(x)
    assert "test_batch_size_branches.py" in str(info.value)
