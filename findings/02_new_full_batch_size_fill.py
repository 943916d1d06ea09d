"""`x.new_full((), len(x))` (or new_full((1,), ...)/full_like(p, len(x))) as the loss's divisor: the fill value is
the batch size, but new_full is a "shape only" op, so the per-sample pass marked it independent of the batch
and each sample's loss kept dividing by B instead of 1 (torch.full((), len(x)) was right). Silent: err 0.637 on
scale 0.796 (factor B=5)."""
import torch, torch.nn as nn, torch.nn.functional as F
from _h import check
torch.manual_seed(0)
x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
ce = lambda x, y: F.cross_entropy(m(x), y, reduction="sum")
check("sum / x.new_full((), len(x))", lambda x, y: ce(x, y) / x.new_full((), len(x)), m, (x, y))
check("sum / x.new_full((1,), len(x)).sum()", lambda x, y: ce(x, y) / x.new_full((1,), len(x)).sum(), m, (x, y))
check("sum / full_like(bias, len(x)).sum()", lambda x, y: ce(x, y) / torch.full_like(m[2].bias, len(x)).sum(),
      m, (x, y))
check("control: sum / torch.full((), len(x))", lambda x, y: ce(x, y) / torch.full((), len(x), dtype=torch.float64),
      m, (x, y))
