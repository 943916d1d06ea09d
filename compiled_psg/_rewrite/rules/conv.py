"""``convolution_backward``: per-sample weight and bias gradients of Conv1d/2d/3d and ConvTranspose."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..._analyze.batch_dims import BatchDims, value_of
from ..._analyze.layout import batch_layout, split_batch
from ..._capture import patches
from ..contraction import Contraction, cpu_rounds_in_float32, factored_sq_norms
from ..registry import contraction_rule

ATEN = torch.ops.aten


@torch.library.custom_op("compiled_psg::conv_weight_per_sample", mutates_args=())
def conv_weight_per_sample(gs: torch.Tensor, xs: torch.Tensor, weight_shape: list[int], stride: list[int],
                           padding: list[int], dilation: list[int], transposed: bool, output_padding: list[int],
                           groups: int) -> torch.Tensor:
    """Per-sample conv weight gradients ``[n, *weight_shape]`` from ``gs [n, r, o, *s']`` and ``xs [n, r, c, *s]``.

    The samples become the groups of one convolution (groups = n*r*G). It is an opaque op for the compiler:
    Inductor's convolution lowering specializes ``groups``, which would fix the batch size.
    """
    n, r = gs.shape[0], gs.shape[1]
    g1 = gs.reshape(1, n * r * gs.shape[2], *gs.shape[3:])
    x1 = xs.reshape(1, n * r * xs.shape[2], *xs.shape[3:])
    w1 = gs.new_empty([n * r * weight_shape[0]] + list(weight_shape[1:]))
    gw = ATEN.convolution_backward(g1, x1, w1, None, stride, padding, dilation, transposed, output_padding,
                                   n * r * groups, [False, True, False])[1]
    gw = gw.view([n, r] + list(weight_shape))
    return gw.sum(1) if r != 1 else gw.squeeze(1)


@conv_weight_per_sample.register_fake
def _(gs, xs, weight_shape, stride, padding, dilation, transposed, output_padding, groups):
    return gs.new_empty([gs.shape[0]] + list(weight_shape))


patches.register(patches.Patch(
    "conv GEMM in the convolution's precision", "torch.backends.cuda.matmul.allow_tf32",
    "the per-sample Conv2d weight GEMM on CUDA rounds as the cuDNN convolution it replaces does "
    "(torch.backends.cudnn.allow_tf32, on by default): TF32 tensor cores instead of float32 CUDA cores",
    ("kernel",), "every thread, for the duration of one per-sample conv GEMM (a float32 matmul of another thread "
    "in that window may round in TF32); only while cudnn.allow_tf32 is on and cuBLAS TF32 is off",
    "restored to the value read before the GEMM, on any exit",
    enter=patches.flag_set(torch._C._get_cublas_allow_tf32, torch._C._set_cublas_allow_tf32, True),
    current=lambda: (torch._C._get_cublas_allow_tf32(),)))


def rounds_as_cudnn(x: torch.Tensor) -> bool:
    """Whether a float32 CUDA matmul must be allowed TF32 to round as cuDNN's convolutions do now."""
    return (x.is_cuda and x.dtype == torch.float32 and torch.backends.cudnn.allow_tf32
            and not torch._C._get_cublas_allow_tf32())


def conv2d_patches(x: torch.Tensor, kernel: tuple[int, int], dilation: list[int], padding: list[int],
                   stride: list[int]) -> torch.Tensor:
    """``F.unfold(x, kernel, dilation, padding, stride)``: the patches ``[N, c*kh*kw, h'*w']`` of ``x [N, c, h, w]``
    as one strided view of the padded input and one gather (after the padding's copy, if any). On CUDA
    ``F.unfold`` (``aten::im2col``) launches one kernel per sample: 64 per convolution of ResNet-50 at B = 64,
    which bound its DP step by launches (``benchmarks/scale_notes.md``, resnet50_gn). Where the patches do not
    overlap and need no padding (a 1x1 convolution of stride 1) the view is the input itself, and nothing is
    copied."""
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = kernel, dilation, padding, stride
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph))
    x = x.contiguous()
    n, c, h, w = x.shape
    out_h, out_w = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    s_n, s_c, s_h, s_w = x.stride()
    view = x.as_strided((n, c, kh, kw, out_h, out_w), (s_n, s_c, dh * s_h, dw * s_w, sh * s_h, sw * s_w))
    return view.reshape(n, c * kh * kw, out_h * out_w)


