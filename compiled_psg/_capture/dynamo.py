"""Capture the user's loss and its parameter gradients as one joint ATen graph, through Dynamo and AOT autograd.

``torch.compile(joint, fullgraph=True)`` with ``trace_autograd_ops`` traces ``loss`` *and*
``torch.autograd.grad(loss, params)``; since no output requires grad, AOT autograd hands one functionalized
graph (forward + backward) to our ``fw_compiler``. Only the batch dimensions are dynamic (``mark_dynamic``), so
every other size is a constant and ``node.meta["val"]`` tells which dimensions carry the batch.

Placeholders are labelled by identity: Dynamo's backend receives the real tensors, so each placeholder is known
to be a named parameter, a batched argument, another argument, a buffer or constant, or a size.

Side-effect free: the capture never runs the loss. The compiled function Dynamo installs raises ``_Abort`` on
its first instruction (the graph call), so neither the graph (buffer updates, in-place ops on inputs) nor
Dynamo's replay of Python side effects (list appends, attribute writes) happens; ``replay_side_effects`` is off
as well. In-place updates of inputs and buffers come back as the joint graph's first outputs
(``Captured.mutated``); the runner applies them on every call (``_compile/run.py``). A registered buffer the
loss rebinds (``self.running = 0.9 * self.running + ...``) is a write of the module's ``_buffers`` dict in Dynamo's
side effects, which are not replayed: the backend appends its new value to the graph's outputs
(``_buffer_rebinds``) and ``Captured.mutated`` carries it after the in-place updates. ``F.embedding`` with
``max_norm`` renorms its weight that way: in Dynamo's graph its lookup renorms the rows per sample
(``_embedding_rows_renormed``), and the in-place renorm runs at the graph's end (``_embedding_max_norm_per_row``).

Guards: the cache entry Dynamo built for the captured frame holds its guards (module structure, hooks, Python
attributes and globals the loss read, tensor metadata, grad mode). ``Captured.guards`` keeps that guard manager
so a later call can ask whether the graph still applies (``Guards.check``) and, if not, why (``Guards.why``).
``global_guards`` adds what Dynamo's guards miss (global module hooks, module classes' methods, numpy inputs).

Settings the capture switches on, each restored when it returns, entered together as ``patches.applied("capture")``
(the registry of every change inside torch, with each one's thread policy and undo) under one process-wide lock
(``CAPTURE_LOCK``: Dynamo and these switches are process-wide, not thread-safe) and Dynamo's compile lock:

- ``torch._dynamo.config.trace_autograd_ops = True``: trace ``torch.autograd.grad`` into the graph.
- ``torch._dynamo.config.allow_rnn = True``: trace ``nn.RNN``/``LSTM``/``GRU`` instead of breaking the graph.
- ``torch._dynamo.config.replay_side_effects = False``: the capture must not write the user's Python objects.
- ``torch._dynamo.config.skip_nnmodule_hook_guards = False``: guard on modules' hooks, so that adding or removing
  a hook after the capture is seen.
- ``torch._dynamo.config.skip_fsdp_guards = False``: guard on FSDP-managed modules (``fully_shard``) like any
  other, so that a changed submodule of a sharded model is seen.
- ``torch._dynamo.config.ignore_logging_functions``: ``logging.Logger`` methods (and ``warning_once``/
  ``info_once`` where a library such as transformers added them), the ``logging`` module functions, and
  ``warnings.warn`` become no-ops in the traced loss instead of graph breaks.
- ``Guard.create``'s log records (logger ``torch._guards``) dropped: a fixed batch size fails the shape guard,
  which torch logs with a traceback before raising; the capture raises its own error instead.
- mkldnn disabled (``torch._C._set_mkldnn_enabled(False)``): float32 RNNs would become fused ``mkldnn_rnn_layer``
  ops whose backward does not trace.
- ``torch.backends.opt_einsum.enabled = False``: opt_einsum plans contractions from concrete sizes, which would
  fix the batch size. (Another thread's eager ``einsum`` during a capture uses the default contraction order.)
- ``ShapeEnv.evaluate_expr`` wrapped (``batch_size_branches.watched``) to record decisions on the batch size that
  a batch of one would make differently (only on the capturing thread).
- stand-ins (``_stand_ins``) for ``nn.modules.transformer._detect_is_causal_mask`` (a data-dependent guard) and
  ``F.linear_cross_entropy`` (its chunked path is opaque), also installed while a call checks the guards.
- torch decompositions that trace to wrong values replaced by correct ones (``corrected_decompositions``:
  ``multilabel_margin_loss_forward``, ``_upsample_bicubic2d_aa``), and those whose trace stops the capture by
  ones that trace (``linalg.inv``, ``cholesky``, ``lu_factor`` and ``solve`` as their ``_ex`` twins and an
  assertion, ``sgn``, ``kron``).

docs/semantics.md ("Every change inside torch") carries the registry's table, checked by tests/test_patches.py.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import gc
import inspect
import logging
import operator
import re
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch._dynamo
import torch.fx as fx
import torch.nn as nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.comptime import comptime
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.multiprocessing.reductions import StorageWeakRef

from .._analyze.mixing import FLAT_ORDER_REFUSAL, batch_length_values
from .._analyze.source import readable_module_path, source_line, where
from .._compat import logs_ignored_functions_in_metrics, torch_minor
from .._errors import BatchInputError, CaptureError, InternalError, PerSampleError, SampleMixingError, UnsupportedError
from . import (  # noqa: F401 - they register capture-phase changes
    backward_semantics,
    batch_size_branches,
    corrected_decompositions,
    global_guards,
    identity_guards,
    patches,
    torch_caches,
)

#: Held while capturing (and while compiling a captured graph): Dynamo is not thread-safe, and the switches above
#: are process-wide. Re-entrant, so a loss that calls another per-sample function still works.
CAPTURE_LOCK = threading.RLock()

_OWN_COMPILATION = (
    "compiled_psg's per-sample functions and DP steps capture and compile the loss themselves (with Dynamo), so "
    "torch.compile cannot trace them: call it outside the torch.compile(fullgraph=True) region (a region without "
    "fullgraph=True runs it as is), and compile only the code around it")


def own_compilation(fn: Callable) -> Callable:
    """``fn``, an entry point (a per-sample function's call, a DP step), skipped by a user's ``torch.compile``:
    traced there, Dynamo would trace compiled_psg's own capture. A compiled region breaks its graph at the call and
    runs it as is; ``fullgraph=True`` refuses that break with torch's error carrying ``_OWN_COMPILATION``."""
    return torch._dynamo.disable(fn, reason=_OWN_COMPILATION)


@dataclass(frozen=True)
class Role:
    """What feeds one placeholder: ``param`` (name), ``arg`` (position; batched or not), ``size``, ``const``."""

    kind: str
    key: object = None
    batched: bool = False


class Guards:
    """Dynamo's guards for the captured frame: does the graph still describe what the loss would do?

    The frame is ``joint``'s: its locals are ``call_args`` (the capture arguments), ``loss_fn``, ``tensors`` (the
    parameters, in order) and ``batched``. A call's arguments must be given as the capture saw them: detached,
    contiguous, with at least two samples (``_api.guard_args``).
    """

    def __init__(self, manager, batched: list, code, stand_ins: bool = False,
                 tensor_sources: list[tuple[str, torch.Tensor]] = (), extra: global_guards.GlobalGuards | None = None):
        self._manager = manager
        self._extra = extra  # what Dynamo's guards miss (global hooks, module classes' methods, numpy inputs)
        # Tensors the graph took from the loss's closure, globals or module attributes, with Dynamo's source for
        # each: Dynamo's guards check their metadata, not which tensor object is there, and the runner keeps
        # passing the captured object. A replaced tensor (``model.temp = torch.tensor(3.)``) must recapture.
        self._tensor_sources = [(name, compile(name, "<tensor source>", "eval"), t) for name, t in tensor_sources
                                if _evaluable(name)]
        self._batched = batched
        self._stand_ins = stand_ins  # the loss called a stand-in: its guards hold the stand-in's identity
        # The guards read names Dynamo installed in this module's globals, which Dynamo deletes with the frame's
        # cache entry; the entry lives on ``code`` (unique to this capture) until these guards die. Dynamo keeps
        # code objects referenced, so the entry (and the graph it holds) is dropped explicitly.
        weakref.finalize(self, torch._dynamo.reset_code, code)
        self._stale: str | None = None
        identity_guards.adopt(manager, self)

    def stale(self, reason: str) -> None:
        """Mark these guards failed for good (an object they matched by identity was freed)."""
        self._stale = reason

    def _locals(self, loss_fn, tensors: list, args: tuple) -> dict:
        return {"call_args": args, "loss_fn": loss_fn, "tensors": tensors, "batched": self._batched}

    def _replaced_tensor(self, f_locals: dict) -> str | None:
        """The source of the first captured tensor that is no longer the object the loss would read."""
        scope = {"G": globals(), "L": f_locals}
        for name, code, tensor in self._tensor_sources:
            try:
                current = eval(code, scope)  # noqa: S307 - Dynamo's own source expression for a graph input
            except Exception:  # the path no longer resolves: the metadata guards decide
                continue
            if current is not tensor:
                return name
        return None

    def check(self, loss_fn, tensors: list, args: tuple) -> bool:
        if self._stale is not None:
            return False
        f_locals = self._locals(loss_fn, tensors, args)
        if self._tensor_sources and self._replaced_tensor(f_locals) is not None:
            return False
        if self._extra is not None and self._extra.failure(f_locals) is not None:
            return False
        # the capture ran with grad enabled; so does every call of the graph
        if not self._stand_ins:  # the common case, without a context manager's cost
            grad = torch.is_grad_enabled()
            torch._C._set_grad_enabled(True)
            try:
                return self._manager.check(f_locals) or not self._failing(f_locals)
            finally:
                torch._C._set_grad_enabled(grad)
        with self._as_captured():
            return self._manager.check(f_locals) or not self._failing(f_locals)

    @contextlib.contextmanager
    def _as_captured(self):
        """Grad mode and, when the loss called one, the stand-ins of the capture (``_replaced_functions``): the
        guards hold their identity."""
        if not self._stand_ins:
            with torch.enable_grad():
                yield
            return
        with CAPTURE_LOCK, patches.applied("guard check"), torch.enable_grad():
            yield

    def _failing(self, f_locals: dict) -> list[str]:
        """The failing guards, less those on the batch size alone: the shape environment's guards (``16 <= B``
        from a meta function's heuristic, ``B == B'`` between batched arguments) are checked last, and the
        rewritten graph serves every batch size (``_api.batch_dims_of`` checks that batched arguments agree)."""
        info = self._manager.check_verbose(f_locals)
        parts = [" ".join(p.split()) for p in getattr(info, "verbose_code_parts", [])]
        return [p for p in parts if not _on_batch_size_only(p)]

    def why(self, loss_fn, tensors: list, args: tuple) -> str:
        """The failing guard's text (what changed since the capture)."""
        if self._stale is not None:
            return self._stale
        replaced = self._replaced_tensor(self._locals(loss_fn, tensors, args))
        if replaced is not None:
            return f"{replaced} is another tensor object than at capture"
        extra = self._extra.failure(self._locals(loss_fn, tensors, args)) if self._extra is not None else None
        if extra is not None:
            return extra
        with self._as_captured():
            parts = self._failing(self._locals(loss_fn, tensors, args))
        return "; ".join(parts) or "a guard failed"


_SIZE = re.compile(r"L\['call_args'\]\[\d+\]\.size\(\)\[\d+\]")
_ARITHMETIC = re.compile(r"^[\d\s()<>=!+*/%-]*$")


_SOURCE = re.compile(r"^[GL]\[[^\]]+\](\.[A-Za-z_]\w*|\[('[^']*'|\d+)\])*$")


def _evaluable(name: str) -> bool:
    """A Dynamo source made of item and attribute reads from ``G``/``L`` only (no helper functions)."""
    return bool(_SOURCE.match(name))


def _on_batch_size_only(part: str) -> bool:
    """Whether a guard's text (before its ``#`` comment) compares argument sizes and numbers only; every other
    size is static, so such a guard is on the batch size."""
    for clause in part.split(";"):
        code = clause.split("#", 1)[0]
        if not _SIZE.search(code) or not _ARITHMETIC.match(_SIZE.sub("0", code).replace(" and ", " ")):
            return False
    return True


@dataclass
class Captured:
    joint: fx.GraphModule
    roles: list[Role]
    constants: dict[int, object]  # placeholder index -> the real value, for kind "const"
    fake_inputs: list
    loss_output: int  # index of the loss among the joint graph's outputs
    #: placeholder indices whose data the loss updates in place, in the order of the joint graph's first outputs
    mutated: list[int] = field(default_factory=list)
    #: the joint graph reduced to those first outputs: the inputs' new values, from the inputs' old values
    mutation_graph: fx.GraphModule | None = None
    guards: Guards | None = None
    #: ``torch.autograd.grad`` calls inside the loss (not the capture's own): (create_graph, the user's line)
    inner_grads: list[tuple[bool, str]] = field(default_factory=list)
    #: decisions on the batch size that a batch of one makes differently (``batch_size_branches``)
    batch_size_branches: list[str] = field(default_factory=list)
    #: torch's backward formulas that turned an expression in the batch size into a number (celu's
    #: ``alpha=float(len(x))``), named with the op's lines: the guard check's refusal names them
    backward_numbers: list[str] = field(default_factory=list)
    #: in-place writes of parameters or buffers that read a batched argument, found once (``_train.release``)
    batch_dependent_writes: list | None = None
    #: placeholder index -> how the user names a constant tensor the loss reads from outside the model (a global,
    #: a tensor the loss closes over), from Dynamo's source of it (``tensor_names``)
    tensor_names: dict[int, str] = field(default_factory=dict)


class _Abort(Exception):
    """Raised by the function Dynamo compiled, instead of running it: the capture has no side effects."""


def _abort(*_args):
    raise _Abort()


# One backend for every capture: Dynamo keeps each backend it sees alive for the whole process, so a closure per
# capture would keep that capture's model and batch alive. The per-capture state lives in _pending (under the
# lock) and is cleared when the capture returns.
_pending: dict[str, object] = {}


def _fw_compiler(gm, example_inputs):
    _pending["gm"], _pending["fake"] = gm, list(example_inputs)
    torch_caches.track(getattr(torch._guards.detect_fake_mode(example_inputs), "shape_env", None))
    ctx = torch._guards.TracingContext.try_get()
    _pending["meta"] = getattr(ctx, "fw_metadata", None)
    return _abort


_aot_backend = aot_autograd(fw_compiler=_fw_compiler)


def _backend(gm, example_inputs):
    _pending["dynamo_graph"] = gm  # to name the user's line of a node AOT autograd fails on
    _pending["real"] = list(example_inputs)
    _pending["sources"] = [getattr(getattr(n.meta.get("grapharg"), "source", None), "name", None)
                           for n in gm.graph.nodes if n.op == "placeholder"]
    _pending["inner_grads"] = _inner_grad_calls(gm)
    _pending["backward_changes"] = backward_semantics.custom_backward_sites(gm)
    backward_semantics.detach_in_place(gm)
    _pending["backward_changes"] += _detach_values_from_no_grad(gm)
    _embedding_max_norm_per_row(gm)
    _pending["rebinds"] = _buffer_rebinds(gm)
    _pending["backward_changes"] += _hooks_registered_on_inputs()
    return _aot_backend(gm, example_inputs)


def _hooks_registered_on_inputs() -> list[str]:
    """Hooks the loss registers on a tensor from outside it (``model.w.register_hook(f)`` inside the loss): Dynamo
    keeps them as side effects to replay after the frame, not as graph nodes (a hook on a value the loss computes
    is a ``register_hook`` node, refused by ``backward_semantics``). The capture replays no side effect, so the
    hook would never run: the per-sample gradients would differ from eager autograd's wherever it changes them."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    sites = []
    for tensor, hook, _, name in InstructionTranslator.current_tx().output.side_effects.tensor_hooks.values():
        source = getattr(tensor, "source", None)
        target = _source_name(source) if source is not None else None
        target = (readable_module_path(target).replace("._parameters.", ".") if target
                  else "a tensor from outside the loss")
        code = hook.get_code() if hasattr(hook, "get_code") else None
        line = f" (the hook {code.co_name} at {code.co_filename}:{code.co_firstlineno})" if code is not None else ""
        sites.append(f"{name} on {target} inside the loss{line}: the hook would change or read the gradient, and "
                     "compiled_psg derives per-sample gradients from the forward ops and runs no hook registered "
                     "there. Fix: register no hook inside the loss; express a change of the gradient in the loss "
                     "(scale with x.detach() * (1 - s) + x * s)")
    return sites


@dataclass(frozen=True)
class _Rebind:
    """A registered buffer the loss rebinds (``self.running = 0.9 * self.running + 0.1 * x.mean(0)``), seen in
    Dynamo's side effects: ``nn.Module.__setattr__`` writes the module's ``_buffers`` dict, a write the capture
    does not replay. ``placeholder``: the index of the graph input that holds the buffer, None where the loss does
    not read it; ``output``: the index of the new value among the Dynamo graph's outputs (appended), None where
    the new value is not a tensor of the graph (``self.running = None``)."""

    module: str
    buffer: str
    placeholder: int | None
    output: int | None
    line: str  # "" where the new value is not a node of the graph


_BUFFERS = re.compile(r"(?:\._buffers|\.__dict__\['_buffers'\])$")


def _source_name(source) -> str | None:
    """Dynamo's expression for a source (a property from torch 2.13 on, a method before), None for a source that
    has none (it raises NotImplementedError)."""
    try:
        name = source.name
        return name if isinstance(name, str) else name()
    except NotImplementedError:
        return None


def _buffer_rebinds(gm: fx.GraphModule) -> list[_Rebind]:
    """The buffers the traced loss rebinds, each new value appended (detached) to ``gm``'s outputs so that AOT
    autograd traces it: the capture applies it as it applies an in-place write (``_finish``)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator
    from torch._dynamo.variables import ConstDictVariable, TensorVariable

    side_effects = InstructionTranslator.current_tx().output.side_effects
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = gm.graph.output_node()
    outs = list(output.args[0])
    rebinds = []
    for vt in list(side_effects.id_to_variable.values()):  # every Python object the trace wrote
        if not isinstance(vt, ConstDictVariable) or getattr(vt, "source", None) is None \
                or not side_effects.is_modified(vt):
            continue
        name = _source_name(vt.source)
        if name is None or not _BUFFERS.search(name):
            continue
        original = getattr(vt, "original_items", {})
        for key, value in vt.items.items():
            before = original.get(key.vt)
            if not vt.is_new_item(before, value):
                continue
            buffer = key.vt.as_python_constant()
            module = readable_module_path(_BUFFERS.sub("", name)) or "the model"
            read = before.as_proxy().node if isinstance(before, TensorVariable) and before.is_realized() else None
            placeholder = placeholders.index(read) if read in placeholders else None
            index, line = None, ""
            if isinstance(value, TensorVariable) and value.as_proxy().node.graph is gm.graph:
                node = value.as_proxy().node
                with gm.graph.inserting_before(output):
                    detached = gm.graph.call_method("detach", (node,))
                detached.meta = dict(node.meta)
                index, line = len(outs), source_line(node)
                outs.append(detached)
            rebinds.append(_Rebind(module, buffer, placeholder, index, line))
    if rebinds:
        output.args = (tuple(outs),)
        gm.recompile()
    return rebinds


def _embedding_rows_renormed(input, weight, padding_idx=None, max_norm=None, norm_type=2.0,
                             scale_grad_by_freq=False, sparse=False):
    """The values eager ``F.embedding`` with ``max_norm`` returns, in ops that keep samples apart.

    Eager renormalizes, in place and outside autograd, every weight row the batch looks up, then looks the rows
    up: the values are the renormed rows, and the weight's gradient is the lookup's (the renorm is not
    differentiated). Here the rows are looked up and renormed one by one, as ``embedding_renorm_`` does, and the
    gradient passes them unscaled. A sample's rows are renormed from its own rows only, as on a batch of one
    (the renorm is idempotent, so a second lookup reads the same values)."""
    rows = _original_embedding(input, weight, padding_idx, None, norm_type, scale_grad_by_freq, sparse)
    values = rows.detach()
    norms = torch.linalg.vector_norm(values, norm_type, dim=-1, keepdim=True)
    scale = torch.where(norms > max_norm, max_norm / (norms + 1e-7), torch.ones_like(norms))
    return values * scale + (rows - values)


def _renorm_in_place(weight, input, max_norm, norm_type) -> None:
    """Eager ``F.embedding``'s update of the weight; AOT autograd records it as a mutation under ``no_grad``,
    which the runner applies on every call (``Captured.mutated``)."""
    with torch.no_grad():
        torch.embedding_renorm_(weight, input, max_norm, norm_type)


_original_embedding = torch.nn.functional.embedding
_EMBEDDING_SIGNATURE = inspect.signature(_original_embedding)
_EMBEDDING_BAG_SIGNATURE = inspect.signature(torch.nn.functional.embedding_bag)


def _embedding_max_norm_per_row(gm: fx.GraphModule) -> int:
    """``F.embedding(..., max_norm=...)`` in Dynamo's graph: each lookup reads the rows renormed one by one
    (``_embedding_rows_renormed``), and the in-place renorms of the weight run, in order, at the end of the
    graph. Returns how many lookups. Without it, the renorm of a parameter through ``weight.detach()`` makes AOT
    autograd split a forward and a backward graph, and a sample would read rows renormed by the whole batch.

    Eager code that reads the weight after a lookup (tied weights, ``h @ emb.weight.T``) reads it renormed from
    every sample's indices: refused (``SampleMixingError``), noted in ``_pending`` for the capture to raise."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    lookups = []
    for node in list(graph.nodes):
        if (node.op == "call_function" and node.target is torch.nn.functional.embedding_bag
                and _EMBEDDING_BAG_SIGNATURE.bind(*node.args, **node.kwargs).arguments.get("max_norm") is not None):
            _pending.setdefault("refusal", UnsupportedError(
                f"nn.EmbeddingBag(max_norm=...) (F.embedding_bag) at {where(node)}: compiled_psg computes "
                "per-sample gradients of nn.Embedding's max_norm, not of EmbeddingBag's, whose in-place renorm of "
                "the batch's rows feeds the bags (a write it cannot capture as it is). Fix: renormalize outside "
                "the loss (with torch.no_grad(): bag.weight.renorm_(2, 0, max_norm)) and construct the "
                "EmbeddingBag with max_norm=None"))
        if node.op != "call_function" or node.target is not torch.nn.functional.embedding:
            continue
        bound = _EMBEDDING_SIGNATURE.bind(*node.args, **node.kwargs)
        bound.apply_defaults()
        args = bound.arguments
        if args["max_norm"] is None:
            continue
        with graph.inserting_after(node):  # the indices as the lookup saw them
            contiguous = graph.call_method("contiguous", (args["input"],))
        with graph.inserting_after(contiguous):
            indices = graph.call_method("clone", (contiguous,))
        contiguous.meta.update(node.meta)
        indices.meta.update(node.meta)
        node.target = _embedding_rows_renormed
        lookups.append((node, args["weight"], indices, args["max_norm"], args["norm_type"]))
    first: dict[fx.Node, fx.Node] = {}
    for node, weight, *_ in lookups:
        first.setdefault(weight, node)
    skip = {n for n, *_ in lookups}
    for weight, lookup in first.items():
        if not isinstance(weight, fx.Node):
            continue
        # a view taken before the lookup (wt = emb.weight.t()) reads the renormed values too
        readers = [u for alias in _aliases(graph, weight) for u in alias.users]
        for user in readers:
            if user in skip or user.target is torch.autograd.grad or order.get(user, -1) < order[lookup]:
                continue
            _pending.setdefault("refusal", SampleMixingError(
                f"per-sample gradients are undefined for this loss: at {where(user)}, the loss reads an embedding "
                f"weight after F.embedding(max_norm=...) at {where(lookup)} renormalized it in place from the whole "
                "batch's indices (tied weights such as h @ emb.weight.T), so each sample would read rows renormed "
                "for other samples. Fix: renormalize outside the loss (with torch.no_grad(): "
                "emb.weight.renorm_(2, 0, max_norm)) and construct the embedding with max_norm=None"))
    with graph.inserting_before(graph.output_node()):
        for _, weight, indices, max_norm, norm_type in lookups:
            graph.call_function(_renorm_in_place, (weight, indices, max_norm, norm_type))
    if lookups:
        graph.lint()
        gm.recompile()
    return len(lookups)


def _aliases(graph: fx.Graph, node: fx.Node) -> list[fx.Node]:
    """``node`` and the nodes of Dynamo's graph whose value shares its storage (views of it)."""
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor):
        return [node]
    storage = StorageWeakRef(value.untyped_storage())
    return [n for n in graph.nodes if n is node or (isinstance(n.meta.get("example_value"), torch.Tensor)
            and StorageWeakRef(n.meta["example_value"].untyped_storage()) == storage)]


