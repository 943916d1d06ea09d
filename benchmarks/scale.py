"""``python -m benchmarks.scale``: the DP step at the scale people train (``benchmarks.scale_models``), against
the plain step (eager and ``torch.compile``d), Opacus ghost clipping and ``torch.compile(vmap(grad))`` + clip.

    python -m benchmarks.scale --device cpu --out runs/scale                 # scaled configs, one process each
    python -m benchmarks.scale --device cuda --out DIR --parallel --profile gpt2 --budget 420

One process per model. In each: every method is set up and called until compiled (its first call is timed:
the cold compile when the Inductor cache is empty), then the methods are timed side by side
(``measure.interleaved_times``: rounds, the order rotated, at least ``--reps`` timed calls each after warm-up;
the median is reported), then each method's peak memory over one step on top of what the process holds
(``measure.Device.peak_bytes``). ``--parallel`` (GPU) runs the model processes at once for their compiles,
which are CPU work, and lets one at a time time its methods (a lock file): the GPU is timed alone, the host
shares its cores with the other models' compiles. ``--profile M [M ...]`` adds a ``torch.profiler`` kernel table
of the DP step and the compiled plain step of each model M, and on CUDA what one step holds at its peak
(``memory_at_peak``); ``TORCH_LOGS=output_code`` there gives Inductor's code.

Every DP step clips to 1.0, adds noise of multiplier 1.0, divides by the batch size and steps SGD (lr 0.01),
over the parameters that require a gradient. Writes ``DIR/MODEL.jsonl`` (one record per method) and, with
``--report``, prints the tables and the targets from the records.
"""

from __future__ import annotations

import argparse
import copy
import fcntl
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

from . import first_step_report, keep_freed_memory
from .measure import Device, Plan, environment, interleaved_times, short_error
from .scale_models import SCALE_MODELS, build_scale_model

MAX_NORM, NOISE_MULTIPLIER, LR = 1.0, 1.0, 0.01
METHOD_LABELS = {  # set up in this order: past the deadline the last ones are skipped
    "plain": "plain SGD step, eager",
    "psg": "compiled_psg compile_step DP step",
    "psg_bounded": "compiled_psg compile_step DP step, memory_budget=0",
    "psg_nocopy": "compiled_psg compile_step DP step, transactional=False",
    "plain_compile": "plain SGD step, torch.compile",
    "opacus_ghost": "Opacus 1.6 DP step, ghost clipping",
    "vmap_dp": "torch.compile(vmap(grad)) + clip DP step",
    "psg_graphs": "compiled_psg compile_step DP step, CUDA graphs (power-of-two buckets)",
}
DP_METHODS = ("psg", "psg_bounded", "psg_nocopy", "opacus_ghost", "vmap_dp", "psg_graphs")
GRAPH_BUCKETS = tuple(2 ** k for k in range(13))  # psg_graphs: every batch size up to 4096 padded to a power of two


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _training_step(model, criterion, opt):
    def run(x, y):
        opt.zero_grad(set_to_none=True)
        criterion(model(x), y).backward()
        opt.step()

    return run


def plain(model, criterion):
    return _training_step(model, criterion, torch.optim.SGD([p for _, p in _trainable(model)], lr=LR))


def plain_compile(model, criterion):
    """forward + loss under ``torch.compile`` (static shapes; its backward compiled with it) and the optimizer's
    step under its own ``torch.compile``: PyTorch's compiled-optimizer recipe."""
    opt = torch.optim.SGD([p for _, p in _trainable(model)], lr=LR)
    loss = torch.compile(lambda x, y: criterion(model(x), y), dynamic=False)
    step = torch.compile(opt.step, dynamic=False)

    def run(x, y):
        opt.zero_grad(set_to_none=True)
        loss(x, y).backward()
        step()

    return run


def psg(model, criterion, memory_budget=None, transactional=True, **options):
    import compiled_psg as psg_lib

    opt = torch.optim.SGD([p for _, p in _trainable(model)], lr=LR)
    return psg_lib.compile_step(lambda x, y: criterion(model(x), y), model, opt, max_grad_norm=MAX_NORM,
                                noise_multiplier=NOISE_MULTIPLIER, expected_batch_size=None,
                                memory_budget=memory_budget, transactional=transactional, **options)


def psg_bounded(model, criterion):
    """The memory-bounded plan: no per-sample value held across the program."""
    return psg(model, criterion, memory_budget=0)


def psg_nocopy(model, criterion):
    """The DP step without its transaction: no copy of the buffers per step, nor of the parameters, ``.grad`` and
    optimizer state on an eager update (what ``transactional=True``, the default, costs is the difference to
    ``psg``)."""
    return psg(model, criterion, transactional=False)


def psg_graphs(model, criterion):
    """The DP step's program recorded as CUDA graphs (``cuda_graphs=True``), each batch padded to the next power
    of two (``GRAPH_BUCKETS``): one graph per bucket, replayed. CUDA only (refused on a CPU model)."""
    return psg(model, criterion, cuda_graphs=True, batch_buckets=GRAPH_BUCKETS)


