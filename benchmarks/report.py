"""Turn the raw results (``benchmarks.json``) into ``benchmarks.md`` and the plots under ``img/``.

Everything here is derived from the results dict; nothing is measured. On a CPU the tables give time ratios
only (absolute CPU times on a shared machine say little); on a GPU they give milliseconds too.
"""

from __future__ import annotations

from pathlib import Path

from .measure import TOLERANCE
from .methods import COMPILED_BASELINE, METHODS, baseline_of
from .models import MODELS

TIME_PLOT = "img/benchmarks_time_ratio.png"
MEMORY_PLOT = "img/benchmarks_memory.png"


# -- lookups ---------------------------------------------------------------------------------------


def _entry(model: dict, method: str, size) -> dict:
    record = model["methods"].get(method, {})
    if "error" in record:
        return {"error": record["error"]}
    return record.get("sizes", {}).get(str(size), {"error": "not run"})


def base_entry(model: dict, name: str, size) -> dict:
    """``name``'s entry, or for a baseline with a compiled twin (``backward``, ``sgd_step``) the entry of the
    faster of the two at this batch size: a target against "the plain step" is against the best plain step."""
    keys = [k for k in (name, COMPILED_BASELINE.get(name)) if k and k in model["methods"]]
    entries = [_entry(model, k, size) for k in keys] or [_entry(model, name, size)]
    timed = [e for e in entries if "median_s" in e]
    return min(timed, key=lambda e: e["median_s"]) if timed else entries[0]


def faster_baseline(model: dict, name: str, size) -> str | None:
    """Which of ``name`` and its compiled twin is the faster at ``size`` (None if neither ran)."""
    keys = [k for k in (name, COMPILED_BASELINE.get(name)) if k and "median_s" in _entry(model, k, size)]
    return min(keys, key=lambda k: _entry(model, k, size)["median_s"]) if keys else None


def ratio(model: dict, method: str, size, against: str | None = None) -> float | None:
    base = base_entry(model, against or baseline_of(method), size).get("median_s")
    mine = _entry(model, method, size).get("median_s")
    return mine / base if mine is not None and base else None


