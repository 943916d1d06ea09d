"""The mixing analysis is an allow-list: every program is exact or refused.

Each adversarial program of issue 10 is refused with ``SampleMixingError`` (or ``UnsupportedError`` for an op
of unknown batch semantics), naming the op and this file's line. Programs that keep samples apart in ways the
analysis must prove (indexing with ``arange(n)``, gathering within a sample, concatenating along the batch) stay
exact against the naive loop. ``test_mixing_property.py`` generates programs at random.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import ref_clip_sum, reference_per_sample

import compiled_psg as psg
from compiled_psg._compat import reconnects_inner_gradients

THIS = Path(__file__)
F64 = torch.float64
B, D, C = 4, 5, 3
TOL = dict(rtol=1e-9, atol=1e-10)


def line_of(marker: str) -> int:
    hits = [i + 1 for i, text in enumerate(THIS.read_text().splitlines()) if text.rstrip().endswith(f"# <{marker}>")]
    assert len(hits) == 1, f"marker {marker!r} found on lines {hits}"
    return hits[0]


def setup(seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(D, C).double()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g, dtype=F64)
    y = torch.randint(0, C, (B,), generator=g)
    return lin, x, y


# --------------------------------------------------------------- refused: the examples of issue 10 and more


def mixup(lin, x, y):
    mixed = 0.7 * x + 0.3 * x[torch.randperm(x.shape[0])]  # <mixup>
    return F.cross_entropy(lin(mixed), y)


def shift_by_index(lin, x, y):
    n = x.shape[0]
    shifted = x[(torch.arange(n) + 1) % n]  # <shift_index>
    return F.cross_entropy(lin(x + shifted), y)


def index_add_batched(lin, x, y, idx):
    moved = torch.zeros_like(x).index_add(0, idx, x)  # <index_add>
    return F.cross_entropy(lin(moved), y)


def scatter_batched(lin, x, y, idx):
    moved = torch.zeros_like(x).scatter(0, idx.unsqueeze(1).expand(-1, x.shape[1]), x)  # <scatter>
    return F.cross_entropy(lin(moved), y)


def conv_over_batch(lin, x, y, conv):
    h = conv(x.t().unsqueeze(0))  # <conv_batch>
    return F.cross_entropy(lin(x + h[0].t()), y)


def view_halves(lin, x, y):
    h = x.view(2, -1, x.shape[1])  # <halves>
    swapped = torch.cat([h[1], h[0]], 0)
    return F.cross_entropy(lin(swapped), y)


def finite_difference(lin, x, y):
    h = lin(x)
    diff = h[1:] - h[:-1]  # <difference>
    return diff.pow(2).sum() + F.cross_entropy(h, y)


def reinterpret_view(lin, x, y):
    h = x.t().flatten().view(x.shape[0], -1)  # <reinterpret>
    return F.cross_entropy(lin(h), y)


def roll_batch(lin, x, y):
    return F.cross_entropy(lin(torch.roll(x, 1, 0)), y)  # <roll>


def flip_batch(lin, x, y):
    return F.cross_entropy(lin(x + x.flip(0)), y)  # <flip>


def cumsum_batch(lin, x, y):
    return F.cross_entropy(lin(x.cumsum(0)), y)  # <cumsum>


def sort_batch(lin, x, y):
    return F.cross_entropy(lin(x.sort(0).values), y)  # <sort>


def gram_batch(lin, x, y):
    return F.cross_entropy(lin(x @ x.T @ x), y)  # <gram>


def mean_back(lin, x, y):
    return F.cross_entropy(lin(x - x.mean(0, keepdim=True)), y)  # <center>


def first_sample(lin, x, y):
    return F.cross_entropy(lin(x + x[0]), y)  # <first>


def cat_rotate(lin, x, y):
    rotated = torch.cat([x[1:], x[:1]], 0)  # <rotate>
    return F.cross_entropy(lin(rotated), y)


def index_select_batch(lin, x, y, idx):
    return F.cross_entropy(lin(x.index_select(0, idx)), y)  # <index_select>


def gather_batch(lin, x, y, idx):
    picked = x.gather(0, idx.unsqueeze(1).expand(-1, x.shape[1]))  # <gather0>
    return F.cross_entropy(lin(picked), y)


def pairs_index(lin, x, y, idx):
    h = x[:, idx % D]  # <pairs_index>
    return F.cross_entropy(lin(x) + h.sum(1, keepdim=True), y)


def item_back(lin, x, y):
    scale = x.abs().max()  # <item_max>
    return F.cross_entropy(lin(x / scale), y)


def masked_scatter_rows(lin, x, y):
    h = lin(x)
    placed = torch.zeros_like(h).masked_scatter(h > 0, h)  # <masked_scatter>
    return F.cross_entropy(placed, y)


def rot90_over_batch(lin, x, y):
    return F.cross_entropy(lin(torch.rot90(x, 2, (0, 1))), y)  # <rot90>


def put_flat(lin, x, y):
    h = lin(x).put(torch.tensor([0, 5]), torch.tensor([1.0, 2.0], dtype=x.dtype))  # <put>
    return F.cross_entropy(h, y)


def take_flat(lin, x, y):
    h = lin(x)
    return F.cross_entropy(h, y) + torch.take(h, torch.tensor([0, 5, 9])).sum()  # <take>


def index_fill_first_position(lin, x, y):
    h = lin(x)  # fills sample 0 alone: in a batch of its own, every sample is at position 0 and would be filled
    return F.cross_entropy(h.index_fill(0, torch.tensor([0]), 0.5), y)  # <index_fill_first>


def write_rows_of_other_samples(lin, x, y):
    h = torch.zeros(x.shape[0], C, dtype=x.dtype)  # row y[i], not i: each sample's value lands in another's row
    h[y, 0] = lin(x)[:, 0]  # <index_put_rows>
    return F.cross_entropy(lin(x) + h, y)


def write_then_combine_other_layout(lin, x, y):
    steps = torch.stack([lin(x), 2 * lin(x)], 1)  # [n, 2, c]
    h = torch.zeros(2 * x.shape[0], C, dtype=x.dtype)  # the same for every sample until written
    h[:, torch.tensor([0, 1, 2])] = steps.transpose(0, 1).flatten(0, 1)  # rows step-major: (step, sample)
    return F.cross_entropy(lin(x), y) + (h * steps.flatten(0, 1)).sum()  # <index_put_layout>


def channel_shuffle_across_blocks(lin, x, y):
    z = torch.cat([lin(x), 2 * lin(x)], 0).t().unsqueeze(-1)  # [c, 2n, 1]: the samples in channel blocks
    return F.cross_entropy(lin(x), y) + (F.channel_shuffle(z, 2) * z).sum()  # <channel_shuffle>


def cosine_between_layouts(lin, x, y):
    steps = torch.stack([lin(x), lin(x).tanh()], 1)  # [n, 2, c]; row k of one flattening is another sample's below
    sample_major, step_major = steps.flatten(0, 1), steps.transpose(0, 1).flatten(0, 1)
    ones = torch.ones(2 * x.shape[0], dtype=x.dtype)
    return F.cosine_embedding_loss(sample_major, step_major, ones)  # <cosine_layouts>


def solve_with_batch_statistics(lin, x, y):
    h = lin(x)
    m = torch.eye(C, dtype=x.dtype) + h.t() @ h  # a matrix summed over the batch
    return F.cross_entropy(torch.linalg.solve(m, h.t()).t(), y)  # <solve_pooled>


def positions_through_bfloat16(lin, x, y):
    rows = torch.arange(x.shape[0]).to(torch.bfloat16).long()  # <bf16_positions>
    return F.cross_entropy(lin(x)[rows], y)  # bfloat16 rounds 257 to 256: sample 257 would read sample 256's row


def step_major_rows_times_tiled_weights(lin, x, y):
    rows = torch.stack([lin(x), lin(x).tanh()], 0).flatten(0, 1)  # [2n, c], step-major: row t*n + b
    w = torch.tensor([1.0, 3.0], dtype=x.dtype)  # row k reads w[k % 2]: sample b reads w[b % 2] at step 0
    return (rows.pow(2).sum(1) * w.repeat(x.shape[0])).sum()  # <tiled_weights>


def step_major_rows_to_a_tiled_target(lin, x, y):
    rows = torch.stack([lin(x), lin(x).tanh()], 0).flatten(0, 1)
    target = torch.arange(2.0 * C, dtype=x.dtype).view(2, C)
    return F.mse_loss(rows, target.repeat(x.shape[0], 1))  # <tiled_target>


def slice_off_by_one_in_blocks(lin, x, y):
    both = lin(torch.cat([x, 2 * x]))
    return F.cross_entropy(both[1:x.shape[0] + 1], y)  # <block_off_by_one>


def slice_across_two_blocks(lin, x, y):
    both = lin(torch.cat([x, 2 * x]))
    n = x.shape[0]
    return F.cross_entropy(both[n // 2:n // 2 + n], y)  # <block_across>


def slice_half_of_interleaved_rows(lin, x, y):
    rows = torch.stack([lin(x), lin(x).tanh()], 1).flatten(0, 1)  # [2n, c], batch-major: row 2b + t
    return F.cross_entropy(rows[x.shape[0]:], y)  # <interleaved_half>


def two_rows_of_values_broadcast_over_the_batch(lin, x, y):
    ids = torch.arange(C).unsqueeze(0).expand(x.shape[0], -1)  # the same [c] for every sample
    return F.cross_entropy(lin(x)[:, ids[:2].sum(0) % C], y)  # <broadcast_two_rows>


def one_row_of_a_parameter_broadcast_by_arithmetic(lin, x, y):
    """Every row alike, but broadcast by a product, not an ``expand``: a gradient flows back through the row kept,
    and autograd gives it every sample's share."""
    rows = lin.weight * torch.ones(x.shape[0], 1, 1, dtype=x.dtype)
    prompt = rows[:1].repeat(x.shape[0], 1, 1)  # <broadcast_parameter_row>
    return F.cross_entropy(lin(torch.cat([prompt, x.unsqueeze(1)], 1).tanh().sum(1)), y)


