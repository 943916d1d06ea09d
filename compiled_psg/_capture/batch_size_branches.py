"""Decisions on the batch size that a batch of one would take the other way.

A sample's gradient is defined on the batch made of that sample alone, so the per-sample program is the batched
program with the batch size read as 1. Where the loss's Python code (or a library's) turns an expression in the
batch size into a constant (``if x.shape[0] == 1``, ``int(len(x) > 1)``, ``x.numel() == d``), the trace decides
it for the traced batch. Dynamo assumes a dynamic size is at least 2 (0/1 specialization), so a comparison with 1
is decided *without a guard*: nothing in the captured graph or its guards shows that the batch took a branch no
sample alone would take. So every decision on the batch size made while tracing is watched, and one that a batch
of one would decide differently is refused, unless it is made inside a tensor op.

Allowed, by where the decision is made: tensor ops' shape functions (fake tensors' dispatch, meta functions,
decompositions, the autograd engine's shape checks) compare sizes with 1 to pick layouts (contiguity, strides,
broadcasting) and give the same values at every size; so do the checks of torch's own Python functions listed
in ``_ARGUMENT_CHECKS`` (``F.affine_grid``'s ``min(size) <= 0``), which a batch of one passes as the batch does.
Anything else is the program's own control flow.
Batch-size values that stay symbolic (``loss * (len(x) > 1)``) reach the graph and read 1 per sample there
(``_rewrite.per_sample_pass.substitute_batch_values``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import dataclass

import sympy
import torch
from torch.utils._sympy.symbol import SymT, symbol_is_type

from .._errors import CaptureError
from . import patches

# The shape environment between a decision's maker and the evaluation.
_MACHINERY = ("torch/fx/experimental/", "compiled_psg/_capture/batch_size_branches.py")
# Dynamo interpreting the traced Python code: its branches, truth tests, ``assert``s and builtins on sizes.
_DYNAMO = ("torch/_dynamo/variables/", "torch/_dynamo/symbolic_convert.py")
# Python-level conversions of symbolic values (``SymBool.__bool__``, ``SymInt.__int__``, ``torch.sym_int``).
_CONVERSIONS = ("torch/__init__.py",)
# torch's Python shape code: its decisions pick layouts (contiguity, strides, broadcasting), not values.
_SHAPE_CODE = ("torch/_subclasses/", "torch/_meta_registrations.py", "torch/_prims_common/", "torch/_prims/",
               "torch/_refs/", "torch/_decomp/")
#: ``_at_batch_of_one`` of an expression that has no value at a batch of one (a modulo by ``B - 1``)
UNDEFINED = "undefined"


def _not_a_guard_source() -> None:
    """The shape environment names a guard's source by the innermost frame outside its "uninteresting" files;
    our wrapper of ``evaluate_expr`` would hide the real one (a meta function's ``n >= 16`` heuristic, which
    ``_compile.build`` allows by where it comes from). torch's set is cached: add this file to it once."""
    from torch.fx.experimental.symbolic_shapes import uninteresting_files

    uninteresting_files().add(__file__)


_not_a_guard_source()


