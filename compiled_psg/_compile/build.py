"""The pipeline, one stage per module: capture -> analyze -> rewrite -> reduce. Compilation is in ``run.py``."""

from __future__ import annotations

import copy
import logging
import re
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils import _pytree as pytree

from .._analyze.batch_dims import BatchDims, find_batch_symbol, value_of
from .._analyze.mixing import MixingSite, find_mixing
from .._analyze.source import group_sites, source_line
from .._capture import batch_size_branches, patches
from .._capture.broadcast_rows import fold_broadcast_rows
from .._capture.dynamo import Captured, Role, capture_joint, shape_from_values
from .._capture.retrace import forward_slice, retrace_joint, seed_weights_like
from .._compat import reconnects_inner_gradients
from .._errors import BatchInputError, CaptureError, InternalError, PerSampleError, SampleMixingError, UnsupportedError
from .._reduce.context import ReduceContext, collect_param_grads
from .._reduce.reductions import Reduction
from .._rewrite.loss_head import per_sample_loss_head
from .._rewrite.per_sample_pass import LiftResult, lift_to_per_sample
from .masks import narrow_output_masks

log = logging.getLogger("compiled_psg")
ATEN = torch.ops.aten


@dataclass
class Rewritten:
    """Everything one capture and rewrite produced; ``explain`` reads it."""

    captured: Captured
    forward: fx.GraphModule  # forward with the per-sample loss head
    joint: fx.GraphModule  # joint graph of the per-sample losses, before the per-sample pass
    graph_module: fx.GraphModule  # after the per-sample pass and the reduction
    roles: list[Role]
    batch: BatchDims
    param_names: list[str]
    head: LiftResult
    backward: LiftResult
    param_grads: list = field(default_factory=list)
    choices: dict = field(default_factory=dict)
    memory_plan: dict | None = None  # ReduceContext.memory_plan: the held bytes against a memory_budget
    out_spec: object = None
    mixing: list[MixingSite] = field(default_factory=list)
    # the fake [n] of the seed weights' placeholder, after the captured ones (``seed_weights=True``), else None
    seed_weights: torch.Tensor | None = None

    @property
    def fake_inputs(self) -> list:
        """The fake value of every placeholder ``roles`` describes: the captured inputs, then the seed weights."""
        fakes = self.captured.fake_inputs
        return fakes if self.seed_weights is None else [*fakes, self.seed_weights]


def build(loss_fn, params: dict[str, torch.Tensor], args: tuple, batch_dims: dict[int, int],
          reduction: Reduction, seed_weights: bool = False) -> Rewritten:
    """``seed_weights``: the graph takes one more batched input ``w [n]`` after the loss's arguments (its role:
    argument ``len(args)``), and the backward starts from ``sum(w * per-sample losses)`` (``retrace_joint``)."""
    # Dynamo's compile lock across the whole rewrite, not only its capture: the rewrite's own make_fx traces patch
    # nn.Module.__call__ for the whole process (torch.fx's tracer), and two tracers in two threads restore each
    # other's patches (another thread's torch.compile beside a first call left it patched)
    with patches.applied("rewrite"):
        return _build(loss_fn, params, args, batch_dims, reduction, seed_weights)


