"""``per_sample`` and ``per_sample_grad``: validate the call, find or build the rewritten graph, run it."""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ._capture import backward_semantics, torch_caches
from ._capture.dynamo import CAPTURE_LOCK, own_compilation
from ._compile.build import Rewritten, build
from ._compile.run import BACKENDS, CompiledGraph
from ._errors import BatchInputError, CaptureError, InternalError, PerSampleError, UnsupportedError
from ._inspect.report import Report, dump_if_asked
from ._reduce.reductions import PerSampleGrads, Reduction

InDims = int | None | tuple[int | None, ...]
log = logging.getLogger("compiled_psg")

#: Graphs kept per cache key whose guards differ (e.g. a temperature switched between two values).
MAX_ENTRIES_PER_KEY = 8


def _named_params(params: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return _params_and_modes(params)[0]


def _params_and_modes(params: nn.Module | Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], tuple]:
    """The parameters to differentiate, checked, and (for a module) every submodule's ``training`` flag, in
    ``modules()`` order: what a call's cache key reads from the module."""
    if isinstance(params, nn.Module):
        walked = _walk(params)
        if walked is None:  # a module that overrides how it lists its members: ask it
            named = {n: p for n, p in params.named_parameters() if p.requires_grad}
            modes = tuple(m.training for m in params.modules())
        else:
            named, modes = walked
    elif isinstance(params, Mapping):
        named, modes = dict(params), ()
    else:
        raise BatchInputError(f"params must be an nn.Module or a dict of tensors, got {type(params).__name__}")
    refuse_nested(named)
    for name, p in named.items():
        if not isinstance(p, torch.Tensor):
            raise BatchInputError(f"parameter {name!r} is a {type(p).__name__}, not a tensor")
        if p.is_complex():
            raise BatchInputError(f"parameter {name!r} is complex ({p.dtype}): compiled_psg computes per-sample "
                                  "gradients of real parameters only. Fix: hold it as its real and imaginary parts, "
                                  "a real parameter of shape [..., 2] read as torch.view_as_complex(p) in the loss")
        if not p.is_floating_point():
            raise BatchInputError(f"parameter {name!r} has dtype {p.dtype}; gradients need a floating dtype. "
                                  "Fix: leave it out of params, or convert it with .float()")
    first_name: dict[int, str] = {}
    for name, p in named.items():
        if first_name.setdefault(id(p), name) != name:
            raise BatchInputError(
                f"params names one tensor twice, as {first_name[id(p)]!r} and {name!r}: its gradient would be "
                "returned under one of them only. Fix: name each tensor once (a weight shared by two layers has "
                "one gradient, the sum of both uses)")
    _refuse_views_of_each_other(named)
    frozen = [name for name, p in named.items() if not p.requires_grad]
    if frozen and isinstance(params, Mapping):
        raise BatchInputError(
            f"the tensors {frozen} of params do not require grad, so the loss that reads them has no gradient. "
            "per_sample differentiates the very tensors the loss reads. Fix: pass tensors that require grad "
            "(nn.Parameter, or t.requires_grad_()), or use psg.per_sample_grad(fn)(params, *batch), which takes the "
            "dict as an argument and differentiates any tensors in it")
    if not named:
        raise BatchInputError("no parameters to differentiate: every parameter is frozen or the dict is empty")
    return named, modes


def _refuse_views_of_each_other(named: dict[str, torch.Tensor]) -> None:
    """An entry that is an autograd view of another (``{"a": w, "b": w.view(...)}``): autograd's gradient of
    ``a`` includes the uses of ``b``, but the capture differentiates each tensor the loss reads as an input of its
    own, so ``a`` would get only its direct uses. (Two views of a third tensor are separate inputs, as for
    autograd.)"""
    name_of = {id(p): name for name, p in named.items()}
    for name, p in named.items():
        base = p._base
        while base is not None:
            if id(base) in name_of:
                owner = name_of[id(base)]
                raise BatchInputError(
                    f"params holds {name!r}, a view of {owner!r}: the gradient of {owner!r} includes the uses of "
                    f"{name!r}, which per_sample differentiates as an input of its own. Fix: name the base tensor "
                    f"only, and take the view inside the loss ({owner}.view(...)): its uses count toward the base's "
                    "gradient")
            base = base._base


def memory_span(t: torch.Tensor) -> tuple | None:
    """(device, storage address, first byte, end byte) of the bytes ``t`` can read; None for a tensor with no
    storage of its own to share (nested, sparse, empty)."""
    try:
        address = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    if t.numel() == 0 or not address or t.layout != torch.strided:
        return None
    size = t.element_size()
    first = t.storage_offset() * size
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) * size
    return t.device, address, first, first + extent + size