def first_sample_broadcast_and_flipped(lin, x, y):
    """``x[:1]`` broadcast over the batch holds sample 0 in every row: flipping or slicing the broadcast does not
    make it each sample's own."""
    first = x[:1].expand(x.shape[0], -1).flip(0)[-1:]  # <broadcast_first_sample>
    return F.cross_entropy(lin(x * first), y)


REFUSED = {  # name -> (program, extra batched args, marker)
    "mixup_randperm": (mixup, (), "mixup"),
    "shift_by_arange_index": (shift_by_index, (), "shift_index"),
    "index_add_batched_index": (index_add_batched, ("idx",), "index_add"),
    "scatter_batched_index": (scatter_batched, ("idx",), "scatter"),
    "conv_over_batch_axis": (conv_over_batch, ("conv",), "conv_batch"),
    "view_halves_swapped": (view_halves, (), "halves"),
    "finite_difference_over_batch": (finite_difference, (), "difference"),
    "reinterpreting_view": (reinterpret_view, (), "reinterpret"),
    "roll_over_batch": (roll_batch, (), "roll"),
    "flip_over_batch": (flip_batch, (), "flip"),
    "cumsum_over_batch": (cumsum_batch, (), "cumsum"),
    "sort_over_batch": (sort_batch, (), "sort"),
    "gram_over_batch": (gram_batch, (), "gram"),
    "center_by_batch_mean": (mean_back, (), "center"),
    "add_first_sample": (first_sample, (), "first"),
    "cat_rotated_batch": (cat_rotate, (), "rotate"),
    "index_select_over_batch": (index_select_batch, ("idx",), "index_select"),
    "gather_over_batch": (gather_batch, ("idx",), "gather0"),
    "per_sample_index_into_features": (pairs_index, ("idx",), "pairs_index"),
    "batch_max_flows_back": (item_back, (), "item_max"),
    "masked_scatter_in_flat_order": (masked_scatter_rows, (), "masked_scatter"),
    "take_in_flat_order": (take_flat, (), "take"),
    "put_in_flat_order": (put_flat, (), "put"),
    "rot90_over_batch": (rot90_over_batch, (), "rot90"),
    "index_fill_of_batch_positions": (index_fill_first_position, (), "index_fill_first"),
    "index_put_into_other_samples_rows": (write_rows_of_other_samples, (), "index_put_rows"),
    "index_put_then_combined_with_another_layout": (write_then_combine_other_layout, (), "index_put_layout"),
    "channel_shuffle_of_the_batch": (channel_shuffle_across_blocks, (), "channel_shuffle"),
    "cosine_between_sample_and_step_major_rows": (cosine_between_layouts, (), "cosine_layouts"),
    "solve_with_a_matrix_of_the_batch": (solve_with_batch_statistics, (), "solve_pooled"),
    "batch_positions_rounded_in_bfloat16": (positions_through_bfloat16, (), "bf16_positions"),
    "step_major_rows_times_weights_tiled_per_sample": (step_major_rows_times_tiled_weights, (), "tiled_weights"),
    "step_major_rows_against_a_target_tiled_per_sample": (step_major_rows_to_a_tiled_target, (), "tiled_target"),
    "slice_of_a_cat_off_by_one_row": (slice_off_by_one_in_blocks, (), "block_off_by_one"),
    "slice_of_a_cat_across_two_blocks": (slice_across_two_blocks, (), "block_across"),
    "slice_of_interleaved_rows_keeps_half_of_each_sample": (slice_half_of_interleaved_rows, (), "interleaved_half"),
    "two_rows_of_values_broadcast_over_the_batch": (two_rows_of_values_broadcast_over_the_batch, (),
                                                    "broadcast_two_rows"),
    "one_row_of_a_parameter_broadcast_by_arithmetic": (one_row_of_a_parameter_broadcast_by_arithmetic, (),
                                                       "broadcast_parameter_row"),
    "first_sample_broadcast_then_flipped_and_sliced": (first_sample_broadcast_and_flipped, (),
                                                       "broadcast_first_sample"),
}


