"""The one rule table: ATen op -> rewrite rule. Rules register where they are defined.

Two kinds (see ``contraction.py`` and ``rules/lift.py``)::

    @contraction_rule(aten.mm.default)          # batched inputs, shared output: the per-sample form
    def mm(node, batch) -> Contraction | None: ...

    @lift_rule(aten.t.default, linear=True)     # after a contraction: the op on per-sample values
    def shape_op(node, lifted) -> Callable | None: ...

A rule declines by returning None (the node then takes the counted vmap fallback). ``linear`` says whether the
op is linear in its per-sample arguments (a bool, or ``linear(node, lifted) -> bool``): weighted sums over
samples commute with linear ops, which is what lets ``clip_sum`` skip per-sample gradients (book-keeping). It is
declared once, with the rule, or with ``linear_op`` for pointwise ops that need no rule of their own.

``register_rule`` is the public form for users' own ops. The supported-op page is generated from this table.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx

ContractionRule = Callable[..., object]
LiftRule = Callable[[fx.Node, list[bool]], Callable | None]
Linearity = bool | Callable[[fx.Node, list[bool]], bool]

CONTRACTION_RULES: dict[torch._ops.OpOverload, ContractionRule] = {}
LIFT_RULES: dict[torch._ops.OpOverload, LiftRule] = {}
LINEARITY: dict[torch._ops.OpOverload, Linearity] = {}
TAG_LIFT_RULES: dict[torch.Tag, LiftRule] = {}  # the lift of every op carrying the tag (and no rule of its own)


def _check_op(op) -> None:
    if not isinstance(op, torch._ops.OpOverload):
        from .._errors import BatchInputError

        raise BatchInputError(f"rules are keyed by ATen op overloads such as torch.ops.aten.mm.default, got {op!r}")


def contraction_rule(*ops: torch._ops.OpOverload):
    """Register ``rule(node, batch) -> Contraction | None`` for ``ops`` (for a multi-output op, the rule receives
    the ``getitem`` node of the output that contracts the batch)."""
    def register(rule: ContractionRule) -> ContractionRule:
        for op in ops:
            _check_op(op)
            CONTRACTION_RULES[op] = rule
        return rule
    return register


def lift_rule(*ops: torch._ops.OpOverload, linear: Linearity = False):
    """Register ``rule(node, lifted) -> tensor function | None`` for ops after a contraction."""
    def register(rule: LiftRule) -> LiftRule:
        for op in ops:
            _check_op(op)
            LIFT_RULES[op] = rule
            LINEARITY[op] = linear
        return rule
    return register


def linear_op(*ops: torch._ops.OpOverload, linear: Linearity = True) -> None:
    """Declare ops (lifted by the generic pointwise rule) linear in their per-sample arguments."""
    for op in ops:
        LINEARITY[op] = linear


def register_rule(op: torch._ops.OpOverload, rule: Callable, *, kind: str = "contraction",
                  linear: Linearity = False) -> None:
    """Add a rule for ``op`` to the table (public: ``psg.register_rule``).

    ``kind="contraction"``: ``rule(node, batch) -> compiled_psg contraction | None`` for a node whose inputs carry
    the batch and whose output does not. ``kind="lift"``: ``rule(node, lifted) -> function | None`` for an op
    applied to per-sample values after a contraction; ``linear`` as in ``lift_rule``. Captures made before the
    call keep their graphs; new captures use the rule. See docs/contributing.md.
    """
    if kind == "contraction":
        contraction_rule(op)(rule)
    elif kind == "lift":
        lift_rule(op, linear=linear)(rule)
    else:
        from .._errors import BatchInputError

        raise BatchInputError(f"kind must be 'contraction' or 'lift', got {kind!r}")


def is_linear(target, node: fx.Node, lifted: list[bool]) -> bool:
    linear = LINEARITY.get(target, False)
    return linear(node, lifted) if callable(linear) else bool(linear)


def tag_lift_rule(tag: torch.Tag):
    """Register ``rule(node, lifted)`` as the lift of every op tagged ``tag`` that has no lift rule of its own."""
    def register(rule: LiftRule) -> LiftRule:
        TAG_LIFT_RULES[tag] = rule
        return rule
    return register


def lift_rule_for(node: fx.Node) -> LiftRule | None:
    """The lift rule of ``node``'s op (for a ``getitem``, of the op it reads): its own, else its tags'."""
    target = node.target
    if target is operator.getitem and isinstance(node.args[0], fx.Node):
        target = node.args[0].target
    if target in LIFT_RULES:
        return LIFT_RULES[target]
    tags = getattr(target, "tags", ()) if isinstance(target, torch._ops.OpOverload) else ()
    return next((rule for tag, rule in TAG_LIFT_RULES.items() if tag in tags), None)
