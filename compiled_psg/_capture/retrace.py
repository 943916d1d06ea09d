"""From the captured joint graph to the joint graph of the per-sample losses.

1. ``forward_slice``: the forward part of the captured joint graph (the ancestors of the loss).
2. The loss-head pass (``_rewrite/loss_head.py``) makes it return per-sample losses ``[n]`` as well.
3. ``retrace_joint``: ``make_fx`` of ``autograd.grad(sum(per-sample losses), params)`` on the same fake inputs
   (the batch stays symbolic). Its backward sums exactly the batch-of-one gradients, so every contraction in it
   is a sum of per-sample gradients as the user defines them, whatever mean or mask the loss applied.

The forward is functionalized: the in-place ops eager autograd differentiates (``out[..., :p] = x[..., -p:]`` in
circular padding, ``x.normal_()``) appear as their functional forms, and some of those have no derivative
(``aten.copy``, ``aten.normal_functional``, ``aten.bernoulli.p``). ``_Differentiable`` runs them as eager autograd
differentiates the in-place forms: ``copy`` as a differentiable selection of ``src``; a random op whose derivative
is missing on its detached inputs (eager autograd gives ``normal_`` and ``bernoulli_`` zero gradients). Any other
op without a derivative is refused by name.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx
from torch.utils._pytree import tree_leaves, tree_map_only

from .._analyze.source import source_line
from .._errors import UnsupportedError

ATEN = torch.ops.aten


def _copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``aten.copy(self, src)`` (``self``'s shape, dtype and layout, ``src``'s values), differentiable as
    ``self.copy_(src)`` is: the gradient goes to ``src`` (summed over broadcast dims), none to ``self``."""
    keep = torch.ones((), dtype=torch.bool, device=self.device)
    return torch.where(keep, src.to(dtype=self.dtype, device=self.device), self)


_MISSING: dict[object, bool] = {}  # op overload -> autograd has no derivative for it (a property of the op)


def _missing_derivative(target, args, kwargs) -> bool:
    """Whether autograd has no derivative for this call (its output's grad_fn raises "not implemented"); probed
    once per op on the fake values, outside the trace."""
    if target in _MISSING:
        return _MISSING[target]
    if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves((args, kwargs))):
        return False
    with disable_proxy_modes_tracing():
        out = target(*args, **kwargs)
    _MISSING[target] = any(isinstance(t, torch.Tensor) and t.grad_fn is not None
                           and "NotImplemented" in t.grad_fn.name() for t in tree_leaves(out))
    return _MISSING[target]


class _Differentiable(fx.Interpreter):
    """Runs the functionalized forward so that autograd differentiates what it differentiates in eager mode."""

    def run_node(self, n: fx.Node):
        self._node = n
        return super().run_node(n)

    def call_function(self, target, args, kwargs):
        if target is ATEN.copy.default:
            return _copy(*args, **kwargs)
        if target is ATEN.detach_copy.default and "psg" in self._node.meta:
            return args[0].detach()  # a detach the per-sample pass emitted (``rules/lift.py``): no gradient flows
        if isinstance(target, torch._ops.OpOverload) and _missing_derivative(target, args, kwargs):
            if torch.Tag.nondeterministic_seeded not in target.tags:
                raise UnsupportedError(
                    f"autograd has no derivative for {target} (at {source_line(self._node)}), the functional form "
                    "of an in-place op in the loss; per-sample gradients cannot be formed through it. Fix: write "
                    "this step out of place, or open an issue naming the op")
            args, kwargs = tree_map_only(torch.Tensor, torch.Tensor.detach, (args, kwargs))
        return super().call_function(target, args, kwargs)


def forward_slice(joint: fx.GraphModule, loss_output: int) -> tuple[fx.GraphModule, fx.Node]:
    """A copy of ``joint`` returning only the loss (all placeholders kept, in order).

    Pre: the joint's outputs are the mutated inputs, the loss (at ``loss_output``), then the gradients.
    Post: no node serves only the gradients, even one DCE counts as impure: CUDA's fused attention backwards
    (``_scaled_dot_product_efficient_attention_backward``, ``_scaled_dot_product_cudnn_attention_backward``) are
    tagged ``nondeterministic_seeded``, and left in the slice the mixing analysis would read them as consumers of
    the loss's batch mean. Impure nodes of the forward (random draws) stay."""
    gm = copy.deepcopy(joint)
    graph = gm.graph
    outputs = graph.output_node().args[0]
    loss = outputs[loss_output]
    if loss.target is ATEN.detach.default:  # our joint returned loss.detach()
        loss = loss.args[0]
    backward = _ancestors(o for o in outputs[loss_output + 1:] if isinstance(o, fx.Node)) - _ancestors([loss])
    graph.output_node().args = ((loss,),)
    graph.eliminate_dead_code(is_impure_node=lambda n: n.op == "placeholder" or (
        n.is_impure() and n not in backward and not n.meta.get("autograd_backward")))
    graph.lint()
    gm.recompile()
    return gm, loss


def _ancestors(nodes) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def retrace_joint(forward: fx.GraphModule, fake_inputs: list, param_positions: list[int],
                  seed_weights: torch.Tensor | None = None) -> fx.GraphModule:
    """Joint graph of ``forward`` (which returns ``(loss, per_sample_losses)``) with outputs
    ``(loss, per_sample_losses, *grads)``; a gradient is None where the loss does not use the parameter.

    ``seed_weights``: a fake ``[n]`` like the per-sample losses (``seed_weights_like``), then one more placeholder
    after ``fake_inputs``'s: the backward starts from ``sum(w * per_sample_losses)``, so that a sample of weight 0
    (a bucket's padding, ``_train/buckets.py``) has per-sample gradients exactly 0 wherever its own backward is
    finite (each is its seed times finite local derivatives)."""

    def joint(*inputs):
        weights = inputs[-1] if seed_weights is not None else None
        inputs = inputs[:len(fake_inputs)]
        with fx_traceback.preserve_node_meta():  # keep the user's stack traces on the forward nodes
            loss, per_sample = _Differentiable(forward).run(*inputs)
        wrt = [inputs[i] for i in param_positions]
        seed = per_sample.sum() if weights is None else (per_sample * weights).sum()
        grads = torch.autograd.grad(seed, wrt, allow_unused=True)
        return (loss.detach(), per_sample.detach(), *grads)

    inputs = [
        v.detach().requires_grad_(i in param_positions) if isinstance(v, torch.Tensor) else v
        for i, v in enumerate(fake_inputs)
    ]
    if seed_weights is not None:
        inputs.append(seed_weights)
    # constants made by autograd must be fake too; the Python dispatcher, as AOT autograd traces with it, gives
    # ops their symbolic-shape Python kernels (baddbmm's meta expands its input to SymInt sizes, which the C++
    # expand refuses: nn.MultiheadAttention with kdim/vdim, a key padding mask and its weights)
    with torch.enable_grad(), detect_fake_mode(fake_inputs), enable_python_dispatcher():
        gm = make_fx(joint)(*inputs)
    return gm


def seed_weights_like(forward: fx.GraphModule) -> torch.Tensor:
    """A fake tensor like ``forward``'s per-sample losses (``[n]``, the batch symbolic): the seed weights'
    placeholder of ``retrace_joint``."""
    per_sample = forward.graph.output_node().args[0][1].meta["val"]
    with detect_fake_mode([per_sample]):
        return torch.empty(per_sample.shape, dtype=per_sample.dtype, device=per_sample.device)
