import math, torch, torch.nn as nn, torch.nn.functional as F
from _h import check
torch.manual_seed(0)
x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
ce = lambda x, y: F.cross_entropy(m(x), y, reduction="sum")
cases = {
 "x.new_full((), len(x))": lambda x, y: ce(x, y) / x.new_full((), len(x)),
 "torch.full((), len(x))": lambda x, y: ce(x, y) / torch.full((), len(x), dtype=torch.float64),
 "x.new_ones(()) * len(x)": lambda x, y: ce(x, y) / (x.new_ones(()) * len(x)),
 "x.new_full((1,), len(x))": lambda x, y: ce(x, y) / x.new_full((1,), len(x)).sum(),
 "torch.full((3,), len(x)) mean": lambda x, y: ce(x, y) / torch.full((3,), float(len(x)), dtype=torch.float64).mean(),
 "x.new_tensor(len(x))": lambda x, y: ce(x, y) / x.new_tensor(len(x)),
 "mean reduction": lambda x, y: F.cross_entropy(m(x), y),
}
for name, f in cases.items():
    check(name, f, m, (x, y))
import compiled_psg as psg
check("full_like(bias, len(x))", lambda x, y: F.cross_entropy(m(x), y, reduction="sum") / torch.full_like(m[2].bias, len(x)).sum(), m, (x, y))
check("full_like(bias, len(x)) in-forward", lambda x, y: F.cross_entropy(m(x) / torch.full_like(m[2].bias, len(x)), y), m, (x, y))