@contextlib.contextmanager
def watched():
    """While this thread traces, append to the list yielded each decision on the batch size that a batch of one
    would make differently, outside tensor ops, and set its ``fixed_by`` where a decision first fixes the batch size
    to a constant (the refusal names it). Process-wide patch, restored on exit; other threads pass through."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    found = Decisions()
    before = ShapeEnv.evaluate_expr
    owner = threading.get_ident()

    def evaluate_expr(self, orig_expr, hint=None, fx_node=None, size_oblivious=False, fallback_value=None, *,
                      forcing_spec=False):
        mine = threading.get_ident() == owner
        free = _batch_sizes(orig_expr, self) if mine and not found.fixed_by else ()
        loose = [s for s in free if not isinstance(self.replacements.get(s), sympy.Integer)]
        value = before(self, orig_expr, hint, fx_node, size_oblivious, fallback_value, forcing_spec=forcing_spec)
        if any(isinstance(self.replacements.get(s), sympy.Integer) for s in loose):
            found.fixed_by = _fixing_op()
        if mine and not size_oblivious and fallback_value is None:
            at_one = _at_batch_of_one(orig_expr, self)
            if at_one is not None and at_one != value and _made_by_the_program() and not _in_an_argument_check():
                one = "has no value" if at_one is UNDEFINED else at_one
                found.append(Decision(f"{orig_expr} is {value} for this batch but {one} for a batch of one, at "
                                      f"{_user_line()}", is_number=not isinstance(value, sympy.logic.boolalg.Boolean),
                                      against_batch=_size_against_the_batch(orig_expr, value, self)))
            elif (at_one is not None and at_one != value and not isinstance(value, sympy.logic.boolalg.Boolean)
                  and (node := torch._C._current_autograd_node()) is not None):
                # a backward formula taking a number made of the batch size (celu's alpha=float(len(x))) as a
                # C++ scalar: the graph holds the batch's value; the guard check refuses, and names it from here
                found.backward_numbers.append((node.name(), f"{orig_expr} = {float(value):g}"))
        return value

    ShapeEnv.evaluate_expr = evaluate_expr
    try:
        yield found
    finally:
        ShapeEnv.evaluate_expr = before


@contextlib.contextmanager
def membership_compares_sizes():
    """Dynamo answers ``1 in x.shape`` by comparing the constant with the constant items only: False for a
    symbolic batch size, with no decision to watch (and wrong for a batch of one). Compare with the symbolic
    items too, through the shape environment, so that the decision is seen."""
    import torch._dynamo.utils as dynamo_utils
    import torch._dynamo.variables.lists as dynamo_lists
    from torch._dynamo.variables import ConstantVariable, SymNodeVariable
    from torch.fx.experimental.symbolic_shapes import guard_bool

    before = dynamo_utils.iter_contains
    owner = threading.get_ident()

    def iter_contains(items, search, tx, *rest, **options):  # 2.11 to 2.13 have a fourth argument, 2.14+ not
        items = list(items)
        if threading.get_ident() == owner and search.is_python_constant() and any(
                isinstance(x, SymNodeVariable) for x in items):
            value = search.as_python_constant()
            return ConstantVariable.create(any(
                guard_bool(x.sym_num == value) if isinstance(x, SymNodeVariable)
                else x.is_python_constant() and x.as_python_constant() == value for x in items))
        return before(items, search, tx, *rest, **options)

    dynamo_utils.iter_contains = dynamo_lists.iter_contains = iter_contains
    try:
        yield
    finally:
        dynamo_utils.iter_contains = dynamo_lists.iter_contains = before


def _evaluate_expr():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return (ShapeEnv.evaluate_expr,)


def _iter_contains():
    import torch._dynamo.utils as dynamo_utils
    import torch._dynamo.variables.lists as dynamo_lists

    return dynamo_utils.iter_contains, dynamo_lists.iter_contains


patches.register(patches.Patch(
    "batch-size decisions", "torch.fx.experimental.symbolic_shapes.ShapeEnv.evaluate_expr",
    "to see every decision on the batch size that a batch of one would take the other way (this module), and the "
    "op (or autograd node) that fixes it, for the refusal to name",
    ("capture",), "the class attribute is process-wide; the wrapper records only on the capturing thread",
    "the original method restored on exit", enter=watched, current=_evaluate_expr))
patches.register(patches.Patch(
    "membership on sizes", "torch._dynamo.utils.iter_contains, torch._dynamo.variables.lists.iter_contains",
    "Dynamo answers `1 in x.shape` from the constant sizes alone: compare with the symbolic batch size too, so "
    "that the decision is watched", ("capture",),
    "process-wide; acts only on the capturing thread, others get torch's answer",
    "the original functions restored on exit", enter=membership_compares_sizes, current=_iter_contains))
patches.register(patches.Patch(
    "guard source", "torch.fx.experimental.symbolic_shapes.uninteresting_files()",
    "this file added once, so that a guard is attributed to the code that made the decision, not to our wrapper",
    ("process",), "all threads; only names in guard messages change", "permanent: torch caches the set and "
    "offers no removal; the file holds only our wrapper, which no user frame is"))


def refusal(decision: str) -> CaptureError:
    """The refusal of a loss that decides on the batch size as a batch of one would not (``decision``, as
    ``watched`` records it)."""
    if getattr(decision, "is_number", False):
        return CaptureError(
            "the loss turns the batch size into a Python number, and a batch of one gets another: "
            f"{decision}. A sample's gradient is the gradient of the loss on the batch made of that sample alone, "
            "and the number is a constant of the captured graph, so it would keep the batch's value. Fix: keep it "
            "a value of the graph, computed with torch ops on a tensor (torch.log(x.new_ones(()) * (x.shape[0] + 1)) "
            "for math.log(x.shape[0] + 1)), or use a constant that is not the batch size")
    if getattr(decision, "against_batch", False):
        return CaptureError(
            f"the loss compares the batch size with a fixed size equal to it: {decision}. That is a tensor with "
            "one entry per sample that is not a batched argument (read from a closure or a global, or in an "
            "argument whose in_dims entry is None), met by a batched one (torch checks that their sizes agree), or "
            "a size written as this batch's number. Fix: pass every per-sample tensor (labels, targets, weights) as "
            "a batched argument (in_dims 0)")
    return CaptureError(
        "the loss branches on the batch size, and a batch of one takes the other branch: "
        f"{decision}. A sample's gradient is the gradient of the loss on the batch made "
        "of that sample alone, so the batch's branch would give wrong per-sample gradients. Fix: keep the "
        "batch size out of the loss's control flow (no x.shape[0] == 1, x.shape[0] == x.shape[1] or len(x) > 1 "
        "tests; torch.where on tensors is fine)")


class Decision(str):
    """One decision ``watched`` records (its text); ``is_number``: the batch size turned into a Python number
    (``math.log(n)``, ``float(n)``), not a branch on it."""

    is_number: bool
    against_batch: bool

    def __new__(cls, text: str, is_number: bool = False, against_batch: bool = False):
        made = super().__new__(cls, text)
        made.is_number, made.against_batch = is_number, against_batch
        return made


class Decisions(list):
    """The decisions a batch of one makes differently (``watched``), ``fixed_by``: where the trace first fixed the
    batch size to a constant (``_fixing_op``), or None, and ``backward_numbers``."""

    fixed_by: FixedBy | None = None
    #: (autograd node, its reading) where a backward formula turned an expression in the batch size into a number
    backward_numbers: list[tuple[str, str]]

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.backward_numbers = []


@dataclass(frozen=True)
class FixedBy:
    """Where the batch size got fixed: the op torch was running (None for Python code, as ``int(len(x))``), the
    autograd node whose backward ran it (None outside a backward), the traced code's line and the torch function
    Dynamo was calling there (``torch.linspace``, whose ``steps`` torch takes as a Python int; None: none)."""

    op: str | None
    backward_of: str | None
    line: str
    function: str | None = None

    def describe(self) -> str:
        if self.op is None:
            return f"at {self.line}"
        where = f"torch's backward of {self.backward_of} (autograd node), " if self.backward_of else ""
        return f"{where}in the shape function of {self.op}, while tracing {self.line}"


def _fixing_op() -> FixedBy:
    """The ATen op whose shape function (fake tensor dispatch) is running on this thread, outermost first (the op
    the traced code or the autograd engine called, not an op of its decomposition), and the autograd node."""
    op, function = None, None
    frame = sys._getframe(1)
    while frame is not None:
        func = frame.f_locals.get("func") if "func" in frame.f_code.co_varnames \
            and _in(frame, ("torch/_subclasses/",)) else None
        if isinstance(func, torch._ops.OpOverload):
            op = func
        if function is None and frame.f_code.co_name == "run_node" and _in(frame, ("torch/_dynamo/utils.py",)):
            function = _function_name(frame.f_locals.get("node"))
        frame = frame.f_back
    node = torch._C._current_autograd_node()
    return FixedBy(str(op) if op is not None else None, node.name() if node is not None else None, _user_line(),
                   function)


def _function_name(node) -> str | None:
    """The torch function (``torch.linspace``) or tensor method (``Tensor.repeat``) of the node of Dynamo's graph
    being run on fake values, as the user writes it, where a size is among its arguments (a symbolic int: the
    batch size given as a number); None for other nodes (``F.cross_entropy(h, y)`` of a label tensor of a fixed
    size fixes the batch size by its shapes, not by a number)."""
    if not any(isinstance(getattr(a, "meta", {}).get("example_value"), torch.SymInt)
               for a in (*getattr(node, "args", ()), *getattr(node, "kwargs", {}).values())):
        return None
    if getattr(node, "op", None) == "call_method":
        return f"Tensor.{node.target}"
    target = getattr(node, "target", None)
    name = getattr(target, "__name__", None)
    if getattr(node, "op", None) != "call_function" or name is None:
        return None
    for prefix, module in (("torch", torch), ("torch.nn.functional", torch.nn.functional)):
        if getattr(module, name, None) is target:
            return f"{prefix}.{name}"
    return name


def _size_against_the_batch(expr, value, shape_env) -> bool:
    """Whether ``expr`` is ``batch size == N`` (or ``!=``), decided as this batch's size being ``N``: a fixed size
    that meets the batch's, the mark of a per-sample tensor left out of the batched arguments."""
    if not (isinstance(expr, sympy.Eq | sympy.Ne) and value == isinstance(expr, sympy.Eq)) or not _in_torch_code():
        return False
    return any(isinstance(side, sympy.Symbol) and isinstance(other, sympy.Integer)
               and side in _batch_sizes(side, shape_env)
               for side, other in ((expr.lhs, expr.rhs), (expr.rhs, expr.lhs)))


