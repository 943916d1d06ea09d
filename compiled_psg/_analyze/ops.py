"""Facts about ATen ops, in one place: how each op treats the dimensions of its tensors.

The mixing analysis (``mixing.py``), the batch-layout walk (``layout.py``), the lift rules and the reductions all
read these tables; nothing else in the package lists ops by kind. An op that is in no table has *unknown* batch
semantics: the mixing analysis refuses it wherever it touches a value that depends on the samples.

Each entry says which argument holds what (by schema name, after ``normalize_function``), never how to rewrite:

- ``is_pointwise``: element ``k`` of the output reads element ``k`` of each (broadcast) input.
- ``IDENTITY``: the output is the input (copies, dtype casts, detach).
- ``VIEWS``: reshapes; ``DIM_OPS``: ops that move, drop, tile or slice whole dimensions.
- ``REDUCTIONS``: reduce over ``dim`` (all dims when empty), ``keepdim`` or not.
- ``ALONG_DIM``: every output element along ``dim`` reads the whole input along ``dim`` (softmax, cumsum, sort).
- ``SPATIAL``: ops that mix the last ``k`` dimensions only (pooling, padding, upsampling, ``triu``); the leading
  dimensions are independent.
- ``MATMULS``: index strings of matrix products (letters shared by operands; a letter missing from the output is
  summed over).
- ``FACTORIES``: ops that make a tensor from sizes and constants; ``RANDOM``: factories and ops drawing random
  numbers.
- ``LOSSES``: loss ops with a ``reduction`` argument (0 none, 1 mean, 2 sum) over their leading dimensions.
"""

from __future__ import annotations

import operator

import torch

ATEN = torch.ops.aten


def _overloads(*names: str) -> set:
    """``"sum.dim_IntList"`` -> ``aten.sum.dim_IntList``, skipping overloads this torch build lacks."""
    found = set()
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(ATEN, packet, None), overload or "default", None)
        if op is not None:
            found.add(op)
    return found


# Beyond the ops tagged ``torch.Tag.pointwise``: elementwise ops (with broadcasting) that lack the tag.
ELEMENTWISE = _overloads(
    "masked_fill.Tensor", "hardtanh_backward", "leaky_relu_backward", "elu_backward", "softplus_backward",
    "log_sigmoid_forward", "log_sigmoid_backward", "fill.Scalar", "fill.Tensor", "copy", "native_dropout",
    "bernoulli.p", "bernoulli", "hardsigmoid_backward", "hardswish_backward",
    "mse_loss_backward", "smooth_l1_loss_backward", "huber_loss_backward", "gelu_backward", "silu_backward",
    "native_dropout_backward", "threshold_backward", "mish_backward", "_conj", "lift_fresh_copy",
    "hardswish", "rsub.Tensor", "rsub.Scalar", "softshrink_backward", "hardshrink_backward", "zero", "complex",
    "polar",
)

IDENTITY = _overloads("clone", "alias", "detach", "contiguous", "_to_copy", "lift_fresh_copy", "view_as",
                      "_assert_tensor_metadata", "alias_copy", "detach_copy")
VIEWS = _overloads("view", "_unsafe_view", "reshape", "view_copy")

# Ops that move, drop, tile or slice whole dimensions; each has its own handler in mixing.py.
DIM_OPS = _overloads(
    "t", "transpose.int", "permute", "unsqueeze", "squeeze.dim", "squeeze.dims", "squeeze", "expand", "select.int",
    "slice.Tensor", "narrow", "flip", "roll", "repeat", "split.Tensor", "split_with_sizes", "unbind.int",
    "chunk", "unsafe_split.Tensor", "unsafe_split_with_sizes", "unsafe_chunk", "diagonal", "unfold",
    "cat", "stack", "constant_pad_nd", "slice_scatter", "select_scatter", "one_hot", "tensor_split.sections",
    # the functional copies of views (``*_copy``): the same handlers as the views
    "t_copy", "transpose_copy.int", "permute_copy", "unsqueeze_copy", "squeeze_copy.dim", "squeeze_copy.dims",
    "squeeze_copy", "expand_copy", "select_copy.int", "slice_copy.Tensor", "narrow_copy", "split_copy.Tensor",
    "split_with_sizes_copy", "unbind_copy.int", "diagonal_copy", "unfold_copy",
)

# Ops over some dimensions that keep every other dimension apart: the name of the argument giving the dims, or the
# dims themselves (``channel_shuffle`` permutes the channels, dimension 1, of each row of dimension 0 alike).
OVER_DIMS = {op: "dim" for op in _overloads("_fft_r2c", "_fft_c2r", "_fft_c2c")} | {
    op: "dims" for op in _overloads("rot90")} | {op: (1,) for op in _overloads("channel_shuffle",
                                                                             "native_channel_shuffle")}