def _call(program, extras, backend="eager"):
    lin, x, y = setup()
    idx = torch.tensor([1, 2, 3, 0])
    conv = nn.Conv1d(D, D, 3, padding=1).double()
    values = {"idx": idx, "conv": conv}
    extra = tuple(values[e] for e in extras)
    batched_extra = tuple(e == "idx" for e in extras)
    in_dims = (0, 0) + tuple(0 if b else None for b in batched_extra)
    params = nn.ModuleDict({"lin": lin, "conv": conv})
    fn = psg.per_sample(params, in_dims=in_dims, backend=backend)(lambda x, y, *e: program(lin, x, y, *e))
    return fn, (x, y, *extra)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused(name):
    program, extras, marker = REFUSED[name]
    fn, args = _call(program, extras)
    with pytest.raises(psg.SampleMixingError) as info:
        fn(*args)
    message = str(info.value)
    line = line_of(marker)
    assert re.search(rf"{re.escape(THIS.name)}\D{{1,12}}{line}\b", message), (
        f"{name}: the refusal should name {THIS.name}:{line}:\n{message}")
    assert "Fix:" in message


def test_refusal_changes_nothing():
    """A refused capture leaves the module's parameters and the caller's tensors as they were."""
    program, extras, _ = REFUSED["mixup_randperm"]
    fn, args = _call(program, extras)
    before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    with pytest.raises(psg.SampleMixingError):
        fn(*args)
    for a, b in zip([a for a in args if isinstance(a, torch.Tensor)], before, strict=True):
        assert torch.equal(a, b)


# --------------------------------------------------------------- accepted: exact against the naive loop


def pick_own_target(lin, x, y):
    logp = F.log_softmax(lin(x), 1)
    return -logp[torch.arange(x.shape[0]), y].mean()