@torch.library.custom_op("compiled_psg::conv2d_weight_gemm", mutates_args=())
def conv2d_weight_gemm(gs: torch.Tensor, xs: torch.Tensor, weight_shape: list[int], stride: list[int],
                       padding: list[int], dilation: list[int]) -> torch.Tensor:
    """The same per-sample Conv2d weight gradients as ``conv_weight_per_sample`` (``groups = 1``, not
    transposed), as one batched GEMM: ``ps[n] = G[n] U[n]^T`` with ``G [n, o, r*h'*w']`` the output gradient and
    ``U [n, c*kh*kw, r*h'*w']`` the input's patches (``conv2d_patches``).

    An op of its own, opaque to the compiler, for three reasons: the patches' strided view and padding fix the
    batch size when traced; the patches (kh*kw times the input) must live only while the GEMM runs, where a traced
    gather depends on forward activations alone and Inductor computes it early and holds it across the backward
    (``benchmarks/scale_notes.md``, resnet50_gn); and the GEMM must round as the cuDNN convolution it replaces
    does: in TF32 while ``torch.backends.cudnn.allow_tf32`` is on (the default, and the plain step's weight
    gradient with it), where Inductor would emit a bare ``bmm`` under cuBLAS's own flag (off by default). The
    flags are read at every call, as cuDNN reads its own.
    """
    n, r, o = gs.shape[0], gs.shape[1], gs.shape[2]
    c, kh, kw = weight_shape[1], weight_shape[2], weight_shape[3]
    cols = conv2d_patches(xs.reshape(n * r, c, xs.shape[3], xs.shape[4]), (kh, kw), dilation, padding, stride)
    positions = cols.shape[-1]
    if r == 1:
        cols, grads = cols.view(n, c * kh * kw, positions), gs.reshape(n, o, positions)
    else:
        cols = cols.view(n, r, c * kh * kw, positions).transpose(1, 2).reshape(n, c * kh * kw, r * positions)
        grads = gs.reshape(n, r, o, positions).transpose(1, 2).reshape(n, o, r * positions)
    if rounds_as_cudnn(gs):
        with patches.REGISTRY["conv GEMM in the convolution's precision"].enter():
            return torch.bmm(grads, cols.transpose(1, 2)).view(n, *weight_shape)
    return torch.bmm(grads, cols.transpose(1, 2)).view(n, *weight_shape)


@conv2d_weight_gemm.register_fake
def _(gs, xs, weight_shape, stride, padding, dilation):
    return gs.new_empty([gs.shape[0], *weight_shape])