# Backward of a view that picks part of a dimension (``x[:, k]``, ``x[:, a:b]``): zeros shaped ``input_sizes`` with
# the gradient written at the picked positions. They appear in a loss that calls ``torch.autograd.grad`` inside
# itself (the inner backward of ``out[:, k]``); mixing.py's ``_view_backward`` handles them.
VIEW_BACKWARDS = _overloads("select_backward", "slice_backward")

# Backwards of SPATIAL ops (inner gradients): op -> number of trailing dims they mix. Every tensor argument (the
# gradient, the saved input, pooling indices) holds the samples alike.
SPATIAL_BACKWARDS: dict = {}
for _k, _names in [
    (1, ("avg_pool1d_backward", "adaptive_avg_pool1d_backward", "reflection_pad1d_backward",
         "replication_pad1d_backward")),
    (2, ("avg_pool2d_backward", "max_pool2d_with_indices_backward", "_adaptive_avg_pool2d_backward",
         "adaptive_max_pool2d_backward", "reflection_pad2d_backward", "replication_pad2d_backward")),
    (3, ("avg_pool3d_backward", "max_pool3d_with_indices_backward", "_adaptive_avg_pool3d_backward",
         "adaptive_max_pool3d_backward", "reflection_pad3d_backward", "replication_pad3d_backward")),
]:
    for _op in _overloads(*_names):
        SPATIAL_BACKWARDS[_op] = _k
# Backwards whose input gradient is per sample and whose parameter gradients sum over the batch (inner gradients)
LAYER_NORM_BACKWARDS = _overloads("native_layer_norm_backward")
CONV_BACKWARDS = _overloads("convolution_backward")

# op -> (dim argument name or None for a full reduction, keepdim argument name or None)
REDUCTIONS: dict = {}
for _names, _spec in [
    (("sum.dim_IntList", "mean.dim", "amax", "amin", "logsumexp", "nansum", "any.dims", "all.dims",
      "count_nonzero.dim_IntList", "var.correction", "std.correction", "var_mean.correction", "std_mean.correction",
      "var.dim", "std.dim", "linalg_vector_norm", "norm.ScalarOpt_dim", "prod.dim_int", "max.dim", "min.dim",
      "any.dim", "all.dim", "argmax", "argmin", "median.dim", "nanmedian.dim", "mode", "aminmax", "mean.dtype_out",
      "kthvalue", "norm.ScalarOpt_dim_dtype", "logsumexp.default"), ("dim", "keepdim")),
    (("sum.default", "mean.default", "prod.default", "max.default", "min.default", "any.default", "all.default",
      "norm.Scalar", "norm.ScalarOpt_dtype", "count_nonzero.default", "median.default", "nanmedian.default"),
     (None, None)),
]:
    for _op in _overloads(*_names):
        REDUCTIONS[_op] = _spec

# op -> name of its dim argument (default when absent: -1 for sort/topk)
ALONG_DIM = {op: "dim" for op in _overloads(
    "_softmax", "_log_softmax", "_safe_softmax", "cumsum", "cumprod", "logcumsumexp", "cummax", "cummin", "sort",
    "sort.stable", "topk", "_softmax_backward_data", "_log_softmax_backward_data", "argsort", "argsort.stable", "glu",
    "glu_backward", "cumulative_trapezoid",
)}

# op -> number of trailing dims it mixes (the leading dims are independent, batch or channels)
SPATIAL: dict = {}
for _k, _names in [
    (1, ("max_pool1d_with_indices", "avg_pool1d", "adaptive_avg_pool1d", "adaptive_max_pool1d",
         "reflection_pad1d", "replication_pad1d", "upsample_nearest1d", "upsample_nearest1d.vec",
         "upsample_linear1d", "upsample_linear1d.vec", "_upsample_nearest_exact1d", "_upsample_nearest_exact1d.vec",
         "max_pool1d")),
    (2, ("max_pool2d_with_indices", "avg_pool2d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d",
         "adaptive_max_pool2d", "reflection_pad2d", "replication_pad2d", "upsample_nearest2d",
         "upsample_nearest2d.vec", "upsample_bilinear2d", "upsample_bilinear2d.vec", "upsample_bicubic2d",
         "upsample_bicubic2d.vec", "_upsample_bilinear2d_aa", "_upsample_bilinear2d_aa.vec",
         "_upsample_bicubic2d_aa", "_upsample_bicubic2d_aa.vec", "_upsample_lanczos2d_aa",
         "_upsample_lanczos2d_aa.vec",
         "_upsample_nearest_exact2d", "_upsample_nearest_exact2d.vec", "triu", "tril", "fractional_max_pool2d",
         "max_pool2d", "im2col", "col2im", "pixel_shuffle", "pixel_unshuffle", "lp_pool2d")),
    (3, ("max_pool3d_with_indices", "avg_pool3d", "adaptive_avg_pool3d", "_adaptive_avg_pool3d",
         "adaptive_max_pool3d", "reflection_pad3d", "replication_pad3d", "upsample_nearest3d",
         "upsample_nearest3d.vec", "upsample_trilinear3d", "upsample_trilinear3d.vec",
         "_upsample_nearest_exact3d", "_upsample_nearest_exact3d.vec", "max_pool3d")),
]:
    for _op in _overloads(*_names):
        SPATIAL[_op] = _k