def _is_tensor_value(node: fx.Node) -> bool:
    return isinstance(node.meta.get("example_value"), torch.Tensor)


def _detach_values_from_no_grad(gm: fx.GraphModule) -> list[str]:
    """Detach every value computed with grad disabled (``torch.no_grad()``, ``set_grad_enabled(False)``,
    ``inference_mode()``) where code with grad enabled uses it, and every value written in place with grad
    disabled (``snap.copy_(h)`` into a tensor made before, an EMA buffer's ``mul_``/``add_``, ``b[0] = w``) or
    through a detached alias (``s.data.copy_(h)``) where code with grad enabled reads it later. Returns the
    refusals: a write with grad disabled into a tensor with a gradient history, one line each (eager autograd
    differentiates its old value while it holds the new one).

    Why: AOT autograd's joint graph carries no grad mode, and the per-sample backward is re-derived from its forward
    ops (``retrace.py``), which would differentiate through a no-grad region or an in-place write (functionalized
    into ``copy(t, h)``). An explicit ``detach`` keeps the user's meaning in the ATen graph.
    Post: no node that runs with grad enabled reads a value computed or written with grad disabled except through
    ``detach``.
    """
    enabled, no_grad, detached, outer = True, set(), {}, []
    written: set[fx.Node] = set()  # values written in place with grad disabled (and every view of them)
    sites: list[str] = []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            enabled = bool(node.args[0])
            continue
        if node.op == "call_function" and node.target is torch.autograd.grad_mode._enter_inference_mode:
            outer.append(enabled)
            enabled = enabled and not node.args[0]
            continue
        if node.op == "call_function" and node.target is torch.autograd.grad_mode._exit_inference_mode:
            enabled = outer.pop() if outer else True
            continue
        if not enabled:
            if node.op in ("call_function", "call_method", "call_module"):
                no_grad.add(node)
                target = _written_in_place(node)
                if target is not None and not getattr(target.meta.get("example_value"), "requires_grad", False):
                    # ``snap.copy_(h)``: later reads see a value autograd does not track
                    written.update(a for a in _aliases(gm.graph, target) if a not in no_grad)
                elif target is not None and not getattr(target.meta.get("example_value"), "is_leaf", True):
                    sites.append(f"an in-place write with grad disabled at {where(node)} into a tensor that has "
                                 "a gradient history: eager autograd keeps differentiating its old value while it "
                                 "holds the new one, which a graph of values cannot express. Fix: write into a "
                                 "fresh tensor (torch.zeros_like(t)) or .detach() it first")
            continue
        target = _written_in_place(node)
        if target is not None and _is_detached_alias(target):  # ``s.data.copy_(h)``: invisible to ``s``'s autograd
            written.update(a for a in _aliases(gm.graph, target) if a is not target
                           and not getattr(a.meta.get("example_value"), "requires_grad", True))
        reads = [a for a in node.all_input_nodes if (a in no_grad or a in written) and _is_tensor_value(a)]
        if target is not None:
            reads = [a for a in reads if a is not target]  # a later write, not a read
        for value in reads:
            if value not in detached:
                with gm.graph.inserting_before(node):
                    detached[value] = gm.graph.call_method("detach", (value,))
                    if "example_value" in value.meta:
                        detached[value].meta["example_value"] = value.meta["example_value"]
            node.replace_input_with(value, detached[value])
    if detached:
        gm.graph.lint()
        gm.recompile()
    return sites


