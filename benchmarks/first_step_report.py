"""The records of ``python -m benchmarks.probes.first_step`` as tables: each process's phases, and the compile
targets (the scale page and the probe's own output print them)."""

from __future__ import annotations

from .probes.cold_compile import PHASES


def table(rows: list[dict]) -> str:
    head = ["model", "B", "method", "cache", "process s", "first step s", "kernels", *PHASES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], str(r["batch"]), r["method"], r["cache"], f"{r['process_s']:.2f}",
                 f"{r['first_step_s']:.2f}", str(r["kernels"]), *(f"{r['phases'][p]:.2f}" for p in PHASES)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(rows: list[dict], dp: str = "psg", peer: str = "vmap_dp", warm_limit_s: float = 3.0) -> str:
    """Per model: the cold first step against the peer's, and the warm process's first step against
    ``warm_limit_s`` (beside it the whole process, and what the process spent before the step: Python, the
    imports and the model's build, which no method changes)."""
    lines = ["| model | cold first step: DP / compiled vmap <= 1.0 | "
             f"warm process: first DP step <= {warm_limit_s:g} s | "
             "warm process: start to the end of its first DP step, s (before the step) |", "|---|---|---|---|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        def pick(method, cache, model=model):
            return next((r for r in rows if (r["model"], r["method"], r["cache"]) == (model, method, cache)), None)
        cold_dp, cold_peer, warm_dp = pick(dp, "cold"), pick(peer, "cold"), pick(dp, "warm")
        cold = "not measured" if cold_dp is None or cold_peer is None else (
            f"{'PASS' if cold_dp['first_step_s'] <= cold_peer['first_step_s'] else 'FAIL'} "
            f"({cold_dp['first_step_s'] / cold_peer['first_step_s']:.2f})")
        warm = "not measured" if warm_dp is None else (
            f"{'PASS' if warm_dp['first_step_s'] <= warm_limit_s else 'FAIL'} ({warm_dp['first_step_s']:.1f} s)")
        whole = "-" if warm_dp is None else (
            f"{warm_dp['process_s']:.1f} ({warm_dp['process_s'] - warm_dp['first_step_s']:.1f})")
        lines.append(f"| {model} | {cold} | {warm} | {whole} |")
    return "\n".join(lines)