def _batch_sizes(expr, shape_env) -> set:
    """The batch sizes ``expr`` reads (every backed size of a tensor in a capture is one). torch 2.14 also makes a
    backed size of ``.item()`` on a constant tensor (split points held in a tensor), guarded on its value: that
    one is no batch size."""
    return {s for s in getattr(expr, "free_symbols", ()) if symbol_is_type(s, SymT.SIZE)
            and not _read_from_a_value(shape_env, s)}


def _at_batch_of_one(expr, shape_env):
    """``expr`` with every batch size 1, or None where it does not depend on the batch size alone."""
    sizes = _batch_sizes(expr, shape_env)
    if not sizes:
        return None
    try:
        at_one = expr.xreplace(dict.fromkeys(sizes, sympy.Integer(1)))
    except ZeroDivisionError:  # Mod(B - 1, 2*B - 2) from the backward of x.unfold(0, 2, 1): no windows at B = 1
        return UNDEFINED
    return None if getattr(at_one, "free_symbols", None) else at_one


def _read_from_a_value(shape_env, symbol) -> bool:
    """Whether every source Dynamo recorded for ``symbol`` is other than a tensor's size (``.item()`` of a tensor)."""
    from torch._dynamo.source import TensorProperty, TensorPropertySource

    sources = getattr(shape_env, "var_to_sources", {}).get(symbol, ())
    return bool(sources) and not any(isinstance(source, TensorPropertySource) and source.prop is TensorProperty.SIZE
                                     for source in sources)


