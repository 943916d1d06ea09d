import torch, torch.nn as nn, torch.nn.functional as F
import compiled_psg as psg
from tests.reference import reference_per_sample
torch.manual_seed(0)
x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
def loss(x, y, k):
    s = 3.0 if isinstance(k, bool) else 1.0
    return F.cross_entropy(m(x), y) * s * (2.0 if type(k) is float else 1.0)
f = psg.per_sample(m, in_dims=(0, 0, None), backend="eager")(loss)
for k in (1, True, 1.0, 1):
    got = f(x, y, k)
    ref = reference_per_sample(loss, dict(m.named_parameters()), (x, y, k), (0, 0, None))
    err = max((got[n] - ref[n]).abs().max().item() for n in ref)
    print(f"[k={k!r}] {'OK' if err < 1e-9 else 'WRONG'} err {err:.3g}")