def _fmt_ratio(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _fmt_mib(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**20:.0f}" if n >= 2**20 else f"{n / 2**20:.2f}"


def _cell(model: dict, method: str, size, fmt) -> str:
    entry = _entry(model, method, size)
    return _failure(entry["error"]) if "error" in entry else fmt(entry)


def _failure(error: str) -> str:
    return error.replace("|", "\\|")


def _label(method: str, record: dict | None = None) -> str:
    label = METHODS[method].label if method in METHODS else method
    return f"{label} ({record['note']})" if record and record.get("note") else label


# -- tables ----------------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def headline_table(model: dict, gpu: bool) -> list[str]:
    size = model["plan"]["check_size"]
    header = [
        "method",
        "× backward (faster of eager, compiled)",
        "× SGD step (faster of eager, compiled)",
        "peak extra memory (MiB)",
        "first call in the run (s)",
        "recompiles",
        "check (max rel. err.)",
    ]
    if gpu:
        header.insert(1, "time (ms)")
    rows = []
    for key, record in model["methods"].items():
        entry = _entry(model, key, size)
        if "error" in entry:
            rows.append([_label(key, record), _failure(entry["error"])] + [""] * (len(header) - 2))
            continue
        dp = METHODS[key].group == "DP step" or key.startswith("sgd_step")
        row = [
            _label(key, record),
            _fmt_ratio(ratio(model, key, size, "backward")),
            _fmt_ratio(ratio(model, key, size, "sgd_step")) if dp else "",
            _fmt_mib(entry.get("peak_bytes")),
            _first_call(record, model),
            str(record.get("recompiles", "")),
            _fmt_check(record.get("check")),
        ]
        if gpu:
            row.insert(1, f"{entry['median_s'] * 1e3:.2f}")
        rows.append(row)
    return _table(header, rows)


def _first_call(record: dict, model: dict) -> str:
    """The run's first call, at the first batch size: capture and compile, for the compiled methods."""
    first = record.get("sizes", {}).get(str(model["plan"]["sizes"][0]), {})
    return f"{first['first_call_s']:.2f}" if "first_call_s" in first else "—"


def _fmt_check(check: dict | None) -> str:
    if not check:
        return ""
    if "error" in check:
        return _failure(check["error"])
    err = check["max_rel_err"]
    return f"{err:.1e}" if err <= TOLERANCE else f"{err:.1e} (wrong)"


def sizes_table(model: dict, gpu: bool) -> list[str]:
    sizes = model["plan"]["sizes"]
    header = ["method"] + [f"B={b}: × baseline" for b in sizes] + [f"B={b}: MiB" for b in sizes]
    rows = []
    for key in model["methods"]:
        cells = [_cell(model, key, b, lambda e, b=b, key=key: _fmt_ratio(ratio(model, key, b))) for b in sizes]
        mems = [_cell(model, key, b, lambda e: _fmt_mib(e.get("peak_bytes"))) for b in sizes]
        if gpu:
            cells = [
                c
                + (
                    f" ({_entry(model, key, b)['median_s'] * 1e3:.2f} ms)"
                    if "median_s" in _entry(model, key, b)
                    else ""
                )
                for c, b in zip(cells, sizes, strict=True)
            ]
        rows.append([_label(key)] + cells + mems)
    return _table(header, rows)


def sequence_table(model: dict, gpu: bool) -> list[str]:
    base = model["methods"].get("backward", {}).get("sequence") or {}
    header = [
        "method",
        "recompiles in the sequence",
        "compiles in the whole run",
        "sequence time × backward's",
    ]
    if gpu:
        header.append("sequence time (ms)")
    rows = []
    for key, record in model["methods"].items():
        seq = record.get("sequence")
        if seq is None:
            rows.append(
                [_label(key), _failure(record.get("error", "not run (every batch size failed)")), "", ""]
                + ([""] if gpu else [])
            )
            continue
        if "error" in seq:
            rows.append([_label(key), _failure(seq["error"]), "", ""] + ([""] if gpu else []))
            continue
        counters = record.get("counters", {})
        compiles = str(counters.get("compiles", ""))
        if "captures" in counters:
            compiles += f" ({counters['captures']} capture{'s' if counters['captures'] != 1 else ''})"
        rel = seq["total_s"] / base["total_s"] if base.get("total_s") else None
        row = [
            _label(key),
            str(seq.get("recompiles", "— (not compiled)")),
            compiles,
            _fmt_ratio(rel),
        ]
        if gpu:
            row.append(f"{seq['total_s'] * 1e3:.1f}")
        rows.append(row)
    return _table(header, rows)


TARGETS = [
    ("compiled_psg materialized <= torch.compile(vmap(grad))", "psg_grads", "func_compile", 1.0),
    ("compiled_psg norms <= 1.3 × ordinary backward", "psg_norms", "backward", 1.3),
    ("compiled_psg DP step <= 1.5 × plain SGD step", "dp_psg", "sgd_step", 1.5),
]
PEER_DP = ["dp_func_compile", "dp_opacus_hooks", "dp_opacus_ghost"]


def targets_table(results: dict) -> list[str]:
    header = ["model (headline B)"] + [t[0] for t in TARGETS] + ["compiled_psg DP step faster than every peer DP step"]
    rows = []
    for name, model in results["models"].items():
        size = model["plan"]["check_size"]
        row = [f"{name} (B={size})"]
        for _, mine, other, bound in TARGETS:
            r = ratio(model, mine, size, other)
            row.append("—" if r is None else f"{'PASS' if r <= bound else 'FAIL'} ({r:.2f})")
        mine = _entry(model, "dp_psg", size).get("median_s")
        peers = {p: _entry(model, p, size).get("median_s") for p in PEER_DP}
        timed = {p: t for p, t in peers.items() if t is not None}
        if mine is None:
            row.append("—")
        else:
            best = min(timed, key=timed.get) if timed else None
            verdict = "PASS" if all(mine < t for t in timed.values()) else "FAIL"
            detail = f"fastest peer: {_label(best)}, {mine / timed[best]:.2f}×" if best else "no peer ran"
            row.append(f"{verdict} ({detail})")
        rows.append(row)
    return _table(header, rows)


# Issue 12's targets, at every batch size measured: (title, mine, against, bound, what). "time": mine's median
# over against's (a baseline: the faster of eager and compiled) must be <= bound ("<" where strict); "memory":
# peak extra memory over the LOWER of the two plain steps' peaks; "cold": the first call of the run (capture
# and cold compile, empty Inductor cache) over the other's first call, at the run's first batch size only.
TARGETS_12 = [
    ("DP step / plain step <= 1.25", "dp_psg_compile_step", "sgd_step", 1.25, "time"),
    ("DP step / torch.compile(vmap(grad)) + clip-sum < 1", "dp_psg_compile_step", "dp_func_compile", 1.0, "strict"),
    ("norms / backward <= 1.15", "psg_norms", "backward", 1.15, "time"),
    ("materialized / torch.compile(vmap(grad)) <= 0.9", "psg_grads", "func_compile", 0.9, "time"),
    ("peak memory DP step / plain step <= 1.25", "dp_psg_compile_step", "sgd_step", 1.25, "memory"),
    ("cold compile: compile_step / torch.compile(vmap(grad)) <= 1.0", "dp_psg_compile_step", "func_compile", 1.0,
     "cold"),
]


def target_value(model: dict, size, mine: str, other: str, what: str) -> float | None:
    if what in ("time", "strict"):
        return ratio(model, mine, size, other)
    if what == "memory":  # the whole allocation at the peak where recorded (CUDA), else the extra memory
        keys = [k for k in (other, COMPILED_BASELINE.get(other)) if k and k in model["methods"]]
        entries = [_entry(model, k, size) for k in keys] + [_entry(model, mine, size)]
        field = "peak_total_bytes" if all("peak_total_bytes" in e for e in entries) else "peak_bytes"
        peaks = [e.get(field) for e in entries[:-1] if e.get(field)]
        got = entries[-1].get(field)
        return got / min(peaks) if got is not None and peaks else None
    first = str(model["plan"]["sizes"][0])
    if str(size) != first:
        return None
    a, b = (_entry(model, k, size).get("first_call_s") for k in (mine, other))
    return a / b if a is not None and b else None


def targets_12_table(results: dict) -> tuple[list[str], dict]:
    """Issue 12's targets as PASS/FAIL per model and batch size; also the counts."""
    header = ["model", "B"] + [t[0] for t in TARGETS_12]
    rows, counts = [], {"PASS": 0, "FAIL": 0, "not run": 0}
    for name, model in results["models"].items():
        for size in model["plan"]["sizes"]:
            row = [name, str(size)]
            for _, mine, other, bound, what in TARGETS_12:
                if what == "cold" and str(size) != str(model["plan"]["sizes"][0]):
                    row.append("")
                    continue
                r = target_value(model, size, mine, other, what)
                if r is None:
                    error = _entry(model, mine, size).get("error", "")
                    if error.startswith("unsupported: "):  # compiled_psg could not run it: the target is missed
                        cause = error.removeprefix("unsupported: ").split(":")[0]
                        row.append(f"FAIL ({cause})")
                        counts["FAIL"] += 1
                    else:  # the baseline or peer is missing, or it was skipped
                        row.append("not run")
                        counts["not run"] += 1
                    continue
                ok = r < bound if what == "strict" else r <= bound
                counts["PASS" if ok else "FAIL"] += 1
                row.append(f"{'PASS' if ok else 'FAIL'} ({r:.2f})")
            rows.append(row)
    return _table(header, rows), counts


def failures(results: dict) -> list[str]:
    lines = []
    for name, model in results["models"].items():
        for key, record in model["methods"].items():
            if "error" in record:
                lines.append(f"- {name} / {_label(key, record)}: {record['error']}")
                continue
            for size, entry in record.get("sizes", {}).items():
                if "error" in entry:
                    lines.append(f"- {name} / {_label(key, record)} / B={size}: {entry['error']}")
            seq = record.get("sequence") or {}
            if "error" in seq:
                lines.append(f"- {name} / {_label(key, record)} / changing batch size: {seq['error']}")
            chk = record.get("check") or {}
            if "error" in chk:
                lines.append(f"- {name} / {_label(key, record)} / check: {chk['error']}")
            elif chk.get("max_rel_err", 0) > TOLERANCE:
                err = chk["max_rel_err"]
                lines.append(f"- {name} / {_label(key, record)} / check: wrong, relative error {err:.1e}")
    return lines or ["None."]


def not_best(results: dict) -> list[str]:
    """Every model, batch size and quantity where a peer that ran (and passed the check) beat compiled_psg's best
    method on time, or on peak extra memory (by more than 5%: resident-set noise)."""
    lines = []
    for name, model in results["models"].items():
        groups: dict[str, list[str]] = {}
        for key in model["methods"]:
            if key in METHODS and METHODS[key].group != "baseline":
                groups.setdefault(METHODS[key].group, []).append(key)
        sizes = sorted({int(s) for r in model["methods"].values() for s in r.get("sizes", {})})
        for group, keys in groups.items():
            ours = [k for k in keys if k.startswith(("psg_", "dp_psg"))]
            peers = [k for k in keys if k not in ours and _passed(model, k)]
            for size in sizes:
                for field, what, slack in (("median_s", "time", 1.0), ("peak_bytes", "peak extra memory", 1.05)):
                    mine = {k: _entry(model, k, size).get(field) for k in ours}
                    mine = {k: v for k, v in mine.items() if v is not None}
                    theirs = {k: _entry(model, k, size).get(field) for k in peers}
                    theirs = {k: v for k, v in theirs.items() if v is not None}
                    if not mine or not theirs:
                        continue
                    best_ours, best_peer = min(mine, key=mine.get), min(theirs, key=theirs.get)
                    if theirs[best_peer] * slack < mine[best_ours]:
                        if field == "median_s":
                            detail = f", which takes {mine[best_ours] / theirs[best_peer]:.2f}× as long"
                        else:
                            detail = f" ({_fmt_mib(mine[best_ours])} MiB against {_fmt_mib(theirs[best_peer])})"
                        lines.append(f"- {name} B={size}, {group}, {what}: {_label(best_peer)} beats "
                                     f"{_label(best_ours)}{detail}")
    return lines or ["None."]


def _passed(model: dict, key: str) -> bool:
    check = model["methods"][key].get("check") or {}
    return "error" not in check and check.get("max_rel_err", 0) <= TOLERANCE


# -- the page --------------------------------------------------------------------------------------


HOW = (
    "How it measures: one process per model runs every method side by side. Per batch size: each method's "
    "first call is timed on its own (capture and compile for the compiled methods), then its warm-up calls "
    "and one call for peak memory; then the timed calls of all methods interleaved, one call of each per "
    "round with the order rotated every round, so that a slow phase of the machine falls on every method "
    "alike, each timed call after an untimed call of the same method, so that its data is back in the caches "
    "as in a loop of that method alone; the tables give each method's median. Full runs start each model with an "
    "empty Inductor cache, so the run's first call of a compiled method is a cold compile (quick runs share "
    "the user's cache)."
)
HOW_TIME = {
    "cpu": "Times are ratios against the ordinary backward pass (forward + `loss.backward()`) in the same "
    "process; a DP step is also compared with a plain SGD step (forward, backward, `optimizer.step()`). "
    "Each baseline is the faster of its eager and its `torch.compile`'d version (both are listed).",
    "cuda": "Times in ms are medians of at least 7 timed calls (up to 25, until they add up to 1 s), each "
    "between two `torch.cuda.synchronize()` calls (host clock), after 2 warm-up calls; ratios as on CPU: against "
    "the faster of the eager and the `torch.compile`'d baseline.",
}
HOW_MEMORY = {
    "cpu": "Peak extra memory: the peak resident set during one call (VmHWM, reset through "
    "/proc/self/clear_refs) minus the resident set before it.",
    "cuda": "Peak extra memory: `torch.cuda.max_memory_allocated()` during one call minus the allocation before it.",
}
HOW_CHECK = (
    "Check: the largest error of the method's result (per-sample gradients, norms, variance or Gram matrix, "
    "rescaled to the gradient of each sample's loss alone) relative to the largest entry of an eager "
    "`vmap(grad)` reference. A failure is recorded as `unsupported: <error>`."
)
QUICK = "quick (tiny sizes, 3 timed calls: checks the harness; the figures mean little)"


def markdown(results: dict) -> str:
    env = results["environment"]
    gpu = env["device"].startswith("cuda")
    kind = "cuda" if gpu else "cpu"
    dp = results["dp"]
    stem = page_stem(results)
    plots = plot_paths(results)
    t12, counts = targets_12_table(results)
    out = [
        "# Benchmarks" + (f" on a GPU ({env['device_name']})" if gpu else ""),
        "",
        "Generated by `python -m benchmarks`; every number on this page comes from the command below. "
        f"Raw results: [{stem}.json]({stem}.json). Models of 10M to 1.2B parameters (GPT-2, a Llama-style "
        "model with LoRA, ViT-B/16, ResNet-50 with GroupNorm, BERT-base with its last layer trained), in scaled "
        "configs on the CPU and full ones on GPUs, with the scale targets: [The DP step at "
        "scale](benchmarks-scale.md).",
        "",
        f"- Command: `{results['command']}`",
        f"- Mode: {QUICK if results['quick'] else 'full'}"
        + (f"; {results['jobs']} models measured at once" if results.get("jobs", 1) > 1 else ""),
        f"- Machine: {env['cpu']}, {env['cores']} cores ({env['threads']} torch threads); "
        f"device: {env['device']} ({env['device_name']})",
        f"- torch {env['torch']}, Python {env['python']}; {results['date']}; "
        + ("assembled from the raw results of the commands above (`--scratch`)" if results.get("assembled")
           else f"the run took {results['wall_s'] / 60:.1f} min"),
        "",
        " ".join([HOW, HOW_TIME[kind], HOW_MEMORY[kind], HOW_CHECK]),
        "",
        f"A DP step clips each sample's gradient to norm {dp['max_norm']}, sums, adds Gaussian noise (noise "
        f"multiplier {dp['noise_multiplier']}), divides by the batch size and steps SGD; Opacus runs with "
        "`poisson_sampling=False` and a fixed batch.",
        "",
        "## Targets (issue 12)",
        "",
        "Per model and batch size. `compile_step` is `compiled_psg.compile_step` (the whole DP step as one "
        "compiled program); the plain step and the backward are each the FASTER of the eager and the "
        "`torch.compile`'d (Inductor, static shapes) version at that batch size; peak memory is against the "
        "LOWER of the two plain steps' peaks (on CUDA the whole allocation at the peak, "
        "`torch.cuda.max_memory_allocated()`, where recorded; else the extra memory of the tables); the cold "
        "compile is the run's first call (capture, compile and one "
        "step, empty Inductor cache) at the first batch size, against the first call of "
        "`torch.compile(vmap(grad))`. `FAIL (Error)`: compiled_psg's method failed on this model; `not run`: the "
        "baseline or peer failed or was not measured (see Failures).",
        "",
        *t12,
        "",
        f"PASS {counts['PASS']}, FAIL {counts['FAIL']}, not run {counts['not run']}.",
        "",
        *(["## Earlier targets", "", *targets_table(results), ""] if any(
            "dp_psg" in m["methods"] for m in results["models"].values()) else []),
        f"![time ratio against the ordinary backward pass]({plots[0]})",
        "",
        f"![peak extra memory against batch size]({plots[1]})",
        "",
    ]
    for name, model in results["models"].items():
        spec = MODELS[name]
        size = model["plan"]["check_size"]
        out += [
            f"## {spec.label} (`{name}`)",
            "",
            f"{model['config']}; {model['params']:,} parameters.",
            "",
            f"### Batch size {size}",
            "",
            *headline_table(model, gpu),
            "",
            "### Batch sizes",
            "",
            "Time against the method's baseline (ordinary backward; a plain SGD step for DP steps), and "
            "peak extra memory.",
            "",
            *sizes_table(model, gpu),
            "",
        ]
        if model["plan"]["sequence"]:  # none with --no-sequence
            out += [
                f"### Changing batch size {tuple(model['plan']['sequence'])}",
                "",
                "Run after the batch sizes above, on the same (already compiled) callables.",
                "",
                *sequence_table(model, gpu),
                "",
            ]
    out += ["## Where compiled_psg is not the fastest or the leanest", "",
            "Generated from the tables above: each model, batch size and quantity where a peer that ran and "
            "passed the check beats compiled_psg's best method for that quantity.", "",
            *not_best(results), ""]
    out += ["## Failures and wrong results", "", *failures(results), ""]
    # hand-written, from the commands they name: what the GPU run's generated code shows; on CPU, the measured
    # cause of each missed target (python -m benchmarks.probes.breakdown)
    notes = Path(__file__).with_name("gpu_notes.md" if gpu else "cpu_notes.md")
    if notes.exists() and not results["quick"]:
        out += [notes.read_text().rstrip(), ""]
    return "\n".join(out)


def page_stem(results: dict) -> str:
    """``benchmarks`` for a CPU run, ``benchmarks-gpu`` for a CUDA one (both pages live in docs/)."""
    return "benchmarks-gpu" if results["environment"]["device"].startswith("cuda") else "benchmarks"


def plot_paths(results: dict) -> tuple[str, str]:
    if page_stem(results) == "benchmarks":
        return TIME_PLOT, MEMORY_PLOT
    return TIME_PLOT.replace("benchmarks_", "benchmarks-gpu_"), MEMORY_PLOT.replace("benchmarks_", "benchmarks-gpu_")


# -- plots -----------------------------------------------------------------------------------------


GROUP_COLORS = {  # the time plot colours methods by what they compute
    "baseline": "#888888",
    "per-sample grads": "#1f77b4",
    "norms": "#2ca02c",
    "DP step": "#d62728",
    "variance": "#9467bd",
    "gram": "#8c564b",
}


def plot_time_ratios(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["models"].items())
    methods = [m for m in METHODS if any(m in model["methods"] for _, model in models)]
    fig, axes = plt.subplots(
        1, len(models), figsize=(3.2 * len(models) + 3, 0.32 * len(methods) + 1.5), sharey=True, squeeze=False
    )
    for ax, (name, model) in zip(axes[0], models, strict=True):
        size = model["plan"]["check_size"]
        for i, key in enumerate(methods):
            r = ratio(model, key, size, "backward") if key in model["methods"] else None
            if r is None:
                ax.text(1, i, " unsupported", va="center", fontsize=7, color="#555555")
                continue
            ax.barh(i, r, color=GROUP_COLORS[METHODS[key].group], edgecolor="black" if "psg" in key else "none")
            ax.text(r, i, f" {r:.2f}", va="center", fontsize=7)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_xscale("log")
        ax.set_title(f"{name}, B={size}", fontsize=9)
        ax.set_xlabel("time / ordinary backward")
    axes[0][0].set_yticks(range(len(methods)), [_label(m) for m in methods], fontsize=8)
    axes[0][0].invert_yaxis()
    fig.suptitle(f"Time against the ordinary backward pass ({results['environment']['device_name']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(results: dict, path: Path) -> None:
    """One panel per model: peak extra memory against batch size, a line per method (compiled_psg solid)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["models"].items())
    colors = plt.get_cmap("tab20").colors
    fig, axes = plt.subplots(1, len(models), figsize=(3.6 * len(models) + 3, 4.2), squeeze=False,
                             layout="constrained")  # fmt: skip
    handles = {}
    for ax, (name, model) in zip(axes[0], models, strict=True):
        for key, record in model["methods"].items():
            sizes = record.get("sizes", {}).items()
            points = sorted((int(b), e["peak_bytes"] / 2**20) for b, e in sizes if e.get("peak_bytes"))
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            color = colors[list(METHODS).index(key) % len(colors)] if key in METHODS else "black"
            style = "-" if key.startswith(("psg", "dp_psg")) else "--"
            handles[key] = ax.plot(xs, ys, style, marker="o", ms=3, color=color)[0]
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("batch size")
    axes[0][0].set_ylabel("peak extra memory (MiB)")
    fig.legend(handles.values(), [_label(k) for k in handles], loc="outside right center", fontsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(results: dict, out: Path) -> list[Path]:
    (out / "img").mkdir(parents=True, exist_ok=True)
    page = out / f"{page_stem(results)}.md"
    page.write_text(markdown(results))
    time_plot, memory_plot = plot_paths(results)
    plot_time_ratios(results, out / time_plot)
    plot_memory(results, out / memory_plot)
    return [page, out / time_plot, out / memory_plot]