# torch functions whose decisions on sizes are argument checks that a batch of one passes as the batch does:
# F.affine_grid's ``min(size) <= 0`` compares the batch size with the image sizes, and raises only for a size < 1
_ARGUMENT_CHECKS = (torch.nn.functional.affine_grid.__code__,)


def _in_an_argument_check() -> bool:
    """Whether the code that made the decision (past the shape environment and the conversions of symbolic values)
    is one of ``_ARGUMENT_CHECKS``: Dynamo runs ``F.affine_grid`` on fake values as one in-graph function."""
    frame = sys._getframe(2)
    while frame is not None and (_in(frame, _MACHINERY) or _in(frame, _CONVERSIONS)):
        frame = frame.f_back
    return frame is not None and frame.f_code in _ARGUMENT_CHECKS


def in_an_argument_check(filename: str, function: str) -> bool:
    """Whether the torch code a guard names (``nn/functional.py``, ``affine_grid``: its file's path may be
    shortened to its end) is one of ``_ARGUMENT_CHECKS``."""
    return any(code.co_name == function and code.co_filename.replace("\\", "/").endswith("/" + filename.lstrip("/"))
               for code in _ARGUMENT_CHECKS)


def _in_torch_code() -> bool:
    """Whether the decision is made in torch's own Python code run on fake values (``F.mse_loss``'s check that the
    target's size is the input's), not in Dynamo's interpretation of the traced code (the user's ``if``)."""
    frame = sys._getframe(2)
    while frame is not None and (_in(frame, _MACHINERY) or _in(frame, _CONVERSIONS)):
        frame = frame.f_back
    return frame is not None and _in(frame, ("torch/",)) and not _in(frame, _DYNAMO)


def _made_by_the_program() -> bool:
    """Whether the decision is the traced Python code's own: Dynamo deciding its control flow, or a Python-level
    conversion (``bool``/``int`` of a symbolic value) outside torch's shape code. A C++ op's shape function calls
    the shape environment directly, so its caller frame is the op's Python caller: a layout decision."""
    frame = sys._getframe(2)
    while frame is not None and _in(frame, _MACHINERY):
        frame = frame.f_back
    if frame is None:
        return False
    if _in(frame, _DYNAMO):
        return True
    if not _in(frame, _CONVERSIONS):
        return False
    while frame is not None and _in(frame, _CONVERSIONS):
        frame = frame.f_back
    return frame is not None and not _in(frame, _SHAPE_CODE)


def _in(frame, parts: tuple[str, ...]) -> bool:
    name = frame.f_code.co_filename.replace("\\", "/")
    return any(part in name for part in parts)


def _user_line() -> str:
    """The innermost line of the user's (or a library's) code Dynamo was tracing."""
    # Dynamo's polyfills stand for Python builtins (tuple equality runs one on torch 2.11): not the user's code
    frames = [f for f in torch._guards.TracingContext.extract_stack()
              if "compiled_psg/_capture" not in f.filename and "torch/_dynamo/polyfills" not in f.filename]
    if not frames:
        return "unknown source line"
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
