"""Capture the user's loss and its parameter gradients as one joint ATen graph, through Dynamo and AOT autograd.

``torch.compile(joint, fullgraph=True)`` with ``trace_autograd_ops`` traces ``loss`` *and*
``torch.autograd.grad(loss, params)``; since no output requires grad, AOT autograd hands one functionalized
graph (forward + backward) to our ``fw_compiler``. Only the batch dimensions are dynamic (``mark_dynamic``), so
every other size is a constant and ``node.meta["val"]`` tells which dimensions carry the batch.

Placeholders are labelled by identity: Dynamo's backend receives the real tensors, so each placeholder is known
to be a named parameter, a batched argument, another argument, a buffer or constant, or a size.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch._dynamo
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd

from .._errors import BatchInputError, CaptureError


@dataclass(frozen=True)
class Role:
    """What feeds one placeholder: ``param`` (name), ``arg`` (position; batched or not), ``size``, ``const``."""

    kind: str
    key: object = None
    batched: bool = False


@dataclass
class Captured:
    joint: fx.GraphModule
    roles: list[Role]
    constants: dict[int, object]  # placeholder index -> the real value, for kind "const"
    fake_inputs: list
    loss_output: int  # index of the loss among the joint graph's outputs


def _label(real_inputs, params: dict[str, torch.Tensor], args: tuple, batched: set[int]):
    by_id = {id(t): ("param", name) for name, t in params.items()}
    for pos, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            by_id.setdefault(id(a), ("arg", pos))
    roles, constants = [], {}
    for i, r in enumerate(real_inputs):
        if isinstance(r, torch.SymInt) or isinstance(r, int):
            roles.append(Role("size"))
        elif id(r) in by_id:
            kind, key = by_id[id(r)]
            roles.append(Role(kind, key, batched=(kind == "arg" and key in batched)))
        else:
            roles.append(Role("const"))
            constants[i] = r
    return roles, constants


@contextlib.contextmanager
def _mkldnn_disabled():
    """Only the ``enabled`` flag: ``torch.backends.mkldnn.flags`` also sets a deprecated TF32 flag (a warning)."""
    before = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(before)


def capture_joint(loss_fn, params: dict[str, torch.Tensor], args: tuple, batch_dims: dict[int, int]) -> Captured:
    """Trace ``loss_fn(*args)`` and its gradients w.r.t. ``params``; ``batch_dims``: arg position -> batch dim."""
    names = list(params)
    tensors = [params[n] for n in names]
    state: dict[str, object] = {}

    def fw_compiler(gm, example_inputs):
        state["gm"], state["fake"] = gm, list(example_inputs)
        ctx = torch._guards.TracingContext.try_get()
        meta = getattr(ctx, "fw_metadata", None)
        state["mutations"] = len(getattr(meta, "mutated_inp_runtime_indices", []) or [])
        return gm.forward

    inner = aot_autograd(fw_compiler=fw_compiler)

    def backend(gm, example_inputs):
        state["real"] = list(example_inputs)
        return inner(gm, example_inputs)

    batched = sorted(batch_dims.items())

    def joint(*call_args):
        first_pos, first_dim = batched[0]
        for pos, dim in batched[1:]:  # one batch symbol for every batched argument
            torch._check(call_args[pos].shape[dim] == call_args[first_pos].shape[first_dim])
        loss = loss_fn(*call_args)
        if not isinstance(loss, torch.Tensor):
            return (loss,)
        total = loss.sum() if loss.dim() > 0 else loss
        grads = torch.autograd.grad(total, tensors, allow_unused=True)
        return (loss.detach(), *grads)

    for pos, dim in batch_dims.items():
        torch._dynamo.mark_dynamic(args[pos], dim)
    compiled = torch.compile(joint, backend=backend, fullgraph=True, dynamic=False)
    try:
        # mkldnn off: float32 RNNs would become fused mkldnn_rnn_layer ops whose backward does not trace;
        # opt_einsum off: it plans contractions from concrete sizes, which fixes the batch size.
        with torch._dynamo.config.patch(trace_autograd_ops=True, allow_rnn=True), \
                _mkldnn_disabled(), torch.backends.opt_einsum.flags(enabled=False):
            out = compiled(*args)
    except torch._dynamo.exc.Unsupported as e:
        raise CaptureError(
            "compiled_psg needs the loss function as one graph, and Dynamo could not capture it (a graph break):\n"
            f"{e}\nFix: remove the Python construct named above (data-dependent control flow, .item(), "
            "printing tensors, unsupported libraries) from the loss function.") from None
    except torch._dynamo.exc.UserError as e:
        text = str(e)
        if "ConstraintViolation" not in text and "marked dynamic" not in text:
            raise CaptureError(
                "compiled_psg needs the loss function as one graph, and Dynamo could not capture it:\n"
                f"{text}\nFix: keep tensor values out of Python control flow (no .item() or bool(tensor) in "
                "branches); use torch.where for data-dependent choices.") from None
        raise CaptureError(
            "the loss function fixes the batch size, so one graph cannot serve every batch size:\n"
            f"{text}\nFix: use x.view(x.shape[0], -1) or x.flatten(1).") from None
    except Exception as e:  # ConstraintViolationError: the batch size got fixed
        text = str(e)
        if "ConstraintViolation" in type(e).__name__ or "marked dynamic" in text or "specialize" in text:
            raise CaptureError(
                "the loss function fixes the batch size (for example x.view(64, -1) or a Python int taken from "
                f"x.shape[0] used as a constant), so one graph cannot serve every batch size:\n{text}\nFix: use "
                "x.view(x.shape[0], -1) or x.flatten(1).") from None
        raise
    finally:
        torch._dynamo.reset_code(joint.__code__)
    if not isinstance(out[0], torch.Tensor):
        raise BatchInputError(f"the loss function must return a tensor, got {type(out[0]).__name__}")
    if "gm" not in state:
        raise CaptureError("Dynamo did not call the compiled_psg backend (was the function already compiled?)")
    roles, constants = _label(state["real"], params, args, set(batch_dims))
    if len(roles) != len(state["fake"]):
        raise CaptureError(f"internal: {len(roles)} Dynamo inputs but {len(state['fake'])} AOT inputs")
    return Captured(joint=state["gm"], roles=roles, constants=constants, fake_inputs=state["fake"],
                    loss_output=int(state["mutations"]))
