"""``python -m benchmarks --quick`` end to end, in a subprocess, into a temporary folder.

Checks the outputs exist and that every method has, on every model, either a measurement or a recorded
failure ("unsupported: ..."). Timings are not asserted: they depend on the machine. The run measures the MLP,
which every method supports (about a minute on 2 cores); the quick run's GPT-2-style decoder, where peers fail,
takes six more and adds nothing the harness does not already do for the MLP (a failure record is checked by
``test_a_killed_worker_keeps_its_finished_sizes``).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.long
def test_quick_run_records_every_method(tmp_path):
    out = tmp_path / "docs"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--models", "mlp", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    for name in (
        "benchmarks.md",
        "benchmarks.json",
        "img/benchmarks_time_ratio.png",
        "img/benchmarks_memory.png",
    ):
        assert (out / name).stat().st_size > 0, name
    results = json.loads((out / "benchmarks.json").read_text())
    page = (out / "benchmarks.md").read_text()
    assert results["quick"] and results["command"].startswith("python -m benchmarks --quick")
    assert len(results["methods"]) >= 18 and list(results["models"]) == ["mlp"]

    for model, data in results["models"].items():
        assert set(data["methods"]) == set(results["methods"]), model
        for key, record in data["methods"].items():
            assert record["label"] in page
            if "error" in record:  # the method could not even be set up on this model
                assert record["error"].startswith("unsupported: "), (model, key)
                continue
            assert record["sizes"], (model, key)
            for size, entry in record["sizes"].items():
                if "error" in entry:
                    assert entry["error"].startswith("unsupported: "), (model, key, size)
                else:
                    assert entry["median_s"] > 0 and len(entry["times_s"]) >= 3, (model, key, size)


def test_a_killed_worker_keeps_its_finished_sizes(tmp_path):
    """A worker killed in the middle of a method (the out-of-memory killer): the method whose first calls ran
    last is the one killed; it keeps the batch sizes it finished and records the fatal one; methods with no
    record are failures, not silently dropped."""
    import argparse

    sys.path.insert(0, str(ROOT))
    from benchmarks.__main__ import _collect, _killed_method, _record_killed

    path = tmp_path / "mlp.jsonl"
    lines = [
        {"model": "mlp", "environment": {"device": "cpu"}},
        {"model": "mlp", "method": "backward", "sizes": {"16": {"median_s": 0.01}}},
        {"running": "psg_gram", "size": 16},
        {"running": "psg_norms", "size": 16},
        {"running": "interleaved", "size": 16, "methods": ["psg_gram", "psg_norms"]},
        {"partial": "psg_gram", "size": 16, "entry": {"median_s": 0.02}},
        {"partial": "psg_norms", "size": 16, "entry": {"median_s": 0.01}},
        {"running": "psg_gram", "size": 64},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    killed = _killed_method(path, ["psg_gram", "psg_norms"])
    assert killed == "psg_gram"
    _record_killed("mlp", killed, path, -9)
    args = argparse.Namespace(methods=["backward", "psg_gram", "psg_norms"])
    got = _collect("mlp", args, path, rc=-9)["methods"]
    assert got["backward"]["sizes"]["16"]["median_s"] == 0.01
    assert got["psg_gram"]["sizes"]["16"] == {"median_s": 0.02}
    assert "out-of-memory killer" in got["psg_gram"]["sizes"]["64"]["error"]
    assert got["psg_norms"]["error"].startswith("unsupported: the worker process exited with code -9")


def test_timed_calls_are_interleaved_in_rotated_rounds():
    """Each round times every method once (after an untimed call of the same method), starting one method later
    each round; a method that raises leaves the rotation with its error; fast methods get extra rounds until
    their timed calls add up to ``min_seconds``."""
    import dataclasses

    sys.path.insert(0, str(ROOT))
    from benchmarks.measure import Plan, interleaved_times

    class Clock:  # a device whose calls take the time the callable says
        def timed(self, fn, batch):
            seconds = fn()
            return seconds, None

        def release(self):
            pass

    calls: list[str] = []

    def method(name: str, seconds: float, fail_at: int | None = None):
        def run():
            if fail_at is not None and calls.count(name) == fail_at:
                raise RuntimeError(f"{name} broke")
            calls.append(name)
            return seconds
        return run

    plan = Plan(sizes=(4,), sequence=(), check_size=4, warmup=0, reps=3, min_seconds=0.0, max_reps=10)
    times, errors = interleaved_times({"a": method("a", 1.0), "b": method("b", 1.0), "c": method("c", 1.0)},
                                      plan, Clock())
    assert calls == [m for m in "abcbcacab" for _ in range(2)] and not errors  # an untimed call, then the timed
    assert times == {"a": [1.0] * 3, "b": [1.0] * 3, "c": [1.0] * 3}

    calls.clear()
    plan = dataclasses.replace(plan, min_seconds=1.0)
    times, errors = interleaved_times({"slow": method("slow", 0.5), "fast": method("fast", 0.25),
                                       "bad": method("bad", 0.1, fail_at=3)}, plan, Clock())
    assert str(errors["bad"]) == "bad broke" and times["bad"] == [0.1]  # its 4th call (2nd timed) raised
    assert len(times["slow"]) == 3 and times["fast"] == [0.25] * 4


def test_sizes_predicted_too_slow_or_too_big_are_skipped():
    sys.path.insert(0, str(ROOT))
    from benchmarks.measure import plan_for, predicted_skip

    plan = plan_for("mlp", quick=False)
    done = {"16": {"median_s": 0.01, "peak_bytes": 2**20}}
    assert predicted_skip("grads", done, 64, plan) is None
    slow = {"64": {"median_s": 20.0, "peak_bytes": 2**20}}
    assert "min budget" in predicted_skip("gram", slow, 256, plan)  # 16x the time of B=64
    big = {"64": {"median_s": 0.1, "peak_bytes": 2**50}}
    assert "peak memory" in predicted_skip("grads", big, 256, plan)
    assert predicted_skip("grads", {"16": {"error": "unsupported: x"}}, 64, plan) is None


def test_cost_model_benchmark_forces_each_strategy():
    """The cost-model benchmark times what it says: under ``only(...)`` the rewrite records the forced strategy, and
    both forced forms give the same norms."""
    import torch

    sys.path.insert(0, str(ROOT))
    from benchmarks.probes.cost_model import _norms_fn, only

    norms = {}
    for name in ("ghost", "materialize"):
        with only("sq_norm", name):
            fn, x = _norms_fn((4, 3, 8, 8), "eager")
            norms[name] = fn(x)
        assert fn.compiled_for(x)[0].rewritten.choices["weight"][0].method == name
    torch.testing.assert_close(norms["ghost"], norms["materialize"])


def test_breakdown_attributes_a_call_to_its_ops():
    """``benchmarks.probes.breakdown`` sums each op's own time into categories: a matmul is a library call, the noise
    of a DP step is named (it is drawn on worker threads), the rest of the call is outside every op."""
    import torch

    from benchmarks.probes.breakdown import _profile, category
    from compiled_psg._train.dp import gaussian_many

    assert category("aten::addmm") == "library matmul/conv"
    assert category("graph_0_cpp_fused_add_0") == "Inductor fused kernels"
    assert category("compiled_psg.noise") == "noise"
    a = torch.randn(256, 256)
    got = _profile(lambda a: (a @ a, gaussian_many([torch.zeros(400, 400)], 1.0)), (a,), calls=2)
    ms = got["categories_ms"]
    assert ms["library matmul/conv"] > 0 and ms["noise"] > 0
    assert ms["noise"] > ms["Inductor fused kernels"] == 0
    assert got["top_ops"][0]["calls"] >= 1


def test_the_threefry_candidate_matches_random123_and_is_gaussian():
    """``benchmarks.probes.noise``'s candidate generator: Threefry-2x32-20's known answers (Random123's kat_vectors),
    and Box-Muller on its words gives N(0, 1) (Kolmogorov-Smirnov), a different stream for another key."""
    import torch
    from scipy import stats

    sys.path.insert(0, str(ROOT))
    from benchmarks.probes.noise import threefry2x32, threefry_normal

    known = [((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
             ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
             ((0x243F6A88, 0x85A308D3), (0x13198A2E, 0x03707344), (0xC4923A9C, 0x483DF7A0))]
    for counter, key, want in known:
        got = threefry2x32(*(torch.tensor(w) for w in (*key, *counter)))
        assert tuple(int(w) for w in got) == want
    z = threefry_normal(torch.tensor([7, 9]), 100_000).double()
    assert stats.kstest(z.numpy(), "norm").pvalue > 1e-3
    other = threefry_normal(torch.tensor([7, 10]), 100_000).double()
    assert abs(float(torch.corrcoef(torch.stack([z, other]))[0, 1])) < 0.02


def test_cold_compile_phases_count_each_function_once():
    """``benchmarks.probes.cold_compile``'s timer: a phase called inside another is taken out of the outer one, an
    inclusive phase keeps what it calls, and calls from other threads (the noise build) are not counted."""
    import threading
    import time
    import types

    sys.path.insert(0, str(ROOT))
    from benchmarks.probes.cold_compile import PhaseTimer

    ns = types.SimpleNamespace()
    ns.inner = lambda: time.sleep(0.05)
    ns.outer = lambda: (time.sleep(0.03), ns.inner())
    ns.whole = lambda: ns.outer()
    timer = PhaseTimer()
    timer.wrap(ns, "inner", "inner")
    timer.wrap(ns, "outer", "outer")
    ns.outer()
    assert timer.seconds["inner"] >= 0.05 and 0.03 <= timer.seconds["outer"] < 0.075, timer.seconds  # not 0.08
    timer.seconds.clear()
    timer.wrap(ns, "whole", "whole", inclusive=True)
    ns.whole()
    assert set(timer.seconds) == {"whole"} and timer.seconds["whole"] >= 0.08, timer.seconds
    timer.seconds.clear()
    thread = threading.Thread(target=ns.outer)
    thread.start()
    thread.join()
    assert timer.seconds == {}
    timer.restore()
    assert not hasattr(ns.inner, "__wrapped__") and not hasattr(ns.whole, "__wrapped__")


def test_cold_compile_phases_fire_where_torch_calls_them():
    """Every wrapper of ``benchmarks.probes.cold_compile.install`` sits where its callers look the function up: one
    ``torch.compile`` with AOT autograd records Dynamo's trace and both halves of AOT's trace (the metadata pass
    and the graph capture, which ``aot_autograd`` imports by name), and ``restore`` undoes them."""
    import torch
    import torch._functorch.aot_autograd as aot_autograd

    sys.path.insert(0, str(ROOT))
    from benchmarks.probes.cold_compile import PhaseTimer, install

    timer = PhaseTimer()
    install(timer)
    try:
        torch._dynamo.reset()
        torch.compile(lambda x: (x.sin() * 2).sum(), backend="aot_eager")(torch.randn(4, requires_grad=True))
    finally:
        timer.restore()
        torch._dynamo.reset()
    assert timer.calls.get("dynamo") == 1 and timer.calls.get("aot trace") == 2, timer.calls
    assert timer.seconds["dynamo"] > 0 and timer.seconds["aot trace"] > 0
    assert not hasattr(aot_autograd.aot_stage1_graph_capture, "__wrapped__")


def test_scale_ratios_take_the_faster_plain_step_and_the_lower_peak(tmp_path):
    """``benchmarks.scale``'s targets: time against the faster plain step, memory against the plain step of lower
    peak, peers by time; a method that failed gives no ratio."""
    import json

    from benchmarks.scale import load, ratios, report

    head = {"model": "m", "label": "m", "config": {}, "batch": 4, "params": 10, "trained_params": 10,
            "environment": {"device": "cpu", "device_name": "x", "torch": "t", "threads": 2}}
    methods = [
        {"model": "m", "method": "plain", "median_s": 0.010, "peak_extra_bytes": 100, "allocated_peak_bytes": 80},
        {"model": "m", "method": "plain_compile", "median_s": 0.008, "peak_extra_bytes": 200,
         "allocated_peak_bytes": 64},
        {"model": "m", "method": "psg", "median_s": 0.012, "peak_extra_bytes": 150, "allocated_peak_bytes": 72},
        {"model": "m", "method": "opacus_ghost", "median_s": 0.030},
        {"model": "m", "method": "vmap_dp", "error": "unsupported: RuntimeError: x"},
    ]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in [head, *methods]))
    r = ratios(load(tmp_path)["m"]["methods"])
    assert r["time"] == pytest.approx(1.5) and r["memory"] == pytest.approx(1.5)
    assert r["opacus_ghost"] == pytest.approx(0.4) and r["vmap_dp"] is None
    assert r["memory_allocated"] == pytest.approx(72 / 64) and r["bounded_memory_allocated"] is None
    text = report(tmp_path)
    assert "FAIL (1.50)" in text and "PASS (0.40)" in text and "unsupported: RuntimeError: x" in text
    assert "PASS (1.12)" in text  # the tensors-allocated ratio, its own column
    assert r["back_to_back"] is None and "back to back" not in text  # records without the measure: no table
    methods[0]["back_to_back_s"], methods[1]["back_to_back_s"], methods[2]["back_to_back_s"] = 0.009, 0.0085, 0.0095
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in [head, *methods]))
    assert ratios(load(tmp_path)["m"]["methods"])["back_to_back"] == pytest.approx(0.0095 / 0.0085)
    assert "steps back to back" in report(tmp_path) and "| m | 4 | PASS (1.12) |" in report(tmp_path)


def test_first_step_targets_compare_cold_first_steps_and_judge_the_warm_step_alone():
    """``benchmarks.probes.first_step``: the cold DP first step against compiled vmap's, the warm process's first
    step against 3 s (the process's start, imports and model build shown beside it, not judged); a model without
    a peer's row says so."""
    from benchmarks.first_step_report import PHASES, table, targets

    def row(model, method, cache, process, first):
        return {"model": model, "method": method, "cache": cache, "batch": 8, "process_s": process,
                "first_step_s": first, "kernels": 3, "phases": dict.fromkeys(PHASES, 0.0)}

    rows = [row("a", "psg", "cold", 30.0, 24.0), row("a", "vmap_dp", "cold", 26.0, 20.0),
            row("a", "psg", "warm", 7.5, 2.5), row("b", "psg", "cold", 10.0, 5.0), row("b", "psg", "warm", 9.0, 4.0)]
    text = targets(rows)
    assert "| a | FAIL (1.20) | PASS (2.5 s) | 7.5 (5.0) |" in text
    assert "| b | not measured | FAIL (4.0 s) | 9.0 (5.0) |" in text
    assert table(rows).count("\n") == len(rows) + 1


def test_cpu_allocated_peak_is_the_most_tensor_bytes_a_step_holds_at_once():
    """``benchmarks.scale.cpu_allocated_peak``: 4 MiB held while 1 MiB is allocated peaks at 5 MiB (not the 9 MiB
    allocated in all), and a tensor made before the step does not count."""
    import torch

    from benchmarks.scale import cpu_allocated_peak

    a = torch.randn(1024, 1024)

    def step():
        for _ in range(2):
            big = a * 2  # 4 MiB, freed before the next one is made
            big.sum(0, keepdim=True).expand(256, 1024).contiguous().sum()  # 1 MiB while `big` lives
            del big

    assert 5 * 2**20 <= cpu_allocated_peak(step, ()) < 5 * 2**20 + 2**16


def test_cpu_memory_at_peak_names_what_a_step_holds():
    """``benchmarks.scale.cpu_memory_at_peak``: the blocks live at a CPU step's peak, grouped by the op that
    allocated them. A step that holds a 4 MiB product while it allocates a 1 MiB sum peaks at both, and each is
    named by its op."""
    import torch

    from benchmarks.scale import cpu_memory_at_peak

    a = torch.randn(1024, 1024)

    def step():
        big = a * 2  # 4 MiB, live until the sum below is taken
        return big.sum(0, keepdim=True).expand(256, 1024).contiguous().sum()  # 1 MiB while `big` lives

    found = cpu_memory_at_peak(step, ())
    by_op = {row["site"].split(", in ")[0]: row["bytes"] for row in found["by_site"]}
    assert by_op.get("aten::mul, 4.0 MiB blocks") == 4 * 2**20, found
    assert by_op.get("aten::empty, 1.0 MiB blocks") == 2**20, found
    assert found["peak_bytes_allocated_in_step"] >= 5 * 2**20
