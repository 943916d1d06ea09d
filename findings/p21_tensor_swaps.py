import types, torch, torch.nn as nn, torch.nn.functional as F
import compiled_psg as psg
from tests.reference import reference_per_sample
torch.manual_seed(0)
x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
D = {"t": torch.tensor(2.0, dtype=torch.float64)}
L = [torch.tensor(2.0, dtype=torch.float64)]
NS = types.SimpleNamespace(t=torch.tensor(2.0, dtype=torch.float64))
class Cfg: pass
C = Cfg(); C.t = torch.tensor(2.0, dtype=torch.float64)
def make(get):
    return lambda x, y: F.cross_entropy(m(x) / get(), y)
for name, get, swap in [("global dict value tensor", lambda: D["t"], lambda: D.__setitem__("t", torch.tensor(5.0, dtype=torch.float64))),
                        ("global list element tensor", lambda: L[0], lambda: L.__setitem__(0, torch.tensor(5.0, dtype=torch.float64))),
                        ("SimpleNamespace attr tensor", lambda: NS.t, lambda: setattr(NS, "t", torch.tensor(5.0, dtype=torch.float64))),
                        ("plain object attr tensor", lambda: C.t, lambda: setattr(C, "t", torch.tensor(5.0, dtype=torch.float64))),
                        ("module non-buffer tensor attr", lambda: m.temp, lambda: setattr(m, "temp", torch.tensor(5.0, dtype=torch.float64))),
                        ("dtype change of attr", lambda: m.temp2, lambda: setattr(m, "temp2", torch.tensor(5.0, dtype=torch.float32)))]:
    m.temp = torch.tensor(2.0, dtype=torch.float64); m.temp2 = torch.tensor(2.0, dtype=torch.float64)
    loss = make(get)
    f = psg.per_sample(m, backend="eager")(loss)
    try:
        f(x, y); swap(); got = f(x, y)
    except psg.PerSampleError as e:
        print(f"[{name}] REFUSED {type(e).__name__}: {str(e)[:150]}"); continue
    ref = reference_per_sample(loss, dict(m.named_parameters()), (x, y))
    err = max((got[n] - ref[n]).abs().max().item() for n in ref)
    print(f"[{name}] {'OK' if err < 1e-9 else 'WRONG'} err {err:.3g}")