# pixel_shuffle moves channels into space: the channel dim is mixed too
MIXES_CHANNELS = _overloads("pixel_shuffle", "pixel_unshuffle", "im2col")

# op -> (operand index strings, output index string, names of the operands, name of an added bias or None)
MATMULS: dict = {}
for _names, _spec in [
    (("mm",), (("mk", "kn"), "mn", ("input", "mat2"), None)),
    (("addmm",), (("mk", "kn"), "mn", ("mat1", "mat2"), "input")),
    (("bmm",), (("hmk", "hkn"), "hmn", ("input", "mat2"), None)),
    (("baddbmm",), (("hmk", "hkn"), "hmn", ("batch1", "batch2"), "input")),
    (("mv",), (("mk", "k"), "m", ("input", "vec"), None)),
    (("addmv",), (("mk", "k"), "m", ("mat", "vec"), "input")),
    (("dot",), (("k", "k"), "", ("input", "tensor"), None)),
    (("vdot",), (("k", "k"), "", ("input", "other"), None)),
    (("outer",), (("m", "n"), "mn", ("input", "vec2"), None)),
]:
    for _op in _overloads(*_names):
        MATMULS[_op] = _spec

FACTORIES = _overloads(
    "zeros", "ones", "full", "empty.memory_format", "empty_strided", "scalar_tensor", "new_zeros", "new_ones",
    "new_full", "new_empty", "new_empty_strided", "zeros_like", "ones_like", "full_like", "empty_like",
    "rand", "randn", "rand_like", "randn_like", "randint", "randint.low", "randint_like", "randint_like.low_dtype",
    "normal.float_float", "normal_functional", "uniform", "exponential", "cauchy", "log_normal", "geometric",
    "empty_permuted",
)
# factories whose value does not depend on a tensor input's values, only on its shape (``*_like``, ``new_*``)
SHAPE_ONLY = _overloads("ones_like", "zeros_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty",
                        "new_full", "rand_like", "randn_like", "randint_like", "randint_like.low_dtype",
                        "new_empty_strided")
ARANGES = _overloads("arange", "arange.start", "arange.start_step")
# factories whose value depends on the batch size beyond the shape (refused when the size involves the batch)
POSITIONAL_FACTORIES = _overloads("randperm", "linspace", "logspace", "eye", "eye.m", "tril_indices", "triu_indices")


def has_pointwise_tag(target) -> bool:
    """Tagged ``torch.Tag.pointwise``: one output, computed element by element (what the pointwise lift needs)."""
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def is_pointwise(target) -> bool:
    """Element ``k`` of the output reads element ``k`` of each input (with broadcasting)."""
    if target in ELEMENTWISE:
        return True
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


# Linear algebra on stacks of matrices: each matrix of the stack is solved, factored or inverted on its own.
MATRIX_STACKS = _overloads(
    "linalg_inv_ex", "linalg_cholesky_ex", "_linalg_solve_ex", "linalg_lu_factor_ex", "linalg_lu", "lu_unpack",
    "linalg_lu_solve", "_linalg_det", "_linalg_slogdet", "_linalg_eigh", "_linalg_svd", "linalg_qr", "cholesky",
    "cholesky_solve", "cholesky_inverse", "triangular_solve", "linalg_solve_triangular", "linalg_matrix_exp",
    "linalg_householder_product", "linalg_ldl_factor_ex", "linalg_ldl_solve", "linalg_eig", "_linalg_eigvals",
    "linalg_eigvals", "linalg_pinv.atol_rtol_tensor",
    "linalg_matrix_sqrth", "linalg_polar",  # from torch 2.14
)
# MATRIX_STACKS ops that solve ``A X = B`` (``X A = B`` when ``left`` is False): with shared matrices, every column
# of ``B`` (every row when not ``left``) is solved on its own, so the samples may be those columns.
# op -> (names of the matrix arguments, name of the right-hand side, name of the ``left`` flag or None), by the
# names ``normalize_function`` gives (``input`` for ``self``)
SOLVES = {}
for _names, _spec in [
    (("_linalg_solve_ex",), (("A",), "B", "left")),
    (("linalg_lu_solve",), (("LU", "pivots"), "B", "left")),
    (("linalg_solve_triangular",), (("input",), "B", "left")),
    (("cholesky_solve",), (("input2",), "input", None)),
    (("triangular_solve",), (("A",), "input", None)),
]:
    for _op in _overloads(*_names):
        SOLVES[_op] = _spec