def opacus_ghost(model, criterion, batch):
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    opt = torch.optim.SGD([p for _, p in _trainable(model)], lr=LR)
    loader = DataLoader(TensorDataset(*[t.cpu() for t in batch]), batch_size=len(batch[0]))
    dp_model, dp_opt, dp_criterion, _ = PrivacyEngine().make_private(
        module=model, optimizer=opt, criterion=copy.deepcopy(criterion), data_loader=loader,
        noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=MAX_NORM, poisson_sampling=False,
        grad_sample_mode="ghost")
    return _training_step(dp_model, dp_criterion, dp_opt)


def vmap_dp(model, criterion):
    """``torch.compile(vmap(grad))`` of the loss of one sample, clip and sum in the same compiled function,
    then noise, ``p.grad`` and the optimizer's step (the torch.func recipe; one compile per batch size)."""
    from torch.func import functional_call, grad, vmap

    named = _trainable(model)
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())

    def loss_one(trained, x, y):
        out = functional_call(model, ({**trained, **frozen}, buffers), (x.unsqueeze(0),))
        return criterion(out, y.unsqueeze(0))

    per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0), randomness="different")

    def clipped_sum(trained, x, y):
        grads = per_sample(trained, x, y)
        norms = torch.stack([g.float().flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()
        factors = (MAX_NORM / (norms + 1e-6)).clamp(max=1.0)
        return {n: torch.einsum("b,b...->...", factors, g.float()) for n, g in grads.items()}

    compiled = torch.compile(clipped_sum, fullgraph=True)
    opt = torch.optim.SGD([p for _, p in named], lr=LR)

    def run(x, y):
        sums = compiled({n: p.detach() for n, p in named}, x, y)
        for n, p in named:
            p.grad = ((sums[n] + NOISE_MULTIPLIER * MAX_NORM * torch.randn_like(sums[n])) / x.shape[0]).to(p.dtype)
        opt.step()

    return run


def _setup(method: str, model, criterion, batch) -> Callable:
    model = copy.deepcopy(model)
    if method == "opacus_ghost":
        return opacus_ghost(model, criterion, batch)
    return {"plain": plain, "plain_compile": plain_compile, "psg": psg, "psg_bounded": psg_bounded,
            "psg_nocopy": psg_nocopy, "vmap_dp": vmap_dp, "psg_graphs": psg_graphs}[method](model, criterion)


# -- one model's process ---------------------------------------------------------------------------


class _PastDeadline(BaseException):
    """Raised by SIGALRM in a set-up or warm-up still running at the deadline (a BaseException, so that no
    ``except Exception`` inside torch swallows it)."""


def _past_deadline(signum, frame):
    raise _PastDeadline("not measured: its set-up and compile ran past the deadline")


class _Turn:
    """One model process at a time holds the GPU for timing (a lock file); without ``--parallel`` a no-op."""

    def __init__(self, path: Path | None):
        self.path, self.handle = path, None

    def __enter__(self):
        if self.path is not None:
            self.handle = open(self.path, "a")
            fcntl.flock(self.handle, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.handle is not None:
            fcntl.flock(self.handle, fcntl.LOCK_UN)
            self.handle.close()


def worker(name: str, methods: list[str], device: str, out: Path, reps: int, deadline: float, warm_calls: int,
           lock: Path | None, barrier: tuple[Path, int, float] | None, profile: bool, tiny: bool = False) -> None:
    for noise in ("Full backward hook is firing", "Secure RNG turned off", "Using a non-full backward hook",
                  "Optimal order"):
        warnings.filterwarnings("ignore", message=noise)
    signal.signal(signal.SIGALRM, _past_deadline)
    dev = Device(torch.device(device))
    scaled = dev.device.type == "cpu"
    spec = SCALE_MODELS[name]
    record_path = out / f"{name}.jsonl"

    def emit(obj: dict) -> None:
        with open(record_path, "a") as f:
            f.write(json.dumps(obj) + "\n")

    def log(msg: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    model, make_batch, criterion = build_scale_model(name, scaled, dev.device, tiny)
    batch_size = 4 if tiny else spec.cpu_batch if scaled else spec.gpu_batch
    batch = tuple(t.to(dev.device) for t in make_batch(batch_size, torch.Generator().manual_seed(0)))
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for _, p in _trainable(model))
    emit({"model": name, "label": spec.label, "config": spec.config(scaled, tiny), "batch": batch_size, "tiny": tiny,
          "params": total, "trained_params": trained, "dtype": str(next(model.parameters()).dtype),
          "environment": environment(dev)})
    log(f"{total / 1e6:.1f}M parameters ({trained / 1e6:.2f}M trained), B={batch_size}")

    runs, records = {}, {}
    for method in methods:
        rec = records[method] = {"model": name, "method": method}
        if time.time() > deadline:
            rec["error"] = "not measured: out of time before its set-up"
            continue
        try:
            dev.release()
            signal.alarm(max(1, int(deadline - time.time())))  # a compile still running at the deadline stops
            start = time.perf_counter()
            run = _setup(method, model, criterion, batch)
            rec["setup_s"] = round(time.perf_counter() - start, 3)
            first, _ = dev.timed(run, batch)
            rec["first_call_s"] = round(first, 3)
            for _ in range(warm_calls):
                dev.timed(run, batch)
            signal.alarm(0)
            runs[method] = run
            log(f"{method}: first call {first:.1f} s")
        except BaseException as e:
            signal.alarm(0)
            if not isinstance(e, Exception | _PastDeadline):
                raise
            rec["error"] = short_error(e)
            log(f"{method} failed: {traceback.format_exc(limit=-6)}")
            dev.release()
    for rec in records.values():  # first calls now; the timed record replaces it (``load`` keeps the last)
        emit(rec)
    if barrier is not None:  # wait for the other models' compiles to end (or for the deadline)
        folder, count, until = barrier
        (folder / f"compiled_{name}").touch()
        while len(list(folder.glob("compiled_*"))) < count and time.time() < until:
            time.sleep(1)
    with _Turn(lock):
        log("timing")
        plan = Plan(sizes=(batch_size,), sequence=(), check_size=batch_size, warmup=0, reps=reps, min_seconds=0.0,
                    max_reps=reps)
        times, errors = interleaved_times({m: (lambda r=r: r(*batch)) for m, r in runs.items()}, plan, dev)
        # steps back to back, as a training loop runs them: the host's work for a step overlaps the kernels of the
        # one before (the timing above synchronizes around every step, so the host time adds to the kernels')
        back, back_errors = _back_to_back({m: r for m, r in runs.items() if m not in errors}, batch, reps, dev)
        for method, run in runs.items():
            rec = records[method]
            if method in errors:
                rec["error"] = short_error(errors[method])
                continue
            rec["times_s"] = [round(t, 6) for t in times[method]]
            rec["median_s"] = statistics.median(times[method])
            if back.get(method) and method not in back_errors:
                rec["back_to_back_s"] = statistics.median(back[method]) / BACK_TO_BACK
            try:
                rec["peak_extra_bytes"] = dev.peak_bytes(run, batch)
                if dev.cuda:
                    rec["peak_total_bytes"] = dev.last_total
                else:
                    rec["allocated_peak_bytes"] = cpu_allocated_peak(run, batch)
            except Exception as e:
                rec["peak_error"] = short_error(e)
                dev.release()
        if profile:
            profiled = ("psg", "psg_bounded", "psg_nocopy", "psg_graphs", "plain_compile", "plain")
            _profile(name, {m: runs[m] for m in profiled if m in runs}, batch, out, dev)
    for rec in records.values():
        emit(rec)
    log("done")


def _profile(name: str, runs: dict, batch: tuple, out: Path, dev: Device, steps: int = 5) -> None:
    from torch.profiler import ProfilerActivity, profile

    tables, kernels = [f"{dev.name()}, torch {torch.__version__}, {name}"], {}
    for method, run in runs.items():
        dev.sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.cuda else [])
        with profile(activities=activities, acc_events=True) as prof:
            for _ in range(steps):
                run(*batch)
            dev.sync()
        averages = prof.key_averages()
        rows = []
        for ev in averages:  # CUDA: the kernels; CPU: the ops' own time (an op's children not counted)
            us = (getattr(ev, "self_device_time_total", 0) if dev.cuda else ev.self_cpu_time_total) or 0
            kind = torch.autograd.DeviceType.CUDA if dev.cuda else torch.autograd.DeviceType.CPU
            if us and ev.device_type == kind:
                rows.append({"name": ev.key, "launches_per_step": ev.count / steps, "us_per_step": us / steps})
        kernels[method] = sorted(rows, key=lambda r: -r["us_per_step"])
        try:
            table = averages.table(sort_by="self_cuda_time_total" if dev.cuda else "self_cpu_time_total",
                                   row_limit=50, max_name_column_width=100)
        except Exception as e:
            table = f"(table: {e})"
        tables += [f"\n===== {method} ({steps} steps) =====", table]
    (out / f"profile_{name}.txt").write_text("\n".join(tables))
    (out / f"kernels_{name}.json").write_text(json.dumps({"device": dev.name(), "torch": torch.__version__,
                                                          "steps": kernels}, indent=1))
    peaks = {}
    for method, run in runs.items():
        try:
            peaks[method] = memory_at_peak(run, batch) if dev.cuda else cpu_memory_at_peak(run, batch)
        except Exception as e:  # a breakdown is an extra: its failure must not lose the tables above
            peaks[method] = {"error": short_error(e)}
    (out / f"memory_{name}.json").write_text(json.dumps({"device": dev.name(), "torch": torch.__version__,
                                                         "methods": peaks}, indent=1))


def _allocation_events(prof) -> list:
    """The profiler's allocation events (a free is one of negative size), in time order."""
    from torch._C._profiler import _EventType

    allocations = []

    def walk(node) -> None:
        if node.tag == _EventType.Allocation:
            allocations.append(node)
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    return sorted(allocations, key=lambda n: n.start_time_ns)


def cpu_allocated_peak(run: Callable, batch: tuple) -> int:
    """The CPU counterpart of CUDA's ``max_memory_allocated() - memory_allocated()`` over one step: the largest
    total of the tensor bytes the step allocates and has not freed yet (``torch.profiler``'s allocation events).
    The profiler does not see frees of blocks allocated before it started, so a tensor the step replaces (the
    plain step's ``.grad`` after ``zero_grad``) is not subtracted: the measure is at most CUDA's plus those
    bytes. What it leaves out is the heap's own layout, which the resident set (``Device.peak_bytes``) adds:
    with freed memory kept in the heap (``benchmarks/__init__.py``), that depends on the order in which blocks
    of different sizes were allocated, not on what is live."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, acc_events=True) as prof:
        run(*batch)
    total = peak = 0
    for node in _allocation_events(prof):
        total += node.extra_fields.alloc_size
        peak = max(peak, total)
    return peak


def cpu_memory_at_peak(run: Callable, batch: tuple, top: int = 30) -> dict:
    """What one CPU step holds at its peak: ``torch.profiler``'s allocation events over the step replayed (the
    blocks allocated during the step only), and the blocks live when their total is largest, grouped by the op
    that allocated them, their size and the nearest Python function."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True, acc_events=True) as prof:
        run(*batch)
    allocations = _allocation_events(prof)

    def site(node) -> str:
        op = python = None
        parent = node.parent
        while parent is not None and python is None:
            if parent.tag == _EventType.TorchOp and op is None:
                op = parent.name
            elif parent.tag == _EventType.PyCall:
                python = parent.name
            parent = parent.parent
        # Inductor's CPU code allocates its buffers without an op (``empty_strided_cpu``): the size tells them apart
        return f"{op or '(no op)'}, {node.extra_fields.alloc_size / 2**20:.1f} MiB blocks, in {python or '?'}"

    def replay(until: int | None) -> tuple[dict[int, tuple[int, object]], int, int]:
        """The blocks live after the first ``until`` events (all: None), and the peak's total and position."""
        live: dict[int, tuple[int, object]] = {}
        total = peak = position = 0
        for k, node in enumerate(allocations[:until]):
            fields = node.extra_fields
            if fields.alloc_size > 0:
                live[fields.ptr] = (fields.alloc_size, node)
                total += fields.alloc_size
                if total > peak:
                    peak, position = total, k + 1
            elif fields.ptr in live:
                total -= live.pop(fields.ptr)[0]
        return live, peak, position

    _, peak, position = replay(None)
    at_peak = {ptr: (size, site(node)) for ptr, (size, node) in replay(position)[0].items()}
    groups: dict[str, list[int]] = {}
    for size, where in at_peak.values():
        entry = groups.setdefault(where, [0, 0])
        entry[0] += size
        entry[1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return {"peak_bytes_allocated_in_step": peak, "live_blocks": len(at_peak),
            "by_site": [{"bytes": b, "blocks": n, "site": where} for where, (b, n) in rows]}


def memory_at_peak(run: Callable, batch: tuple, top: int = 30) -> dict:
    """What one CUDA step holds at its peak: the allocator's history over the step replayed (allocations made
    during the step only), and the blocks live at the moment their total is largest, grouped by the line that
    allocated them: the first frame outside torch's own files (a line of Inductor's generated code for a
    compiled program, the model's code for an eager one), with the line's text."""
    import linecache

    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=1_000_000)
    try:
        run(*batch)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live: dict[int, tuple[int, tuple]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, tuple]] = {}
    for event in snapshot["device_traces"][torch.cuda.current_device()]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], tuple(event.get("frames", ())))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]

    def site(frames: tuple) -> str:
        for f in frames:
            path = f.get("filename", "")
            if "torchinductor" in path or ("/torch/" not in path and "/site-packages/" not in path
                                           and not path.startswith("<")):
                text = linecache.getline(path, f.get("line", 0)).strip()
                return f"{Path(path).name}:{f.get('line')} {f.get('name')}: {text[:160]}"
        return "(torch internals)"

    groups: dict[str, list[int]] = {}
    for size, frames in at_peak.values():
        entry = groups.setdefault(site(frames), [0, 0])
        entry[0] += size
        entry[1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return {"peak_bytes_allocated_in_step": peak, "live_blocks": len(at_peak),
            "by_site": [{"bytes": b, "blocks": n, "site": where} for where, (b, n) in rows]}


# -- the driver ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    keep_freed_memory()
    ap = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", nargs="+", default=None)
    ap.add_argument("--methods", nargs="+", default=None, help="default: all (psg_graphs on cuda only)")
    ap.add_argument("--out", type=Path, default=Path("runs/scale"))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warm-calls", type=int, default=3)
    ap.add_argument("--budget", type=float, default=3600.0, help="seconds: no method is set up past it")
    ap.add_argument("--parallel", action="store_true", help="compile the models at once, time them one by one")
    ap.add_argument("--profile", nargs="+", default=[], help="models whose kernels to profile")
    ap.add_argument("--output-code", action="store_true", help="TORCH_LOGS=output_code for the profiled models")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny configs: checks the harness, gives no figures")
    ap.add_argument("--report", action="store_true", help="print the tables of the records in --out")
    ap.add_argument("--save", type=Path, default=None, help="with --report: also write --out's records to one JSON")
    ap.add_argument("--page", type=Path, default=None, help="write the benchmarks page from the saved JSONs")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--barrier", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.methods is None:  # CUDA graphs are CUDA's: psg_graphs is refused on a CPU model
        args.methods = [m for m in METHOD_LABELS if m != "psg_graphs" or args.device.startswith("cuda")]
    if args.page:
        args.page.write_text(page())
        return
    if args.report:
        if args.save:
            save(load(args.out), args.save)
        print(report(args.out))
        return
    if args.worker:
        if args.threads:
            torch.set_num_threads(args.threads)
        worker(args.worker, args.methods, args.device, args.out, args.reps, args.deadline, args.warm_calls,
               args.out / "gpu.lock" if args.parallel else None,
               (args.out, args.count, args.barrier) if args.parallel else None, args.worker in args.profile,
               args.tiny)
        return
    scaled = args.device == "cpu"
    models = args.models or [m for m, s in SCALE_MODELS.items() if not scaled or args.tiny or s.cpu is not None]
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in [*args.out.glob("compiled_*"), *(args.out / f"{m}.jsonl" for m in models)]:
        stale.unlink(missing_ok=True)
    start = time.time()
    deadline = start + args.budget
    common = [sys.executable, "-m", "benchmarks.scale", "--device", args.device, "--out", str(args.out),
              "--reps", str(args.reps), "--warm-calls", str(args.warm_calls), "--methods", *args.methods,
              "--deadline", str(deadline)]
    if args.threads:
        common += ["--threads", str(args.threads)]
    if args.tiny:
        common += ["--tiny"]
    if args.profile:
        common += ["--profile", *args.profile]
    procs = []
    for model in models:
        cmd = common + ["--worker", model]
        env = dict(os.environ)
        if args.output_code and model in args.profile:
            env["TORCH_LOGS"] = "output_code"
        if args.parallel:
            cmd += ["--parallel", "--count", str(len(models)), "--barrier", str(deadline)]
            log = open(args.out / f"stderr_{model}.txt", "w")
            procs.append((model, subprocess.Popen(cmd, env=env, stderr=log), log))
        else:
            with open(args.out / f"stderr_{model}.txt", "w") as log:
                limit = max(60.0, deadline - time.time() + 600)
                rc = subprocess.run(cmd, env=env, stderr=log, timeout=limit).returncode
            print(f"{model}: rc={rc} after {time.time() - start:.0f} s", flush=True)
    for model, proc, log in procs:
        rc = proc.wait()
        log.close()
        print(f"{model}: rc={rc} after {time.time() - start:.0f} s", flush=True)
    print(report(args.out))


# -- the report ------------------------------------------------------------------------------------

TARGETS = {"time": 1.15, "memory": {"cpu": 1.25, "cuda": 1.15}, "opacus": 0.5, "bounded_memory": 1.05,
           "bounded_time": 1.6}


def load(source: Path) -> dict[str, dict]:
    """The records of a run folder (``MODEL.jsonl``, a later record of a method replacing an earlier one) or
    of a saved JSON (``--save``): ``{model: {"head": ..., "methods": {method: record}}}``."""
    if source.is_file():
        lines = [json.dumps(r) for r in json.loads(source.read_text())]
    else:
        lines = [ln for path in sorted(source.glob("*.jsonl")) for ln in path.read_text().splitlines()]
    models: dict[str, dict] = {}
    for line in lines:
        rec = json.loads(line)
        entry = models.setdefault(rec["model"], {"head": None, "methods": {}})
        if "method" in rec:
            entry["methods"][rec["method"]] = rec
        else:
            entry["head"] = rec
    return {name: entry for name, entry in models.items() if entry["head"] is not None}


def save(models: dict[str, dict], path: Path) -> None:
    records = [r for e in models.values() for r in (e["head"], *e["methods"].values())]
    path.write_text(json.dumps(records, indent=1) + "\n")


def _ms(rec: dict | None) -> str:
    if not rec or "median_s" not in rec:
        return (rec or {}).get("error", "not run").replace("|", "/")[:70]
    return f"{rec['median_s'] * 1e3:.1f}"


def _mib(rec: dict | None, key: str = "peak_extra_bytes") -> str:
    value = (rec or {}).get(key)
    return "-" if value is None else f"{value / 2**20:.0f}"


def _verdict(value: float | None, limit: float, strict: bool = False) -> str:
    if value is None:
        return "not measured"
    ok = value < limit if strict else value <= limit
    return f"{'PASS' if ok else 'FAIL'} ({value:.2f})"


#: steps per timing of the back-to-back measure (``back_to_back_s``: seconds per step)
BACK_TO_BACK = 5


def _back_to_back(runs: dict[str, Callable], batch: tuple, reps: int, dev: Device) -> tuple[dict, dict]:
    """Seconds of ``BACK_TO_BACK`` calls in a row between two synchronizations, ``reps`` rounds in a rotating
    order (the calls before a timed one warm its caches: no untimed call as in ``interleaved_times``)."""
    keys = list(runs)
    times: dict[str, list[float]] = {k: [] for k in keys}
    errors: dict[str, BaseException] = {}
    for r in range(reps):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            if k in errors:
                continue
            try:
                times[k].append(dev.timed(lambda k=k: [runs[k](*batch) for _ in range(BACK_TO_BACK)], ())[0])
            except Exception as e:
                errors[k] = e
                dev.release()
    return times, errors


def ratios(methods: dict) -> dict:
    """The DP step against the faster plain step (time), against the plain step of lower peak (memory: the
    extra memory of one step, and the whole allocation at the peak on CUDA), and against the peers."""
    plains = [methods[k] for k in ("plain", "plain_compile") if "median_s" in methods.get(k, {})]
    dp = methods.get("psg", {})
    found: dict = {"time": None, "memory": None, "memory_total": None, "opacus_ghost": None, "vmap_dp": None,
                   "bounded_time": None, "bounded_memory": None, "memory_allocated": None,
                   "bounded_memory_allocated": None, "back_to_back": None}
    if not plains:
        return found
    for method, prefix in (("psg_bounded", "bounded_"), ("psg", "")):
        rec = methods.get(method, {})
        if "median_s" in rec:
            found[prefix + "time"] = rec["median_s"] / min(r["median_s"] for r in plains)
        for key, name in (("peak_extra_bytes", "memory"), ("allocated_peak_bytes", "memory_allocated")):
            peaks = [r[key] for r in plains if r.get(key)]
            if peaks and rec.get(key):
                found[prefix + name] = rec[key] / min(peaks)
    if "median_s" not in dp:
        return found
    peaks = [r["peak_total_bytes"] for r in plains if r.get("peak_total_bytes")]
    if peaks and dp.get("peak_total_bytes"):
        found["memory_total"] = dp["peak_total_bytes"] / min(peaks)
    for peer in ("opacus_ghost", "vmap_dp"):
        if "median_s" in methods.get(peer, {}):
            found[peer] = dp["median_s"] / methods[peer]["median_s"]
    backs = [r["back_to_back_s"] for r in plains if "back_to_back_s" in r]
    if backs and "back_to_back_s" in dp:
        found["back_to_back"] = dp["back_to_back_s"] / min(backs)
    return found


def report(source: Path) -> str:
    models = load(source)
    if not models:
        return f"no records in {source}"
    env = next(iter(models.values()))["head"]["environment"]
    kind = "cuda" if env.get("device", "").startswith("cuda") else "cpu"
    # CUDA graphs run on a GPU only: a column where a record has them
    shown = [m for m in METHOD_LABELS if m != "psg_graphs" or any(m in e["methods"] for e in models.values())]
    lines = [f"Device: {env.get('device_name', '?')}; torch {env.get('torch', '?')}, {env.get('threads')} threads.",
             "",
             "| model | B | parameters (trained) | " + " | ".join(METHOD_LABELS[m] + ", ms" for m in shown)
             + " |", "|---|---|---|" + "---|" * len(shown)]
    memory = ["| model | peak extra MiB: plain eager / plain compiled / DP step / DP memory_budget=0 / DP "
              "transactional=False / Opacus / vmap | "
              "whole allocation at the peak, MiB: plain eager / compiled / DP | "
              "tensors allocated at the peak (CPU), MiB: plain eager / compiled / DP / DP memory_budget=0 | "
              "first call s: plain compiled / DP step / vmap |", "|---|---|---|---|---|"]
    targets = [f"| model | B | DP / faster plain time <= {TARGETS['time']} | DP / plain peak extra memory <= "
               f"{TARGETS['memory'][kind]} | the same, whole allocation | the same, tensors allocated (CPU) | "
               f"DP / Opacus ghost time < {TARGETS['opacus']} | DP / compiled vmap time | memory_budget=0: peak "
               f"extra <= {TARGETS['bounded_memory']} | the same, tensors allocated (CPU) | memory_budget=0: time "
               f"<= {TARGETS['bounded_time']} |",
               "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, entry in models.items():
        head, m = entry["head"], entry["methods"]
        size = f"{head['params'] / 1e6:.1f}M ({head['trained_params'] / 1e6:.2f}M)"
        times = " | ".join(_ms(m.get(k)) for k in shown)
        lines.append(f"| {name} | {head['batch']} | {size} | {times} |")
        memory.append(f"| {name} | " + " / ".join(_mib(m.get(k)) for k in ("plain", "plain_compile", "psg",
                                                                          "psg_bounded", "psg_nocopy",
                                                                          "opacus_ghost", "vmap_dp"))
                      + " | " + " / ".join(_mib(m.get(k), "peak_total_bytes")
                                           for k in ("plain", "plain_compile", "psg"))
                      + " | " + " / ".join(_mib(m.get(k), "allocated_peak_bytes")
                                           for k in ("plain", "plain_compile", "psg", "psg_bounded"))
                      + " | " + " / ".join(str(m.get(k, {}).get("first_call_s", "-"))
                                           for k in ("plain_compile", "psg", "vmap_dp")) + " |")
        r = ratios(m)
        targets.append(f"| {name} | {head['batch']} | {_verdict(r['time'], TARGETS['time'])} | "
                       f"{_verdict(r['memory'], TARGETS['memory'][kind])} | "
                       f"{_verdict(r['memory_total'], TARGETS['memory'][kind])} | "
                       f"{_verdict(r['memory_allocated'], TARGETS['memory'][kind])} | "
                       f"{_verdict(r['opacus_ghost'], TARGETS['opacus'], strict=True)} | "
                       f"{'-' if r['vmap_dp'] is None else format(r['vmap_dp'], '.2f')} | "
                       f"{_verdict(r['bounded_memory'], TARGETS['bounded_memory'])} | "
                       f"{_verdict(r['bounded_memory_allocated'], TARGETS['bounded_memory'])} | "
                       f"{_verdict(r['bounded_time'], TARGETS['bounded_time'])} |")
    back = [(name, entry["head"]["batch"], ratios(entry["methods"])["back_to_back"]) for name, entry in models.items()]
    if any(r is not None for _, _, r in back):  # records made before this measure have none
        targets += ["", f"| model | B | DP / faster plain time, {BACK_TO_BACK} steps back to back between two "
                        f"synchronizations <= {TARGETS['time']} |", "|---|---|---|"]
        targets += [f"| {name} | {batch} | {_verdict(r, TARGETS['time'])} |" for name, batch, r in back]
    return "\n".join(lines + ["", *memory, "", *targets])


# (title, records, command, the commit of compiled_psg measured: the code of each table)
PAGE_SOURCES = (("GPU (H200), full configs: gpt2, resnet50_gn, vit, CUDA graphs, memory_budget=0 and Opacus",
                 "benchmarks-scale-gpu-h200-graphs.json",
                 'MODELS="gpt2 resnet50_gn vit" METHODS="plain plain_compile psg psg_graphs psg_bounded" '
                 'PROFILE="gpt2 resnet50_gn" CHECK_S=110 bash benchmarks/gpu_scale.sh 400 280`; `memory_budget=0` '
                 'and Opacus ghost clipping from a second call on the same machine, `MODELS="gpt2 resnet50_gn vit" '
                 'METHODS="plain_compile psg_bounded opacus_ghost" PROFILE="none" CHECK_S=1 bash '
                 'benchmarks/gpu_scale.sh 300 220` (its compiled plain step left out: the first call\'s is the '
                 'reference), merged with `python -m benchmarks.merge_records',
                 "2c3f41f: the update committed after the program (no copy of the parameters), batch buckets and "
                 "CUDA graphs (`psg_graphs`: power-of-two buckets, `cuda_graphs=True`)"),
                ("GPU (H100), full configs: gpt2, resnet50_gn, vit, the transactional step and memory_budget=0",
                 "benchmarks-scale-gpu-h100-bounded.json",
                 'MODELS="gpt2 vit resnet50_gn" METHODS="plain plain_compile psg psg_bounded" PROFILE="gpt2 vit" '
                 'CHECK_S=50 bash benchmarks/gpu_scale.sh 410 290`; resnet50_gn profiled by a second call, '
                 '`MODELS="resnet50_gn" METHODS="plain_compile psg" PROFILE="resnet50_gn" bash benchmarks/gpu_scale.sh '
                 '270 200`; the `memory_budget=0` rows of gpt2 and vit, with the compiled plain step beside them, from '
                 'a third, `MODELS="gpt2 vit" METHODS="plain_compile psg_bounded" PROFILE="none" bash '
                 'benchmarks/gpu_scale.sh 235 190`, merged with `python -m benchmarks.merge_records',
                 "21927c9: the transactional step (a copy of the parameters per step), a tied weight's ghost norm "
                 "with its Grams traced slice by slice, the per-sample Conv2d GEMM with `F.unfold` inside"),
                ("GPU (H100), full configs: gpt2, llama_lora, resnet50_gn, vit with memory_budget=0",
                 "benchmarks-scale-gpu-h100-tf32.json",
                 'MODELS="resnet50_gn vit gpt2 llama_lora" METHODS="plain plain_compile psg psg_bounded" '
                 'PROFILE="resnet50_gn llama_lora gpt2" bash benchmarks/gpu_scale.sh 450 330',
                 "f1239d8: the per-sample Conv2d weight GEMM in TF32 where cuDNN rounds in TF32, its patch gather "
                 "traced (the opaque `conv2d_weight_gemm` with `F.unfold` inside is not measured on a GPU); no copy "
                 "of the parameters per step (`transactional=False` in this page's code)"),
                ("GPU (H100), full configs: resnet50_gn, vit, bert_last with memory_budget=0",
                 "benchmarks-scale-gpu-h100.json",
                 'MODELS="resnet50_gn vit bert_last" METHODS="plain psg psg_bounded plain_compile" '
                 'PROFILE="resnet50_gn vit" bash benchmarks/gpu_scale.sh 320 210',
                 "f7e26b7: the per-sample Conv2d weight GEMM in float32, no copy of the parameters per step"),
                ("GPU (H200), full configs, every model and peer", "benchmarks-scale-gpu.json",
                 "bash benchmarks/gpu_scale.sh 450 270` (which runs `python -m benchmarks.scale --device cuda "
                 "--parallel --profile gpt2 --output-code --budget 270`); llama_lora from a second call on the same "
                 "machine, "
                 "`python -m benchmarks.scale --device cuda --models llama_lora --methods plain plain_compile psg "
                 "opacus_ghost --budget 280", "ddbc185: per-tensor noise draws, grouped-convolution per-sample "
                 "conv gradients, no memory_budget"),
                ("CPU, scaled configs: the update committed after the program, the losses before the backward",
                 "benchmarks-scale-cpu-commit.json",
                 "python -m benchmarks.scale --device cpu --threads 2 --models gpt2 resnet50_gn vit bert_last "
                 "--methods plain plain_compile psg psg_bounded psg_nocopy --profile gpt2 resnet50_gn --reps 7 "
                 "--budget 2400 --out DIR",
                 "9188df9: the fused program returns the update and one `_foreach_copy_` per device and dtype "
                 "commits it (the transaction copies buffers only), the backward's seed reads the total loss "
                 "(the logits' gradient written over the logits)"),
                ("CPU, scaled configs", "benchmarks-scale-cpu.json",
                 "python -m benchmarks.scale --device cpu --threads 2 --models gpt2 vit resnet50_gn bert_last "
                 "--methods plain psg psg_bounded psg_nocopy plain_compile opacus_ghost vmap_dp --profile resnet50_gn "
                 "vit gpt2 bert_last --reps 7 --budget 3000 --out DIR",
                 "f2c33cf: Conv2d ghost and bounded norms on the CPU, a tied weight's per-sample gradient in one "
                 "buffer, the transactional step (`psg`; `psg_nocopy` is `transactional=False`)"),
                ("CPU, scaled configs: gpt2 with a tied weight's ghost norm", "benchmarks-scale-cpu-gpt2.json",
                 "python -m benchmarks.scale --device cpu --threads 2 --models gpt2 --methods plain psg psg_bounded "
                 "psg_nocopy plain_compile vmap_dp --profile gpt2 --reps 7 --budget 1400 --out DIR",
                 "938af05: the ghost norm of a weight used more than once (the embedding and LM head), taken by "
                 "`memory_budget=0` and by the default plan where the heap does not keep freed memory (the benchmarks "
                 "keep it: `benchmarks/__init__.py`)"))


# the first step of a user's process, cold and on warm caches (``benchmarks.probes.first_step``): title, record,
# command, code measured
FIRST_STEP_SOURCES = (
    ("CPU, scaled configs: a process's first DP step, cold and on warm caches", "benchmarks-scale-cpu-first-step.json",
     "python -m benchmarks.probes.first_step --models bert_last gpt2 vit resnet50_gn --methods psg vmap_dp --warm 3 "
     "--out FILE",
     "b342022 (2 cores shared with two test runs: every figure is an upper bound)"),
    ("CPU, scaled configs: plain SGD's first DP step on the program", "benchmarks-scale-cpu-first-step-sgd.json",
     "python -m benchmarks.probes.first_step --models bert_last gpt2 --methods psg --warm 3 --out FILE",
     "6a1c8a0: `torch.optim.SGD` without momentum runs the step's program from the first step, no eager step "
     "(2 cores shared with a test run and a red team's probes: every figure is an upper bound)"),
)

DOCS = Path(__file__).resolve().parent.parent / "docs"


def page(docs: Path = DOCS) -> str:
    """docs/benchmarks-scale.md: the tables of the saved runs, then ``scale_notes.md`` (the measured causes)."""
    parts = ["# The DP step at scale", "",
             "Generated by `python -m benchmarks.scale --page docs/benchmarks-scale.md` from the saved records "
             "beside it; every number comes from the command named in its section. Models: "
             "`benchmarks/scale_models.py`. Each model runs in its own process; the methods of a model are timed "
             "side by side, in rounds whose order rotates (median of 7 timed calls after 3 warm-up calls, each "
             "call between two device synchronizations; where a section has it, also five steps back to back between "
             "two synchronizations, as a training loop runs them, so that a step's host work overlaps the kernels "
             "of the step before). Peak extra memory: the most memory one step allocates on "
             "top of what the process holds before it (CUDA: `torch.cuda.max_memory_allocated`; CPU: the peak "
             "resident set); the whole allocation adds the model, optimizer and inputs. Tensors allocated (CPU): "
             "the peak of the tensor bytes the step allocates and has not freed (`cpu_allocated_peak`, from "
             "`torch.profiler`'s allocation events), CUDA's measure on the CPU, without the heap's layout that the "
             "resident set adds. First call: the method's "
             "first step, compile included (GPU: five model processes compiling at once, so these are upper "
             "bounds). Targets: DP step time over the faster plain step; DP step peak over the plain "
             "step of lower peak; DP step time over Opacus ghost clipping's.", ""]
    def first_step_tables(path: Path) -> str:
        rows = json.loads(path.read_text())
        return first_step_report.table(rows) + "\n\n" + first_step_report.targets(rows)

    for sources, tables in ((PAGE_SOURCES, report), (FIRST_STEP_SOURCES, first_step_tables)):
        for title, name, command, commit in sources:
            path = docs / name
            parts += [f"## {title}", ""]
            if not path.exists():
                parts += ["Not measured yet.", ""]
                continue
            parts += [f"Command: `{command}`. Code measured: {commit}. Records: [{name}]({name}).", "",
                      tables(path), ""]
    notes = Path(__file__).with_name("scale_notes.md")
    if notes.exists():
        parts += [notes.read_text().rstrip(), ""]
    return "\n".join(parts)


if __name__ == "__main__":
    main()