def memories_overlap(a: tuple | None, b: tuple | None) -> bool:
    return a is not None and b is not None and a[:2] == b[:2] and a[2] < b[3] and b[2] < a[3]


def _shared_memory(args: tuple, params: dict[str, torch.Tensor], outside: Iterable[tuple[str, object]],
                   written: set[int] | None = None) -> list[tuple[str, str]]:
    """Pairs (an argument, what shares its memory: another argument, a parameter, a tensor the loss reads from
    ``outside``, named), for the arguments in ``written`` (all where None)."""
    spans = {pos: memory_span(a) for pos, a in enumerate(args) if isinstance(a, torch.Tensor)}
    others = [(f"argument {pos}", span) for pos, span in spans.items()]
    others += [(f"parameter {name!r}", memory_span(p)) for name, p in params.items()]
    others += [(name, memory_span(c)) for name, c in outside if isinstance(c, torch.Tensor)]
    return [(f"argument {pos}", other) for pos, span in spans.items() if written is None or pos in written
            for other, other_span in others if other != f"argument {pos}" and memories_overlap(span, other_span)]


def _outside_in_parameter_memory(outside: Iterable[tuple[str, object]],
                                 params: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    """Pairs (a tensor the loss reads from ``outside`` its arguments, the parameter whose memory it shares):
    ``alias = w.detach()`` held in a closure, which the loss writes (AOT autograd then counts one more input)."""
    spans = [(f"parameter {name!r}", memory_span(p)) for name, p in params.items()]
    return [(name, param) for name, c in outside if isinstance(c, torch.Tensor)
            for param, span in spans if memories_overlap(memory_span(c), span)]


_READ_FROM_OUTSIDE = "a tensor the loss reads from outside its arguments (a buffer, a global or a closure's)"


def _tensors_read_from_outside(fn, source) -> list[tuple[str, object]]:
    """Named tensors a loss that failed to capture may read besides its arguments and parameters: the buffers of
    its module (or of modules among its free and global names), and the tensors among those names."""
    found: list[tuple[str, object]] = []
    modules = [("the model", source)] if isinstance(source, nn.Module) else []
    for name, value in backward_semantics.names_read_from_outside(fn).items():
        if isinstance(value, torch.Tensor):
            found.append((f"`{name}`, a tensor the loss reads from outside its arguments", value))
        elif isinstance(value, nn.Module):
            modules.append((f"`{name}`", value))
    for owner, module in {id(module): (owner, module) for owner, module in reversed(modules)}.values():
        found += [(f"the buffer {buffer!r} of {owner}", b) for buffer, b in module.named_buffers()]
    return found


def _overlapping_itself(args: tuple, written: set[int]) -> list[int]:
    """The written arguments two of whose elements are one memory location (``expand``, a zero stride): more
    elements than bytes to hold them, or torch's own check."""
    return [pos for pos in sorted(written) if isinstance(args[pos], torch.Tensor) and args[pos].layout == torch.strided
            and (torch._debug_has_internal_overlap(args[pos]) == 1
                 or _span_bytes(args[pos]) < args[pos].numel() * args[pos].element_size())]


def _span_bytes(t: torch.Tensor) -> int:
    span = memory_span(t)
    return t.numel() * t.element_size() if span is None else span[3] - span[2]


def _buffer_in_parameter_memory(source, params: dict[str, torch.Tensor]) -> tuple[str | None, str | None]:
    """(a buffer of the module, the parameter whose memory it shares), or (None, None)."""
    if not isinstance(source, nn.Module):
        return None, None
    spans = [(name, memory_span(p)) for name, p in params.items()]
    for buffer_name, b in source.named_buffers():
        span = memory_span(b)
        param = next((n for n, s in spans if memories_overlap(span, s)), None)
        if param is not None:
            return buffer_name, param
    return None, None


def _shared_memory_error(pairs: list[tuple[str, str]], written: bool) -> BatchInputError:
    """``written``: the capture says which argument the loss writes; else AOT autograd refused the write."""
    unique = list({frozenset(pair): pair for pair in reversed(pairs)}.values())[::-1]  # (a, b) and (b, a) once
    which = "; ".join(f"{a} with {b}" for a, b in unique[:3])
    what = ("the loss writes an argument in place that shares memory with another input" if written else
            "the loss writes an input in place, and inputs share memory (AOT autograd cannot capture that write)")
    fix = ("pass tensors that do not share memory (a.clone() for one of them), or pass the tensor once and take the "
           "view inside the loss")
    if all(not a.startswith("argument") and b.startswith("parameter") for a, b in unique):
        fix = ("let the loss hold a copy (w.detach().clone(), not w.detach() or w.data), or change the parameter "
               "outside the loss, under torch.no_grad()")
    return BatchInputError(
        f"{what}: {which}. The captured graph takes each tensor as an input of its own, so a write through one "
        f"would not be seen through the other, where eager torch sees it. Fix: {fix}")


def refuse_nested(params: Mapping) -> None:
    nested = [name for name, v in params.items() if isinstance(v, Mapping)]
    if nested:
        raise BatchInputError(f"params entries {nested} are dicts: nested dicts of parameters are not accepted. Fix: "
                              "flatten them into one dict, e.g. {'a.w': w} for {'a': {'w': w}} (dict(model."
                              "named_parameters()) has this form)")


def check_loss(fn) -> None:
    """At decoration: a loss that is not a function would fail only at its first call, inside the capture."""
    if not callable(fn):
        raise BatchInputError(f"the loss must be a function, got {type(fn).__name__} {fn!r}. Fix: decorate the "
                              "function that computes the loss, @psg.per_sample(model) above def loss_fn(x, y)")


class _Unusual(Exception):
    """A submodule overrides ``named_modules``: the walk defers to the module's own methods."""


_NAMED_MODULES = nn.Module.named_modules


def _visit(module: nn.Module, prefix: str, named: dict, modes: list, seen_modules: set, seen_params: set) -> None:
    """``named_modules`` order (depth first, children in registration order), each module and parameter once."""
    if type(module).named_modules is not _NAMED_MODULES:
        raise _Unusual
    seen_modules.add(id(module))
    modes.append(module.training)
    for k, p in module._parameters.items():
        if p is None or id(p) in seen_params:
            continue
        seen_params.add(id(p))
        if p.requires_grad:
            named[f"{prefix}.{k}" if prefix else k] = p
    for k, child in module._modules.items():
        if child is not None and id(child) not in seen_modules:
            _visit(child, f"{prefix}.{k}" if prefix else k, named, modes, seen_modules, seen_params)


def _walk(root: nn.Module) -> tuple[dict[str, torch.Tensor], tuple] | None:
    """``{n: p for n, p in root.named_parameters() if p.requires_grad}`` and the ``training`` flags of
    ``root.modules()`` in one walk of ``_modules``/``_parameters`` (the generators cost more than the loss's
    graph on a small model); the same names and order, shared modules and parameters once. None where a module
    overrides the methods that define them."""
    if (type(root).named_parameters is not nn.Module.named_parameters
            or type(root)._named_members is not nn.Module._named_members):
        return None
    named: dict[str, torch.Tensor] = {}
    modes: list[bool] = []
    try:
        _visit(root, "", named, modes, set(), set())
    except _Unusual:
        return None
    return named, tuple(modes)


def check_in_dims(in_dims: InDims) -> None:
    """``in_dims``'s form alone (an int, None, or a tuple of ints and None), before any batch is seen."""
    entries = in_dims if isinstance(in_dims, tuple) else (in_dims,)
    for pos, d in enumerate(entries):
        if d is not None and (not isinstance(d, int) or isinstance(d, bool)):
            where = f"in_dims[{pos}]" if isinstance(in_dims, tuple) else "in_dims"
            raise BatchInputError(f"{where} must be an int or None (in_dims: an int, None or a tuple of them), got "
                                  f"{d!r}")


def batch_dims_of(args: tuple, in_dims: InDims) -> tuple[dict[int, int], int]:
    """Map each batched argument position to its batch dimension; return it with the batch size."""
    if isinstance(in_dims, tuple):
        if len(in_dims) != len(args):
            raise BatchInputError(f"in_dims has {len(in_dims)} entries but the function got {len(args)} "
                                  "positional arguments; give one entry per argument (None for unbatched)")
        dims = in_dims
    elif in_dims is None or (isinstance(in_dims, int) and not isinstance(in_dims, bool)):
        dims = (in_dims,) * len(args)
    else:
        raise BatchInputError(f"in_dims must be an int, None or a tuple, got {type(in_dims).__name__}")
    batch_dims, sizes = {}, {}
    for pos, (arg, d) in enumerate(zip(args, dims, strict=True)):
        if d is None:
            continue
        if not isinstance(d, int) or isinstance(d, bool):
            raise BatchInputError(f"in_dims[{pos}] must be an int or None, got {d!r}")
        if not isinstance(arg, torch.Tensor):
            raise BatchInputError(
                f"argument {pos} is a {type(arg).__name__}, but in_dims marks it as batched; batched arguments must "
                "be tensors. Fix: pass each batched tensor it holds as its own positional argument (loss(x, y, w), "
                "not loss(x, {'y': y, 'w': w})); set its in_dims entry to None only if it holds nothing per sample")
        if arg.is_nested or arg.layout != torch.strided:
            raise BatchInputError(
                f"argument {pos} is a {'nested' if arg.is_nested else arg.layout} tensor; batched arguments must "
                "be dense (strided) tensors whose dimension in_dims is the batch. Fix: pass x.to_dense(), or pad a "
                "nested tensor (x.to_padded_tensor(0)) and mask the padding in the loss")
        if arg.device.type == "meta":  # no values to compute with; the trace would fail on a device mismatch
            raise BatchInputError(f"argument {pos} is on the meta device, which holds shapes but no values. Fix: "
                                  "pass the batch on the device of the model's parameters")
        if arg.dim() == 0 or not -arg.dim() <= d < arg.dim():
            raise BatchInputError(f"in_dims[{pos}]={d} is out of range for argument {pos} of shape "
                                  f"{tuple(arg.shape)}")
        batch_dims[pos] = d % arg.dim()
        sizes[pos] = arg.shape[d]
    if not batch_dims:
        raise BatchInputError("no argument is batched: in_dims marks every argument None")
    if len(set(sizes.values())) != 1:
        listing = ", ".join(f"argument {p}: {s}" for p, s in sizes.items())
        raise BatchInputError(f"batched arguments disagree on the batch size ({listing}). Fix: pass arguments "
                              "with the same batch size, or mark unbatched ones None in in_dims")
    return batch_dims, next(iter(sizes.values()))


def _arg_signature(args: tuple, batch_dims: dict[int, int]) -> tuple:
    sig = []
    for pos, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            shape = a.shape
            d = batch_dims.get(pos)
            if d is not None:
                shape = (*shape[:d], -1, *shape[d + 1:])
            sig.append((tuple(shape), a.dtype, a.device, a.requires_grad))
        else:
            try:
                hash(a)
                sig.append(("value", a))
            except TypeError:
                sig.append(("object", id(a)))
    return tuple(sig)


def _params_signature(params: dict[str, torch.Tensor]) -> tuple:
    return tuple((n, p.shape, p.dtype, p.device) for n, p in params.items())


def _capture_args(args: tuple, batch_dims: dict[int, int], batch_size: int) -> tuple:
    """Arguments to trace with: fresh tensor objects (so marking them dynamic leaves the user's alone), with
    at least two samples (a batch of one is specialized by the shape environment). They share the user's
    storage where they can (a batch that starts inside its storage is copied), which is safe because the capture
    never runs the loss."""
    out = []
    for pos, a in enumerate(args):
        if pos in batch_dims:
            if batch_size == 0:  # two samples of zeros: the capture reads shapes and dtypes, never values
                shape = list(a.shape)
                shape[batch_dims[pos]] = 2
                a = a.new_zeros(shape).requires_grad_(a.requires_grad)
            elif batch_size < 2:
                index = torch.zeros(2, dtype=torch.long, device=a.device)
                a = a.index_select(batch_dims[pos], index)
            else:
                a = a.detach().contiguous()
                # a fresh tensor object even when already contiguous; a copy where the batch starts inside its
                # storage (x[8:]): Dynamo makes a nonzero storage offset a symbol of its own, an input no batch
                # size determines
                a = a.clone() if a.storage_offset() else a.view_as(a)
        out.append(a)
    return tuple(out)


def _guard_args(args: tuple, batch_dims: dict[int, int], batch_size: int) -> tuple:
    """The arguments as the capture saw them (detached, contiguous, two samples or more), for its guards; the
    user's own tensors where they already are (the common case costs no copy)."""
    if batch_size < 2:
        return _capture_args(args, batch_dims, batch_size)
    if all(not (args[pos].requires_grad or not args[pos].is_contiguous()) for pos in batch_dims):
        return args
    return tuple(a.detach().contiguous() if pos in batch_dims else a for pos, a in enumerate(args))


#: a torch failure inside the capture, by a pattern of its message (re.search) -> the fix the user owns
_CAPTURE_FAILURE_FIXES = (
    ("Sparse", "Fix: use dense gradients (nn.Embedding(..., sparse=False)); sparse gradients are not supported. "),
    ("set_ on a graph input", "Fix: compute a new tensor (x = x - m) instead of assigning x.data (or calling "
                              "x.set_()) in the loss: AOT autograd cannot trace a swapped storage. "),
    ("does not support RNG ops in recompute regions",
     "Fix: activation checkpointing (torch.utils.checkpoint) around a random op, such as dropout, cannot be "
     "captured: move the random op out of the checkpointed function, or call the model without checkpointing "
     "(the per-sample step keeps what its backward needs either way). "),
    (r"buffers_\w* must have _dynamo_source",
     "The loss writes a module's buffer through its _buffers dict (self._buffers['name'] = value), "
     "which torch's capture cannot follow. Fix: update the buffer in place, under torch.no_grad(): "
     "self.name.copy_(value), which compiled_psg applies on every call as eager torch does. "),
    ("One of the differentiated Tensors does not require grad",
     "The loss writes a parameter through .data (p.data.add_(...)) or through another tensor in its memory, which "
     "AOT autograd cannot differentiate past: compiled_psg does not give per-sample gradients of a loss that "
     "changes its own parameters, and a DP step refuses writes to the parameters it trains. Fix: apply the write "
     "outside the loss, after the step (with torch.no_grad(): p.add_(...)), or express it as a parametrization "
     "(torch.nn.utils.parametrize). "),
    ("PendingUnbackedSymbolNotFound",
     "The gradient of an op whose output size depends on the batch's values (a boolean mask, h[h > 0] or "
     "out[mask] = v; masked_select, nonzero, unique) cannot be traced. Fix: keep the shape: torch.where(mask, new, "
     "h) for a masked write, h * mask or h.masked_fill(~mask, 0) for a masked read, then reduce per sample. "),
)


def _first_line(e: BaseException) -> str:
    """The first non-empty line of ``e``, or of the error it wraps (Dynamo's ``BackendCompilerFailed`` says only
    "backend='...' raised:" on its first line)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        if lines and not lines[0].rstrip().endswith("raised:"):
            return lines[0].strip()
        e = e.__cause__ or e.__context__ or getattr(e, "inner_exception", None)
    return ""


@dataclass(frozen=True)
class PreparedCall:
    """One call, ready to run: the cached (or new) compiled entry and the inputs it takes."""

    entry: CompiledGraph
    params: dict[str, torch.Tensor]  # the parameters, read from their source at this call
    args: tuple  # the call's arguments
    batch_size: int


class PerSampleFunction:
    """A loss function whose call returns per-sample gradients (or a reduction of them)."""

    def __init__(self, fn: Callable, params_source, in_dims: InDims, reduce: Reduction | None, backend: str, *,
                 seed_weights: bool = False, cuda_graphs: bool = False):
        """``seed_weights`` and ``cuda_graphs`` are the DP step's (``_train/buckets.py``): the graph takes the
        backward's seed weights after the loss's arguments, and Inductor records CUDA graphs."""
        if backend not in BACKENDS:
            raise BatchInputError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if reduce is not None and not isinstance(reduce, Reduction):
            raise BatchInputError(f"reduce must be a compiled_psg reduction (psg.norms(), psg.clip_sum(...), ...), "
                                  f"got {type(reduce).__name__}")
        self.fn = fn
        self.params_source = params_source
        self.in_dims = in_dims
        self.reduce = reduce if reduce is not None else PerSampleGrads()
        self.backend = backend
        self.seed_weights, self.cuda_graphs = seed_weights, cuda_graphs
        # key -> graphs for that signature, most recently built first; one is used only while its guards hold
        self._cache: dict[Any, list[CompiledGraph]] = {}
        self._captures = 0
        self._retired_compiles = 0
        self._retired_seconds = 0.0
        functools.update_wrapper(self, fn)

    @property
    def captures(self) -> int:
        """How many times the loss was captured and rewritten (one per new signature, and one per recapture
        after a guard failed)."""
        return self._captures

    def _entries(self) -> list[CompiledGraph]:
        return [c for entries in list(self._cache.values()) for c in entries]

    @property
    def compiles(self) -> int:
        """Graphs compiled so far (per capture: one for every batch size from 2 up, one for a batch of one)."""
        return self._retired_compiles + sum(c.compiles for c in self._entries())

    @property
    def compile_seconds(self) -> float:
        return self._retired_seconds + sum(c.compile_seconds for c in self._entries())

    def _params(self) -> dict[str, torch.Tensor]:
        return _named_params(self.params_source)

    def _key(self, params, modes: tuple, args, batch_dims):
        return (_params_signature(params), _arg_signature(args, batch_dims), tuple(batch_dims.items()), modes,
                self.reduce, self.backend)

    def _valid(self, entries: list[CompiledGraph], params, args, batch_dims, batch_size):
        """The first entry whose Dynamo guards hold for this call, and otherwise why the newest one's failed."""
        if not entries:
            return None, None
        tensors = list(params.values())
        guard_args = _guard_args(args, batch_dims, batch_size)
        for entry in entries:
            guards = entry.rewritten.captured.guards
            if guards is None or guards.check(self.fn, tensors, guard_args):
                return entry, None
        return None, entries[0].rewritten.captured.guards.why(self.fn, tensors, guard_args)

    def compiled_for(self, *args) -> tuple[CompiledGraph, dict, tuple, int]:
        """``(entry, params, args, batch_size)`` for this call (public, for inspection); the library itself uses
        ``prepare_call``, which names them."""
        call = self.prepare_call(*args)
        return call.entry, call.params, call.args, call.batch_size

    def prepare_call(self, *args) -> PreparedCall:
        """The compiled graph for this call: cached while its key matches and its guards hold, else captured now.

        Post: the entry's graph describes what the loss would compute now (module structure, hooks, Python
        attributes and globals it read are as at its capture)."""
        params, modes = _params_and_modes(self.params_source)
        return self._prepare(params, modes, args, *batch_dims_of(args, self.in_dims))

    def _prepare(self, params: dict[str, torch.Tensor], modes: tuple, args: tuple, batch_dims: dict[int, int],
                 batch_size: int) -> PreparedCall:
        if torch._C._functorch.peek_interpreter_stack() is not None:
            raise BatchInputError(
                "the per-sample function was called inside a torch.func transform (vmap, grad, jacrev, ...): it "
                "computes the per-sample gradients of the whole batch itself, and its capture cannot run under a "
                "transform. Fix: call it on the batch outside the transform")
        backward_semantics.refuse_parameter_hooks(params)
        backward_semantics.refuse_arguments_from_parameters(args, params)
        backward_semantics.refuse_parameters_as_batched_arguments(args, params, batch_dims)
        backward_semantics.refuse_closures_from_parameters(self.fn, params)
        key = self._key(params, modes, args, batch_dims)
        entry, _ = self._valid(self._cache.get(key, []), params, args, batch_dims, batch_size)
        if entry is not None:
            return self._checked_call(entry, params, args, batch_size)
        with CAPTURE_LOCK:  # one capture at a time; another thread may have captured it meanwhile
            entries = self._cache.get(key, [])
            entry, reason = self._valid(entries, params, args, batch_dims, batch_size)
            if entry is None:
                if reason is not None:
                    log.warning("compiled_psg: %s: recapturing the loss, because what its graph assumed changed: %s",
                                getattr(self.fn, "__qualname__", "loss"), reason)
                try:
                    rewritten = self._build(params, args, batch_dims, batch_size)
                finally:
                    torch_caches.release()
                entry = CompiledGraph(rewritten, self.backend, cuda_graphs=self.cuda_graphs)
                self._captures += 1
                for old in entries[MAX_ENTRIES_PER_KEY - 1:]:
                    self._retired_compiles += old.compiles
                    self._retired_seconds += old.compile_seconds
                self._cache[key] = [entry, *entries[:MAX_ENTRIES_PER_KEY - 1]]
        return self._checked_call(entry, params, args, batch_size)

    @staticmethod
    def _checked_call(entry: CompiledGraph, params: dict[str, torch.Tensor], args: tuple,
                      batch_size: int) -> PreparedCall:
        """The call, unless the loss writes an argument that shares memory with another input: checked at every
        call, as a graph captured on separate tensors may be called with views of one."""
        captured = entry.rewritten.captured
        written = {captured.roles[i].key for i in captured.mutated
                   if isinstance(i, int) and 0 <= i < len(captured.roles) and captured.roles[i].kind == "arg"}
        if written:
            overlapping = _overlapping_itself(args, written)
            if overlapping:
                pos = overlapping[0]
                raise BatchInputError(
                    f"the loss writes argument {pos} in place, and several of its elements are one memory location "
                    f"(shape {tuple(args[pos].shape)}, strides {args[pos].stride()}: an expand() or a zero "
                    "stride); eager torch refuses that write too. Fix: pass a tensor of its own, "
                    "x.contiguous() or x.clone()")
            outside = [(_READ_FROM_OUTSIDE, c) for c in captured.constants.values()]
            pairs = _shared_memory(args, params, outside, written)
            if pairs:
                raise _shared_memory_error(pairs, written=True)
        return PreparedCall(entry, params, args, batch_size)

    def _build(self, params, args, batch_dims, batch_size) -> Rewritten:
        capture_args = _capture_args(args, batch_dims, batch_size)
        try:
            rewritten = build(self.fn, params, capture_args, batch_dims, self.reduce, self.seed_weights)
        except PerSampleError as e:
            if isinstance(e, InternalError) and "Dynamo inputs but" in str(e):
                # AOT autograd counted an unbatched argument in a parameter's memory as one more input (it is
                # passed as it is, not copied as a batched one is): the write the shared memory check names
                outside = _tensors_read_from_outside(self.fn, self.params_source)
                pairs = _shared_memory(args, params, outside) or _outside_in_parameter_memory(outside, params)
                if pairs:
                    raise _shared_memory_error(pairs, written=False) from e
            refusal = getattr(e, "refusal", None)
            if refusal is not None and e.report is None:  # the refused graph's report: SampleMixingError.report
                e.report = Report.for_refusal(*refusal)
            raise
        except Exception as e:  # the last line of "no raw torch traceback": name what failed, and who can fix it
            text = _first_line(e)
            if re.search(r"input mutations|[Aa]liased inputs", text):  # AOT autograd on a write into shared memory
                pairs = _shared_memory(args, params, _tensors_read_from_outside(self.fn, self.params_source))
                if pairs:
                    raise _shared_memory_error(pairs, written=False) from e
            buffer, param = _buffer_in_parameter_memory(self.params_source, params)
            if buffer is not None:  # AOT autograd: "One of the differentiated Tensors does not require grad", ...
                raise UnsupportedError(
                    f"the buffer {buffer!r} shares memory with the parameter {param!r}, and capturing the loss failed "
                    f"({type(e).__name__}: {text}): a write through the buffer is a write of the parameter, which "
                    "compiled_psg refuses, and AOT autograd cannot trace the parameter's gradient through it. Fix: "
                    "register a copy (register_buffer(name, weight.detach().clone())), or read the parameter "
                    "itself") from e
            hint = next((fix for cause, fix in _CAPTURE_FAILURE_FIXES if re.search(cause, text)), "")
            tail = "" if hint else ("If the loss raises this when called eagerly on the batch, fix it there; otherwise "
                                    "this is a compiled_psg bug: please report this message.")
            raise CaptureError(
                f"capturing and rewriting the loss failed ({type(e).__name__}: {text}). {hint}{tail}".rstrip()) from e
        dump_if_asked(rewritten)
        return rewritten

    @own_compilation
    def with_losses(self, *args, **kwargs):
        """``(loss, per_sample_losses [B], result)``: the loss as the function computes it, and each sample's
        batch-of-one loss. Under ``torch.inference_mode()`` as under ``torch.no_grad()``: the gradients are the
        function's result, so they are computed (an ambient mode does not reach the loss, see docs/semantics.md)."""
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                return self.with_losses(*args, **kwargs)
        no_keywords(kwargs)
        params, modes = _params_and_modes(self.params_source)
        batch_dims, batch_size = batch_dims_of(args, self.in_dims)
        try:
            call = self._prepare(params, modes, args, batch_dims, batch_size)  # an empty batch is checked as any is
        except (BatchInputError, CaptureError) as e:
            if batch_size == 0:  # its capture traced two samples of zeros: say why sizes of 2 appear
                e.args = (f"{e}\n(The batch is empty: it was checked against the loss as two samples of its "
                          "shapes and dtypes, so a size of 2 above stands for its batch size.)", *e.args[1:])
            raise
        if batch_size == 0:  # nothing to differentiate: the empty results, and the loss the function computes
            shapes = {n: (p.shape, p.dtype, p.device) for n, p in params.items()}
            ref = params[next(iter(params))]
            empty = torch.zeros(0, dtype=ref.dtype, device=ref.device)
            return call.entry.loss_of_empty_batch(call.params, call.args), empty, self.reduce.empty(shapes)
        return call.entry(call.params, call.args, call.batch_size)

    def __call__(self, *args, **kwargs):
        return self.with_losses(*args, **kwargs)[2]


def no_keywords(kwargs: dict) -> None:
    if kwargs:
        raise BatchInputError(f"keyword arguments are not supported (got {', '.join(sorted(kwargs))}): in_dims "
                              "describes positional arguments only. Fix: pass them positionally, with in_dims "
                              "entries (None for unbatched ones), or bind them with functools.partial")


def per_sample(params: nn.Module | Mapping[str, torch.Tensor], *, in_dims: InDims = 0,
               reduce: Reduction | None = None, backend: str = "inductor") -> Callable[[Callable], PerSampleFunction]:
    """Decorate a batched loss function so that calling it returns per-sample gradients.

    ``params``: an ``nn.Module`` (its parameters that require grad, named as in ``named_parameters()``) or a
    dict from name to tensor. ``in_dims``: as in ``torch.func.vmap`` (an int, or one entry per positional
    argument, None for unbatched). ``reduce``: a reduction (``psg.norms()``, ``psg.clip_sum(1.0)``, ...), or
    None for ``{name: Tensor[B, *param.shape]}``. ``backend``: ``"inductor"`` or ``"eager"`` (the rewritten graph
    without a compiler). Entry ``i`` of the result is autograd's gradient of the same function called on the
    batch made of sample ``i`` alone.
    """

    if not isinstance(params, nn.Module | Mapping):
        bare = callable(params)  # @psg.per_sample above the loss: the loss arrived as params
        raise BatchInputError(
            f"per_sample(params) takes the model (an nn.Module) or a dict of tensors, got {type(params).__name__} "
            f"{getattr(params, '__name__', '')}. " + ("It was given the loss itself: @psg.per_sample decorates "
                                                      "with the model as its argument. Fix: @psg.per_sample(model)"
                                                      if bare else "Fix: psg.per_sample(model)(loss_fn)"))

    def decorate(fn: Callable) -> PerSampleFunction:
        check_loss(fn)
        return PerSampleFunction(fn, params, in_dims, reduce, backend)

    return decorate


def per_sample_grad(fn: Callable, argnums: int = 0, *, in_dims: InDims = 0, reduce: Reduction | None = None,
                    backend: str = "inductor") -> PerSampleGrad:
    """The functional form, like ``torch.func.grad``: ``fn(params_dict, *batch)`` -> per-sample gradients.

    ``in_dims`` refers to the batch arguments (every positional argument but ``argnums``); a tuple with one
    entry per positional argument of ``fn`` is accepted too, with ``None`` at ``argnums`` (the parameters are
    shared by every sample: another entry there is refused).
    """
    check_loss(fn)
    if isinstance(argnums, bool) or not (isinstance(argnums, int) and argnums >= 0):
        raise BatchInputError(f"argnums must be an int >= 0, the position of the parameter dict among fn's "
                              f"arguments, got {argnums!r}")
    return PerSampleGrad(fn, argnums, in_dims, reduce, backend)


class PerSampleGrad:
    """What ``per_sample_grad`` returns: called as ``fn`` is (the parameter dict at ``argnums``), it gives the
    per-sample gradients; ``per_sample_function`` is the ``PerSampleFunction`` of the batch arguments it runs,
    whose parameters are those of the last call."""

    def __init__(self, fn: Callable, argnums: int, in_dims: InDims, reduce: Reduction | None, backend: str):
        self.fn, self.argnums, self.in_dims = fn, argnums, in_dims
        self._params: dict[str, Any] = {}
        self.per_sample_function = PerSampleFunction(self._loss_of_batch, {}, in_dims, reduce, backend)

    def _loss_of_batch(self, *batch):
        full = list(batch)
        full.insert(self.argnums, self._params)
        return self.fn(*full)

    def bind(self, args: tuple, kwargs: dict) -> tuple:
        """Take the parameter dict out of ``fn``'s arguments for ``per_sample_function``; the batch arguments."""
        no_keywords(kwargs)
        argnums = self.argnums
        if len(args) <= argnums:
            raise BatchInputError(f"expected the parameter dict at position {argnums}, got {len(args)} arguments")
        params = args[argnums]
        if not isinstance(params, Mapping):
            raise BatchInputError(f"argument {argnums} must be a dict of parameters, got {type(params).__name__}")
        refuse_nested(params)
        dims = self.in_dims
        if isinstance(dims, tuple) and len(dims) == len(args):
            if dims[argnums] is not None:  # was dropped silently, as if it were None
                raise BatchInputError(
                    f"in_dims[{argnums}]={dims[argnums]!r} is the entry of the parameter dict (argument {argnums}, "
                    "argnums), which every sample shares: per_sample_grad differentiates the parameters, it does "
                    f"not batch them. Fix: in_dims[{argnums}]=None, or give in_dims for the batch arguments only "
                    f"({len(args) - 1} entries)")
            dims = dims[:argnums] + dims[argnums + 1:]
        # fresh leaves each call: the tensors the loss sees are the ones differentiated (and labelled by identity)
        self._params = {k: v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v
                        for k, v in params.items()}
        psf = self.per_sample_function
        psf.params_source = {k: v for k, v in self._params.items() if isinstance(v, torch.Tensor)}
        psf.in_dims = dims
        return args[:argnums] + args[argnums + 1:]

    def __call__(self, *args, **kwargs):
        return self.per_sample_function(*self.bind(args, kwargs))
