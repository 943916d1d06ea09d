import torch, torch.nn as nn, torch.nn.functional as F
from torch.func import functional_call
import compiled_psg as psg
from tests.reference import reference_per_sample
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
params = {k: v.detach() for k, v in m.named_parameters()}
x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
def f(x, p, y): return F.cross_entropy(functional_call(m, p, (x,)), y)
g = psg.per_sample_grad(f, argnums=1, in_dims=(0, None, 0), backend="eager")
for trial in range(2):
    got = g(x, params, y)
    pd = {k: v.clone().requires_grad_() for k, v in params.items()}
    ref = reference_per_sample(lambda x, y: f(x, pd, y), pd, (x, y))
    err = max((got[n] - ref[n]).abs().max().item() for n in ref)
    print(f"[per_sample_grad argnums=1 call {trial}] {'OK' if err < 1e-9 else 'WRONG'} err {err:.3g}")
    params = {k: v + 0.1 for k, v in params.items()}  # new values: must not reuse old ones
