import math, torch, torch.nn as nn, torch.nn.functional as F
from _h import check
torch.manual_seed(0)
x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
cases = {
 "logits / x.new_full((), len(x))": lambda x, y: F.cross_entropy(m(x) / x.new_full((), len(x)), y),
 "logits / torch.full((), len(x))": lambda x, y: F.cross_entropy(m(x) / torch.full((), len(x), dtype=torch.float64), y),
 "logits / torch.tensor(float(len(x)))": lambda x, y: F.cross_entropy(m(x) / torch.tensor(float(len(x)), dtype=torch.float64), y),
 "logits / len(x)": lambda x, y: F.cross_entropy(m(x) / len(x), y),
 "logits / sqrt(len(x))": lambda x, y: F.cross_entropy(m(x) / math.sqrt(len(x)), y),
 "hidden * len(x)": lambda x, y: F.cross_entropy(m[2](m[1](m[0](x) * (1.0 / len(x)))), y),
 "x.new_tensor(len(x))": lambda x, y: F.cross_entropy(m(x) / x.new_tensor(float(len(x))), y),
 "scalar_tensor": lambda x, y: F.cross_entropy(m(x) / torch.scalar_tensor(len(x), dtype=torch.float64), y),
 "torch.ones(()).mul(len(x))": lambda x, y: F.cross_entropy(m(x) / torch.ones((), dtype=torch.float64).mul(len(x)), y),
 "x.new_ones(len(x)).sum()": lambda x, y: F.cross_entropy(m(x) / x.new_ones(len(x)).sum(), y),
 "ones_like(y).sum()": lambda x, y: F.cross_entropy(m(x) / torch.ones_like(y, dtype=torch.float64).sum(), y),
}
for name, f in cases.items():
    check(name, f, m, (x, y))
