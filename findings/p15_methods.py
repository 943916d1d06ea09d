import torch, torch.nn as nn, torch.nn.functional as F
import compiled_psg as psg
from tests.reference import reference_per_sample
torch.manual_seed(0)
x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
def act(t): return torch.tanh(t)
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.a = nn.Linear(4, 8); s.b = nn.Linear(8, 3)
    @classmethod
    def scale(cls): return 2.0
    @staticmethod
    def shift(t): return t + 1.0
    @property
    def gain(self): return 1.5
    def forward(s, x):
        return s.b(act(s.shift(s.a(x)) * s.scale() * s.gain))
def run(name, mutate, undo):
    torch.manual_seed(0); m = M().double()
    loss = lambda x, y: F.cross_entropy(m(x), y)
    f = psg.per_sample(m, backend="eager")(loss)
    f(x, y); mutate()
    try:
        got = f(x, y); ref = reference_per_sample(loss, dict(m.named_parameters()), (x, y))
        err = max((got[n] - ref[n]).abs().max().item() for n in ref)
        print(f"[{name}] {'OK' if err < 1e-9 else 'WRONG'} err {err:.3g}")
    except psg.PerSampleError as e:
        print(f"[{name}] REFUSED {type(e).__name__}: {str(e)[:120]}")
    finally:
        undo()
orig = dict(M.__dict__)
run("classmethod replaced", lambda: setattr(M, "scale", classmethod(lambda cls: 3.0)), lambda: setattr(M, "scale", orig["scale"]))
run("staticmethod replaced", lambda: setattr(M, "shift", staticmethod(lambda t: t - 1.0)), lambda: setattr(M, "shift", orig["shift"]))
run("property replaced", lambda: setattr(M, "gain", property(lambda s: 0.5)), lambda: setattr(M, "gain", orig["gain"]))
g = globals()
run("global function replaced", lambda: g.__setitem__("act", torch.sin), lambda: g.__setitem__("act", act))
run("torch.tanh monkeypatched", lambda: setattr(torch, "tanh", torch.sin), lambda: None)