def _is_detached_alias(node: fx.Node) -> bool:
    """``t.data`` or ``t.detach()``: a view of ``t``'s values whose writes ``t``'s autograd does not see."""
    return (node.op == "call_function" and node.target is torch._C._autograd._get_data_attr) or \
        (node.op == "call_method" and node.target == "detach")


def _written_in_place(node: fx.Node) -> fx.Node | None:
    """The tensor a node of Dynamo's graph writes in place (``t.copy_(v)``, ``t.mul_(s)``, ``t[i] = v``,
    ``torch.add(a, b, out=t)``), or None."""
    if node.op == "call_method" and isinstance(node.target, str) and node.target.endswith("_") \
            and not node.target.startswith("_") and node.args and isinstance(node.args[0], fx.Node):
        return node.args[0]
    if node.op == "call_function" and node.target is operator.setitem and isinstance(node.args[0], fx.Node):
        return node.args[0]
    out = node.kwargs.get("out") if node.op == "call_function" else None
    return out if isinstance(out, fx.Node) else None


_GRAD_SIGNATURE = inspect.signature(torch.autograd.grad)


def _inner_grad_calls(gm: fx.GraphModule) -> list[tuple[bool, str]]:
    """The loss's own ``torch.autograd.grad`` calls in Dynamo's graph, with their ``create_graph``: every call
    but the last, which is the capture's (``joint`` calls it after the loss returned). The AOT graph records an
    inner backward the same way with or without ``create_graph``; only here does it show."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.autograd.grad]
    found = []
    for node in calls[:-1]:
        bound = _GRAD_SIGNATURE.bind_partial(*node.args, **node.kwargs)
        found.append((bool(bound.arguments.get("create_graph", False)), where(node)))
    return found


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


def _note_stand_in(ctx) -> None:
    """Runs while Dynamo traces a stand-in (a no-op in eager calls): the capture's guards will need it."""
    _pending["stand_ins"] = True


def _no_causal_mask_detection(mask, is_causal=None, size=None) -> bool:
    """``nn.modules.transformer._detect_is_causal_mask`` without looking at the mask's values: the hint as given.

    The original compares the mask with a causal one (``bool((mask == causal).all())``), a data-dependent guard
    that Dynamo cannot trace. Its answer only picks an implementation (``is_causal=True`` lets attention skip the
    explicit mask); with ``False`` the mask given is applied as is, which computes the same attention."""
    comptime(_note_stand_in)
    return is_causal is True


_original_linear_cross_entropy = getattr(torch.nn.functional, "linear_cross_entropy", None)  # new in torch 2.13


def _linear_cross_entropy_reference(*args, options=None, **kwargs):
    """``F.linear_cross_entropy`` on its reference path (``options=None``): ``cross_entropy(linear(x))``.

    With ``options`` the loss runs a chunked custom op that computes its gradients inside the forward, opaque to
    autograd tracing (``torch.func.grad`` fails on it too). The reference path computes the same loss; torch itself
    falls back to it under ``torch.jit.trace``. Chunking would save no memory here: per-sample gradients of the
    projection are as large as the logits it avoids."""
    comptime(_note_stand_in)
    return _original_linear_cross_entropy(*args, **kwargs)


def _stand_ins() -> list[tuple[object, str, object]]:
    """``(module, attribute, stand-in)``: library functions Dynamo cannot trace, and equivalent ones it can."""
    stand_ins = [(torch.nn.modules.transformer, "_detect_is_causal_mask", _no_causal_mask_detection)]
    if _original_linear_cross_entropy is not None:
        stand_ins.append((torch.nn.functional, "linear_cross_entropy", _linear_cross_entropy_reference))
    return stand_ins


