"""compile_step(reduce=psg.custom(...), max_physical_batch_size=N): each micro-batch's custom result is SUMMED
(step._add_into), which equals the whole batch's result only for a reduction that is a sum over samples. A
custom mean/max over the batch silently gives another update than the same step on the whole batch."""
import copy, torch, torch.nn as nn, torch.nn.functional as F
import compiled_psg as psg
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
x, y = torch.randn(7, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
for name, red in [("sum over samples (additive)", lambda n, g: g.sum(0)),
                  ("mean over samples", lambda n, g: g.mean(0)),
                  ("max over samples", lambda n, g: g.amax(0))]:
    ms = []
    try:
        for micro in (None, 3):
            m = copy.deepcopy(model)
            st = psg.compile_step(lambda x, y, m=m: F.cross_entropy(m(x), y), m, torch.optim.SGD(m.parameters(), lr=1.0),
                                  reduce=psg.custom(red), loss_reduction="sum", backend="eager",
                                  max_physical_batch_size=micro)
            st(x, y)
            ms.append(m)
        err = max((p - q).abs().max().item() for p, q in zip(*[m.parameters() for m in ms]))
        print(f"[{name}] {'OK' if err < 1e-12 else 'WRONG'} update differs from the whole batch's by {err:.3g}")
    except psg.PerSampleError as e:
        print(f"[{name}] REFUSED {type(e).__name__}: {str(e)[:200]}")
