import math, torch, torch.nn as nn, torch.nn.functional as F
from _h import check
torch.manual_seed(0)
x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
ce = lambda x, y: F.cross_entropy(m(x), y, reduction="none")
cases = {
 "[B] / x.new_full((), len(x))": lambda x, y: ce(x, y) / x.new_full((), len(x)),
 "[B] / torch.full((), len(x))": lambda x, y: ce(x, y) / torch.full((), len(x), dtype=torch.float64),
 "[B] / x.new_zeros(()).add(len(x))": lambda x, y: ce(x, y) / x.new_zeros(()).add(len(x)),
 "[B] / len(x)": lambda x, y: ce(x, y) / len(x),
 "[B] * ones(len(x)).sum()": lambda x, y: ce(x, y) / torch.ones(len(x), dtype=torch.float64).sum(),
 "scalar / x.new_zeros(()).add(len(x))": lambda x, y: ce(x, y).sum() / x.new_zeros(()).add(len(x)),
 "scalar / x.new_ones(len(x)).sum()": lambda x, y: ce(x, y).sum() / x.new_ones(len(x)).sum(),
 "scalar * x.new_empty(()).fill_(len(x))": lambda x, y: ce(x, y).sum() / x.new_empty(()).fill_(len(x)),
 "scalar / torch.zeros_like(x[0,0]).add(len(x))": lambda x, y: ce(x, y).sum() / torch.zeros_like(x[0,0]).add(len(x)),
 "scalar / torch.scalar_tensor(len(x))": lambda x, y: ce(x, y).sum() / torch.scalar_tensor(len(x), dtype=torch.float64),
}
for name, f in cases.items():
    check(name, f, m, (x, y))
