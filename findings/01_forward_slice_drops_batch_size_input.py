"""forward_slice (retrace.py, changed in 8466b8c) dropped a placeholder that only the gradients read (a second
batch-size symbol): the slice then took the captured inputs shifted by one, and the retrace failed with
"aten::addmm() Expected a value of type 'Tensor' for argument 'mat1' but instead found type 'SymInt'"
(a CaptureError saying "please report"). Hit by the common `F.cross_entropy(..., reduction="none") / len(x)`."""
import torch, torch.nn as nn, torch.nn.functional as F
from _h import check
torch.manual_seed(0)
x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
check("[B] losses / len(x)", lambda x, y: F.cross_entropy(m(x), y, reduction="none") / len(x), m, (x, y))
check("scalar / x.new_zeros(()).add(len(x))",
      lambda x, y: F.cross_entropy(m(x), y, reduction="none").sum() / x.new_zeros(()).add(len(x)), m, (x, y))
check("scalar / torch.scalar_tensor(len(x))",
      lambda x, y: F.cross_entropy(m(x), y, reduction="none").sum() / torch.scalar_tensor(len(x), dtype=torch.float64),
      m, (x, y))
