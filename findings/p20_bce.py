import torch, torch.nn as nn, torch.nn.functional as F
from _h import check
torch.manual_seed(0)
B = 5
x = torch.randn(B, 4, dtype=torch.float64)
m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
t = torch.softmax(torch.randn(B, 3, dtype=torch.float64), 1)
w = torch.tensor([0.2, 1.0, 3.0], dtype=torch.float64)
check("bce_with_logits pos_weight mean", lambda x, t: F.binary_cross_entropy_with_logits(m(x), t, pos_weight=w), m, (x, t))
check("bce_with_logits pos_weight sum", lambda x, t: F.binary_cross_entropy_with_logits(m(x), t, pos_weight=w, reduction="sum"), m, (x, t))
check("bce_with_logits pos_weight none.sum", lambda x, t: F.binary_cross_entropy_with_logits(m(x), t, pos_weight=w, reduction="none").sum(), m, (x, t))
check("bce_with_logits weight mean", lambda x, t: F.binary_cross_entropy_with_logits(m(x), t, weight=w), m, (x, t))
check("bce_with_logits plain mean", lambda x, t: F.binary_cross_entropy_with_logits(m(x), t), m, (x, t))
