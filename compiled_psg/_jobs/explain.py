"""``python -m compiled_psg explain MODEL`` and ``python -m compiled_psg graphs DIR`` (regenerates graphs/)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .._errors import BatchInputError
from .._explain import explain
from .._inspect.examples import EXAMPLES
from .cli import output_folder


def report_for(name: str):
    from .._api import per_sample

    if name not in EXAMPLES:
        raise BatchInputError(f"no example named {name!r}; the examples are {', '.join(sorted(EXAMPLES))}")
    example = EXAMPLES[name]
    model, loss_fn, batch = example.build()
    fn = per_sample(model, reduce=example.reduce, backend="eager")(loss_fn)
    return explain(fn, *batch)


def write_graphs(folder: Path, drawings: bool = True) -> list[Path]:
    """Write every example's dumps under ``folder/<example>/``, plus an index."""
    written = []
    lines = ["# Reference dumps", "", "Regenerate with `python -m compiled_psg graphs graphs`.", ""]
    for name, example in EXAMPLES.items():
        report = report_for(name)
        written += report.save(folder / name, drawings=drawings)
        lines.append(f"- [{name}]({name}/summary.txt): {example.doc}")
    index = folder / "README.md"
    index.write_text("\n".join(lines) + "\n")
    return written + [index]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compiled_psg explain",
                                     description="Explain the rewrite of a bundled example model.")
    parser.add_argument("model", choices=sorted(EXAMPLES), help="bundled example")
    parser.add_argument("--graphs", action="store_true", help="print both graphs")
    parser.add_argument("--diff", action="store_true", help="print the rewritten region as a diff")
    parser.add_argument("--save", type=output_folder, help="write text dumps and drawings to this folder")
    args = parser.parse_args(argv)
    report = report_for(args.model)
    print(report)
    if args.graphs:
        report.print_graphs()
    if args.diff:
        print(report.diff())
    if args.save:
        for path in report.save(args.save):
            print(f"wrote {path}")
    return 0


def graphs_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compiled_psg graphs", description="Regenerate the reference dumps.")
    parser.add_argument("folder", type=output_folder, nargs="?", default=Path("graphs"))
    parser.add_argument("--no-drawings", action="store_true")
    args = parser.parse_args(argv)
    for path in write_graphs(args.folder, drawings=not args.no_drawings):
        print(f"wrote {path}")
    return 0