def _build(loss_fn, params: dict[str, torch.Tensor], args: tuple, batch_dims: dict[int, int],
           reduction: Reduction, seed_weights: bool) -> Rewritten:
    captured = capture_joint(loss_fn, params, args, batch_dims)
    roles = captured.roles
    batched_fakes = [f for f, r in zip(captured.fake_inputs, roles, strict=True) if r.batched]
    symbol = find_batch_symbol(batched_fakes)
    if symbol is None:
        raise InternalError("no symbolic batch dimension in the captured graph")
    batch = BatchDims(symbol)

    forward, loss = forward_slice(captured.joint, captured.loss_output)
    differentiates_inside = _inner_gradients(captured, forward)
    _refuse_reads_after_renorm(forward)
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    params = {n for n, role in zip(placeholders, roles, strict=True) if role.kind == "param"}
    # w.expand(n, -1)[:1] read as w: the analysis would refuse the slice, through which autograd gives one batch
    # position every sample's gradient
    forward.meta["broadcast_rows_folded"] = fold_broadcast_rows(forward, batch)
    mixing = find_mixing(forward.graph, batch, params)
    if mixing:
        raise _refusal(captured, forward, mixing)
    _refuse_branches_on_batch_size(captured, batched_fakes)
    try:
        head = per_sample_loss_head(forward, loss, batch)
    except PerSampleError:
        raise
    except Exception as e:  # an op of the loss failed on one sample's slice (e.g. kthvalue(2) over the batch)
        found = shape_from_values(forward.graph, e) if "GuardOnDataDependentSymNode" in type(e).__name__ else None
        if found is not None:  # a size read from a tensor's values (tensor_split at points held in a tensor)
            raise found from e
        raise BatchInputError(
            f"the loss could not be computed for one sample ({type(e).__name__}: "
            f"{(str(e).strip().splitlines() or [''])[0]}). A sample's own loss is the loss of a batch of one; if the "
            "loss is undefined for one sample (kthvalue with k > 1 over the batch, a statistic that needs two "
            "samples), per-sample gradients are undefined too: compute that statistic outside the loss. Otherwise this "
            "is a compiled_psg bug: please report this message") from e
    _check_still_symbolic(captured, batch, "the loss-head pass")

    param_positions = [i for i, r in enumerate(roles) if r.kind == "param"]
    names = [roles[i].key for i in param_positions]
    weights = seed_weights_like(forward) if seed_weights else None
    if weights is not None:  # batched along its only dimension: the per-sample pass reads the batch from its size
        roles = [*roles, Role("arg", len(args), batched=True)]
    try:
        joint = retrace_joint(forward, captured.fake_inputs, param_positions, weights)
    except PerSampleError:  # an op without a derivative, named by the retrace
        raise
    except Exception as e:  # e.g. .item() in the loss: Dynamo captured the number, autograd cannot differentiate it
        if differentiates_inside:  # e.g. loss.backward(create_graph=True) inside the loss writes x.grad (a copy)
            raise UnsupportedError(
                f"the loss differentiates inside itself, and its gradient could not be traced again "
                f"({type(e).__name__}: {e}). Fix: differentiate with torch.autograd.grad(..., create_graph=True) "
                "and use its result (not .backward(), which writes .grad); an op with no double backward in "
                "PyTorch cannot be differentiated twice at all") from e
        raise CaptureError(f"the captured loss could not be re-traced for its gradient ({type(e).__name__}: "
                           f"{(str(e).strip().splitlines() or [''])[0]}). If the loss turns tensor values into "
                           "Python numbers (.item(), float(t), .tolist(), numpy), keep them as tensors; otherwise "
                           "please report this message.") from e
    rewritten = copy.deepcopy(joint)
    graph = rewritten.graph
    loss_node, per_sample_loss, *grads = graph.output_node().args[0]
    present = [g for g in grads if g is not None]
    backward = lift_to_per_sample(graph, present, batch)
    _check_still_symbolic(captured, batch, "the per-sample pass")

    shapes = [tuple(value_of(p).shape) for p in (captured.fake_inputs[i] for i in param_positions)]
    param_grads = collect_param_grads(names, grads, shapes, backward)
    ctx = ReduceContext(graph, batch, backward, param_grads, per_sample_loss)
    result = reduction.emit(ctx)
    _check_still_symbolic(captured, batch, f"the reduction {type(reduction).__name__}")
    flat, spec = pytree.tree_flatten(result)
    graph.output_node().args = ((loss_node, per_sample_loss, *flat),)
    graph.eliminate_dead_code()
    graph.lint()
    rewritten.recompile()
    # after DCE: the batch-summed weight gradients the reduction replaced have no reader left (masks.py)
    rewritten.meta["output_masks_narrowed"] = narrow_output_masks(rewritten)
    out = Rewritten(captured, forward, joint, rewritten, roles, batch, names, head, backward,
                    param_grads=param_grads, choices=ctx.choices, memory_plan=ctx.memory_plan, out_spec=spec,
                    seed_weights=weights)
    n_fallback = len(head.fallbacks) + len(backward.fallbacks)
    log.info("compiled_psg: rewrote %d contractions (%d by the vmap fallback) for %d parameters; dropped %d "
             "unread outputs of masked backward ops", len(backward.contractions) + len(head.contractions),
             n_fallback, len(names), rewritten.meta["output_masks_narrowed"])
    return out


def _refuse_reads_after_renorm(forward: fx.GraphModule) -> None:
    """An in-place ``embedding_renorm_`` renormalizes every weight row the batch's indices name. ``nn.Embedding``'s
    ``max_norm`` is rewritten per row at capture (``dynamo._embedding_max_norm_per_row``), and
    ``nn.EmbeddingBag``'s refused there; a loss whose values still read a renormed weight
    (``torch.embedding_renorm_`` called directly) would give each sample rows renormed by the whole batch."""
    renorms = [n for n in forward.graph.nodes if n.target is ATEN.embedding_renorm.default]
    if not renorms:
        return
    line = source_line(next(u for n in renorms for u in n.users))  # where the renormed weight is read
    raise SampleMixingError(
        f"per-sample gradients are undefined for this loss: at {line}, the loss reads a weight that "
        "embedding_renorm_ renormalized in place from the whole batch's indices, so each sample would read rows "
        "renormed for other samples. Fix: use nn.Embedding(max_norm=...) (renormed per sample), or renormalize "
        "outside the loss (with torch.no_grad(): weight.renorm_(2, 0, max_norm))")