def _conv2d_factors(gs: torch.Tensor, xs: torch.Tensor, kernel: tuple[int, int], stride: list[int],
                    padding: list[int], dilation: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors of per-sample Conv2d weight gradients ``ps[n] = A[n]^T X[n]``: the output gradient ``A [n, t, o]``
    and the input's patches ``X [n, t, c*kh*kw]`` over the t = r*h'*w' output positions."""
    n, r, o, c = gs.shape[0], gs.shape[1], gs.shape[2], xs.shape[2]
    cols = conv2d_patches(xs.reshape(n * r, c, xs.shape[3], xs.shape[4]), kernel, dilation, padding, stride)
    positions = cols.shape[-1]
    a = gs.reshape(n, r, o, positions).permute(0, 1, 3, 2).reshape(n, r * positions, o)
    x = cols.view(n, r, -1, positions).permute(0, 1, 3, 2).reshape(n, r * positions, -1)
    return a, x


# float64 bytes of one chunk's factors and Gram matrices in ``conv2d_ghost_sq_norms``: the samples are taken a
# chunk at a time so that the patches (kh*kw times the input) and the t x t Grams never exist for the whole batch
GHOST_CHUNK_BYTES = 64 * 2**20


@torch.library.custom_op("compiled_psg::conv2d_ghost_sq_norms", mutates_args=())
def conv2d_ghost_sq_norms(gs: torch.Tensor, xs: torch.Tensor, weight_shape: list[int], stride: list[int],
                          padding: list[int], dilation: list[int]) -> torch.Tensor:
    """Certified squared norms of per-sample Conv2d weight gradients (``groups = 1``, not transposed) from their
    factors, without forming the gradients: ``<A A^T, X X^T>`` in float64 (``factored_sq_norms``), with A the
    output gradient and X the input's patches at the t output positions. Cheaper than materializing where
    ``t^2 (o + c*kh*kw) < t*o*c*kh*kw``: the late, small-spatial layers of a ResNet.

    Opaque to the compiler, as ``conv2d_weight_gemm`` (the patches must not be hoisted and held), and it
    takes the samples a chunk at a time (``GHOST_CHUNK_BYTES``)."""
    n, r = gs.shape[0], gs.shape[1]
    kernel = (weight_shape[2], weight_shape[3])
    t = r * gs.shape[3] * gs.shape[4]
    width = gs.shape[2] + weight_shape[1] * kernel[0] * kernel[1]
    chunk = max(1, GHOST_CHUNK_BYTES // (8 * (2 * t * width + 3 * t * t)))  # the factors, two Grams, their product
    norms = [factored_sq_norms(*_conv2d_factors(gs[k:k + chunk], xs[k:k + chunk], kernel, stride, padding,
                                                dilation)) for k in range(0, n, chunk)]
    dtype = torch.promote_types(gs.dtype, torch.float32)  # as the fake says, also where t = 1 keeps the input's
    return torch.cat(norms).to(dtype) if norms else gs.new_empty([0], dtype=dtype)


@conv2d_ghost_sq_norms.register_fake
def _(gs, xs, weight_shape, stride, padding, dilation):
    return gs.new_empty([gs.shape[0]], dtype=torch.promote_types(gs.dtype, torch.float32))


def gemm_form_on(device: torch.device, patchify: bool = False) -> bool:
    """Whether per-sample Conv2d weight gradients take the GEMM form on ``device``: on CUDA, where cuDNN runs the
    batch-as-groups convolution group by group (``benchmarks/scale_notes.md``, resnet50_gn); elsewhere the one
    grouped convolution, but for a ``patchify`` convolution (stride = kernel, no padding or dilation: a ViT's patch
    embedding, and every 1x1 convolution of stride 1), whose patches do not overlap, so the gather only moves the
    input, where oneDNN's grouped convolution took a 73 MiB workspace for ViT's at B = 8."""
    return device.type == "cuda" or patchify


@contraction_rule(ATEN.convolution_backward.default)
def convolution_backward(node: fx.Node, batch: BatchDims) -> Contraction | None:
    """Output 1 (weight) or 2 (bias) of ``convolution_backward(g, x, w, ...)``; n batch, o out, c in.

    Before::

        cb = aten.convolution_backward(g [n, o, *s'], x [n, c, *s], w, ..., groups=G, mask=[_, True, True])
        gw = cb[1]                                       # [o, c/G, *k]
        gb = cb[2]                                       # [o]

    After (weight): the samples become groups of one convolution, so no per-sample loop and no unfold;
    ``compiled_psg.conv_weight_per_sample`` (an opaque op, so the compiler does not fix ``n``) computes::

        cbn = aten.convolution_backward(g.view(1, n*o, *s'), x.view(1, n*c, *s), empty([n*o, c/G, *k]),
                                        ..., groups=n*G, mask=[False, True, False])
        ps = cbn[1].view(n, o, c/G, *k)                  # [n, o, c/G, *k]

    On CUDA a Conv2d with ``groups = 1`` takes the GEMM form instead (``conv2d_weight_gemm``, opaque too)::

        ps = bmm(g.view(n, o, h'*w'), unfold(x) [n, c*kh*kw, h'*w'].mT).view(n, o, c, kh, kw)

    After (bias)::  ps = g.sum(spatial dims)             # [n, o]
    """
    if node.target is not operator.getitem or node.args[1] not in (1, 2):
        return None
    conv = node.args[0]
    g, x, w, _bias_sizes, stride, padding, dilation, transposed, output_padding, groups, _mask = conv.args
    layout = batch_layout(g, 0, batch)
    if batch.dims(g) != (0,) or batch.dims(x) != (0,) or layout is None or layout != batch_layout(x, 0, batch):
        return None
    index = node.args[1]
    w_shape = list(value_of(w).shape)

    def rebuild(g, x, w):
        mask = [False, index == 1, index == 2]
        return ATEN.convolution_backward(g, x, w, _bias_sizes, stride, padding, dilation, transposed,
                                         output_padding, groups, mask)[index]

    if index == 2:
        def per_sample_bias(g, x, w):
            s = split_batch(g, 0, layout)  # [n, r, o, *s']
            return s.sum([1] + list(range(3, s.dim())))

        return Contraction(rule="convolution_backward[bias]", node=node, inputs=[g, x, w],
                           per_sample=per_sample_bias, linear_arg=0, linear_layout=(0, layout), rebuild=rebuild)

    patchify = list(stride) == w_shape[2:] and not any(padding) and all(d == 1 for d in dilation)
    gemm = (not transposed and groups == 1 and len(w_shape) == 4 and gemm_form_on(value_of(g).device, patchify))

    def per_sample_weight(g, x, w):
        gs, xs = split_batch(g, 0, layout), split_batch(x, 0, layout)  # [n, r, o, *s'], [n, r, c, *s]
        if gemm:
            return conv2d_weight_gemm(gs, xs, w_shape, list(stride), list(padding), list(dilation))
        return conv_weight_per_sample(gs, xs, w_shape, list(stride), list(padding), list(dilation), bool(transposed),
                                      list(output_padding), int(groups))

    # (t, o, i) of the unfolded form, for the cost model. No traced factors (the patches are kh*kw times the input,
    # and a traced gather is hoisted and held), so sums of squares and Gram matrices materialize the
    # per-sample conv weight gradient. Where a book-keeping sum rounds as a GEMM over the patches would in the
    # inputs' precision (float64; float32 on the CPU while oneDNN's conv precision is float32), a clip norm may
    # instead be the ghost norm (``conv2d_ghost_sq_norms``) or free each gradient after its norm (the bounded
    # plan, ``conv2d_token_norms``). On CUDA in float32 cuDNN rounds in TF32 by default
    # (torch.backends.cudnn.allow_tf32), past the float32 rounding bounds of both, so there a clipped sum reuses
    # the values normed. The choice is made when the graph is captured.
    factor_shape = token_norms = sq_norms = None
    g_val = value_of(g)
    if not transposed and groups == 1 and len(w_shape) == 4 and not any(output_padding):
        positions = int(g_val.shape[2] * g_val.shape[3]) * layout[0] * layout[1]
        factor_shape = (positions, w_shape[0], w_shape[1] * w_shape[2] * w_shape[3])
        if g_val.dtype == torch.float64 or (g_val.dtype == torch.float32 and g_val.device.type == "cpu"
                                            and cpu_rounds_in_float32("conv")):
            kernel = (w_shape[2], w_shape[3])

            def token_norms(g, x, w):
                return conv2d_token_norms(split_batch(g, 0, layout), split_batch(x, 0, layout), kernel,
                                          list(stride), list(padding), list(dilation))

            def sq_norms(g, x, w):
                return conv2d_ghost_sq_norms(split_batch(g, 0, layout), split_batch(x, 0, layout), w_shape,
                                             list(stride), list(padding), list(dilation))

    return Contraction(
        rule="convolution_backward[weight]", node=node, inputs=[g, x, w], per_sample=per_sample_weight,
        linear_arg=0, linear_layout=(0, layout), rebuild=rebuild, factor_shape=factor_shape,
        token_norms=token_norms, sq_norms=sq_norms,
        other_linear=((1, (0, layout)),),  # the weight gradient is linear in the input too
    )


def conv2d_token_norms(gs: torch.Tensor, xs: torch.Tensor, kernel: tuple[int, int], stride: list[int],
                       padding: list[int], dilation: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The norms of the rows of a Conv2d weight gradient's factors, without forming the patches: ``[n, t]`` each,
    t = r*h'*w' output positions, from ``gs [n, r, o, h', w']`` and ``xs [n, r, c, h, w]``.

    ``||A[n, t]||`` is the output gradient's norm over channels at each position; ``||X[n, t]||``, the norm of the
    input patch read at that position, is the square root of a convolution of the channels' summed squares with
    a ``kh x kw`` kernel of ones (same stride, padding and dilation)."""
    dtype = torch.promote_types(gs.dtype, torch.float32)
    a = gs.to(dtype).pow(2).sum(2).sqrt().flatten(1)
    squares = xs.to(dtype).pow(2).sum(2).flatten(0, 1).unsqueeze(1)  # [n*r, 1, h, w]
    ones = squares.new_ones((1, 1, *kernel))
    patches = F.conv2d(squares, ones, stride=stride, padding=padding, dilation=dilation)  # [n*r, 1, h', w']
    return a, patches.clamp_min(0).sqrt().reshape(a.shape)


@torch.library.custom_op("compiled_psg::conv_channel_batch_per_sample", mutates_args=())
def conv_channel_batch_per_sample(a: torch.Tensor, w: torch.Tensor, stride: list[int], padding: list[int],
                                  dilation: list[int]) -> torch.Tensor:
    """Per-sample ``convolution(a[n], w[n])`` ``[n, c, o, *s']`` from ``a [n, c, r, *s]`` and ``w [n, o, r, *k]``.

    The samples become the groups of one convolution (groups = n); opaque to the compiler for the same reason as
    ``conv_weight_per_sample`` (Inductor's lowering specializes ``groups``).
    """
    n, c, r = a.shape[0], a.shape[1], a.shape[2]
    x1 = a.movedim(0, 1).reshape(c, n * r, *a.shape[3:])
    w1 = w.reshape(n * w.shape[1], r, *w.shape[3:])
    out = ATEN.convolution(x1, w1, None, stride, padding, dilation, False, [0] * len(stride), n)
    return out.view(c, n, w.shape[1], *out.shape[2:]).movedim(1, 0).contiguous()  # the strides of the fake


@conv_channel_batch_per_sample.register_fake
def _(a, w, stride, padding, dilation):
    out = ATEN.convolution(a[0], w[0], None, stride, padding, dilation, False, [0] * len(stride), 1)
    return a.new_empty([a.shape[0], *out.shape])


# Both ops read the batch as the groups of one NCHW convolution. Inductor's layout optimization gives a graph with
# convolutions channels-last buffers, and copies between the layouts follow. ``_compile/run.py`` turns it off for
# graphs that call these ops (docs/benchmarks-probes.md, "No channels-last layout around per-sample convolutions").
BATCH_AS_GROUPS = frozenset({torch.ops.compiled_psg.conv_weight_per_sample.default,
                             torch.ops.compiled_psg.conv_channel_batch_per_sample.default})


def calls_batch_as_groups(graph: fx.Graph) -> bool:
    """Whether ``graph`` calls an op that lays the batch out as convolution groups (``BATCH_AS_GROUPS``)."""
    return any(node.op == "call_function" and node.target in BATCH_AS_GROUPS for node in graph.nodes)


@contraction_rule(ATEN.convolution.default)
def convolution_over_channels(node: fx.Node, batch: BatchDims) -> Contraction | None:
    """``convolution(a, w)`` whose input and weight hold the batch as channels: a conv weight gradient of a loss
    with an inner gradient (the double backward of ``convolution_backward`` contracts the batch this way).

    Before::

        ga = aten.convolution(a [c, n, *s], w [o, n, *k], None, stride, padding, dilation, False, _, 1)   # [c, o, *s']

    After: the samples become the groups of one convolution (``compiled_psg.conv_channel_batch_per_sample``)::

        ps = aten.convolution(a' [c, n*r, *s], w' [n*o, r, *k], ..., groups=n).view(c, n, o, *s').movedim(1, 0)
    """
    a, w, bias, stride, padding, dilation, transposed, output_padding, groups = node.args
    if bias is not None or transposed or groups != 1 or batch.dims(a) != (1,) or batch.dims(w) != (1,):
        return None
    layout = batch_layout(a, 1, batch)
    if layout is None or layout != batch_layout(w, 1, batch):
        return None

    def per_sample(a, w):
        return conv_channel_batch_per_sample(split_batch(a, 1, layout), split_batch(w, 1, layout), list(stride),
                                             list(padding), list(dilation))

    # No book-keeping form (``rebuild``): the convolution over batch channels, re-emitted for clip_sum, has a
    # symbolic channel count, which Inductor's lowering fixes. Reductions materialize this small gradient.
    return Contraction(rule="convolution[channels]", node=node, inputs=[a, w], per_sample=per_sample)
