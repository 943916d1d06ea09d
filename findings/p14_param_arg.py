import torch, torch.nn as nn, torch.nn.functional as F
from _h import check
torch.manual_seed(0)
x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
def loss(x, y, W):
    return F.cross_entropy(F.linear(torch.tanh(F.linear(x, W, m[0].bias)), m[2].weight, m[2].bias), y)
check("parameter passed as an unbatched argument", loss, m, (x, y, m[0].weight), in_dims=(0, 0, None))
def loss2(x, y, W):
    return F.cross_entropy(m(x) + (W ** 2).sum(), y)
check("parameter arg used in addition to the module", loss2, m, (x, y, m[0].weight), in_dims=(0, 0, None))
d = dict(m.named_parameters())
check("param dict entry passed as arg (dict params)", lambda x, y, W: F.cross_entropy(F.linear(torch.tanh(F.linear(x, W, d["0.bias"])), d["2.weight"], d["2.bias"]), y),
      d, (x, y, d["0.weight"]), in_dims=(0, 0, None))
p = nn.Parameter(torch.randn(5, 3, dtype=torch.float64))  # a batched parameter-like leaf requiring grad
check("batched leaf arg requiring grad", lambda x, y, z: F.cross_entropy(m(x) + z, y), m, (x, y, p))