def _refuse_branches_on_batch_size(captured: Captured, batched_fakes: list) -> None:
    """The graph serves every batch size only under Dynamo's guards. A guard that a batch of one would fail
    (``if x.shape[0] > 3``, ``x.shape[0] == 1``, an even batch for ``view(2, -1)``) means the batch took another
    branch than each sample alone would: the per-sample gradients would silently follow the batch's branch.
    Comparisons with 1 that Dynamo decided without a guard were recorded while tracing. Checked after the mixing
    analysis: BatchNorm in training mode also branches on a batch of one, and mixing is the real cause there."""
    if captured.batch_size_branches:
        raise batch_size_branches.refusal(captured.batch_size_branches[0])
    env = getattr(detect_fake_mode(captured.fake_inputs), "shape_env", None)
    if env is None:
        return
    symbols = {s for f in batched_fakes for size in f.shape if isinstance(size, torch.SymInt)
               for s in size.node.expr.free_symbols}
    for guard in env.guards:
        if _in_shape_code(guard) or _in_an_argument_check(guard):
            continue
        at_one = guard.expr.subs({s: 1 for s in symbols})
        if at_one == sympy.false:
            where_from = getattr(guard.sloc, "user_stack", None) or getattr(guard, "sloc", "")
            if captured.backward_numbers and "torch.autograd.grad(total" in str(where_from):
                raise CaptureError(
                    f"the loss gives an op a number made of the batch size: {captured.backward_numbers[0]}, so the "
                    f"graph holds this batch's number (Dynamo guarded on {guard.expr}), and a sample alone (a batch "
                    "of one) would get another. Fix: give that argument a constant that is not the batch size, or, "
                    "where the op takes a tensor there, a tensor of the graph (x.new_ones(()) / x.shape[0] for "
                    "1 / len(x))")
            fix = ("do not branch on x.shape[0] (or on sizes derived from it) in the loss function")
            if "in cdist" in str(where_from):  # torch.cdist picks its algorithm for p = 2 by the number of rows
                fix = ("torch.cdist computes p = 2 distances by a matrix product above 25 rows, and by differences "
                       "below: give it compute_mode='donot_use_mm_for_euclid_dist' (or 'use_mm_for_euclid_dist'), "
                       "so that a batch and a sample alone take the same one")
            raise CaptureError(
                f"the loss depends on the batch size beyond shapes: Dynamo guarded on {guard.expr} (the batch size "
                f"is {sorted(map(str, symbols))}), which a batch of one fails, so the batch takes a branch that no "
                f"sample alone would take ({str(where_from).strip()[:300]}). Fix: {fix}")


# Guards raised inside ops' shape functions choose layouts or check shapes (a convolution's meta function guards
# on n >= 16 to pick a memory format); they do not change values. Reshapes that split the batch are the mixing
# analysis's to refuse.
_SHAPE_CODE = ("_subclasses/fake_impls.py", "_meta_registrations.py", "_prims_common", "/_refs/", "/_decomp/")


def _in_an_argument_check(guard) -> bool:
    """A guard made by a check of torch's own arguments that a batch of one passes as the batch does
    (``batch_size_branches._ARGUMENT_CHECKS``: ``F.affine_grid``'s ``min(size) <= 0``)."""
    made = _FRAMEWORK_LOC.search(str(getattr(guard, "sloc", "")))  # "... (nn/functional.py:5802 in affine_grid)"
    return made is not None and batch_size_branches.in_an_argument_check(made.group(1), made.group(2))


_FRAMEWORK_LOC = re.compile(r"\(([^()\s]+):\d+ in (\w+)\)\s*$")


def _in_shape_code(guard) -> bool:
    loc = getattr(getattr(guard, "sloc", None), "framework_loc", None)
    filename = loc if isinstance(loc, str) else getattr(loc, "filename", "") or ""
    return any(part in filename for part in _SHAPE_CODE)


