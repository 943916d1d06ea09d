"""The rule table, as the per-sample pass reads it: every rule module is imported here, so each has registered
its rules (``registry.py``); the supported-op list is generated from the table.

To add a rule: write ``@contraction_rule(aten.my_op.default) def my_op(node, batch) -> Contraction | None`` in a
module of ``rules/`` (and import that module below), add the op to the zoo in ``tests/``. A user's own op:
``psg.register_rule``. ``docs/contributing.md`` walks through one.
"""

from __future__ import annotations

from .registry import CONTRACTION_RULES, LIFT_RULES, LINEARITY
from .rules import (  # noqa: F401  (each registers its rules)
    conv,
    distance,
    embedding,
    embedding_bag,
    lift,
    linear,
    norm,
    reduce,
)
from .rules.lift import pointwise

__all__ = ["CONTRACTION_RULES", "LIFT_RULES", "supported_ops"]


def supported_ops() -> list[dict[str, str]]:
    """One row per rule in the table: the op, the kind of rule, and the first line of its docstring."""
    rows = []
    for op, rule in sorted(CONTRACTION_RULES.items(), key=lambda item: str(item[0])):
        doc = (rule.__doc__ or "").strip().splitlines()[0]
        rows.append({"op": str(op), "kind": "contraction", "rule": f"{rule.__module__}.{rule.__name__}",
                     "summary": doc})
    for op, rule in sorted(LIFT_RULES.items(), key=lambda item: str(item[0])):
        doc = (rule.__doc__ or "").strip().splitlines()[0]
        rows.append({"op": str(op), "kind": "lift" + (" (linear)" if LINEARITY.get(op) else ""),
                     "rule": f"{rule.__module__}.{rule.__name__}", "summary": doc})
    rows.append({"op": "any op tagged torch.Tag.pointwise", "kind": "lift", "rule": f"{pointwise.__module__}.pointwise",
                 "summary": (pointwise.__doc__ or "").strip().splitlines()[0]})
    return rows