def gather_within_sample(lin, x, y):
    logp = F.log_softmax(lin(x), 1)
    return -logp.gather(1, y.unsqueeze(1)).sum()


def shared_feature_index(lin, x, y):
    perm = torch.tensor([4, 2, 0, 1, 3])
    return F.cross_entropy(lin(x[:, perm] * 0.5 + x), y)


def cat_batch_twice(lin, x, y):
    both = torch.cat([x, 2 * x], 0)
    return F.cross_entropy(lin(both), torch.cat([y, y]))


def repeat_along_batch(lin, x, y):
    """``x.repeat(3, 1)`` tiles the batch as ``torch.cat([x, x, x])`` does: three blocks of the samples."""
    return F.cross_entropy(lin(x.repeat(3, 1)), y.repeat(3))


def tiled_batch_sliced_across_features(lin, x, y):
    """Tiled along both dimensions, then sliced along the features (and whole along the batch)."""
    return lin(x.repeat(2, 2)[:, :D]).pow(2).sum()


def stack_and_mean(lin, x, y):
    h = torch.stack([lin(x), lin(x.flip(1))], 1)  # [n, 2, c]
    return F.cross_entropy(h.mean(1), y)


def cumsum_features(lin, x, y):
    return F.cross_entropy(lin(x.cumsum(1)), y) + lin(x).softmax(1).pow(2).sum()


def reshape_per_sample(lin, x, y):
    z = torch.cat([x, x], 1).view(x.shape[0], 2, D).transpose(1, 2).reshape(x.shape[0], -1)
    return F.cross_entropy(lin(z[:, :D] + z[:, D:]), y)


def masked_write(lin, x, y):
    h = x.clone()
    h[:, 0] = 0.0
    h[torch.arange(x.shape[0]), 1] = 2.0
    return F.cross_entropy(lin(h), y)


def index_fill_own_positions(lin, x, y):
    """Each sample fills its own position along the batch (torch 2.15 traces ``masked_write``'s second line so)."""
    h = lin(x)
    return F.cross_entropy(h.index_fill(0, torch.arange(x.shape[0]), 0.5) + h, y)


def write_own_rows(lin, x, y):
    """``h[arange(n), y] = v`` (and ``+=``) with ``v`` computed from the parameters, into ``torch.zeros(n, c)``:
    each sample writes its own row."""
    n = x.shape[0]
    h = torch.zeros(n, C, dtype=x.dtype)
    h[torch.arange(n), y] = lin(x)[:, 0]
    h[torch.arange(n)[:, None], (y.unsqueeze(1) + 1) % C] += lin(x)[:, 1:2].exp()
    return F.cross_entropy(lin(x) * h, y)


def accumulate_into_own_rows(lin, x, y):
    """``zeros(n, c).index_put((arange(n)[:, None], idx), v, accumulate=True)``, repeated columns in a row."""
    n = x.shape[0]
    idx = torch.stack([y, y, (y + 1) % C], 1)
    out = torch.zeros(n, C, dtype=x.dtype).index_put((torch.arange(n)[:, None], idx), lin(x), accumulate=True)
    return out.pow(2).sum() + F.cross_entropy(out, y)


def channel_shuffle_within_sample(lin, x, y):
    """``channel_shuffle`` permutes each sample's channels; the parameters' gradient flows back through it."""
    h = lin(x)
    z = torch.cat([h, h.tanh()], 1).unsqueeze(-1)  # [n, 2c, 1]
    return (F.channel_shuffle(z, 2).squeeze(-1) * torch.arange(1.0, 2 * C + 1, dtype=x.dtype)).pow(2).sum()


def cosine_embedding_over_steps(lin, x, y):
    """A loss over ``[n*t, ...]`` rows (``flatten(0, 1)``) that reduces each row before the mean: the loss head
    finds the samples through the reductions over the features."""
    a = torch.stack([lin(x), lin(x).tanh()], 1).flatten(0, 1)  # [2n, c]
    b = torch.stack([lin(x).flip(1), x[:, :C]], 1).flatten(0, 1)
    target = torch.tensor([1.0, -1.0], dtype=x.dtype).repeat(x.shape[0])
    return F.cosine_embedding_loss(a, b, target, margin=-0.5)


def multilabel_margin_over_steps(lin, x, y):
    out = torch.stack([lin(x), -lin(x).sin()], 1).flatten(0, 1)  # [2n, c]
    none = torch.full_like(y, -1)
    labels = torch.stack([torch.stack([y, none, none], 1), torch.stack([(y + 1) % C, y, none], 1)], 1)
    return F.multilabel_margin_loss(out, labels.flatten(0, 1))


def solve_with_samples_as_columns(lin, x, y):
    """``solve(m, h.t())`` with a shared matrix made from the parameters: each column, a sample, is solved on its
    own; so are the rows of ``X m = h`` (``left=False``) and the columns of a triangular solve."""
    m = lin.weight[:, :C] + 3 * torch.eye(C, dtype=x.dtype)
    h = lin(x)  # [n, c]
    columns = torch.linalg.solve(m, h.t()).t()
    rows = torch.linalg.solve(m, h.tanh(), left=False)
    triangular = torch.linalg.solve_triangular(m, h.t(), upper=True).t()
    return F.cross_entropy(columns + rows, y) + triangular.pow(2).sum()


def batch_size_scalar(lin, x, y):
    return F.cross_entropy(lin(x), y, reduction="sum") / x.shape[0] + lin(x).sum() * (1.0 / x.shape[0])


