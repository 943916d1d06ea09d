"""First calls from several threads at once; no capture keeps the user's model or batch alive."""

import gc
import os
import threading
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import reference_per_sample

import compiled_psg as psg


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _batch(seed: int, B: int = 5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (B,), generator=g)


def test_concurrent_first_calls_are_exact_and_restore_process_switches():
    opt_einsum_before, mkldnn_before = torch.backends.opt_einsum.enabled, torch._C._get_mkldnn_enabled()
    model = _model(0)

    @psg.per_sample(model, backend="eager")
    def loss(x, y):  # einsum: the capture switches opt_einsum off, which must not leak to the other threads
        return F.cross_entropy(torch.einsum("bi,oi->bo", torch.tanh(model[0](x)), model[2].weight), y)

    batches = [_batch(s) for s in range(4)]
    results, errors = [None] * len(batches), []
    barrier = threading.Barrier(len(batches))

    def work(i):
        try:
            barrier.wait()
            results[i] = loss(*batches[i])
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert torch.backends.opt_einsum.enabled == opt_einsum_before
    assert torch._C._get_mkldnn_enabled() == mkldnn_before
    params = dict(model.named_parameters())
    for got, batch in zip(results, batches, strict=True):
        expected = reference_per_sample(loss.fn, params, batch)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-9, atol=1e-12)
    assert loss.captures == 1, "threads that waited for the capture reuse it"


def _capture_once(seed: int) -> weakref.ref:
    model = _model(seed)

    @psg.per_sample(model, backend="eager")
    def loss(x, y):
        return F.cross_entropy(model(x), y)

    x, y = _batch(seed)
    grads = loss(x, y)
    assert grads["0.weight"].shape == (5, 6, 4)
    return weakref.ref(model)  # the function, the model and the gradients go out of scope here


def test_dropped_model_is_freed():
    ref = _capture_once(0)
    gc.collect()
    assert ref() is None, gc.get_referrers(ref())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_rss_flat_over_many_captures():
    """15 captures of fresh models of 16 MB of parameters each: keeping each model alive would grow RSS by 240 MB or
    more. Tolerance 100 MB: torch keeps each capture's ShapeEnv and fake-tensor dispatch cache (~1.5 MB per capture
    here, not reachable from Python; ``torch._dynamo.reset()`` does not free them either)."""

    def capture(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(1024, 2048), nn.Tanh(), nn.Linear(2048, 3)).double()

        @psg.per_sample(model, reduce=psg.norms(), backend="eager")
        def loss(x, y):
            return F.cross_entropy(model(x), y)

        loss(torch.randn(2, 1024, dtype=torch.float64), torch.zeros(2, dtype=torch.long))
        return weakref.ref(model)

    for seed in range(2):  # warm up caches and the allocator
        capture(seed)
    gc.collect()
    before = _rss_bytes()
    refs = [capture(seed) for seed in range(15)]
    gc.collect()
    grown = _rss_bytes() - before
    assert all(r() is None for r in refs)
    assert grown < 100 * 2**20, f"RSS grew by {grown / 2**20:.0f} MB over 15 captures"