@contextlib.contextmanager
def _replaced_functions():
    """The stand-ins installed while capturing, and while checking the capture's guards (which hold the
    stand-ins' identity). Process-wide, like every switch here: another thread's eager call in that window takes
    the stand-in, which computes the same values."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in _stand_ins()]
    try:
        for module, name, stand_in in _stand_ins():
            setattr(module, name, stand_in)
        yield
    finally:
        for module, name, before in saved:
            setattr(module, name, before)


_DYNAMO_KEYS = ("trace_autograd_ops", "allow_rnn", "replay_side_effects", "skip_nnmodule_hook_guards",
                "skip_fsdp_guards", "ignore_logging_functions")


def _dynamo_settings():
    return torch._dynamo.config.patch(trace_autograd_ops=True, allow_rnn=True, replay_side_effects=False,
                                      skip_nnmodule_hook_guards=False, skip_fsdp_guards=False,
                                      ignore_logging_functions=_ignored_logging_functions())


patches.register(patches.Patch(
    "Dynamo settings", "torch._dynamo.config: " + ", ".join(_DYNAMO_KEYS),
    "trace torch.autograd.grad and RNNs into one graph; never write the user's objects (no side-effect replay); "
    "guard on hooks and FSDP modules; logging calls become no-ops in the traced loss (module docstring)",
    ("capture",), "process-wide config; another thread's torch.compile waits on Dynamo's compile lock",
    "torch._dynamo.config.patch restores each value on exit", enter=_dynamo_settings,
    current=lambda: tuple(getattr(torch._dynamo.config, k) for k in _DYNAMO_KEYS)))
_METRICS_LOGGER = "torch._dynamo.metrics_context"
_METRICS_FAILURE = "Unexpected exception logging compilation metrics"


class _Drop(logging.Filter):
    """Drops the records ``dropped(record)`` names."""

    def __init__(self, dropped: Callable[[logging.LogRecord], bool]):
        super().__init__()
        self.dropped = dropped

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.dropped(record)


def _records_dropped(logger_name: str, dropped: Callable[[logging.LogRecord], bool]):
    """A context manager that filters ``dropped`` records out of one logger, removing the filter on exit."""
    @contextlib.contextmanager
    def enter() -> Iterator[None]:
        logger, drop = logging.getLogger(logger_name), _Drop(dropped)
        logger.addFilter(drop)
        try:
            yield
        finally:
            logger.removeFilter(drop)
    return enter


_metrics_failure_dropped = _records_dropped(_METRICS_LOGGER,
                                            lambda record: record.getMessage().startswith(_METRICS_FAILURE))


patches.register(patches.Patch(
    "metrics failure unlogged", f"logging.getLogger({_METRICS_LOGGER!r}).filters",
    "torch < 2.13 fails to write a compile's metrics while ignore_logging_functions holds functions (it sorts and "
    "JSON-dumps every set of Dynamo's config) and logs that failure with a traceback: dropped during a capture; "
    "the compile is unaffected", ("capture",), "every thread's records of that logger, during a capture",
    "the filter removed on exit", enter=_metrics_failure_dropped,
    current=lambda: tuple(logging.getLogger(_METRICS_LOGGER).filters), only_if=logs_ignored_functions_in_metrics))
_GUARDS_LOGGER = "torch._guards"


# ``Guard.create``'s records: the guard it failed to build, with the exception, then where it was made
_guard_failures_dropped = _records_dropped(
    _GUARDS_LOGGER, lambda record: record.funcName == "create"
    and record.pathname.replace("\\", "/").endswith("torch/_guards.py"))


patches.register(patches.Patch(
    "guard failures unlogged", f"logging.getLogger({_GUARDS_LOGGER!r}).filters",
    "a batch size fixed while capturing fails Dynamo's shape guard, which torch logs (Guard.create: 'Error while "
    "creating guard', a ConstraintViolationError's traceback, 'Created at') before it raises; the capture raises "
    "its own error, naming the cause: those records dropped during a capture", ("capture",),
    "every thread's records of Guard.create, during a capture", "the filter removed on exit",
    enter=_guard_failures_dropped, current=lambda: tuple(logging.getLogger(_GUARDS_LOGGER).filters)))
_FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"
_META_FAILURE = "failed while attempting to run meta"
_meta_failures_dropped = _records_dropped(_FAKE_TENSOR_LOGGER,
                                          lambda record: str(record.msg).startswith(_META_FAILURE))
patches.register(patches.Patch(
    "meta failures unlogged", f"logging.getLogger({_FAKE_TENSOR_LOGGER!r}).filters",
    "an op that fails on fake tensors (a batch of the wrong width, an op whose shape function cannot take a "
    "symbolic size) is logged by torch with its whole traceback ('failed while attempting to run meta for ...') "
    "before the exception propagates; the capture raises its own error, naming the cause: those records dropped "
    "during a capture", ("capture",), "every thread's records of that message, during a capture",
    "the filter removed on exit", enter=_meta_failures_dropped,
    current=lambda: tuple(logging.getLogger(_FAKE_TENSOR_LOGGER).filters)))
patches.register(patches.Patch(
    "mkldnn off", "torch._C._set_mkldnn_enabled", "float32 RNNs would become mkldnn_rnn_layer ops whose backward "
    "does not trace", ("capture",), "process-wide flag: another thread's eager RNN in that window runs the "
    "native kernel (same values)", "the flag restored on exit",
    enter=patches.flag_set(torch._C._get_mkldnn_enabled, torch._C._set_mkldnn_enabled, False),
    current=lambda: (torch._C._get_mkldnn_enabled(),)))
patches.register(patches.Patch(
    "anomaly mode off", "torch.set_anomaly_enabled",
    "under anomaly mode autograd checks each gradient's values for NaN, a data-dependent guard that stops the "
    "capture's and the retrace's traces of torch.autograd.grad; the graphs are the same without it", ("rewrite",),
    "process-wide flag: another thread's backward in that window runs without anomaly checks",
    "the flag (and its check_nan) restored on exit",
    enter=patches.flag_set(lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
                           lambda v: torch.set_anomaly_enabled(*v), (False, True)),
    current=lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())))
patches.register(patches.Patch(
    "opt_einsum off", "torch.backends.opt_einsum.enabled", "opt_einsum plans contractions from concrete sizes, "
    "which would fix the batch size", ("capture",), "process-wide flag: another thread's eager einsum in that "
    "window uses the default contraction order (same values)", "the attribute restored on exit",
    # the module attribute alone: torch.backends.opt_einsum.flags restores ``strategy`` through a setter that
    # raises while disabled (torch.backends.mkldnn.flags likewise sets a deprecated TF32 flag: a warning)
    enter=patches.flag_set(lambda: torch.backends.opt_einsum.enabled,
                           lambda v: setattr(torch.backends.opt_einsum, "enabled", v), False),
    current=lambda: (torch.backends.opt_einsum.enabled,)))
patches.register(patches.Patch(
    "stand-ins", "torch.nn.modules.transformer._detect_is_causal_mask, torch.nn.functional.linear_cross_entropy",
    "the first reads the mask's values (a data-dependent guard); the second's chunked path is opaque to "
    "autograd tracing: equivalent functions Dynamo can trace (_stand_ins; the second exists from torch 2.13)",
    ("capture", "guard check"),
    "process-wide module attributes: another thread's eager call in that window takes the stand-in, which "
    "computes the same values", "the original attributes restored on exit", enter=_replaced_functions,
    current=lambda: tuple(getattr(module, name) for module, name, _ in _stand_ins())))


def _ignored_logging_functions() -> set:
    """Logging calls that become no-ops in the traced loss (library code logs, e.g. transformers' warning_once)."""
    names = ("debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log",
             "warning_once", "info_once")
    functions = {getattr(logging.Logger, n) for n in names if hasattr(logging.Logger, n)}
    functions |= {getattr(logging, n) for n in names if callable(getattr(logging, n, None))}
    functions.add(warnings.warn)
    return functions


def _fixed_in_our_backward(text: str) -> bool:
    """Whether Dynamo's user stack ends in ``joint``'s own ``torch.autograd.grad`` over the loss: the batch size
    was fixed by a backward formula, the user's loss code ran without fixing it."""
    stack = text.partition("User stack:")[2].strip().splitlines()
    frames = [line for line in stack if line.strip().startswith("File ")]
    return bool(frames) and __file__.rstrip("c") in frames[-1] and any(
        "torch.autograd.grad(total" in line for line in stack)


def _note_not_a_tensor(ctx) -> None:
    _pending["refusal"] = BatchInputError(
        "the loss function must return a tensor (a scalar loss or per-sample losses [B]), got "
        f"{ctx.get_local('loss').python_type().__name__}. Fix: return one tensor; compute other outputs outside the "
        "loss function")


def _note_no_gradient(ctx) -> None:
    _pending["refusal"] = BatchInputError(
        "the loss has no gradient with respect to the parameters: it is a constant, detached (.detach(), "
        "torch.no_grad(), a Python number turned back into a tensor), or uses no parameter. Fix: return the "
        "differentiable loss, as loss.backward() would need it")


def _note_other_tensors(ctx) -> None:
    _pending["refusal"] = BatchInputError(
        "the loss uses none of the parameters given to per_sample, yet it has a gradient: it reads other tensors "
        "that require grad (another model than the one passed: an EMA copy, a teacher, a second network). Fix: "
        "pass the model (or the dict of tensors) the loss trains, psg.per_sample(that_model); call the other "
        "model under torch.no_grad() if it should not train")


def _note_complex(ctx) -> None:
    _pending["refusal"] = BatchInputError(
        "the loss is complex: a gradient needs a real loss, as loss.backward() does. Fix: return a real loss, such "
        "as the squared modulus (z.abs() ** 2) or the real part (z.real) of a complex one")


def _make_joint(loss_fn, tensors: list, batched: list):
    """The function Dynamo traces; its locals are what ``Guards`` evaluates."""

    def joint(*call_args):
        first_pos, first_dim = batched[0]
        for pos, dim in batched[1:]:  # one batch symbol for every batched argument
            torch._check(call_args[pos].shape[dim] == call_args[first_pos].shape[first_dim])
        loss = loss_fn(*call_args)
        # A refusal is noted while tracing (comptime runs at trace time only): raising here would be a graph break
        # reported in Dynamo's words.
        if not isinstance(loss, torch.Tensor):
            comptime(_note_not_a_tensor)
            return (None,)
        if not loss.requires_grad:  # known while tracing: the loss is constant in the parameters (or detached)
            comptime(_note_no_gradient)
            return (None,)
        if loss.is_complex():  # autograd.grad would say "only for real scalar outputs" inside the trace
            comptime(_note_complex)
            return (None,)
        total = loss.sum() if loss.dim() > 0 else loss
        grads = torch.autograd.grad(total, tensors, allow_unused=True)
        if tensors and all(g is None for g in grads):  # known while tracing: it reaches other tensors than these
            comptime(_note_other_tensors)
            return (None,)
        return (loss.detach(), *grads)

    # A code object of its own per capture: Dynamo's cache entry for it (which holds the guards and the globals
    # they read) then lives exactly as long as this capture's Guards.
    joint.__code__ = joint.__code__.replace()
    return joint


def capture_joint(loss_fn, params: dict[str, torch.Tensor], args: tuple, batch_dims: dict[int, int]) -> Captured:
    """Trace ``loss_fn(*args)`` and its gradients w.r.t. ``params``; ``batch_dims``: arg position -> batch dim.

    Pre: ``args``' batched tensors are fresh objects the caller lets us mark dynamic (``_api._capture_args``).
    Post: nothing the user owns changed (the loss did not run); the lock is released and no switch left flipped.
    """
    with CAPTURE_LOCK:
        try:
            return _capture(loss_fn, params, args, batch_dims)
        finally:
            _pending.clear()


def _batchnorm_cumulative_average(text: str) -> SampleMixingError | None:
    """The cumulative average of BatchNorm(momentum=None) in train mode, where Dynamo stopped (a data-dependent
    guard): batch statistics anyway."""
    if "data-dependent" not in text or "nn/modules/batchnorm.py" not in text:
        return None
    return SampleMixingError(
        "per-sample gradients are undefined for this loss: samples are mixed. BatchNorm in training mode "
        "normalizes each sample with statistics of the whole batch (Dynamo stopped at its cumulative "
        "average, momentum=None). Fix: call model.eval() so BatchNorm uses its running statistics, or "
        "replace BatchNorm with GroupNorm or LayerNorm")


def _check_arguments(loss_fn, args: tuple) -> None:
    """The loss function takes the call's arguments, as Python would check; else a ``BatchInputError`` saying so
    (Dynamo would report it as a graph break)."""
    try:
        # not through functools.wraps: a wrapper may pass its callee arguments of its own (the model)
        signature = inspect.signature(loss_fn, follow_wrapped=False)
    except (TypeError, ValueError):  # a builtin or an object without a signature: the call itself will tell
        return
    try:
        signature.bind(*args)
    except TypeError as e:
        name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
        raise BatchInputError(
            f"the loss function {name}{signature} cannot take the {len(args)} argument(s) it is called with ({e}). "
            "Fix: make its parameters the batch's parts, in order: the step calls loss_fn(*batch), and the model "
            "and parameters reach it as a closure, not as arguments") from None


def _capture(loss_fn, params: dict[str, torch.Tensor], args: tuple, batch_dims: dict[int, int]) -> Captured:
    _check_arguments(loss_fn, args)
    names = list(params)
    tensors = [params[n] for n in names]
    batched = sorted(batch_dims.items())
    joint = _make_joint(loss_fn, tensors, batched)
    for pos, dim in batch_dims.items():
        torch._dynamo.mark_dynamic(args[pos], dim)
    # torch.compile would wrap _backend in a new object per call, which Dynamo caches for the whole process.
    compiled = torch._dynamo.optimize(_backend, nopython=True, dynamic=False)(joint)
    manager, out, branches = None, None, []
    try:
        with patches.applied("capture") as entered, torch.enable_grad():
            branches = entered["batch-size decisions"]
            out = compiled(*args)
    except _Abort:  # the expected way out: the graph was captured, and nothing ran
        entries = _debug_get_cache_entry_list(joint.__code__)
        manager = entries[0].guard_manager if len(entries) == 1 else None
    except torch._dynamo.exc.Unsupported as e:  # torch 2.11 stops at BatchNorm's cumulative average here
        raised = _raised_by_the_loss(e)
        if raised is not None:
            raise raised[0] from raised[1]
        raise _batchnorm_cumulative_average(str(e)) or global_guards.backward_hook_refusal(str(e)) \
            or _value_checked_in_a_library(str(e)) or _graph_break(e) from None
    except torch._dynamo.exc.TorchRuntimeError as e:  # an op failed on the fake (symbolic) values
        raise _runtime_failure(
            e, lambda failure=e: _fails_with_static_sizes(loss_fn, tensors, batched, args, failure)) from None
    except torch._dynamo.exc.UserError as e:
        text = str(e)
        if (mixing := _batchnorm_cumulative_average(text)) is not None:
            raise mixing from None
        if (checked := _value_checked_in_a_library(text)) is not None:
            raise checked from None
        if "ConstraintViolation" not in text and "marked dynamic" not in text:
            raise CaptureError(
                "compiled_psg needs the loss function as one graph, and Dynamo could not capture it:\n"
                f"{text}\nFix: keep tensor values out of Python control flow (no .item() or bool(tensor) in "
                "branches); use torch.where for data-dependent choices.") from None
        if branches:  # a branch (x.shape[0] == x.shape[1]) at a batch size that fixed it
            raise batch_size_branches.refusal(branches[0]) from None
        raise CaptureError(
            "the loss function fixes the batch size, so one graph cannot serve every batch size:\n"
            f"{text}\nFix: use x.view(x.shape[0], -1) or x.flatten(1).") from None
    except Exception as e:  # ConstraintViolationError: the batch size got fixed
        if (raised := _raised_by_the_loss(e)) is not None:  # torch 2.11: an AssertionError handling a raise
            raise raised[0] from raised[1]
        text = str(e)
        if "GuardOnDataDependentSymNode" in text:
            raise _data_dependent_shape(text) from None
        if "ConstraintViolation" in type(e).__name__ or "marked dynamic" in text or "specialize" in text:
            if branches:  # a branch (x.shape[0] == x.shape[1]) at a batch size that fixed it
                raise batch_size_branches.refusal(branches[0]) from None
            raise _fixed_batch_size(text, getattr(branches, "fixed_by", None)) from None
        raise
    finally:
        if manager is None:
            torch._dynamo.reset_code(joint.__code__)
    try:
        if "refusal" in _pending:  # noted while tracing (_note_not_a_tensor, _note_no_gradient)
            raise _pending["refusal"]
        if out is not None:  # the compiled function returned: Dynamo found no graph to hand to our backend
            raise InternalError("Dynamo did not call the compiled_psg backend (was the function already compiled?)")
        return _finish(manager, joint.__code__, loss_fn, params, args, batch_dims, batched, branches)
    except BaseException:
        torch._dynamo.reset_code(joint.__code__)  # a refused capture leaves no cache entry (nor globals) behind
        raise


def _fixed_batch_size(text: str, fixed: batch_size_branches.FixedBy | None) -> CaptureError:
    """The batch size got fixed: where the trace fixed it (``fixed``, seen by ``batch_size_branches.watched``),
    named, with torch's message after it."""
    torch_says = f"\n(torch: {text.strip().splitlines()[0]})"
    if fixed is not None and fixed.backward_of is not None:
        return _fixed_by_a_backward(fixed, torch_says)
    if fixed is not None and fixed.op is None and fixed.function is not None:
        return _fixed_by_a_python_int(fixed, torch_says)
    if _fixed_in_our_backward(text):  # in the backward, where no op was seen
        return CaptureError(
            "tracing the gradients of the loss fixed the batch size. Either a tensor with one entry per sample is "
            "not a batched argument (read from a closure or a global, or in an argument whose in_dims entry is "
            "None: pass it as a batched argument), or torch's backward formula of an op in the loss reads the "
            "batch size as a number (compute that op outside the per-sample function)" + torch_says)
    if fixed is not None and fixed.op and fixed.op.startswith("aten.unbind"):
        return CaptureError(
            f"the loss splits a batched tensor into its samples at {fixed.line} ({fixed.op}: x.tolist(), list(x), "
            "a loop over x or x.unbind(0)): the number of pieces is the batch size, so one graph cannot serve every "
            "batch size. Fix: keep the values as tensors and compute on the whole batch at once (torch.tensor(y."
            "tolist()) is y itself; a loop over the samples is an op along dimension 0)" + torch_says)
    seen = (f" The batch size was fixed in {fixed.op}, at {fixed.line}." if fixed is not None and fixed.op
            else f" The batch size was fixed at {fixed.line}." if fixed is not None else "")
    return CaptureError(
        "the loss function fixes the batch size, so one graph cannot serve every batch size: a reshape to a "
        "fixed size (x.view(64, -1)), a Python int taken from x.shape[0] used as a constant, or a tensor with one "
        "entry per sample that is not a batched argument (read from a closure or a global, or in an argument "
        f"whose in_dims entry is None).{seen}\n{text}\nFix: use x.view(x.shape[0], -1) or x.flatten(1), and pass "
        "every per-sample tensor as a batched argument.")


# factories whose values depend on their length, which torch takes as a Python int (the mixing analysis refuses
# the others, eye and randperm, whose length stays symbolic)
_INT_LENGTH_FACTORIES = ("linspace", "logspace", "tril_indices", "triu_indices")


def _fixed_by_a_python_int(fixed: batch_size_branches.FixedBy, torch_says: str) -> PerSampleError:
    """The batch size given to a torch function that takes that argument as a Python int (``torch.linspace(0, 1,
    len(x))``'s ``steps``, ``torch.histc(h, bins=len(x))``): the trace fixed it at the call. A factory of the
    batch's length is refused as the mixing analysis refuses ``torch.eye(len(x))``."""
    name = fixed.function.rpartition(".")[2]
    if fixed.function in {f"torch.{f}" for f in _INT_LENGTH_FACTORIES}:
        reason, fix = batch_length_values(name)
        return UnsupportedError(f"compiled_psg cannot give this loss a sample's own batch size:\n  - "
                                f"{fixed.function} at {fixed.line}: {reason}. Fix: {fix}")
    return CaptureError(
        f"the loss gives the batch size to {fixed.function} at {fixed.line}, which takes that argument as a Python "
        "int: the trace fixes it to this batch's size, so one graph cannot serve every batch size, and a sample's "
        "own loss (a batch of one) would see 1 there. Fix: give it a size that is not the batch's (a constant, or "
        "a non-batch dimension's size such as x.shape[1]), or compute that step outside the per-sample function"
        + torch_says)


#: ops whose backward formula reads the batch size (``masked_select``'s ``numel`` of the mask), refused by the
#: mixing analysis as placing elements in flat order
_FLAT_ORDER_OPS = ("masked_select", "masked_scatter", "take", "put", "nonzero")


def _fixed_by_a_backward(fixed: batch_size_branches.FixedBy, torch_says: str) -> CaptureError | SampleMixingError:
    """The batch size fixed by torch's backward formula of an op: the autograd node that ran it (its name says
    which op it differentiates; ``...BackwardBackward0`` is the derivative of a backward, which only a gradient
    taken with ``create_graph=True`` differentiates), the op of the loss it belongs to and the user's lines."""
    base = re.sub(r"\d+$", "", fixed.backward_of).removesuffix("Backward")
    double = base.endswith("Backward")
    op, sites = _sites_of(base.removesuffix("Backward"))
    at = f" at {' or '.join(sites)}" if sites else ""
    running = f", running {fixed.op}" if fixed.op and not re.match(r"aten\.(sym_)?(size|stride|numel)", fixed.op) \
        else ""
    if not double and op.split(".")[-1] in _FLAT_ORDER_OPS:  # the analysis's refusal, which it does not reach
        reason, fix = FLAT_ORDER_REFUSAL
        return SampleMixingError(f"per-sample gradients are undefined for this loss: samples are mixed.\n  - {op}"
                                 f"{at}: {reason}. Fix: {fix}")
    if double:
        inner = [line for create, line in _pending.get("inner_grads", []) if create]
        through = (f"; torch.autograd.grad(..., create_graph=True) at {inner[0]} differentiates that backward"
                   if inner else "")
        return CaptureError(
            f"tracing the gradients of the loss fixed the batch size: torch's double backward of {op}{at} (the "
            f"derivative of its backward formula, autograd node {fixed.backward_of}{running}) reads the batch size "
            f"as a number{through}. Fix: take the inner gradient with respect to an activation after that layer, "
            "or compute that term outside the per-sample function" + torch_says)
    return CaptureError(
        f"tracing the gradients of the loss fixed the batch size: torch's backward formula of {op}{at} (autograd "
        f"node {fixed.backward_of}{running}) reads the batch size as a number, so one graph cannot serve every "
        "batch size. Fix: compute that op outside the per-sample function (on .detach()ed inputs if no "
        "parameter's gradient flows through it), or write it with other torch ops" + torch_says)


def _sites_of(forward: str) -> tuple[str, list[str]]:
    """The op of the captured joint graph named like an autograd node's op (``fractional_max_pool2d`` for
    ``FractionalMaxPool2D``, ``_native_batch_norm_legit`` for ``NativeBatchNorm``) and the user's lines of its
    nodes (up to 3), when the graph exists; else the node's name and no line."""
    gm = _pending.get("gm")
    key = forward.lower()
    found: dict[str, list[str]] = {}
    for node in gm.graph.nodes if gm is not None else ():
        name = getattr(getattr(node.target, "overloadpacket", None), "__name__", "")
        plain = name.replace("_", "").lower()
        if node.op == "call_function" and "backward" not in plain and plain.startswith(key) \
                and "compiled_psg/_capture" not in (line := where(node)):  # not in the capture's own backward
            found.setdefault(name, []).append(line)
    if not found:
        return forward, []
    name = min(found, key=lambda n: (n.replace("_", "").lower() != key, n))  # the exact name first
    sites = list(dict.fromkeys(found[name]))
    return name, sites[:3]


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def _frames(text: str) -> list[tuple[str, str, str, str]]:
    """The ``from user code`` frames of a Dynamo message, outermost first, without compiled_psg's own."""
    part = text.split("from user code:", 1)[1] if "from user code:" in text else ""
    return [f for f in _FRAME.findall(part) if "compiled_psg/_capture" not in f[0]]


def _is_library(path: str) -> bool:
    return "site-packages" in path or "dist-packages" in path or "/lib/python3" in path


def _is_tracer(path: str) -> bool:
    """Dynamo's own Python (its polyfills of builtins) and ``contextlib``, which a graph break inside a ``with`` of
    library code passes through: never the construct to name."""
    return "/torch/_dynamo/" in path or path.endswith("/contextlib.py")


def _show(frame) -> str:
    return f"{frame[0]}:{frame[1]} in {frame[2]}: {frame[3].strip()}"


def _located(text: str) -> tuple[str, bool]:
    """Where a Dynamo message says the trace stopped: ``at`` the user's line, or ``inside library code at`` a
    library's line ``called from`` the user's; and whether that is library code."""
    frames = [f for f in _frames(text) if not _is_tracer(f[0])]
    user = [f for f in frames if not _is_library(f[0])]
    if frames and _is_library(frames[-1][0]):
        called = f", called from {_show(user[-1])}" if user else ""
        return f"inside library code at {_show(frames[-1])}{called}", True
    return (f"at {_show(user[-1])}" if user else "in the loss function"), False


#: Dynamo's text of what the traced code raised: ``raised exception ValueError('msg')`` (torch 2.13 on),
#: ``raised exception ValueError([ConstantVariable(str: 'msg')])`` (2.11)
_RAISED_REPR = re.compile(r"raised exception (\w+\(.*\))\s*$", re.MULTILINE)
_CONSTANT_VARIABLE = re.compile(r"ConstantVariable\(\w+: (.*?)\)")
#: Dynamo's reading of ``raise err`` for an exception object made outside the traced code: a TypeError it raises
#: (``, not ValueError`` on torch 2.13, no type on 2.15), a graph break of its own on 2.11
_NOT_AN_EXCEPTION = re.compile(r"exceptions must derive from BaseException(?:, not (\w+))?"
                               r"|Attempted to raise a non-Exception type/value")
#: a call of a function with arguments it does not take: Dynamo keeps Python's own TypeError as the cause
_FAKE_CALL_FAILED = "when making fake tensor call"
_ASSERT_FAILED = "Data-dependent assertion failed"


def _raised_by_the_loss(e: Exception) -> tuple[BaseException, BaseException | None] | None:
    """``(error, cause)`` where Dynamo stopped because the loss's own code raised, as it would run without
    compiled_psg on this batch: a ``raise``, a call with arguments the callee does not take, a failing ``assert``.
    A ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``) is rebuilt and
    re-raised as is; other exceptions become a ``BatchInputError`` naming the exception and the line, with the
    user's exception as the cause where it can be rebuilt without running user code. None for other stops."""
    chain = _chain(e)
    text = "\n".join(map(str, chain))  # torch 2.11 raises an AssertionError while handling a graph break
    observed = next((c for c in chain if isinstance(c, torch._dynamo.exc.ObservedException)), None)
    cause, what = None, None
    if (made_outside := _NOT_AN_EXCEPTION.search(text)) is not None:  # Dynamo cannot show that object's message
        what = f"the {made_outside.group(1) or 'exception'} object it was given (made outside the loss function)"
    elif observed is not None:
        kind = next((t for t, c in torch._dynamo.exc.observed_exception_map.items() if c is type(observed)), None)
        name, args = _shown_call(text)
        what = f"{name}({', '.join(map(repr, args))})" if args is not None else name or getattr(kind, "__name__", "")
        if kind is not None and args is not None:
            cause = _rebuilt(kind, args)
            if not issubclass(kind, Exception):  # KeyboardInterrupt, SystemExit: not an error to report
                return (cause if cause is not None else kind()), None
    elif _FAKE_CALL_FAILED in text and isinstance(chain[-1], TypeError):
        cause = chain[-1]
        what = f"{type(cause).__name__}: {cause}"
    elif _ASSERT_FAILED in text and "ConstantVariable(bool: False)" in text:
        what = "AssertionError (an assert that fails on this batch)"
    else:
        return None
    where, _ = _located(text)
    return BatchInputError(
        f"the loss function raised {what} {where}. The capture runs the loss's Python code once (on fake tensors), "
        "and this raise would happen without compiled_psg too, on this batch. Fix: make loss_fn(*batch) run "
        "without raising on this batch" + (" (the exception is this error's __cause__)" if cause is not None
                                           else "")), cause


def _shown_call(text: str) -> tuple[str, list | None]:
    """The exception's name and its arguments (None where they are not literals) in Dynamo's text of it."""
    shown = _RAISED_REPR.search(text)
    if shown is None:
        return "", None
    try:
        call = ast.parse(_CONSTANT_VARIABLE.sub(r"\1", shown.group(1)), mode="eval").body
        args = [ast.literal_eval(a) for a in call.args]
    except (SyntaxError, ValueError):
        return shown.group(1).split("(", 1)[0], None
    if len(args) == 1 and isinstance(args[0], (list, tuple)) and "ConstantVariable" in shown.group(1):
        args = list(args[0])  # torch 2.11 shows the arguments as one list or tuple
    return ast.unparse(call.func), args


def _rebuilt(kind: type, args: list) -> BaseException | None:
    """``kind(*args)`` where neither ``kind`` nor a base class of the user's defines ``__init__`` or ``__new__``
    (rebuilding runs no user code); else None."""
    if any(k.__module__ != "builtins" and ("__init__" in vars(k) or "__new__" in vars(k)) for k in kind.__mro__):
        return None
    return kind(*args)


def _graph_break(e: Exception) -> CaptureError:
    """A graph break: where it is (the user's line, or a library's line and the user's call of it) and the fix."""
    text = str(e)
    reason = " ".join(text.strip().splitlines()[:2]).strip()
    where, in_library = _located(text)
    if in_library:
        fix = ("call that library function outside the loss function and pass its result in, or use a version "
               "of it without the construct above; logging and warnings.warn are ignored during the capture "
               "already (docs/limits.md, Graph breaks)")
    else:
        lowered = text.lower()
        unsupported = _NO_FAKE_KERNEL.search(text)
        if unsupported:
            op = unsupported.group(1)
            what = (f"torch's backward formula of {op.removeprefix('aten.').split('_backward')[0]} runs {op}"
                    if "_backward" in op else f"the loss calls {op}")
            fix = (f"{what}, which torch cannot run on the fake tensors a capture traces (it has no shape "
                   "function), so no graph can hold it: compute that op outside the per-sample function, or write "
                   "it with other torch ops")
        elif "print" in lowered and "builtin" in lowered:
            fix = ("print outside the loss function: compiled_psg runs the captured graph, not the function's "
                   "Python code, so a print in the loss would not run on later calls anyway")
        elif "failed to bind arguments" in lowered or "argument mismatch" in lowered:
            fix = ("call the function at this line with the arguments it takes: the call would raise TypeError "
                   "without compiled_psg too")
        elif "requires_grad_()" in text and torch_minor() >= (2, 13):  # on an argument: a graph input
            fix = ("the loss calls requires_grad_() on a tensor that comes from outside it (one of its arguments), "
                   "which Dynamo does not trace; it does on a tensor the loss makes: take the gradient with respect "
                   "to a copy, a = a.clone().requires_grad_() (the per-sample gradients are the same)")
        elif "requires_grad_()" in text:  # torch 2.11's Dynamo traces it on no tensor; 2.13 on a tensor made inside
            fix = (f"torch {torch.__version__.split('+')[0]}'s Dynamo does not trace requires_grad_() inside a "
                   "compiled function (torch 2.13 and later do, on a tensor the loss makes: a.clone()."
                   "requires_grad_()): upgrade torch, or compute what needs it outside the loss")
        elif "PerSampleFunction" in text and "torch.compiler.disable" in text:
            fix = ("a per-sample function (or a DP step) is called inside the loss of another, whose capture cannot "
                   "hold it: call it outside that loss function and combine the results there")
        elif "external grad_fn" in lowered:
            fix = ("a tensor the loss reads was computed from the parameters outside the loss function (it carries "
                   "a grad_fn, as `w2 = model.weight * 2` made once before the call does), and its gradient path "
                   "runs outside the captured graph: compute it inside the loss function, or .detach() it where it "
                   "is meant as a constant")
        elif _SKIPPED_FUNCTION.search(text):
            skipped = _SKIPPED_FUNCTION.search(text).group(1)
            fix = _SKIPPED_FIXES.get(skipped, f"torch.compile does not trace `{skipped}` (Dynamo marks it skipped), so "
                                              "no graph can hold it: call it outside the loss function and pass its "
                                              "result in, or write it with tensor operations")
        elif any(k in lowered for k in (".item()", "item()", "tolist", "data-dependent", "data dependent",
                                        "numpy")):
            fix = ("keep tensor values as tensors: no .item(), .tolist(), float(t) or bool(t) in the loss; use "
                   "torch.where for data-dependent choices")
        else:
            fix = "rewrite this line with torch operations (no Python control flow on tensor values)"
    dynamic = _DYNAMIC_SHAPE_OP.search(text)
    if dynamic:
        return _dynamic_shape_operator(dynamic.group(1) or dynamic.group(2), where, text)
    return CaptureError(f"compiled_psg needs the loss function as one graph, and Dynamo cannot capture it "
                        f"(a graph break) {where}: {reason}\nFix: {fix}. Details from Dynamo:\n{text}")


#: Dynamo's graph break at a function it never traces (torch 2.11 to 2.15: "the function `pack_padded_sequence` in
#: file ... should not be traced")
_SKIPPED_FUNCTION = re.compile(r"the function `([^`]+)` in file .* should not be traced")

#: skipped function -> the form the capture traces
_SKIPPED_FIXES = {
    "pack_padded_sequence": "torch.compile does not trace packed sequences (pack_padded_sequence builds a "
                            "PackedSequence from lengths held in a tensor): run the RNN on the padded batch and "
                            "select each sample's last valid step with the lengths (out[arange(B), lengths - 1]), "
                            "or mask the padded steps; per-sample gradients are the same",
}


#: Dynamo's graph break at an op whose output shape depends on its inputs' values (``aten._ctc_loss.Tensor``,
#: ``aten.linalg_lstsq.default``; the same text on torch 2.11 to 2.15)
_DYNAMIC_SHAPE_OP = re.compile(r"Operator `([^`]+)`'s output shape depends on input Tensor data"
                               r"|dynamic shape operator: (\S+?);")

#: op -> a form with the same values that the capture traces, where one exists
_DYNAMIC_SHAPE_FIXES = {
    "aten.linalg_lstsq": "for a matrix A of full column rank, torch.linalg.solve(A.mT @ A, A.mT @ B) (or "
                         "torch.linalg.pinv(A) @ B) gives lstsq's solution with ops the capture traces",
}


def _dynamic_shape_operator(op: str, where: str, text: str) -> CaptureError:
    """An op whose output shape depends on the values of its inputs: Dynamo does not trace it into a graph (it is
    not the user's control flow), so compiled_psg does not support it (docs/limits.md)."""
    packet = op.rsplit(".", 1)[0] if op.count(".") > 1 else op
    fix = _DYNAMIC_SHAPE_FIXES.get(packet, "compute it outside the per-sample function, or write it with other "
                                           "torch operations")
    return CaptureError(
        f"the loss calls {op} {where}: the shape of its output depends on the values of its inputs, and "
        "torch.compile (Dynamo) does not trace such an op into a graph, so compiled_psg, which needs the loss as "
        f"one graph, does not support it (docs/limits.md lists these ops). Fix: {fix}.\n"
        f"(Dynamo: {' '.join(text.strip().splitlines()[:2]).strip()})")


_NO_FAKE_KERNEL = re.compile(r"unsupported operator: (\S+)")
_EXECUTING = re.compile(r"While executing %(\S+) : .*?target=([^\]]+)\]")
_CAUSED_BY = re.compile(r"Caused by: \((\S+) in (\S+)\)")


_LIBRARY_FRAME = re.compile(r"Caused by: .*\((\S+:\d+) in (\w+)\)\s*$", re.MULTILINE)


def _value_checked_in_a_library(text: str) -> CaptureError | None:
    """A function the loss calls (``F.gaussian_nll_loss``: ``if torch.any(var < 0): raise``) that branches on a
    tensor's values in Python: Dynamo cannot guard on the value (``Could not guard on data-dependent expression``)
    and names that function's frame after the user's. None for other errors."""
    frame = _LIBRARY_FRAME.search(text)
    if "Could not guard on data-dependent expression" not in text or frame is None or frame.group(1).startswith(
            ("_dynamo/", "fx/", "_subclasses/")):  # Dynamo's own frame: the user's code branched (.item() > 0)
        return None
    user = [f for f in _frames(text) if not _is_tracer(f[0]) and not _is_library(f[0])]
    called = f", called by the loss at {_show(user[-1])}," if user else ""
    return CaptureError(
        f"{frame.group(2)} ({frame.group(1)}){called} branches on a tensor's values in Python (a check such as "
        "if torch.any(t < 0): raise): one graph for every batch cannot hold a decision known only when it runs. "
        f"Fix: write {frame.group(2)}'s formula with torch ops in the loss (without the check), or compute it "
        "outside the per-sample function\n(torch: " + text.strip().splitlines()[0] + ")")


def _data_dependent_shape(text: str) -> CaptureError:
    """A shape that depends on a tensor's values (``tensor_split`` at split points held in a tensor), seen while
    capturing: the fake tensors of the capture have none. Names the op, the torch code that read the value, and
    the user's line."""
    op = _EXECUTING.search(text)
    cause = _CAUSED_BY.search(text)
    graph = _pending.get("dynamo_graph")
    node = next((n for n in graph.graph.nodes if n.name == op.group(1)), None) if op and graph is not None else None
    return _shape_from_values(
        [f"in {op.group(2)}" if op else "", f"(torch's {cause.group(2)} at {cause.group(1)})" if cause else "",
         f"at {where(node)}" if node is not None else ""], text)


def shape_from_values(graph: fx.Graph, error: Exception) -> CaptureError | None:
    """The same, seen after the capture (a later pass guarded on a size read from a tensor): names the first value
    of ``graph`` whose shape holds such a size; None when there is none."""
    node = next((n for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
                 and free_unbacked_symbols(n.meta["val"])), None)
    if node is None:
        return None
    return _shape_from_values([f"in {node.target}", f"at {where(node)}"], f"{type(error).__name__}: {error}")


def _shape_from_values(parts: list[str], text: str) -> CaptureError:
    guard = next((line for line in text.splitlines() if "GuardOnDataDependentSymNode" in line), "")
    return CaptureError(
        "the loss computes a shape from a tensor's values " + " ".join(p for p in parts if p) + ": one graph for "
        "every batch cannot hold sizes that are known only when it runs. Fix: give the sizes, split points or "
        "indices that decide a shape as Python ints or lists, not tensors (x.tensor_split([2, 4], dim) rather than "
        f"x.tensor_split(torch.tensor([2, 4]), dim))\n(torch: {guard.strip()})")


def _chain(e: BaseException, stop: frozenset[int] = frozenset()) -> list[BaseException]:
    """``e`` and the exceptions it was raised from or while handling, outermost first, up to one in ``stop``."""
    chain = [e]
    while (nxt := e.__cause__ or e.__context__) is not None and id(nxt) not in stop \
            and all(nxt is not c for c in chain):
        chain.append(nxt)
        e = nxt
    return chain


def _root_cause(e: BaseException) -> BaseException:
    return _chain(e)[-1]


def _abort_when_run(gm, example_inputs):
    """The static probe's backend: the trace went through; the compiled function raises instead of running (one
    module-level backend, since Dynamo keeps every backend object for the life of the process)."""
    def aborted(*args):
        raise _Abort
    return aborted


_SYMBOLIC_SIZE = re.compile(r"(?<=[\[(,])[^\[\](),]*\bs\d+\b[^\[\](),]*")


def _same_failure(a: BaseException, b: BaseException) -> bool:
    """The same error of the same op, sizes aside (``[s27, 6]`` or ``[2*s27, 6]`` traced symbolically, ``[8, 6]``
    with fixed sizes)."""
    def words(e: BaseException) -> str:
        first = (str(e).strip().splitlines() or [""])[0]
        return re.sub(r"\bs?\d+\b", "#", _SYMBOLIC_SIZE.sub("#", first))
    return type(a) is type(b) and words(a) == words(b)


def _fails_with_static_sizes(loss_fn, tensors: list, batched: list, args: tuple,
                             symbolic: BaseException) -> BaseException | None:
    """Torch's error where tracing the loss fails the same way with every size fixed (the batch's own): then the
    batch does not fit the loss at any batch size (a wrong shape or dtype), and the symbolic batch size is not the
    cause (None: the trace goes through, or stops another way). Traced by Dynamo as the capture is, so nothing
    the user owns changes, and stopped before anything runs."""
    joint = _make_joint(loss_fn, tensors, batched)
    probe = torch._dynamo.optimize(_abort_when_run, nopython=True, dynamic=False)(joint)
    try:
        static = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)  # without mark_dynamic
        for pos, dim in batched:
            torch._dynamo.mark_static(static[pos], dim)  # else Dynamo reuses what it learnt of this code's sizes
        with patches.applied("capture"), torch.enable_grad():
            probe(*static)
    except torch._dynamo.exc.TorchRuntimeError as e:
        # torch's own error: the chain stops where it reaches the symbolic failure it was raised while handling
        static = _chain(e, stop=frozenset(map(id, _chain(symbolic))))[-1]
        return static if _same_failure(static, _root_cause(symbolic)) else None
    except Exception:  # _Abort (the trace went through) or any other way out: not the batch's own error
        return None
    finally:
        torch._dynamo.reset_code(joint.__code__)
        _pending.pop("refusal", None)
    return None


