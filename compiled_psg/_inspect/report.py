"""``explain``: what the rewrite did, as data. It never prints unless asked.

``report.captured``: the joint graph Dynamo and AOT autograd captured from the user's loss.
``report.before``: the joint graph the per-sample pass rewrites (the same computation, with the loss head made
per-sample and the backward re-traced from it). ``report.after``: the rewritten graph that gets compiled.
"""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch.fx as fx

from .._analyze.source import group_sites
from .._errors import BatchInputError
from .draw import draw, drawing_support
from .render import graph_text, normalize, shape_of


@dataclass
class ParamRewrite:
    """One parameter: how its per-sample gradient is computed."""

    name: str
    shape: tuple
    contractions: list[str]  # contraction node names in ``before``
    rules: list[str]
    per_sample_shape: tuple
    choices: list = field(default_factory=list)  # per-layer cost-model choices for the reduction

    @property
    def fallback(self) -> bool:
        return any(r.startswith("fallback") for r in self.rules)


@dataclass
class Report:
    captured: fx.GraphModule | None = None
    before: fx.GraphModule | None = None
    after: fx.GraphModule | None = None
    rewrites: list[ParamRewrite] = field(default_factory=list)
    head: list = field(default_factory=list)  # records of the loss-head pass
    fallbacks: list = field(default_factory=list)
    mixing: list = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    memory_plan: dict | None = None  # with a memory_budget: budget, batch_size, held, peak, the same by_cheapest, fits

    # ----- construction -----
    @classmethod
    def for_refusal(cls, captured, forward, mixing) -> Report:
        labels = _labels(captured.roles, captured.joint)
        return cls(captured=captured.joint, before=forward, mixing=list(mixing), labels=labels)

    @classmethod
    def from_rewritten(cls, rw) -> Report:
        rewrites = []
        for p in rw.param_grads:
            rules = [c.rule for c in p.contractions] or (["(independent of the batch)"] if p.grad is not None
                                                         else ["(unused: zeros)"])
            rewrites.append(ParamRewrite(
                name=p.name, shape=p.shape, contractions=[c.node.name for c in p.contractions], rules=rules,
                per_sample_shape=("B", *p.shape), choices=list(rw.choices.get(p.name, []))))
        return cls(captured=rw.captured.joint, before=rw.joint, after=rw.graph_module, rewrites=rewrites,
                   head=list(rw.head.records), fallbacks=list(rw.head.fallbacks) + list(rw.backward.fallbacks),
                   labels=_labels(rw.roles, rw.joint), memory_plan=rw.memory_plan)

    # ----- reading -----
    def __str__(self) -> str:
        if self.mixing:
            lines = ["compiled_psg refused this loss: samples are mixed."]
            lines += [f"  {site}" for site in group_sites(self.mixing)]
            return "\n".join(lines)
        rows = [("parameter", "shape", "rule(s)", "reduction choice")]
        for r in self.rewrites:
            choice = "; ".join(f"{c.quantity}: {c.method}" + (_cost(c.cost)) for c in r.choices) or "-"
            rows.append((r.name, str(tuple(r.shape)), ", ".join(sorted(set(r.rules))), choice))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        text = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        text.insert(1, "  ".join("-" * w for w in widths))
        head = ", ".join(sorted({r.rule for r in self.head if r.kind == "contraction"})) or "none (per-sample losses)"
        text.append(f"loss head: {head}")
        if self.memory_plan is not None:
            plan = self.memory_plan
            text.append(f"memory budget: {_mib(plan['budget'])}; per-sample values at B = {plan['batch_size']}: "
                        f"{_mib(plan['peak'])} at the peak, {_mib(plan['held'])} of it held across the program "
                        f"(the fastest plan: {_mib(plan['peak_by_cheapest'])} at the peak)"
                        + ("" if plan["fits"] else "; over budget: no strategy holding less applies"))
        text.append(f"fallbacks (vmap of one op): {len(self.fallbacks)}"
                    + "".join(f"\n  {f.op} at {f.source}" for f in self.fallbacks))
        return "\n".join(text)

    def graph_text(self, which: str = "after") -> str:
        """The ``"captured"``, ``"before"`` or ``"after"`` graph as readable code with shapes."""
        if which not in ("captured", "before", "after"):
            raise BatchInputError(f"graph_text(which) takes 'captured' (the joint graph captured from the loss), "
                                  "'before' (the graph the per-sample pass rewrites) or 'after' (the rewritten one), "
                                  f"got {which!r}")
        gm = getattr(self, which)
        return graph_text(gm, self.labels) if gm is not None else ""

    def print_graphs(self, file=None) -> None:
        """Print both graphs as readable code with shapes; rewritten nodes end in ``# psg: <rule>``. ``file``: a
        text stream, as for ``print`` (default ``sys.stdout``)."""
        file = sys.stdout if file is None else file
        fix = ("Fix: pass an open text stream (open(path, 'w'), io.StringIO()), or nothing for standard output; "
               "report.save(folder) writes the graphs to files")
        if not callable(getattr(file, "write", None)):
            raise BatchInputError(f"report.print_graphs(file=...) writes to a text stream (an object with a write "
                                  f"method, as print takes), got {type(file).__name__} {file!r}. {fix}")
        text = "".join(f"# ===== {which} =====\n{self.graph_text(which)}\n" for which in ("before", "after"))
        try:
            file.write(text)
        except (OSError, ValueError, TypeError) as e:  # closed, read-only, or a binary stream
            raise BatchInputError(f"report.print_graphs could not write to {file!r}: {type(e).__name__}: {e}. "
                                  f"{fix}") from e

    def diff(self) -> str:
        """Unified diff of ``before`` and ``after`` restricted to the rewritten region and the outputs."""
        if self.before is None or self.after is None:
            return ""
        region = {name for r in self.rewrites for name in r.contractions}
        before_lines = [normalize(_line(n, self.labels)) for n in self.before.graph.nodes
                        if n.name in region or n.op == "output"]
        after_lines = [normalize(_line(n, self.labels)) for n in self.after.graph.nodes
                       if "psg" in n.meta or n.op == "output"]
        return "".join(difflib.unified_diff([line + "\n" for line in before_lines],
                                            [line + "\n" for line in after_lines], "before", "after", n=0))

    def save(self, folder: str | Path, *, drawings: bool = True) -> list[Path]:
        """Write ``summary.txt``, ``captured.txt``, ``before.txt``, ``after.txt``, ``diff.txt`` and, with Graphviz,
        ``before.svg`` and ``after.svg`` (rewritten nodes highlighted) into ``folder``, created if missing (files of
        those names already in it are replaced). Returns the paths written."""
        if not isinstance(folder, str | os.PathLike):
            raise BatchInputError(f"report.save(folder) takes the path of a folder (a str or a pathlib.Path), got "
                                  f"{type(folder).__name__} {folder!r}. Fix: report.save('report')")
        folder = Path(folder)
        if folder.exists() and not folder.is_dir():
            raise BatchInputError(f"report.save({str(folder)!r}): that path is a file, and the report is several "
                                  "files written into a folder. Fix: pass the path of a folder (it is created if "
                                  "missing)")
        try:
            return self._save(folder, drawings)
        except OSError as e:
            raise BatchInputError(f"report.save could not write into the folder {str(folder)!r}: "
                                  f"{e.strerror or e} ({e.filename or folder}). Fix: pass a folder you can write to"
                                  ) from e

    def _save(self, folder: Path, drawings: bool) -> list[Path]:
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for name, text in (("summary.txt", str(self) + "\n"), ("captured.txt", self.graph_text("captured")),
                           ("before.txt", self.graph_text("before")), ("after.txt", self.graph_text("after")),
                           ("diff.txt", self.diff())):
            if text:
                (folder / name).write_text(text)
                written.append(folder / name)
        if drawings:
            missing = drawing_support()
            if missing:
                (folder / "drawings-skipped.txt").write_text(f"No SVG drawings: {missing}.\n")
                written.append(folder / "drawings-skipped.txt")
            else:
                for which in ("before", "after"):
                    gm = getattr(self, which)
                    if gm is not None:
                        draw(gm, which, folder / f"{which}.svg")
                        written.append(folder / f"{which}.svg")
        return written