def batch_size_tensor(lin, x, y):
    """The batch size as a tensor inside the network reads 1 per sample, as the Python number does."""
    n = torch.full((D,), x.shape[0], dtype=x.dtype)
    return F.cross_entropy(lin(x * n), y)


def roll_batch_by_zero(lin, x, y):
    """A shift of 0 along the batch (with 2 along the features), and of 0 over the flattened tensor."""
    return F.cross_entropy(lin(torch.roll(x, (0, 2), (0, 1)) + torch.roll(x, 0)), y)


def rot90_whole_turns(lin, x, y):
    """Four quarter turns either way over the batch and the features: the tensor as it was."""
    return F.cross_entropy(lin(torch.rot90(x, 4, (0, 1)) + torch.rot90(x, -8, (1, 0))), y)


def put_nothing(lin, x, y):
    """``put`` with an empty index places nothing, in any order."""
    none = torch.tensor([], dtype=torch.long)
    return F.cross_entropy(lin(x).put(none, torch.tensor([], dtype=x.dtype), accumulate=True), y)


def whole_batch_slices(lin, x, y):
    """Slices that keep every row: ``h[-n:]``, and ``h[:1000]`` under Dynamo's guard that the batch has at most
    1000 samples (a larger batch is captured again, and refused)."""
    n = x.shape[0]
    h = lin(x)
    return F.cross_entropy(h[-n:], y) + F.cross_entropy(h[:1000], y) + h[-1000:].narrow(0, 0, n).pow(2).sum()


def whole_blocks_of_a_tiled_batch(lin, x, y):
    """Whole blocks of a batch joined by ``cat`` or ``repeat``: ``[n:2n]``, ``[n:]``, ``[-2n:]``, ``narrow``."""
    n = x.shape[0]
    three = lin(torch.cat([x, 2 * x, x.tanh()]))
    return (F.cross_entropy(three[n:2 * n], y) + F.cross_entropy(three[-2 * n:], y.repeat(2))
            + F.cross_entropy(lin(x.repeat(2, 1)[n:]), y) + three.narrow(0, n, n).pow(2).sum())


def one_row_of_values_broadcast_over_the_batch(lin, x, y):
    """PEFT's prompt tuning: one row of token ids expanded over the batch (every row alike, and a batch of one keeps
    one row too), embedded, repeated over the batch and joined with the samples' own values; a constant's rows."""
    n = x.shape[0]
    ids = torch.arange(C).unsqueeze(0).expand(n, -1)  # [n, c]
    prompt = F.embedding(ids[:1], lin.weight).repeat(n, 1, 1)  # [n, c, d]
    joined = torch.cat([prompt, x.unsqueeze(1)], 1)  # [n, c + 1, d]
    constant = torch.zeros(2 * n, C, dtype=x.dtype)  # 2 rows per sample: a batch of one keeps both of [:2]
    return F.cross_entropy(lin(joined.tanh().sum(1)) + constant[:2].sum() + ids.narrow(0, -1, 1).sum(), y)


def one_row_of_a_parameter_broadcast_over_the_batch(lin, x, y):
    """A row of a parameter expanded over the batch is the parameter, for a batch of one too: read as it
    (``_capture/broadcast_rows.py``), its gradient is each sample's own."""
    rows = lin.weight.unsqueeze(0).expand(x.shape[0], -1, -1)
    prompt = rows[:1].repeat(x.shape[0], 1, 1)
    return F.cross_entropy(lin(torch.cat([prompt, x.unsqueeze(1)], 1).tanh().sum(1)), y)


def tiled_rows_against_constant_targets(lin, x, y):
    """``F.mse_loss(m, torch.zeros_like(m))`` over ``[2n]`` rows of a tiled batch (a constant target holds any
    layout), and class 0 as the target of every row."""
    m = torch.cat([lin(x), lin(x).tanh()])
    zeros = torch.zeros(2 * x.shape[0], dtype=torch.long)
    ones = torch.ones(2 * x.shape[0], C, dtype=x.dtype)
    return F.mse_loss(m, torch.zeros_like(m)) + F.cross_entropy(m, zeros) + F.mse_loss(lin(x).repeat(2, 1), ones)


def batch_major_rows_times_tiled_weights(lin, x, y):
    """``w.repeat(n)`` beside batch-major rows (row ``2b + t``): each sample's rows read all of ``w``."""
    rows = torch.stack([lin(x), lin(x).tanh()], 1).flatten(0, 1)
    w = torch.tensor([1.0, 3.0], dtype=x.dtype)
    target = torch.arange(2.0 * C, dtype=x.dtype).view(2, C)
    return (rows.pow(2).sum(1) * w.repeat(x.shape[0])).sum() + F.mse_loss(rows, target.repeat(x.shape[0], 1))