# MATRIX_STACKS ops' arguments that hold one value per matrix, shaped like the stack without its matrix dimensions
# (the tolerances of ``pinv``, compared with each matrix's largest singular value)
PER_MATRIX_ARGS = {op: ("atol", "rtol") for op in _overloads("linalg_pinv.atol_rtol_tensor")}

# op -> names of (input, target) and the argument names of extra elementwise tensors; reduction in "reduction"
LOSSES: dict = {}
for _names, _extra in [
    (("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "soft_margin_loss"), ()),
    (("binary_cross_entropy",), ("weight",)),
    (("binary_cross_entropy_with_logits",), ("weight", "pos_weight")),
]:
    for _op in _overloads(*_names):
        LOSSES[_op] = _extra
NLL_LOSSES = _overloads("nll_loss_forward", "nll_loss2d_forward")

CONVOLUTIONS = _overloads("convolution", "_convolution", "conv2d", "conv1d", "conv3d")
# Ops whose tensors all hold independent rows in dimension 0 (the batch of the op); the other dims mix.
BATCH_FIRST = _overloads("grid_sampler_2d", "grid_sampler_3d", "_prelu_kernel", "_thnn_fused_lstm_cell",
                         "_thnn_fused_gru_cell", "max_unpool2d", "max_unpool3d")

# Normalization layers: op -> (number of trailing normalized dims source, kind)
LAYER_NORMS = _overloads("native_layer_norm", "_fused_rms_norm")
GROUP_NORMS = _overloads("native_group_norm")
BATCH_NORMS = {op: "training" for op in _overloads(
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit.no_stats",
    "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training", "batch_norm_stats",
)}
ATTENTIONS = _overloads(
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math", "_scaled_dot_product_fused_attention_overrideable",
)

# Ops that pair elements by their position in the whole flattened tensor (the k-th source element goes to the
# k-th selected position): with the batch among the dimensions, one sample's values land in another's rows.
FLAT_ORDER = _overloads("masked_scatter", "masked_select", "nonzero", "take", "put", "index_put_.flat")

# op -> names of its arguments that are sizes: the batch size may appear there (``x.view(n, -1)``,
# ``zeros(n, d)``); anywhere else an argument that reads the batch size uses it as a value, which a batch of one
# would see as 1 (refused unless the op is tagged pointwise: the loss head then reads it as 1).
SIZE_ARGS: dict = {}
for _names, _args in [
    (("view", "_unsafe_view", "view_copy", "expand", "new_zeros", "new_ones", "new_empty", "new_full", "zeros",
      "ones", "empty.memory_format", "full", "rand", "randn", "randint", "randint.low", "empty_permuted"),
     ("size",)),
    (("reshape",), ("shape",)),
    (("repeat",), ("repeats",)),
    (("empty_strided", "new_empty_strided"), ("size", "stride")),
    (("native_group_norm",), ("N", "C", "HxW")),
    (("select_backward", "slice_backward"), ("input_sizes",)),
]:
    for _op in _overloads(*_names):
        SIZE_ARGS[_op] = _args

# Nodes that check sizes or assert, with no value of interest.
CHECKS = _overloads("_assert_scalar", "_assert_async", "_assert_async.msg", "sym_constrain_range",
                    "sym_constrain_range_for_size", "_functional_sym_constrain_range",
                    "_functional_sym_constrain_range_for_size", "_functional_assert_async.msg")
SIZE_QUERIES = _overloads("sym_size.int", "sym_stride.int", "sym_numel", "sym_storage_offset")
SCALAR_READS = _overloads("_local_scalar_dense", "item")
# Python-level operators on sizes (SymInt arithmetic) that Dynamo leaves in graphs.
SYMBOLIC_PYTHON = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.mod,
                   operator.pow, operator.neg, operator.eq, operator.ne, operator.lt, operator.le, operator.gt,
                   operator.ge, operator.and_, operator.or_, operator.not_, torch.sym_float, torch.sym_int,
                   torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_sum, abs}