def _inner_gradients(captured: Captured, forward: fx.GraphModule) -> bool:
    """Make a loss that differentiates inside itself (``torch.autograd.grad(..., create_graph=True)``: gradient
    penalties, Jacobian or Laplacian regularizers) a plain differentiable ATen graph.

    The inner backward is in the captured forward as ordinary ATen ops (``mm`` with the weights, ``tanh_backward``,
    ``select_backward``), found by their ``autograd_backward`` meta. Each tensor an op saved as its *output*
    (``tanh``, ``sigmoid``, ``exp`` save their result) is recorded through two ``detach`` nodes: one when the
    forward saves it, one when the backward unpacks it. Autograd still differentiated through them (the saved
    result keeps its grad_fn), but re-tracing the graph would not, and would silently drop the terms of the outer
    gradient that go through the saved results. So each such pair is replaced by the value itself. A detach the
    user wrote is never such a pair: it feeds the op that consumed it, not only unpacking detaches.

    An inner ``autograd.grad`` without ``create_graph`` is recorded the same way but is a constant to the outer
    gradient; it is refused (``UnsupportedError``) rather than differentiated through.

    Samples: the inner backward's ops go through the mixing analysis like any other; the gradient of a sum over
    the batch w.r.t. per-sample inputs is per sample (the shared ``ones`` seed is a shape-only factory), and a
    gradient that mixes samples is refused there. Returns whether the loss differentiates inside itself."""
    graph = forward.graph
    inner = [n for n in graph.nodes if n.meta.get("autograd_backward")]
    if (inner or captured.inner_grads) and not reconnects_inner_gradients():
        raise UnsupportedError(
            f"the loss differentiates inside itself (torch.autograd.grad in the loss), which compiled_psg computes "
            f"exactly on torch 2.13 and later only; on this torch ({torch.__version__}) the captured inner "
            "backward gives wrong per-sample gradients. Fix: use torch 2.13 or later for this loss")
    if not inner:
        return False
    constant = [line for create_graph, line in captured.inner_grads if not create_graph]
    if constant:
        raise UnsupportedError(
            f"the loss calls torch.autograd.grad without create_graph=True, at {constant[0]}: its result is a "
            "constant to the gradient of the loss, which compiled_psg's graph cannot tell from a differentiable "
            "value. Fix: pass create_graph=True, and call .detach() on the result where you mean it as a constant")
    erased: set[fx.Node] = set()
    for node in list(graph.nodes):
        if node in erased or not _is_unpack_pair(node):
            continue
        for unpack in _unpacks(node):  # with the unpacks of unpacks, if autograd saved one again
            unpack.replace_all_uses_with(node.args[0])
            graph.erase_node(unpack)
            erased.add(unpack)
        graph.erase_node(node)
    graph.lint()
    forward.recompile()
    return True


def _is_backward_detach(node: fx.Node) -> bool:
    return node.target is ATEN.detach.default and bool(node.meta.get("autograd_backward"))


def _is_unpack_pair(node: fx.Node) -> bool:
    """A ``detach`` that autograd made to save a value: only unpacking detaches (in a backward) read it."""
    return node.target is ATEN.detach.default and bool(node.users) and all(map(_is_backward_detach, node.users))


def _unpacks(node: fx.Node) -> list[fx.Node]:
    """The unpacking detaches of ``node``, and theirs, users before their users (each erased after its users)."""
    found = []
    for user in node.users:
        if _is_backward_detach(user):
            found.extend(_unpacks(user))
            found.append(user)
    return found


def _refusal(captured: Captured, forward: fx.GraphModule, sites: list[MixingSite]) -> Exception:
    """``SampleMixingError`` when a site mixes samples; ``UnsupportedError`` when the only obstacles are ops whose
    batch semantics compiled_psg does not know, or batch-size values it cannot read as 1."""
    mixing = [s for s in sites if s.kind == "mixing"]
    if mixing:
        error: Exception = SampleMixingError(
            "per-sample gradients are undefined for this loss: samples are mixed.\n"
            + "\n".join(f"  - {line}" for line in group_sites(sites)))
    else:  # ops of unknown batch semantics, or the batch size as a value a batch of one cannot read as 1
        headline = ("compiled_psg cannot prove that this loss keeps samples apart" if any(
            s.kind == "unknown" for s in sites) else "compiled_psg cannot give this loss a sample's own batch size")
        error = UnsupportedError(headline + ":\n" + "\n".join(f"  - {line}" for line in group_sites(sites)))
    error.refusal = (captured, forward, sites)  # the caller builds the report (_inspect.report.Report)
    return error


def _check_still_symbolic(captured: Captured, batch: BatchDims, stage: str) -> None:
    """Post-condition of every pass: nothing pinned the batch size (vmap's batching rules can)."""
    mode = detect_fake_mode(captured.fake_inputs)
    env = getattr(mode, "shape_env", None)
    if env is not None and batch.symbol in env.replacements:
        raise InternalError(f"{stage} fixed the batch size to {env.replacements[batch.symbol]}; "
                             "the compiled graph would not serve other batch sizes (a custom reduction must not "
                             "use the batch size as a Python number, e.g. len(g))")