ACCEPTED = {
    "logits_at_arange": pick_own_target,
    "gather_within_sample": gather_within_sample,
    "shared_feature_index": shared_feature_index,
    "cat_along_batch": cat_batch_twice,
    "repeat_along_batch": repeat_along_batch,
    "tiled_batch_sliced_across_features": tiled_batch_sliced_across_features,
    "stack_and_mean": stack_and_mean,
    "cumsum_and_softmax_over_features": cumsum_features,
    "reshape_within_sample": reshape_per_sample,
    "masked_write": masked_write,
    "index_fill_own_positions": index_fill_own_positions,
    "index_put_of_parameter_values_into_own_rows": write_own_rows,
    "index_put_accumulate_into_own_rows": accumulate_into_own_rows,
    "channel_shuffle_within_sample": channel_shuffle_within_sample,
    "cosine_embedding_loss_over_flattened_steps": cosine_embedding_over_steps,
    "multilabel_margin_loss_over_flattened_steps": multilabel_margin_over_steps,
    "solve_with_samples_as_columns": solve_with_samples_as_columns,
    "batch_size_as_scalar": batch_size_scalar,
    "batch_size_as_tensor": batch_size_tensor,
    "roll_over_batch_by_zero": roll_batch_by_zero,
    "rot90_whole_turns_over_batch": rot90_whole_turns,
    "put_with_an_empty_index": put_nothing,
    "whole_batch_slices": whole_batch_slices,
    "one_row_of_values_broadcast_over_the_batch": one_row_of_values_broadcast_over_the_batch,
    "one_row_of_a_parameter_broadcast_over_the_batch": one_row_of_a_parameter_broadcast_over_the_batch,
    "whole_blocks_of_a_tiled_batch": whole_blocks_of_a_tiled_batch,
    "tiled_rows_against_constant_targets": tiled_rows_against_constant_targets,
    "batch_major_rows_times_weights_tiled_per_sample": batch_major_rows_times_tiled_weights,
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_accepted_exact(name):
    program = ACCEPTED[name]
    fn, args = _call(program, ())
    lin = fn.params_source["lin"]
    got = fn(*args)
    ref = reference_per_sample(lambda x, y: program(lin, x, y), dict(fn.params_source.named_parameters()), args)
    for key, r in ref.items():
        torch.testing.assert_close(got[key], r, **TOL, msg=lambda m, k=key: f"{name} {k}: {m}")


# --------------------------------------------------------------- rows of a parameter broadcast over the batch

K = 3  # rows of a prompt


class Prompt(nn.Module):
    """A prompt ``[1, K, D]``, one ``[K, D]`` and a readout ``[D]``: the parameters of ``BROADCAST_ROWS``."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.p1 = nn.Parameter(torch.randn(1, K, D, generator=g, dtype=F64))
        self.p = nn.Parameter(torch.randn(K, D, generator=g, dtype=F64))
        self.w = nn.Parameter(torch.randn(D, generator=g, dtype=F64))

    def rows(self, n: int) -> torch.Tensor:
        """``p`` expanded over a batch of ``n``: every row is ``p``."""
        return self.p.unsqueeze(0).expand(n, -1, -1)


def _readout(m: Prompt, h: torch.Tensor) -> torch.Tensor:
    """Each sample's own nonlinear loss of ``h`` ``[n, K, D]``, summed."""
    return (h * m.w).sum(-1).tanh().pow(2).sum() + h.pow(2).mean()


def _cat_of_its_slices(m: Prompt, x: torch.Tensor) -> torch.Tensor:
    rows = m.rows(x.shape[0])
    return _readout(m, x + torch.cat([rows[:1], rows[1:]]))


# name -> (loss of (module, x [n, K, D]), how many row ops are read as the parameter broadcast: a cat's ``[1:]``,
# ``n - 1`` rows, is not, no node holding that size, and the cat of it is)
BROADCAST_ROWS = {
    "first_row_times_x": (lambda m, x: _readout(m, x * m.rows(x.shape[0])[:1]), 1),
    "last_row_plus_x": (lambda m, x: _readout(m, x + m.p1.expand(x.shape[0], -1, -1)[-1:]), 1),
    "first_row_of_the_flipped_rows": (lambda m, x: _readout(m, x * m.rows(x.shape[0]).flip(0)[:1]), 2),
    "flipped_rows": (lambda m, x: _readout(m, x + m.p1.expand(x.shape[0], -1, -1).flip(0)), 1),
    "rolled_rows": (lambda m, x: _readout(m, x * m.rows(x.shape[0]).roll(1, 0)), 1),
    "cat_of_its_slices": (_cat_of_its_slices, 2),
    "cat_of_slices_of_two_expands": (lambda m, x: _readout(m, x + torch.cat([m.rows(x.shape[0])[:1],
                                                                             m.rows(x.shape[0])[1:]])), 2),
    "last_row_of_a_repeat": (lambda m, x: _readout(m, x * m.p1.repeat(x.shape[0], 1, 1)[-1:]), 1),
    "first_row_of_a_clone": (lambda m, x: _readout(m, x + m.rows(x.shape[0]).clone()[:1]), 1),
    # the flip made a contiguous copy, which a flat view reads; the broadcast is copied for it
    "flipped_rows_viewed_flat": (lambda m, x: (x.reshape(-1) * m.rows(x.shape[0]).flip(0).reshape(-1)).tanh().sum()
                                 + _readout(m, x), 1),
}


@pytest.mark.parametrize("name", sorted(BROADCAST_ROWS))
def test_rows_of_a_parameter_broadcast_over_the_batch_exact(name):
    """Slices, flips, rolls and cats along the batch of a parameter expanded over it are the parameter broadcast,
    for a batch of one too: exact against the loop (they were refused), at two batch sizes of one capture."""
    loss, folded = BROADCAST_ROWS[name]
    m = Prompt()
    fn = psg.per_sample(m, backend="eager")(lambda x: loss(m, x))
    params = dict(m.named_parameters())
    g = torch.Generator().manual_seed(3)
    for n in (B, B + 3):
        x = torch.randn(n, K, D, generator=g, dtype=F64)
        got = fn(x)
        for key, want in reference_per_sample(lambda x: loss(m, x), params, (x,)).items():
            torch.testing.assert_close(got[key], want, **TOL, msg=lambda msg, k=key: f"{name} {k}: {msg}")
    assert fn.captures == 1
    assert fn.compiled_for(x)[0].rewritten.forward.meta["broadcast_rows_folded"] == folded


def test_dp_step_through_rows_of_a_parameter_broadcast_over_the_batch():
    """One noiseless DP-SGD step whose loss reads the prompt's first row and a cat of its rows equals the loop's
    per-sample gradients, clipped (the bound cuts about half of them), summed and divided by the batch size."""
    def loss(m, x):
        rows = m.p1.expand(x.shape[0], -1, -1)
        return _readout(m, x * m.rows(x.shape[0]).flip(0)[:1] + torch.cat([rows[:1], rows[1:]]))

    ours, ref = Prompt(), Prompt()
    x = torch.randn(B + 2, K, D, generator=torch.Generator().manual_seed(4), dtype=F64)
    params = dict(ref.named_parameters())
    grads = reference_per_sample(lambda x: loss(ref, x), params, (x,))
    norms = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)
    bound = norms.median().item()
    step = psg.compile_step(lambda x: loss(ours, x), ours, torch.optim.SGD(ours.parameters(), lr=0.5),
                            max_grad_norm=bound, noise_multiplier=0.0, expected_batch_size=len(x), backend="eager")
    step(x)
    assert step.fused, step.fallback_reason
    for key, clipped_sum in ref_clip_sum(grads, bound).items():
        want = params[key].detach() - 0.5 * clipped_sum / len(x)
        torch.testing.assert_close(dict(ours.named_parameters())[key].detach(), want, **TOL,
                                   msg=lambda msg, k=key: f"{k}: {msg}")


