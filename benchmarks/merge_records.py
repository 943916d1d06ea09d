"""``python -m benchmarks.merge_records SCRATCH SOURCE... [--fixed TEXT]``: one scratch folder from several runs.

A lent GPU gives minutes, not the hour a full run takes, so a GPU page is measured in several calls, each on some
models and methods. Each SOURCE is a page's raw results (``docs/benchmarks-gpu.json``), a worker's results
(``MODEL.jsonl``) or a folder or ``.tgz`` of them; later sources replace earlier ones per model and method. The
result is ``SCRATCH/MODEL.jsonl`` per model, which ``python -m benchmarks --scratch SCRATCH --command-note ...``
turns into a page without measuring anything. ``--fixed TEXT``: a record that failed with an error containing
TEXT (a failure since fixed, and not measured again) becomes "not measured" instead of a FAIL of today's code.
"""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path


def _from_page(page: dict) -> dict[str, list[dict]]:
    out = {}
    for model, result in page["models"].items():
        header = {k: v for k, v in result.items() if k != "methods"}
        out[model] = [header, *result["methods"].values()]
    return out


def _from_jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _read(source: Path) -> dict[str, list[dict]]:
    if source.suffix == ".json":
        return _from_page(json.loads(source.read_text()))
    if source.suffix == ".jsonl":
        return {source.stem: _from_jsonl(source.read_text())}
    if source.name.endswith(".tgz"):
        with tarfile.open(source) as tar:
            return {Path(m.name).stem: _from_jsonl(tar.extractfile(m).read().decode())
                    for m in tar.getmembers() if m.name.endswith(".jsonl")}
    return {p.stem: _from_jsonl(p.read_text()) for p in sorted(source.glob("*.jsonl"))}


def _errors(record: dict) -> list[str]:
    sizes = record.get("sizes") or {}
    return [record["error"]] if "error" in record else [e["error"] for e in sizes.values() if "error" in e]


def merge(sources: list[Path], fixed: str | None = None) -> dict[str, list[dict]]:
    """``{model: [header, *records]}``: the last header seen, and per method the last record seen."""
    headers: dict[str, dict] = {}
    records: dict[str, dict[str, dict]] = {}
    for source in sources:
        for model, lines in _read(source).items():
            for line in lines:
                if "environment" in line:
                    headers[model] = line
                elif "method" in line:
                    records.setdefault(model, {})[line["method"]] = line
    for by_method in records.values():
        for method, record in by_method.items():
            if fixed and any(fixed in e for e in _errors(record)):
                by_method[method] = {k: record[k] for k in ("model", "method", "label") if k in record} | {
                    "error": f"not measured in this run (the code it ran refused it: {fixed})"}
    return {model: [headers[model], *records.get(model, {}).values()] for model in headers}


def main(argv: list[str]) -> None:
    fixed = None
    if "--fixed" in argv:
        i = argv.index("--fixed")
        fixed, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    if len(argv) < 2:
        sys.exit(__doc__.split("\n\n")[0])
    scratch = Path(argv[0])
    scratch.mkdir(parents=True, exist_ok=True)
    for model, lines in merge([Path(a) for a in argv[1:]], fixed).items():
        (scratch / f"{model}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        print(f"{model}: {len(lines) - 1} methods")


if __name__ == "__main__":
    main(sys.argv[1:])
