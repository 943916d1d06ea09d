"""Every change compiled_psg makes inside torch, in one table.

Each entry says what it changes (``target``), why, when it is in force (``when``: during a whole rewrite, its
capture included, during a capture, while a call checks a capture's guards, during a compile, or for the whole
process), which threads see it (``threads``), how it is undone (``undo``) and the torch versions it was checked on
(``checked_on``). A rewrite, a capture, a guard check and a compile each enter ``applied(phase)``, built from the
table: the entries of that phase, in the order they were
registered, under Dynamo's own compile lock (``torch._dynamo.convert_frame.compile_lock``, re-entrant), which
every ``torch.compile`` of another thread also takes before it traces or compiles. So a user's ``torch.compile``
running beside a capture waits for it and then sees torch as it was; a compiled function it already built runs
on. ``current()`` reads what each entry replaces; ``tests/test_patches.py`` checks that after a capture, a
compile and a failed one of each, every target is torch's original again.

The modules that own a change register it (``register``) where they define it, so this file imports nothing of
the package: the pipeline's later floors (``_compile``) register theirs too. Process-wide changes without an
``enter`` are permanent, each justified in its entry. A "kernel" entry is in force for one call of one op of a
compiled program, entered by that op itself (``REGISTRY[name].enter()``), not under the compile lock.
``python docs/gen_patches.py`` writes the table into docs/semantics.md ("Every change inside torch").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

PHASES = ("rewrite", "capture", "guard check", "compile", "process", "kernel")
CHECKED_ON = ("2.11.0", "2.13.0", "2.14.1", "2.15.0")


@dataclass(frozen=True)
class Patch:
    name: str
    target: str  # what in torch changes, by its dotted name
    why: str
    when: tuple[str, ...]  # phases of PHASES
    threads: str  # who sees the change while it is in force
    undo: str
    enter: Callable[..., contextlib.AbstractContextManager] | None = None  # None: a permanent process change
    takes: tuple[str, ...] = ()  # keyword arguments of ``applied`` that ``enter`` needs
    current: Callable[[], tuple] | None = None  # the objects the change replaces, as they are now
    checked_on: tuple[str, ...] = CHECKED_ON
    only_if: Callable[[], bool] | None = None  # in force only where this holds (a torch version); None: always

    def in_force_here(self) -> bool:
        return self.only_if is None or self.only_if()

    def __post_init__(self):
        if not self.when or any(w not in PHASES for w in self.when):
            raise ValueError(f"{self.name}: when must name phases of {PHASES}, got {self.when}")
        if (self.enter is None) != (self.when == ("process",)):  # "kernel" entries are entered by their op
            raise ValueError(f"{self.name}: a change has an enter() exactly when it is not a permanent process one")


REGISTRY: dict[str, Patch] = {}


def flag_set(read: Callable[[], object], write: Callable[[object], object], value: object):
    """An ``enter`` for a flag of torch: ``write(value)`` while in force, the value ``read`` found restored on any
    exit."""
    @contextlib.contextmanager
    def enter() -> Iterator[None]:
        before = read()
        write(value)
        try:
            yield
        finally:
            write(before)
    return enter


def register(patch: Patch) -> Patch:
    """Add ``patch`` to the table (once per name: a module imported twice re-registers the same entry)."""
    REGISTRY[patch.name] = patch
    return patch


@contextlib.contextmanager
def applied(phase: str, **arguments) -> Iterator[dict[str, object]]:
    """Every entry of ``phase`` in force, under Dynamo's compile lock; yields what each entry's context gave, by
    name. Pre: ``arguments`` holds every name an entry of the phase ``takes``. Post: on any exit, every entry
    entered is undone, in reverse order, before the lock is released."""
    if phase not in PHASES[:4]:
        raise ValueError(f"phase must be one of {PHASES[:4]}, got {phase!r}")
    from torch._dynamo.convert_frame import compile_lock

    with compile_lock, contextlib.ExitStack() as stack:
        entered = {}
        for patch in REGISTRY.values():
            if phase in patch.when and patch.in_force_here():
                entered[patch.name] = stack.enter_context(patch.enter(**{k: arguments[k] for k in patch.takes}))
        yield entered


def current() -> dict[str, tuple]:
    """What each reversible entry replaces, read now: compare two readings by identity (``is``)."""
    return {name: p.current() for name, p in REGISTRY.items() if p.current is not None}


def markdown() -> str:
    """The table for docs/semantics.md, by phase and name (registration order follows import order)."""
    rows = ["| change | target | why | when | threads | undone by | checked on |", "|---|---|---|---|---|---|---|"]
    for p in sorted(REGISTRY.values(), key=lambda p: (PHASES.index(p.when[0]), p.name.lower())):
        cells = [p.name, f"`{p.target}`", p.why, ", ".join(p.when), p.threads, p.undo, ", ".join(p.checked_on)]
        rows.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(rows)