# --------------------------------------------------------------- batches merged with frames or tiled tokens

T, V = 2, 7  # frames per sample, vocabulary


def merged_setup():
    """Modules for ``[B, T, 3, 6, 6]`` frames folded into the batch (``frames.flatten(0, 1)``) and ``[B, 3]`` token
    sequences, with the batched arguments of a merged program."""
    torch.manual_seed(0)
    m = nn.ModuleDict({"conv": nn.Conv2d(3, 4, 3, padding=1), "gn": nn.GroupNorm(2, 4), "head": nn.Linear(4, C),
                       "emb": nn.Embedding(V, 4)}).double()
    g = torch.Generator().manual_seed(1)
    frames = torch.randn(B, T, 3, 6, 6, generator=g, dtype=F64)
    target = torch.randn(B, T, 4, 6, 6, generator=g, dtype=F64)
    tok = torch.randint(0, V, (B, 3), generator=g)
    y = torch.randint(0, C, (B,), generator=g)
    return m, (frames, target, tok, y)


def frames_sum_of_squares(m, frames, target, tok, y):
    return m.conv(frames.flatten(0, 1)).pow(2).sum()


def frames_through_spatial_ops(m, frames, target, tok, y):
    """gelu, pooling, padding, GroupNorm, pixel_unshuffle, softmax and unfold over ``[B*T, ...]`` rows."""
    h = m.gn(F.max_pool2d(F.gelu(m.conv(frames.flatten(0, 1))), 2))  # [B*T, 4, 3, 3]
    a = F.pixel_unshuffle(F.pad(h, (0, 1, 0, 1), mode="reflect"), 2).softmax(1)
    b = F.layer_norm(F.adaptive_avg_pool2d(h, 2), (2, 2))
    return a.pow(2).sum() + b.pow(2).sum() + F.pad(h, (1, 1)).flip(3).roll(1, 2).pow(2).sum() + F.unfold(h, 2).sum()


def frames_upsampled_against_a_target(m, frames, target, tok, y):
    up = F.interpolate(m.conv(frames.flatten(0, 1)), scale_factor=2)
    return F.mse_loss(up, F.interpolate(target.flatten(0, 1), scale_factor=2))


def frames_classified_one_label_per_frame(m, frames, target, tok, y):
    """Labels ``[B*T]`` in the rows' order (``y.repeat_interleave(T)``: frame ``t`` of sample ``b`` is row
    ``b*T + t``), and per-frame weights ``w.repeat(n)``."""
    logits = m.head(m.conv(frames.flatten(0, 1)).mean((2, 3)))
    w = torch.tensor([1.0, 3.0], dtype=frames.dtype)
    return F.cross_entropy(logits, y.repeat_interleave(T)) + (logits.pow(2).sum(1) * w.repeat(frames.shape[0])).sum()


def embedding_of_two_views(m, frames, target, tok, y):
    """Two views of each token sequence in one batch, looked up in one table; labels tiled alike."""
    both = m.emb(torch.cat([tok, tok.flip(1)])).mean(1)
    return F.cross_entropy(m.head(both), torch.cat([y, y])) + m.emb(tok.repeat(2, 1)).pow(2).sum()