def _runtime_failure(e: Exception, fails_with_static_sizes=lambda: None) -> PerSampleError:
    """A torch op failed while Dynamo ran the loss on fake values with a symbolic batch size."""
    root = _root_cause(e)
    if isinstance(root, PerSampleError):  # raised by compiled_psg's own code in the traced loss
        return root
    first = (str(root).strip().splitlines() or [""])[0]
    user = [f for f in _frames(str(e)) if not _is_library(f[0])]
    where = f" at {_show(user[-1])}" if user else ""
    if "SymInt" in first or "SymFloat" in first:
        return CaptureError(
            f"the loss uses the batch size as a number in an op that torch cannot trace with a symbolic batch size"
            f"{where} ({type(root).__name__}: {first}). Per-sample gradients also need the loss of a batch of one, "
            "where that number would be 1. Fix: do not use x.shape[0] (or len(x)) in this op; a mean over the "
            "batch (loss.mean()) is fine")
    static = fails_with_static_sizes() if user else None  # not where it fails in the backward the capture adds
    if static is not None:
        return BatchInputError(
            f"the loss fails on this batch{where}: {type(static).__name__}: "
            f"{(str(static).strip().splitlines() or [''])[0]}\nThis is torch's own error, raised with this "
            "batch's own sizes too (it fails the same way with every size fixed), as the loss would fail without "
            "compiled_psg: the batch does not fit the loss at any batch size, so this is not a limit of "
            "per-sample gradients. Either the "
            "batch does not have the shapes and dtypes the loss takes, or the loss has a bug at this line (a "
            "tensor or parameter of the wrong shape). Fix: make the loss run eagerly on this batch "
            "(loss_fn(*batch)); if it does, report this message to compiled_psg")
    return CaptureError(
        f"torch failed while tracing the loss on fake tensors with a symbolic batch size{where}: "
        f"{type(root).__name__}: {first}\nFix: check that the loss runs eagerly on this batch and on a batch of "
        "two; if it does, report this message to compiled_psg")


