import torch, torch.nn as nn, torch.nn.functional as F
import compiled_psg as psg
from tests.reference import reference_per_sample
torch.manual_seed(0)
x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
CFG = {"scale": 2.0, "layers": [0]}
class M(nn.Module):
    SCALE = 2.0
    def __init__(s):
        super().__init__(); s.a = nn.Linear(4, 8); s.b = nn.Linear(8, 3); s.alpha = 1.5; s.mods = [torch.tanh]
        s.register_buffer("shift", torch.zeros(8, dtype=torch.float64)); s.cfg = {"p": 1.0}
    def forward(s, x):
        h = s.a(x) * self_scale(s) * s.alpha * s.cfg["p"] + s.shift
        for f in s.mods: h = f(h)
        return s.b(h) * CFG["scale"]
def self_scale(s): return type(s).SCALE
def run(name, mutate, undo=None):
    torch.manual_seed(0); m = M().double()
    loss = lambda x, y: F.cross_entropy(m(x), y)
    f = psg.per_sample(m, backend="eager")(loss)
    f(x, y)
    mutate(m)
    try:
        got = f(x, y)
        ref = reference_per_sample(loss, dict(m.named_parameters()), (x, y))
    except psg.PerSampleError as e:
        print(f"[{name}] REFUSED {type(e).__name__}: {str(e)[:120]}"); return
    finally:
        if undo: undo(m)
    err = max((got[n] - ref[n]).abs().max().item() for n in ref)
    print(f"[{name}] {'OK' if err < 1e-9 else 'WRONG'} err {err:.3g}")
run("class attr SCALE", lambda m: setattr(M, "SCALE", 3.0), lambda m: setattr(M, "SCALE", 2.0))
run("instance float attr", lambda m: setattr(m, "alpha", 0.5))
run("instance dict value", lambda m: m.cfg.__setitem__("p", 3.0))
run("global dict value", lambda m: CFG.__setitem__("scale", 5.0), lambda m: CFG.__setitem__("scale", 2.0))
run("instance list append", lambda m: m.mods.append(torch.sin))
run("instance list replace", lambda m: m.mods.__setitem__(0, torch.sin))
run("buffer in-place", lambda m: m.shift.add_(1.0))
run("buffer reassigned", lambda m: setattr(m, "shift", torch.ones(8, dtype=torch.float64)))
run("buffer .data", lambda m: setattr(m.shift, "data", torch.ones(8, dtype=torch.float64)))
run("submodule swapped", lambda m: setattr(m, "a", nn.Linear(4, 8).double()))
run("default dtype", lambda m: torch.set_default_dtype(torch.float64), lambda m: torch.set_default_dtype(torch.float32))