def _mib(n: float) -> str:
    """Bytes in the largest binary unit that keeps a whole part."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} bytes"


def _cost(cost: dict) -> str:
    if not cost:
        return ""
    return " (" + ", ".join(f"{k}={v}" for k, v in cost.items()) + ")"


def _line(node: fx.Node, labels) -> str:
    from .render import node_line

    return node_line(node, labels.get(node.name))


def _labels(roles, gm: fx.GraphModule) -> dict[str, str]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = {}
    for node, role in zip(placeholders, roles, strict=False):
        if role.kind == "param":
            out[node.name] = f"parameter {role.key}"
        elif role.kind == "arg":
            out[node.name] = f"argument {role.key}" + (" (batched)" if role.batched else "")
        elif role.kind == "size":
            out[node.name] = "batch size"
        else:
            out[node.name] = "buffer or constant"
    return out


def dump_if_asked(rewritten) -> None:
    """Save ``rewritten``'s report (no drawings) under ``$COMPILED_PSG_DUMP``, one folder per rewrite."""
    folder = os.environ.get("COMPILED_PSG_DUMP")
    if folder:
        try:
            Report.from_rewritten(rewritten).save(_next_dump_folder(folder), drawings=False)
        except BatchInputError as e:
            raise BatchInputError(f"COMPILED_PSG_DUMP={folder!r}: {e} (or unset COMPILED_PSG_DUMP)") from e


_dumps = 0


def _next_dump_folder(folder: str) -> str:
    global _dumps
    _dumps += 1
    return os.path.join(folder, f"{os.getpid()}-{_dumps:03d}")


__all__ = ["Report", "ParamRewrite", "dump_if_asked", "shape_of"]