def _refuse_effects(gm: fx.GraphModule) -> None:
    """Ops with side effects reach the joint graph as ``with_effects`` threaded on a token, an input and an
    output of their own that no per-sample program has. The check of ``linalg.inv``, ``cholesky``, ``solve`` and
    ``lu_factor`` (``aten._linalg_check_errors``) would, but the capture traces those ops as their ``_ex`` twins
    and an assertion (``corrected_decompositions.TRACEABLE``); another caller of the check is refused here."""
    effects = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.higher_order.with_effects]
    if not effects:
        return
    lines = []
    for node in effects:
        op = node.args[1]
        name = getattr(op, "__name__", str(op))
        fix = ("use the _ex twin (torch.linalg.inv_ex, cholesky_ex, solve_ex, lu_factor_ex), which returns an "
               "info tensor instead of raising, and check info outside the loss"
               if "_linalg_check_errors" in name else "compute that step outside the per-sample function")
        lines.append(f"{name} at {where(node)}: an op with a side effect (here: raising on a singular matrix) "
                     f"that per-sample programs cannot carry. Fix: {fix}")
    raise UnsupportedError("the loss calls ops with side effects:\n  - " + "\n  - ".join(lines))


def _finish(manager, code, loss_fn, params: dict, args: tuple, batch_dims: dict[int, int], batched: list,
            branches: list[str]) -> Captured:
    """Label the captured graph's inputs and check the contract; ``manager``: the frame's guards."""
    if "gm" not in _pending or manager is None:
        raise InternalError("the capture stopped before Dynamo installed the captured graph")
    if _pending.get("backward_changes"):
        raise UnsupportedError("the loss uses what per-sample gradients derived from its forward ops would "
                               "get wrong:\n  - "
                               + "\n  - ".join(_pending["backward_changes"]))
    _refuse_effects(_pending["gm"])
    roles, constants = _label(_pending["real"], params, args, set(batch_dims))
    fake = _pending["fake"]
    if any(n.op == "placeholder" and n.name.startswith("tangents") for n in _pending["gm"].graph.nodes):
        # AOT autograd partitioned a training graph: something the joint returns, or writes, still needs a
        # gradient. The joint returns detached values, so it is an in-place write into a tensor that requires
        # grad, outside no_grad: ``p.data.clamp_()`` on a parameter, or a tensor of the user's given a value
        # computed from the parameters (``acc.copy_(model.bias * 2)``)
        _refuse_gradients_written_outside(roles, tensor_names(_pending.get("sources") or [], constants, loss_fn))
        raise UnsupportedError(
            "the loss writes a tensor that requires grad in place, with autograd on (p.data.clamp_(...) on a "
            "parameter, say): compiled_psg cannot capture that write. Fix: write it under torch.no_grad() "
            "without .data (with torch.no_grad(): p.clamp_(...)), or apply it outside the loss; a DP step refuses "
            "writes to the parameters it trains, so apply those after the step")
    if len(roles) != len(fake):
        raise InternalError(f"{len(roles)} Dynamo inputs but {len(fake)} AOT inputs")
    gm = _pending["gm"]
    extra = global_guards.capture(manager, gm, _pending.get("sources") or [], constants, globals(),
                                  {"call_args": args, "loss_fn": loss_fn, "tensors": list(params.values()),
                                   "batched": batched}, _evaluable)
    mutated = _mutated_inputs(_pending["meta"], roles)
    rebound, rebound_values = _rebound(gm, len(mutated), constants)
    outputs = gm.graph.output_node().args[0]
    loss = outputs[len(mutated)] if len(outputs) > len(mutated) else None
    if not isinstance(loss, fx.Node) or not isinstance(loss.meta.get("val"), torch.Tensor):
        raise BatchInputError("the loss function must return a tensor (a scalar loss or per-sample losses [B])")
    if not any(r.batched for r in roles):
        raise BatchInputError("the loss function does not use any batched argument, so nothing is per sample. "
                              "Fix: mark arguments the loss does not slice per sample None in in_dims, and pass the "
                              "batch as an argument (not through a closure or global)")
    _refuse_parameter_writes(gm, mutated, roles)
    written = [*outputs[:len(mutated)], *rebound_values]
    mutation_graph = _mutation_graph(gm, written) if written else None
    _drop_outputs(gm, rebound_values)
    return Captured(joint=gm, roles=roles, constants=constants, fake_inputs=fake, loss_output=len(mutated),
                    mutated=[*mutated, *rebound], mutation_graph=mutation_graph,
                    guards=Guards(manager, batched, code, stand_ins=bool(_pending.get("stand_ins")),
                                  tensor_sources=_constant_sources(constants), extra=extra),
                    inner_grads=_pending.get("inner_grads", []), batch_size_branches=branches,
                    backward_numbers=_backward_numbers(getattr(branches, "backward_numbers", [])),
                    tensor_names=tensor_names(_pending.get("sources") or [], constants, loss_fn))


