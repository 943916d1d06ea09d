import torch, torch.nn as nn, torch.nn.functional as F
import compiled_psg as psg
from tests.reference import reference_per_sample
torch.manual_seed(0)
x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
m = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 3)).double()
loss = lambda x, y: F.cross_entropy(m(x), y)
f = psg.per_sample(m, backend="eager")(loss)
def attempt(label):
    try:
        got = f(x, y)
    except psg.PerSampleError as e:
        print(f"[{label}] REFUSED {type(e).__name__}"); return
    ref = reference_per_sample(loss, dict(m.named_parameters()), (x, y))
    err = max((got[n] - ref[n]).abs().max().item() for n in ref)
    print(f"[{label}] {'OK' if err < 1e-9 else 'WRONG'} err {err:.3g}")
m.eval(); attempt("eval")
m.train(); attempt("train (BN mixes)")
m.eval(); attempt("eval again")
m[1].train(); attempt("only BN train")
m[1].eval(); m[2].train(); 
with torch.no_grad(): pass
m[2].p = 0.0; attempt("dropout train p=0")
m[1].track_running_stats = False; m[2].eval(); attempt("BN eval, track_running_stats=False (uses batch stats)")