def frames_as_windows_split_and_stacked(m, frames, target, tok, y):
    """Swin's window attention: ``[B*T, ...]`` rows (a sample's windows) through a projection whose output is cut
    by ``unbind`` (``q, k, v``; its backward a ``stack``) and by ``chunk``, then rejoined per row."""
    rows = m.conv(frames.flatten(0, 1)).flatten(2).transpose(1, 2)  # [B*T, 36, 4]
    q, k, v = m.head(rows).unflatten(-1, (C, 1)).permute(2, 0, 1, 3).unbind(0)  # each [B*T, 36, 1]
    a, b = rows.chunk(2, dim=2)
    return ((q * k + v).pow(2).sum() + torch.stack([a, b], 1).tanh().sum()
            + F.cross_entropy(m.head(rows.mean(1)), y.repeat_interleave(T)))


def frames_labels_step_major(m, frames, target, tok, y):
    logits = m.head(m.conv(frames.flatten(0, 1)).mean((2, 3)))  # row b*T + t; the label of row k is y[k % n]
    return F.cross_entropy(logits, y.repeat(T))  # <frames_step_major>


def frames_weights_step_major(m, frames, target, tok, y):
    rows = m.conv(frames.flatten(0, 1)).pow(2).sum((1, 2, 3))
    w = torch.tensor([1.0, 3.0], dtype=frames.dtype)
    return (rows * w.repeat_interleave(frames.shape[0])).sum()  # <frames_weights>


def embedding_of_two_views_labels_interleaved(m, frames, target, tok, y):
    both = m.emb(torch.cat([tok, tok.flip(1)])).mean(1)
    return F.cross_entropy(m.head(both), y.repeat_interleave(2))  # <emb_interleaved>


def embedding_of_interleaved_views_labels_in_blocks(m, frames, target, tok, y):
    both = m.emb(torch.stack([tok, tok.flip(1)], 1).flatten(0, 1)).mean(1)
    return F.cross_entropy(m.head(both), torch.cat([y, y]))  # <emb_blocks>


MERGED_ACCEPTED = {
    "conv_over_frames_sum_of_squares": frames_sum_of_squares,
    "conv_over_frames_through_spatial_ops": frames_through_spatial_ops,
    "conv_over_frames_upsampled_mse": frames_upsampled_against_a_target,
    "conv_over_frames_one_label_per_frame": frames_classified_one_label_per_frame,
    "embedding_of_concatenated_or_repeated_tokens": embedding_of_two_views,
    "conv_over_frames_split_and_stacked": frames_as_windows_split_and_stacked,
}

MERGED_REFUSED = {  # name -> (program, marker)
    "conv_over_frames_labels_in_step_major_order": (frames_labels_step_major, "frames_step_major"),
    "conv_over_frames_weights_in_step_major_order": (frames_weights_step_major, "frames_weights"),
    "embedding_of_tiled_tokens_labels_interleaved": (embedding_of_two_views_labels_interleaved, "emb_interleaved"),
    "embedding_of_interleaved_tokens_labels_in_blocks": (embedding_of_interleaved_views_labels_in_blocks,
                                                         "emb_blocks"),
}


@pytest.mark.parametrize("name", sorted(MERGED_ACCEPTED))
def test_merged_batch_accepted_exact(name):
    program = MERGED_ACCEPTED[name]
    m, args = merged_setup()
    got = psg.per_sample(m, backend="eager")(lambda *a: program(m, *a))(*args)
    ref = reference_per_sample(lambda *a: program(m, *a), dict(m.named_parameters()), args)
    for key, r in ref.items():
        torch.testing.assert_close(got[key], r, **TOL, msg=lambda msg, k=key: f"{name} {k}: {msg}")


@pytest.mark.parametrize("name", sorted(MERGED_REFUSED))
def test_merged_batch_refused(name):
    program, marker = MERGED_REFUSED[name]
    m, args = merged_setup()
    with pytest.raises(psg.SampleMixingError) as info:
        psg.per_sample(m, backend="eager")(lambda *a: program(m, *a))(*args)
    message = str(info.value)
    assert re.search(rf"{re.escape(THIS.name)}\D{{1,12}}{line_of(marker)}\b", message), message
    assert "(row b*2 + t) in one, 2 blocks of B rows (row t*B + b) in another" in message, message
    assert "Fix: build both in one order" in message


# --------------------------------------------------------------- gradients inside the loss


def jacobian_penalty(lin, x, y):
    h = lin(x)
    out = torch.tanh(h)
    (g,) = torch.autograd.grad(out.sum(), h, create_graph=True)
    return F.cross_entropy(out, y) + 0.1 * g.pow(2).sum()


def test_loss_with_inner_gradient_is_exact():
    """The captured graph records the inner backward's saved results through detaches; the build reconnects them
    (0.26 absolute error on this example without that), so the gradient term is kept (tests/test_input_gradients.py
    has the other forms)."""
    fn, args = _call(jacobian_penalty, ())
    lin = fn.params_source["lin"]
    if not reconnects_inner_gradients():  # torch 2.11/2.12: refused, naming the version (_compat)
        with pytest.raises(psg.UnsupportedError, match="torch 2.13 and later"):
            fn(*args)
        return
    got = fn(*args)
    ref = reference_per_sample(lambda x, y: jacobian_penalty(lin, x, y), dict(fn.params_source.named_parameters()),
                               args)
    for key, r in ref.items():
        torch.testing.assert_close(got[key], r, **TOL, msg=lambda m, k=key: f"{k}: {m}")