def _backward_numbers(reads: list[tuple[str, str]]) -> list[str]:
    """``batch_size_branches.Decisions.backward_numbers``, each once, with the op of the loss and its lines."""
    described = []
    for node, reading in dict.fromkeys(reads):
        op, sites = _sites_of(re.sub(r"\d+$", "", node).removesuffix("Backward"))
        described.append(f"torch's backward formula of {op}{' at ' + ' or '.join(sites) if sites else ''} "
                         f"(autograd node {node}) reads {reading}")
    return described


_IMPORTED_GLOBAL = re.compile(r"^G\['__import_(.+?)'\]\.(.+)$")
_GLOBAL = re.compile(r"^G\['([^']+)'\](.*)$")
_CLOSED_OVER = re.compile(r"^L\['loss_fn'\]\.__closure__\[(\d+)\]\.cell_contents(.*)$")


def _dotted(path: str) -> str:
    """``._buffers['mean']`` -> ``._buffers.mean``: item reads of a Dynamo source as attributes."""
    return re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path)


def tensor_names(sources: list, constants: dict[int, object], loss_fn) -> dict[int, str]:
    """For each constant tensor input, how the user's code names it, from Dynamo's source: ``the global tensor
    stash (module __main__)``, ``the tensor stats.mean that the loss function closes over``; Dynamo's source
    itself where it is another path."""
    names = {}
    freevars = getattr(getattr(loss_fn, "__code__", None), "co_freevars", ())
    for i, value in constants.items():
        source = sources[i] if i < len(sources) else None
        if not isinstance(value, torch.Tensor) or not source:
            continue
        if (m := _IMPORTED_GLOBAL.match(source)) is not None:
            names[i] = f"the global tensor {_dotted(m.group(2))} (module {m.group(1).replace('_dot_', '.')})"
        elif (m := _GLOBAL.match(source)) is not None:
            names[i] = f"the global tensor {m.group(1)}{_dotted(m.group(2))}"
        elif (m := _CLOSED_OVER.match(source)) is not None and int(m.group(1)) < len(freevars):
            names[i] = (f"the tensor {freevars[int(m.group(1))]}{_dotted(m.group(2))} that the loss function closes "
                        "over")
        else:
            names[i] = f"the tensor at {source} (Dynamo's path to it)"
    return names


