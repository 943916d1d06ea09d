"""Measure every method on one model in this process: the worker ``python -m benchmarks`` starts per model.

Every method is set up once; then for each batch size, each method's first call (timed: capture and compile
for the compiled methods), warm-up calls and one call for peak memory, and then the timed calls of all methods
interleaved round by round, each after an untimed call of its own (the median is reported); then each method's
changing batch-size sequence (each call timed, compiles counted) and a check of its result against a
``vmap(grad)`` reference. Any exception becomes a recorded failure, never a missing row.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .methods import METHODS, Prepared
from .models import MODELS, Workload, build_workload


@dataclass(frozen=True)
class Plan:
    sizes: tuple[int, ...]
    sequence: tuple[int, ...]
    check_size: int
    warmup: int
    reps: int  # at least this many timed calls...
    min_seconds: float  # ...and more, up to max_reps, until the timed calls add up to this
    max_reps: int
    max_seconds_per_size: float = 600.0  # a larger batch predicted to take longer than this is skipped


def _machine_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def predicted_skip(kind: str, done: dict, size: int, plan: Plan) -> str | None:
    """Why not to run ``size`` after the sizes ``done`` (str -> entry): its time or peak memory, extrapolated from
    the largest finished size (linearly in B; quadratically for a Gram matrix), exceeds the budget or the
    machine. "Where memory allows": a run killed by the out-of-memory killer costs minutes and tells nothing."""
    finished = [(int(s), e) for s, e in done.items() if "median_s" in e]
    if not finished:
        return None
    prev, entry = max(finished)
    growth = (size / prev) ** (2 if kind == "gram" else 1)
    calls = plan.warmup + plan.reps + 2
    seconds = entry["median_s"] * growth * calls
    if seconds > plan.max_seconds_per_size:
        return (f"skipped: predicted {seconds / 60:.0f} min for B={size} ({entry['median_s']:.1f} s per call at "
                f"B={prev}), over the {plan.max_seconds_per_size / 60:.0f} min budget per batch size")
    memory, machine = entry.get("peak_bytes"), _machine_bytes()
    if memory and machine and memory * growth > 0.8 * machine:
        return (f"skipped: predicted peak memory {memory * growth / 2**30:.0f} GiB for B={size} "
                f"({memory / 2**30:.1f} GiB at B={prev}), over 80% of the machine's {machine / 2**30:.0f} GiB")
    return None


def out_of_time() -> str | None:
    """``BENCH_DEADLINE`` (seconds since the epoch), when set: past it, no method or batch size starts (a lent
    GPU's session has a hard end; what was measured by then is kept)."""
    deadline = os.environ.get("BENCH_DEADLINE")
    if deadline and time.time() > float(deadline):
        return "skipped: out of time (BENCH_DEADLINE passed before this started)"
    return None


FULL_SIZES = (16, 64, 256)
FULL_SEQUENCE = (64, 57, 64, 33)
QUICK_SEQUENCE = (8, 6, 8)


def plan_for(model: str, quick: bool, headline_only: bool = False, sizes: tuple[int, ...] | None = None,
             sequence: bool = True) -> Plan:
    """``sizes`` replaces the batch sizes (the headline size then is the model's own if among them, else the
    first); ``sequence=False`` drops the changing batch-size sequence (its recompiles cost minutes on a GPU)."""
    plan = _plan_for(model, quick, headline_only)
    if sizes:
        sizes = tuple(sorted(set(sizes)))
        check = plan.check_size if plan.check_size in sizes else sizes[0]
        plan = dataclasses.replace(plan, sizes=sizes, check_size=check)
    if not sequence:
        plan = dataclasses.replace(plan, sequence=())
    return plan


def _plan_for(model: str, quick: bool, headline_only: bool = False) -> Plan:
    spec = MODELS[model]
    if quick:
        return Plan(
            (spec.quick_batch,),
            QUICK_SEQUENCE,
            spec.quick_batch,
            warmup=1,
            reps=3,
            min_seconds=0.0,
            max_reps=3,
        )
    return Plan(
        (spec.batch,) if headline_only else tuple(sorted({*FULL_SIZES, spec.batch})),
        FULL_SEQUENCE,
        spec.batch,
        warmup=2,
        reps=7,
        min_seconds=1.0,
        max_reps=25,
    )


def short_error(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    message = lines[0] if lines else ""
    if len(message) > 140:
        message = message[:137] + "..."
    return f"unsupported: {type(exc).__name__}: {message}" if message else f"unsupported: {type(exc).__name__}"


# -- clocks ----------------------------------------------------------------------------------------


class Device:
    """Synchronization and peak memory for one device.

    CPU: the peak resident set (VmHWM, reset by writing 5 to /proc/self/clear_refs) during the call, minus the
    resident set just before it (after freeing what the allocator holds): the memory the call needs on top of
    what the process already holds. CUDA: ``torch.cuda.max_memory_allocated`` minus the allocation before.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._libc = None
        self.last_total: int | None = None
        if not self.cuda:
            try:
                self._libc = ctypes.CDLL("libc.so.6")
            except OSError:
                pass

    def name(self) -> str:
        if self.cuda:
            return torch.cuda.get_device_name(self.device)
        return cpu_model()

    def release(self) -> None:
        """After a failure (out of memory, say): give cached blocks back before the next measurement."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def timed(self, fn, batch) -> tuple[float, object]:
        self.sync()
        start = time.perf_counter()
        out = fn(*batch)
        self.sync()
        return time.perf_counter() - start, out

    def peak_bytes(self, fn, batch) -> int | None:
        gc.collect()
        if self.cuda:
            self.sync()
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            out = fn(*batch)
            self.sync()
            self.last_total = torch.cuda.max_memory_allocated(self.device)  # model, optimizer state, inputs too
            peak = self.last_total - before
            del out
            return peak
        if self._libc is not None:
            self._libc.malloc_trim(0)
        before = _status_kb("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            return None
        out = fn(*batch)
        peak = _status_kb("VmHWM")
        del out
        if before is None or peak is None:
            return None
        return max(0, peak - before) * 1024


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


# -- the check -------------------------------------------------------------------------------------


def reference(wl: Workload, size: int) -> dict:
    """Per-sample gradients from eager ``vmap(grad)``, and what each kind of method is checked against."""
    from .methods import func_vmap

    batch = wl.batch(size)
    grads = {n: g.detach() for n, g in func_vmap(wl).run(*batch).items()}
    flat = torch.cat([g.flatten(1) for g in grads.values()], 1)
    return {
        "grads": grads,
        "norms": flat.norm(dim=1),
        "variance": {n: g.var(0, unbiased=False) for n, g in grads.items()},
        "gram": flat @ flat.T,
    }


TOLERANCE = 1e-3  # a larger relative error marks the result wrong in the tables


class Mismatch(ValueError):
    """The result does not have the reference's structure: a wrong result, not a failure to run."""


def relative_error(got, want) -> float:
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            keys = sorted(got) if isinstance(got, dict) else type(got).__name__
            raise Mismatch(f"result keys {keys} differ from the parameters {sorted(want)}")
        return max(relative_error(got[k], want[k]) for k in want)
    got = got.detach().to(want.dtype)
    if got.shape != want.shape:
        raise Mismatch(f"a result of shape {tuple(got.shape)} where {tuple(want.shape)} is expected")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


# -- one method ------------------------------------------------------------------------------------


def _counters(prepared: Prepared) -> dict:
    return prepared.counters() if prepared and prepared.counters else {}


def _set_up(wl: Workload, key: str, log) -> tuple[dict, Prepared | None]:
    """A method's record, and its prepared callable (None: it could not be set up, the record says why)."""
    method = METHODS[key]
    record: dict = {"model": wl.name, "method": key, "label": method.label, "sizes": {}, "sequence": None,
                    "check": None}
    late = out_of_time()
    if late:
        record["error"] = late
        log(f"{key}: {late}")
        return record, None
    start = time.perf_counter()
    try:
        prepared = method.setup(wl)
    except Exception as e:  # a failure is a result
        record["error"] = short_error(e)
        log(f"{key}: setup {record['error']}")
        return record, None
    record["setup_s"] = time.perf_counter() - start
    if prepared.note:
        record["note"] = prepared.note
    return record, prepared


def _first_calls(key: str, prepared: Prepared, size: int, batch: tuple, plan: Plan, dev: Device, log) -> dict:
    """The first call at this batch size (capture and compile for compiled methods), warm-up calls, and the
    call for peak memory; the timed calls come later, interleaved with the other methods'."""
    entry: dict = {}
    try:
        before = _counters(prepared).get("compiles")
        entry["first_call_s"], out = dev.timed(prepared.run, batch)
        del out
        if before is not None:
            entry["compiles"] = _counters(prepared)["compiles"] - before
        for _ in range(plan.warmup):
            dev.timed(prepared.run, batch)
        entry["peak_bytes"] = dev.peak_bytes(prepared.run, batch)
        if dev.cuda:  # the whole allocation at the peak, not only what the call added
            entry["peak_total_bytes"] = dev.last_total
    except Exception as e:
        entry = {"error": short_error(e)}
        log(f"{key} B={size}: {entry['error']}")
        dev.release()
    return entry


def interleaved_times(runs: dict[str, Callable[[], object]], plan: Plan, dev: Device) -> tuple[dict, dict]:
    """Time the callables in rounds, one timed call of each per round, the order rotated every round: a slow
    phase of the machine (another process, the clock frequency) then falls on every method alike rather than on
    whichever method was timed during it, and the ratios between methods keep. Each timed call follows an
    untimed call of the same callable, so that its data is back in the caches, as in a loop of that method
    alone (the other methods' calls in between evict it). At least ``plan.reps`` rounds; then rounds of the
    methods whose timed calls add up to less than ``plan.min_seconds``, up to ``plan.max_reps``. Returns
    ``(times, errors)`` per key; a callable that raises leaves the rotation."""
    keys = list(runs)
    times: dict[str, list[float]] = {k: [] for k in keys}
    errors: dict[str, BaseException] = {}
    for r in range(plan.max_reps):
        active = [k for k in keys[r % len(keys):] + keys[:r % len(keys)] if k not in errors and (
            r < plan.reps or sum(times[k]) < plan.min_seconds)]
        if not active:
            break
        for k in active:
            try:
                dev.timed(runs[k], ())
                times[k].append(dev.timed(runs[k], ())[0])
            except Exception as e:
                errors[k] = e
                dev.release()
    return times, errors


def measure_model(wl: Workload, keys: list[str], plan: Plan, dev: Device, ref: dict | None, log, emit) -> None:
    """Every method in ``keys`` on one model, side by side. Each method is set up once; then for each batch size,
    each method's first call, warm-up and peak-memory call, and the timed calls of all methods interleaved
    (``interleaved_times``); then each method's changing batch-size sequence and check. ``emit`` records each
    method's sizes as they end and its whole record (a worker killed by the out-of-memory killer leaves those
    behind, see ``__main__.run_model``)."""
    records: dict[str, dict] = {}
    live: dict[str, Prepared] = {}
    for key in keys:
        records[key], prepared = _set_up(wl, key, log)
        if prepared is not None:
            live[key] = prepared
    for size in plan.sizes:
        batch, ready = wl.batch(size), {}
        for key, prepared in live.items():
            skip = out_of_time() or predicted_skip(METHODS[key].kind, records[key]["sizes"], size, plan)
            if skip:
                records[key]["sizes"][str(size)] = {"error": skip}
                log(f"{key} B={size}: {skip}")
                continue
            emit({"running": key, "size": size})
            entry = records[key]["sizes"][str(size)] = _first_calls(key, prepared, size, batch, plan, dev, log)
            if "error" not in entry:
                ready[key] = prepared
        if ready:
            emit({"running": "interleaved", "size": size, "methods": list(ready)})
        times, errors = interleaved_times({k: (lambda p=p, b=batch: p.run(*b)) for k, p in ready.items()},
                                        plan, dev)
        for key in ready:
            entry = records[key]["sizes"][str(size)]
            if key in errors:
                entry.clear()
                entry["error"] = short_error(errors[key])
                log(f"{key} B={size}: {entry['error']}")
            else:
                entry["median_s"], entry["times_s"] = statistics.median(times[key]), times[key]
                log(f"{key} B={size}: {entry['median_s'] * 1e3:.2f} ms (first call {entry['first_call_s']:.2f} s)")
            emit({"partial": key, "size": size, "entry": entry})
    for key in keys:
        record, prepared = records[key], live.pop(key, None)
        if prepared is not None:
            if any("error" not in e for e in record["sizes"].values()):
                if plan.sequence:
                    record["sequence"] = measure_sequence(wl, prepared, plan, dev)
                    seq = record["sequence"]
                    log(f"{key} sizes {plan.sequence}: {seq['total_s']:.2f} s, "
                        f"{seq.get('recompiles', 'no')} recompiles")
                record["check"] = check(wl, METHODS[key].kind, prepared, plan, ref)
            record["counters"] = _counters(prepared)
            if "compiles" in record["counters"]:  # compiles after the first call (which may compile several graphs)
                first = record["sizes"][str(plan.sizes[0])].get("compiles", 1)
                record["recompiles"] = max(0, record["counters"]["compiles"] - first)
        emit(record)
        del prepared
        gc.collect()


def measure_sequence(wl: Workload, prepared: Prepared, plan: Plan, dev: Device) -> dict:
    seq: dict = {"sizes": list(plan.sequence), "times_s": []}
    before = _counters(prepared).get("compiles")
    try:
        for size in plan.sequence:
            seq["times_s"].append(dev.timed(prepared.run, wl.batch(size, seed=1))[0])
    except Exception as e:
        seq["error"] = short_error(e)
    seq["total_s"] = sum(seq["times_s"])
    if before is not None:
        seq["recompiles"] = _counters(prepared)["compiles"] - before
    return seq


def check(wl: Workload, kind: str, prepared: Prepared, plan: Plan, ref: dict | None) -> dict | None:
    if kind in ("backward", "step"):
        return None
    if ref is None:
        return {"error": "no reference"}
    try:
        got = prepared.canonical(prepared.run(*wl.batch(plan.check_size)))
        return {"size": plan.check_size, "max_rel_err": relative_error(got, ref[kind])}
    except Mismatch as e:
        return {"error": f"wrong: {e}"}
    except Exception as e:
        return {"error": short_error(e)}


# -- the worker ------------------------------------------------------------------------------------


def environment(dev: Device) -> dict:
    import platform

    return {
        "device": str(dev.device),
        "device_name": dev.name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "cores": _cores(),
    }


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def warm_up_process(wl: Workload, plan: Plan, dev: Device) -> None:
    """Run the ordinary backward untimed for a while, so that the first method measured (the baseline) does
    not pay for the first use of the thread pool and the allocator."""
    from .methods import backward

    run, batch = backward(wl).run, wl.batch(plan.check_size)
    end = time.perf_counter() + max(plan.min_seconds, 0.2)
    while time.perf_counter() < end:
        dev.timed(run, batch)


def run_worker(
    model: str, methods: list[str], quick: bool, device: str, out_path: str, threads: int | None = None,
    headline_only: bool = False, sizes: tuple[int, ...] | None = None, sequence: bool = True,
) -> None:
    """Measure ``methods`` on ``model``; write one JSON object per line to ``out_path`` as results come."""
    if threads:
        torch.set_num_threads(threads)
    for noise in ("Full backward hook is firing", "Secure RNG turned off"):  # said on every call by the peers
        warnings.filterwarnings("ignore", message=noise)
    dev = Device(torch.device(device))
    plan = plan_for(model, quick, headline_only, sizes, sequence)
    wl = build_workload(model, quick, dev.device)

    def log(msg: str) -> None:
        print(f"[{model}] {msg}", file=sys.stderr, flush=True)

    with open(out_path, "a") as out:

        def emit(obj: dict) -> None:
            out.write(json.dumps(obj) + "\n")
            out.flush()

        emit(
            {
                "model": model,
                "environment": environment(dev),
                "plan": plan.__dict__,
                "config": wl.spec.describe(quick),
                "params": sum(p.numel() for p in wl.model.parameters()),
            }
        )
        ref = None
        if any(METHODS[m].kind not in ("backward", "step") for m in methods):
            try:
                ref = reference(wl, plan.check_size)
            except Exception:
                log("no reference:\n" + traceback.format_exc())
        warm_up_process(wl, plan, dev)
        measure_model(wl, list(methods), plan, dev, ref, log, emit)
