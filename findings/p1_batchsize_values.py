import math, torch, torch.nn as nn, torch.nn.functional as F, numpy as np
from _h import check
torch.manual_seed(0)
x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
ce = lambda x, y: F.cross_entropy(m(x), y, reduction="sum")
cases = {
 "torch.tensor(float(len(x)))": lambda x, y: ce(x, y) / torch.tensor(float(len(x)), dtype=torch.float64),
 "math.sqrt(len(x))": lambda x, y: ce(x, y) / math.sqrt(len(x)),
 "max(len(x), 4)": lambda x, y: ce(x, y) / max(len(x), 4),
 "min(len(x), 3)": lambda x, y: ce(x, y) / min(len(x), 3),
 "x.new_full((), len(x))": lambda x, y: ce(x, y) / x.new_full((), len(x)),
 "torch.as_tensor(x.shape[0])": lambda x, y: ce(x, y) / torch.as_tensor(x.shape[0]),
 "np.sqrt(len(x))": lambda x, y: ce(x, y) / np.sqrt(len(x)),
 "int(math.sqrt(len(x)))": lambda x, y: ce(x, y) / int(math.sqrt(len(x))),
 "len(x)**2": lambda x, y: ce(x, y) / len(x) ** 2,
 "abs(1-len(x))+1": lambda x, y: ce(x, y) * (abs(1 - len(x)) + 1),
 "round(len(x)/2)+1": lambda x, y: ce(x, y) * (round(len(x) / 2) + 1),
 "torch.arange(len(x)).sum()": lambda x, y: ce(x, y) * (1 + torch.arange(len(x), dtype=torch.float64).sum()),
 "ones_like(y).sum()": lambda x, y: ce(x, y) / torch.ones_like(y, dtype=torch.float64).sum(),
 "torch.linspace(0,1,len(x))": lambda x, y: (F.cross_entropy(m(x), y, reduction="none") * torch.linspace(0, 1, len(x), dtype=torch.float64)).sum(),
 "x.shape[0] % 2": lambda x, y: ce(x, y) * (1 + x.shape[0] % 2),
 "float(len(x)) cmp": lambda x, y: ce(x, y) * (2.0 if float(len(x)) > 1.5 else 1.0),
 "list(range(len(x)))": lambda x, y: ce(x, y) * len(list(range(len(x)))),
 "torch.randperm": lambda x, y: ce(x[torch.arange(len(x))], y),
 "bool(torch.tensor(len(x))>1)": lambda x, y: ce(x, y) * (2.0 if bool(torch.tensor(len(x)) > 1) else 1.0),
 "x.size(0) via torch.Size eq": lambda x, y: ce(x, y) * (2.0 if x.shape == (5, 4) else 1.0),
 "y.shape[0] / len(x)": lambda x, y: ce(x, y) * (1 + y.shape[0] / len(x)),
}
import sys
sel = sys.argv[1:] 
for name, f in cases.items():
    if sel and not any(s in name for s in sel): continue
    check(name, f, m, (x, y))