def _constant_sources(constants: dict[int, object]) -> list[tuple[str, torch.Tensor]]:
    """(Dynamo's source, the tensor) for each tensor the graph takes as a constant input."""
    sources = _pending.get("sources") or []
    return [(sources[i], value) for i, value in constants.items()
            if isinstance(value, torch.Tensor) and i < len(sources) and sources[i]]


def _refuse_gradients_written_outside(roles: list[Role], names: dict[int, str]) -> None:
    """A write, in the loss, of a value that carries the parameters' gradient into a tensor that is not a
    parameter (a closure tensor, a buffer, an argument): refused naming the tensor and the line. The write would
    make that tensor part of the autograd graph, which AOT autograd then splits into a training pair the per-sample
    rewrite has no place for."""
    written = [i for i in getattr(_pending["meta"], "mutated_inp_runtime_indices", None) or []
               if i < len(roles) and roles[i].kind in ("const", "arg")]
    if not written:
        return
    graph = _pending["dynamo_graph"].graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    lines = []
    for i in written:
        name = (f"argument {roles[i].key}" if roles[i].kind == "arg"
                else names.get(i, "a tensor from outside the loss"))
        node = placeholders[i] if i < len(placeholders) else None
        writes = [u for u in (node.users if node is not None else ())
                  if str(getattr(u.target, "__name__", u.target)).endswith("_")]
        at = f" at {where(writes[0])}" if writes else ""
        lines.append(f"{name}{at}")
    raise UnsupportedError(
        "the loss writes a value computed from the parameters (it carries their gradient) into a tensor that is "
        "not a parameter: " + "; ".join(lines) + ". The write would make that tensor part of the gradient's "
        "computation, which a per-sample program cannot hold. Fix: write a detached value (acc.copy_(value."
        "detach())), or return the value from the loss function and keep it outside")


def _mutated_inputs(meta, roles: list[Role]) -> list[int]:
    """Placeholder indices the loss updates in place, in output order. Only data updates are carried; a change of
    an input's shape, strides or storage (``x.t_()``, ``resize_``, ``set_``) is refused."""
    if meta is None:
        raise InternalError("AOT autograd gave no metadata for the captured graph")
    mutated = list(getattr(meta, "mutated_inp_runtime_indices", []) or [])
    for i in mutated:
        info = meta.input_info[i]
        what = {"param": "parameter", "arg": "argument", "const": "buffer or constant tensor"}.get(roles[i].kind, "")
        name = f" {roles[i].key!r}" if roles[i].key is not None else ""
        if info.mutates_metadata or info.mutates_storage_metadata:
            raise CaptureError(f"the loss function changes the shape or strides of its input {what}{name} in place "
                               "(e.g. x.t_(), x.unsqueeze_(0), x.resize_()). Fix: use the out-of-place op "
                               "(x = x.t()).")
        if not info.mutates_data or roles[i].kind == "size":
            raise InternalError(f"unexpected mutation of input {i} ({info})")
    return mutated


def _refuse_parameter_writes(joint: fx.GraphModule, mutated: list[int], roles: list[Role]) -> None:
    """Refuse a loss that writes one of its parameters in place, unless the write is ``Embedding(max_norm=...)``'s
    renorm of the looked-up rows. Measured: ``Linear.weight.clamp_(-0.1, 0.1)`` under ``no_grad`` gave per-sample
    gradients 1.4 away from the loop's (torch 2.11 and 2.13): refused, not wrong."""
    values = joint.graph.output_node().args[0][:len(mutated)]
    for i, value in zip(mutated, values, strict=True):
        if roles[i].kind != "param" or _reads_renorm(value):
            continue
        raise UnsupportedError(
            f"the loss writes the parameter {roles[i].key!r} in place: compiled_psg does not give exact per-sample "
            "gradients of a loss that changes its own parameters. Fix: apply the write outside the loss, after the "
            "step (with torch.no_grad(): p.clamp_(...)), or express it as a parametrization "
            "(torch.nn.utils.parametrize)")


def _reads_renorm(value) -> bool:
    seen, stack = set(), [value]
    while stack:
        node = stack.pop()
        if not isinstance(node, fx.Node) or node in seen:
            continue
        seen.add(node)
        if node.op == "call_function" and "embedding_renorm" in str(node.target):
            return True
        stack.extend(node.all_input_nodes)
    return False


def _rebound(joint: fx.GraphModule, mutated: int, constants: dict[int, object]) -> tuple[list[int], list[fx.Node]]:
    """The placeholder of each buffer the loss rebinds (``_buffer_rebinds``) and the joint graph's node of its new
    value, which the runner writes into the buffer as it writes an in-place update. Refused where that would not
    be what eager torch leaves in the buffer: the loss does not read the buffer (no placeholder to write), the new
    value is not a tensor, or it has another shape or dtype."""
    rebinds = _pending.get("rebinds") or []
    if not rebinds:
        return [], []
    outputs = joint.graph.output_node().args[0]
    dynamo_outputs = len(_pending["dynamo_graph"].graph.output_node().args[0])
    if len(outputs) != mutated + dynamo_outputs:
        raise InternalError(f"the joint graph has {len(outputs)} outputs, not {mutated} updated inputs and "
                            f"{dynamo_outputs} of Dynamo's graph")
    indices, values = [], []
    for r in rebinds:
        at = f" ({r.line})" if r.line else ""
        what = f"the loss rebinds the buffer {r.buffer!r} of {r.module}{at}"
        fix = (f"Fix: update the buffer in place, under torch.no_grad(): self.{r.buffer}.copy_(new_value) (or "
               f"self.{r.buffer}.mul_(0.9).add_(...)), which compiled_psg applies on every call as eager torch does")
        if r.output is None:
            raise UnsupportedError(f"{what} to a value that is not a tensor computed in the loss: compiled_psg "
                                   f"applies a buffer's new value by writing it into the buffer. {fix}")
        value = outputs[mutated + r.output]
        index = r.placeholder
        if index is None or not isinstance(constants.get(index), torch.Tensor):
            raise UnsupportedError(f"{what} without reading it: compiled_psg applies a rebound buffer's new value "
                                   f"by writing it into the buffer the loss reads. {fix}")
        new, old = value.meta.get("val"), constants[index]
        if not isinstance(new, torch.Tensor) or tuple(new.shape) != tuple(old.shape) or new.dtype != old.dtype \
                or new.device != old.device:
            shape = (f"{new.dtype}{list(new.shape)} on {new.device}" if isinstance(new, torch.Tensor)
                     else type(new).__name__)
            raise UnsupportedError(f"{what} to a tensor of another shape, dtype or device ({shape}, the buffer is "
                                   f"{old.dtype}{list(old.shape)} on {old.device}): compiled_psg applies a rebound "
                                   f"buffer's new value by writing it into the buffer. {fix}, or keep the buffer's "
                                   "shape, dtype and device")
        if _registered_elsewhere(old):
            raise UnsupportedError(f"{what} whose tensor is also registered under another name (a buffer or "
                                   "parameter of another module, or of this one): eager torch rebinds this name "
                                   "alone, while compiled_psg applies the new value by writing it into the tensor, "
                                   f"which the other name would see. {fix}, if the other name should see it too; "
                                   "or register a copy of the tensor under each name")
        indices.append(index)
        values.append(value)
    return indices, values


def _registered_elsewhere(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is registered under more than one name: held by two entries of modules' ``_buffers`` or
    ``_parameters`` dicts. Found from the objects that refer to it: a rebinding is rare, and only it searches."""
    names = 0
    for holder in gc.get_referrers(tensor):
        if isinstance(holder, dict) and _is_module_registry(holder):
            names += sum(value is tensor for value in holder.values())
    return names > 1


def _is_module_registry(mapping: dict) -> bool:
    """``mapping`` is a module's ``_buffers`` or ``_parameters`` (held by the module, or by its ``__dict__``)."""
    for owner in gc.get_referrers(mapping):
        if isinstance(owner, nn.Module):
            if owner._buffers is mapping or owner._parameters is mapping:
                return True
        elif isinstance(owner, dict) and (owner.get("_buffers") is mapping or owner.get("_parameters") is mapping):
            return True
    return False


def _drop_outputs(joint: fx.GraphModule, values: list[fx.Node]) -> None:
    """``joint`` without the rebound buffers' values appended to its outputs (the mutation graph computes them),
    and the nodes only they used: the joint's outputs are again the updated inputs, the loss and the gradients."""
    if not values:
        return
    output = joint.graph.output_node()
    outs = list(output.args[0])
    output.args = (tuple(outs[:len(outs) - len(values)]),)
    stack = list(values)
    while stack:
        node = stack.pop()
        if node.op in ("placeholder", "output") or node.users or node.is_impure():
            continue
        inputs = node.all_input_nodes
        joint.graph.erase_node(node)
        stack.extend(inputs)
    joint.graph.lint()
    joint.recompile()


def _mutation_graph(joint: fx.GraphModule, values: list[fx.Node]) -> fx.GraphModule:
    """``joint`` returning only ``values`` (the written inputs' new values); every placeholder kept, so it takes
    the same inputs."""
    gm = copy.deepcopy(joint)
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    outputs = [by_name[v.name] for v in values]
    graph.output_node().args = (tuple(outputs),)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return gm
